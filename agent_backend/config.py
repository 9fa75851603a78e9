"""What every configuration model shares: one base, one path rule, one way to import a named object.

* :class:`ConfigModel` is the base of every config (each backend's pool
  config, the daemon's settings): unknown keys are refused, so a misspelt key
  fails at load instead of silently keeping its default; a loaded config is
  frozen; and each field's docstring is its description.
* :data:`ConfigPath` is a path field: ``~`` is expanded and a relative path is
  taken from the folder of the file the config was read from, which the loader
  passes with :func:`config_context` (a config built in code, without one,
  resolves against the working directory).
* :func:`import_object` imports what a ``"module:attribute"`` string names,
  with pydantic's ``ImportString``; :data:`ImportPath` is a field holding such
  a string when the object is imported somewhere else (a Ray pool's tools are
  imported in its actors, not where the pool file is read).

Imports only pydantic and the standard library, so that every layer may use
it. This module must never read a file nor check that a path exists: paths
are resolved here and used (or found missing) by whatever opens them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Annotated, Any, Final

import pydantic

__all__ = [
    "ConfigModel",
    "ConfigPath",
    "ImportPath",
    "config_context",
    "import_object",
]


class ConfigModel(pydantic.BaseModel):
    """Base of the config models: unknown keys refused, frozen, documented field by field."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


_CONFIG_DIR: Final = "config_dir"


def config_context(config_dir: str | os.PathLike[str] | None) -> dict[str, str] | None:
    """The validation context that makes :data:`ConfigPath` fields relative to ``config_dir``:
    ``Model.model_validate(data, context=config_context(folder))``."""
    return None if config_dir is None else {_CONFIG_DIR: os.fspath(config_dir)}


def _resolve_path(value: str, info: pydantic.ValidationInfo) -> str:
    path = Path(value).expanduser()
    if not path.is_absolute():
        base = (info.context or {}).get(_CONFIG_DIR)
        path = (Path(base) if base is not None else Path.cwd()) / path
    return os.fspath(path)


ConfigPath = Annotated[str, pydantic.AfterValidator(_resolve_path)]
"""A path in a config: ``~`` expanded, a relative one taken from the config file's folder."""

ImportPath = Annotated[
    str, pydantic.StringConstraints(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
]
"""``package.module:attribute`` (``module:Class.method`` reaches into a class), the form
:func:`import_object` takes; checked for form only, imported where it is used."""


@functools.cache
def _import_string() -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(pydantic.ImportString)


def import_object(path: str) -> Any:
    """The object ``package.module:attribute`` names, imported (``module:Class.method`` too).

    Raises :class:`ValueError` when ``path`` is not of that form, and
    :class:`ImportError` when the module or the attribute is not there. An
    error raised by the imported module itself propagates as it is.
    """
    module, colon, attributes = path.partition(":")
    first, *rest = attributes.split(".")
    if not colon or not module or not first:
        raise ValueError(f"{path!r} is not module:attribute")
    try:
        target = _import_string().validate_python(f"{module}:{first}")
    except pydantic.ValidationError as exc:
        raise ImportError(f"{path}: {exc.errors(include_url=False)[0]['msg']}") from None
    reached = f"{module}:{first}"
    for name in rest:
        try:
            target = getattr(target, name)
        except AttributeError:
            raise ImportError(f"{path}: {reached} has no attribute {name!r}") from None
        reached = f"{reached}.{name}"
    return target
