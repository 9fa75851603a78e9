"""Every ```python block in README.md and docs/*.md runs as written.

The TRL recipe (docs/rollouts.md) names a hub model; offline, it runs with the tiny one.
The agent-framework recipes (docs/integrations.md) run with the frameworks' own test
models; a block importing a framework that is not installed skips (fails under CI=true).
Their MCP recipes launch `agent-backend` from the PATH (this venv's), a block that reads
AGENT_BACKEND_URL gets a daemon to talk to, and one that imports langchain_mcp_adapters
(which requires mcp<2) runs in .venv-mcp1 (scripts/ensure-mcp-clients.sh).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.daemon_fixtures import start_daemon
from support.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
TRL_MODEL = '"Qwen/Qwen3-0.6B"'
#: Top-level packages a block may import beyond the core, and the extra that installs each.
FRAMEWORKS = {
    "pydantic_ai": "pydantic-ai",
    "agents": "openai-agents",
    "langchain": "langchain",
    "langchain_core": "langchain",
}


def require_frameworks(code: str) -> None:
    """Skip a block whose framework is missing (make test installs them; CI must have them)."""
    for module, extra in FRAMEWORKS.items():
        imported = re.search(rf"^\s*(?:from|import) {module}\b", code, re.M)
        if imported and importlib.util.find_spec(module) is None:
            reason = f"{module} is not installed: pip install -e '.[{extra}]'"
            if os.environ.get("CI") == "true":
                pytest.fail(f"CI=true and {reason}")
            pytest.skip(reason)


def run_in_mcp1_venv(code: str) -> None:
    """Run a block that needs the MCP SDK 1.x in .venv-mcp1, with this test's environment."""
    python = ROOT / ".venv-mcp1" / "bin" / "python"
    if not python.exists():
        reason = ".venv-mcp1 is missing: bash scripts/ensure-mcp-clients.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)
    done = subprocess.run(
        [str(python), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


examples = [
    pytest.param(
        code,
        id=f"{path.name}#{index}",
        # A block that starts a local Ray runs on the worker of the Ray tests (conftest.py).
        marks=[pytest.mark.xdist_group("ray")] if "RayBackend" in code else [],
    )
    for path in DOCS
    for index, code in enumerate(BLOCK.findall(path.read_text(encoding="utf-8")))
]


@pytest.mark.parametrize("code", examples)
def test_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    require_frameworks(code)
    if "GRPOTrainer(" in code:
        pytest.importorskip("trl")
        assert TRL_MODEL in code
        code = code.replace(TRL_MODEL, repr(str(build_tiny_model(tmp_path / "model"))))
        monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    bin_dir = Path(sys.executable).parent  # `agent-backend` as in an activated venv
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    with contextlib.ExitStack() as stack:
        if "AGENT_BACKEND_URL" in code:  # an MCP-over-HTTP recipe: a daemon to talk to
            daemon = stack.enter_context(start_daemon())
            monkeypatch.setenv("AGENT_BACKEND_URL", daemon.url)
            monkeypatch.setenv("AGENT_BACKEND_TOKEN", daemon.token)
        if "langchain_mcp_adapters" in code:
            run_in_mcp1_venv(code)
            return
        exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
