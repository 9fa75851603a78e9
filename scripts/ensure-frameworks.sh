#!/usr/bin/env bash
# The agent frameworks whose native toolsets the integration tests run for real
# (docs/integrations.md): pydantic-ai, the OpenAI Agents SDK and LangChain, in the project's
# venv, through the extras that pin the versions they were tested with; and pydantic-ai's MCP
# client (its `mcp` extra: fastmcp), which the MCP client matrix drives (tests/test_mcp_clients.py).
# Usage: ensure-frameworks.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:?usage: ensure-frameworks.sh PYTHON}"
"$PY" -m pip install --quiet -e '.[dev,pydantic-ai,openai-agents,langchain]' \
    'pydantic-ai-slim[mcp]>=2.68,<3'
"$PY" - <<'PY'
import importlib.metadata as metadata
import importlib
for module in ("pydantic_ai", "pydantic_ai.mcp", "fastmcp", "agents", "langchain_core", "langchain.agents"):
    importlib.import_module(module)
for name in ("pydantic-ai-slim", "openai-agents", "langchain-core", "langchain"):
    print(f"{name} {metadata.version(name)}", end="; ")
print("frameworks ready")
PY
