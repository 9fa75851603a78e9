#!/usr/bin/env bash
# The agent frameworks whose native toolsets the integration tests run for real
# (docs/integrations.md): pydantic-ai, the OpenAI Agents SDK and LangChain, in the project's
# venv, through the extras that pin the versions they were tested with.
# Usage: ensure-frameworks.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:?usage: ensure-frameworks.sh PYTHON}"
"$PY" -m pip install --quiet -e '.[dev,pydantic-ai,openai-agents,langchain]'
"$PY" - <<'PY'
import importlib.metadata as metadata
import importlib
for module in ("pydantic_ai", "agents", "langchain_core", "langchain.agents"):
    importlib.import_module(module)
for name in ("pydantic-ai-slim", "openai-agents", "langchain-core", "langchain"):
    print(f"{name} {metadata.version(name)}", end="; ")
print("frameworks ready")
PY
