#!/usr/bin/env bash
# The trainers the integration tests run for real (docs/rollouts.md), in the project's venv:
# a CPU torch first (a plain `torch` requirement would pull a multi-GB CUDA build), then the
# extras (TRL, verl, transformers for token-in/token-out), then SkyRL.
#
# SkyRL 0.4 declares Python >= 3.12 and pins a torch and a transformers verl refuses; its
# generator interface and its trainer's data path run on 3.11 (agent_backend.integrations.skyrl
# says how), so it is installed without its declared requirements, with only the small
# packages those modules import. Usage: ensure-trainers.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:?usage: ensure-trainers.sh PYTHON}"
"$PY" -m pip install --quiet torch==2.13.0
"$PY" -m pip install --quiet -e '.[dev,tokens,trl,verl]'
"$PY" -m pip install --quiet --no-deps --ignore-requires-python \
  skyrl==0.4.0 skyrl-gym==0.4.0 cloudpathlib==0.26.0 loguru==0.7.3 pybase64==1.5.1 \
  jaxtyping==0.3.11 wadler-lindig==0.1.8
"$PY" - <<'PY'
import importlib
for name in ("torch", "transformers", "trl", "verl", "skyrl"):
    importlib.import_module(name)
import torch
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("trainers ready: torch", torch.__version__)
PY
