"""Every ```python block in README.md and docs/*.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)

examples = [
    pytest.param(code, id=f"{path.name}#{index}")
    for path in DOCS
    for index, code in enumerate(BLOCK.findall(path.read_text(encoding="utf-8")))
]


@pytest.mark.parametrize("code", examples)
def test_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    exec(compile(code, "<doc example>", "exec"), {"__name__": "__doc_example__"})
