"""The layering is checked by a tool (import-linter, `.importlinter`, run by `make lint`):
it holds on the package as it is, and an import that breaks a layer makes the check fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.timeout(120)


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports over the copy of the package in ``tree`` (first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if not LINT_IMPORTS.exists():
        if os.environ.get("CI") == "true":
            pytest.fail("import-linter is not installed (pip install -e '.[dev]')")
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    shutil.copytree(
        ROOT / "agent_backend",
        tmp_path / "agent_backend",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def test_the_package_keeps_every_contract(tree: Path) -> None:
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_import_up_the_layers_breaks_the_check(tree: Path) -> None:
    module = tree / "agent_backend" / "schema" / "refs.py"
    module.write_text(
        module.read_text(encoding="utf-8") + "\nfrom agent_backend.dispatch import Dispatcher\n",
        encoding="utf-8",
    )
    result = lint(tree)
    assert result.returncode != 0
    assert "agent_backend.schema is not allowed to import agent_backend.dispatch" in result.stdout


def test_io_in_the_schema_layer_breaks_the_check(tree: Path) -> None:
    module = tree / "agent_backend" / "schema" / "refs.py"
    module.write_text(module.read_text(encoding="utf-8") + "\nimport socket\n", encoding="utf-8")
    result = lint(tree)
    assert result.returncode != 0
    assert "agent_backend.schema is not allowed to import socket" in result.stdout


def test_an_entry_point_reaching_a_private_module_breaks_the_check(tree: Path) -> None:
    module = tree / "agent_backend" / "daemon" / "__init__.py"
    module.write_text(
        module.read_text(encoding="utf-8") + "\nimport agent_backend.dispatch.leases\n",
        encoding="utf-8",
    )
    result = lint(tree)
    assert result.returncode != 0
    assert "agent_backend.dispatch.leases" in result.stdout
