#!/usr/bin/env bash
# The MCP clients of the client matrix (tests/test_mcp_clients.py) that cannot live in .venv:
#
#   .venv-mcp1                 the MCP SDK 1.x, and langchain-mcp-adapters, whose releases
#                              require mcp<2 (.venv keeps mcp 2.x); the clients run in it,
#                              agent_backend does not (they launch .venv's `agent-backend mcp`
#                              or talk to the daemon over HTTP)
#   .mcp-clients/inspector     the MCP Inspector from the npm registry, run as its installed
#                              binaries (mcp-inspector --cli, mcpdo), never through npx
#
#   ensure-mcp-clients.sh      create or refresh both; a no-op when they are up to date
#
# The versions are the ones the matrix and docs/integrations.md were run with. The stamp is
# named after this script's hash: editing the script (a version bump) reinstalls.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${MCP1_VENV:-.venv-mcp1}
PYTHON=${MCP1_PYTHON:-python3}
NODE_DIR=.mcp-clients/inspector
MCP1_VERSION=1.30.0
LANGCHAIN_MCP_ADAPTERS_VERSION=0.3.2
LANGCHAIN_VERSION=1.5.2
INSPECTOR_VERSION=2.12.0

script_hash=$(sha256sum "$0" | cut -c1-16)
STAMP=".mcp-clients/.installed-$script_hash"

if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ] && [ -x "$NODE_DIR/node_modules/.bin/mcp-inspector" ]; then
  exit 0
fi
mkdir -p .mcp-clients
rm -f .mcp-clients/.installed-*

echo "ensure-mcp-clients: mcp $MCP1_VERSION, langchain-mcp-adapters $LANGCHAIN_MCP_ADAPTERS_VERSION, langchain $LANGCHAIN_VERSION into $VENV"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "mcp==$MCP1_VERSION" "langchain-mcp-adapters==$LANGCHAIN_MCP_ADAPTERS_VERSION" "langchain==$LANGCHAIN_VERSION"
"$VENV/bin/python" - "$MCP1_VERSION" <<'EOF'
import importlib.metadata as md
import sys

import langchain.agents  # noqa: F401
import langchain_mcp_adapters.tools  # noqa: F401
import mcp

if md.version("mcp") != sys.argv[1]:
    sys.exit(f"ensure-mcp-clients: mcp {md.version('mcp')} installed, not {sys.argv[1]}")
print(f"ensure-mcp-clients: .venv-mcp1 has mcp {md.version('mcp')}, "
      f"langchain-mcp-adapters {md.version('langchain-mcp-adapters')}")
EOF

if ! command -v npm >/dev/null 2>&1; then
  echo "ensure-mcp-clients: npm not found (the MCP Inspector is installed from the npm registry)" >&2
  exit 1
fi
echo "ensure-mcp-clients: @modelcontextprotocol/inspector $INSPECTOR_VERSION into $NODE_DIR (node $(node --version))"
mkdir -p "$NODE_DIR"
# Its only install script installs its clients' sources in a checkout of its own repository;
# the published package ships them built. The engines warning (it asks for node >= 22) is
# expected on node 20, where the CLI runs: the matrix is its check.
npm install --prefix "$NODE_DIR" --no-audit --no-fund --ignore-scripts --loglevel=error \
  "@modelcontextprotocol/inspector@$INSPECTOR_VERSION"
"$NODE_DIR/node_modules/.bin/mcp-inspector" --version
touch "$STAMP"
