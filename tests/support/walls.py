"""The namespaces tier in tests: a workspace root its sandboxes can reach, and the rule that a
test needing walls fails (never skips) under ``CI=true``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from agent_backend.sandbox import missing_for_namespaces

__all__ = ["passable", "require_walls"]


def passable(path: Path) -> Path:
    """``path`` and each directory above it, up to the system's temporary directory, made
    passable (0711: not listable) by other uids: a sandbox runs as a uid of its own, which must
    reach its workspace under a root made here (pytest makes each level 0700)."""
    top = Path(tempfile.gettempdir()).resolve()
    current = path.resolve()
    while current != top and top in current.parents:
        current.chmod(0o711)
        current = current.parent
    return path


def require_walls() -> None:
    """Skip where this host cannot build the walls; under ``CI=true``, fail instead."""
    missing = missing_for_namespaces()
    if not missing:
        return
    reason = "the namespaces tier needs: " + "; ".join(missing)
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {reason}")
    pytest.skip(reason)
