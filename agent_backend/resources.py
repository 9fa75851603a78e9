"""Where the data files the package needs at run time are: the one place that knows.

The sources are the repository's top-level ``schemas/`` and ``pools/``. A wheel
carries copies of what :data:`SHIPPED` names inside the package, under
``agent_backend/_data/`` (``setup.py`` copies them at build time, reading
:data:`SHIPPED` from this file), so an installed package finds them from any
directory. A source checkout (an editable install, ``PYTHONPATH``) has no
``_data`` and reads the sources themselves.

Paths only: this module reads and writes no file, and imports nothing but the
standard library (``setup.py`` loads it on its own, before any dependency is
installed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

__all__ = ["BUILTIN_TOOLS_DIR", "PACKAGED_DATA", "POOLS_DIR", "SHIPPED", "SOURCE_ROOT", "data_path"]

#: What a wheel carries, as (folder relative to the repository, file pattern): the
#: built-in tool schemas (not their ``examples/``) and the pool files.
SHIPPED: Final = (("schemas/tools", "*.json"), ("pools", "*.toml"))

_PACKAGE: Final = Path(__file__).resolve().parent
#: Where a wheel's copies are; absent in a source checkout.
PACKAGED_DATA: Final = _PACKAGE / "_data"
#: The repository a source checkout runs from (in an installed package: nothing of ours).
SOURCE_ROOT: Final = _PACKAGE.parent


def data_path(relative: str) -> Path:
    """``relative`` (a path under the repository, such as ``schemas/tools``) where it is now:
    the wheel's copy when the package has them, else the source."""
    base = PACKAGED_DATA if PACKAGED_DATA.is_dir() else SOURCE_ROOT
    return base / relative


#: The built-in tools' schema files (exec, read_file, write_file, list_dir): the default
#: ``--tools-dir`` of every command.
BUILTIN_TOOLS_DIR: Final = data_path("schemas/tools")
#: The pool files: ``local.toml`` spells out :data:`agent_backend.pool_file.DEFAULT_POOL`,
#: ``ssh.example.toml`` and ``ray.example.toml`` are starting points.
POOLS_DIR: Final = data_path("pools")
