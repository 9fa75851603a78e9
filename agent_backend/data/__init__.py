"""The data files the package reads at run time: the one copy of each, inside the package.

* ``tools/``: the built-in tools' schema files (``exec``, ``read_file``, ``write_file``,
  ``list_dir``), their one definition: :mod:`agent_backend.dispatch.builtin` loads them,
  and the folder is every command's default ``--tools-dir``;
* ``pools/``: the pool files: ``local.toml`` spells out
  :data:`agent_backend.pool_file.DEFAULT_POOL` (a test keeps the two equal), the
  ``*.example.toml`` files are starting points.

Being package data, they are found the same way in a checkout, an editable install
and an installed wheel (``importlib.resources``, which pyproject.toml's
``package-data`` ships). A checkout also shows them at the paths the docs use:
``schemas/tools`` and ``pools`` are links to these folders.

This module reads no file and imports only the standard library.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Final

__all__ = ["BUILTIN_TOOLS_DIR", "DEFAULT_POOL_FILE", "POOLS_DIR", "data_path"]


def data_path(name: str) -> Path:
    """The file or folder ``name`` (such as ``"tools"``) of this package, as a path.

    A path rather than an :class:`importlib.resources.abc.Traversable`: the tools folder is a
    command line option's default, and pool files name paths relative to their folder.
    """
    found = importlib.resources.files(__name__).joinpath(name)
    if not isinstance(found, Path):  # a zip import: pip never installs one
        raise RuntimeError(f"agent_backend's data must be files on disk, not {found!r}")
    return found


#: The built-in tools' schema files: the default ``--tools-dir`` of every command.
BUILTIN_TOOLS_DIR: Final = data_path("tools")
#: The pool files (``local.toml`` and the ``*.example.toml`` starting points).
POOLS_DIR: Final = data_path("pools")
#: The default pool as a file: what ``agent-backend pool check`` checks when given no file.
DEFAULT_POOL_FILE: Final = POOLS_DIR / "local.toml"
