"""Every ```python block in README.md and docs/*.md runs as written.

The TRL recipe (docs/rollouts.md) names a hub model; offline, it runs with the tiny one.
The agent-framework recipes (docs/integrations.md) run with the frameworks' own test
models; a block importing a framework that is not installed skips (fails under CI=true).
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

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


examples = [
    pytest.param(code, id=f"{path.name}#{index}")
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
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
