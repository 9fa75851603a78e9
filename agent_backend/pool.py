"""Pools from files: ``load_pool("pools/local.toml")`` gives a backend to ``async with``.

A pool file is TOML whose top-level keys are one backend's config, chosen by
``type``, a discriminated union over:

* ``"local"``: :class:`~agent_backend.backends.local.LocalPoolConfig`
  (``pools/local.toml``);
* ``"ssh"``: :class:`~agent_backend.backends.ssh.SSHPoolConfig`
  (``pools/ssh.example.toml``);
* ``"ray"``: :class:`~agent_backend.backends.ray.RayPoolConfig`
  (``pools/ray.example.toml``).

The union is resolved by hand on ``type`` so that each backend's module (and
its third-party imports: asyncssh, ray) is imported only when a file names
it. Unknown keys are refused, and a bad file fails here, at load, with a
:class:`~agent_backend.errors.ConfigError` naming the file, the dotted key
and what was expected. Relative paths in a pool file are relative to the
file's directory.

:data:`DEFAULT_POOL` is the local pool with every default, as a config
object, so an installed package needs no data file for it; ``pools/local.toml``
spells out the same configuration key by key, and a test keeps the two equal.

This module reads files and builds objects; it must never start a backend
(that is ``async with``) or open a connection.
"""

from __future__ import annotations

import importlib
import os
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import pydantic

from agent_backend.backends.local import LocalPoolConfig
from agent_backend.dispatch.backend import Backend
from agent_backend.dispatch.spec import config_error
from agent_backend.errors import ConfigError, clip

if TYPE_CHECKING:
    from agent_backend.backends.ray import RayPoolConfig
    from agent_backend.backends.ssh import SSHPoolConfig

    PoolConfig: TypeAlias = LocalPoolConfig | SSHPoolConfig | RayPoolConfig
else:
    PoolConfig = Any

__all__ = [
    "DEFAULT_POOL",
    "POOL_TYPES",
    "PoolConfig",
    "load_pool",
    "load_pool_config",
    "pool_config_from_dict",
    "pool_from_config",
]

#: The embedded default: a local pool with every default (what ``pools/local.toml`` says).
DEFAULT_POOL = LocalPoolConfig()

# type -> (module, config class, backend class): imported on first use.
_KINDS: dict[str, tuple[str, str, str]] = {
    "local": ("agent_backend.backends.local", "LocalPoolConfig", "LocalBackend"),
    "ssh": ("agent_backend.backends.ssh", "SSHPoolConfig", "SSHBackend"),
    "ray": ("agent_backend.backends.ray", "RayPoolConfig", "RayBackend"),
}

#: Every pool ``type`` a file may name.
POOL_TYPES: tuple[str, ...] = tuple(_KINDS)


def _kind(tag: str) -> tuple[Any, Any]:
    module_name, config_name, backend_name = _KINDS[tag]
    module = importlib.import_module(module_name)
    return getattr(module, config_name), getattr(module, backend_name)


def pool_config_from_dict(
    data: object, *, file: str | None = None, config_dir: str | os.PathLike[str] | None = None
) -> PoolConfig:
    """The pool config ``data`` describes; :class:`ConfigError` (naming ``file``) if it is wrong."""
    where = file or "<config>"
    expected_types = " or ".join(repr(tag) for tag in POOL_TYPES)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a pool is a table of keys", file=file, expected="a table")
    tag = data.get("type")
    if tag is None:
        raise ConfigError(
            f"{where}: type: missing; say which backend this pool is ({expected_types})",
            file=file,
            key="type",
            expected=f"one of {expected_types}",
        )
    if not isinstance(tag, str) or tag not in _KINDS:
        raise ConfigError(
            f"{where}: type: expected one of {expected_types} (got {clip(repr(tag), 60)})",
            file=file,
            key="type",
            expected=f"one of {expected_types}",
        )
    config_class, _backend = _kind(tag)
    context = {"config_dir": os.fspath(config_dir)} if config_dir is not None else None
    try:
        config: PoolConfig = config_class.model_validate(data, context=context)
    except pydantic.ValidationError as exc:
        raise config_error(exc, file=file) from None
    return config


def load_pool_config(path: str | os.PathLike[str]) -> PoolConfig:
    """The pool config in the TOML file at ``path``; :class:`ConfigError` if it is wrong."""
    file = os.fspath(path)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{file}: cannot read the pool file: {exc.strerror or exc}",
            file=file,
            expected="a readable TOML file",
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{file}: not valid TOML: {exc}", file=file, expected="TOML") from None
    return pool_config_from_dict(data, file=file, config_dir=Path(file).resolve().parent)


def pool_from_config(config: PoolConfig) -> Backend:
    """The (not yet started) backend for a pool config."""
    tag = getattr(config, "type", None)
    if isinstance(tag, str) and tag in _KINDS:
        config_class, backend_class = _kind(tag)
        if isinstance(config, config_class):
            backend: Backend = backend_class.from_config(config)
            return backend
    raise TypeError(f"not a pool config: {type(config).__name__}")


def load_pool(source: str | os.PathLike[str] | PoolConfig = DEFAULT_POOL) -> Backend:
    """The backend a pool file (or config object) describes; start it with ``async with``.

    ``source`` is a path to a TOML pool file, or a config object such as
    :data:`DEFAULT_POOL`. Raises :class:`ConfigError` for a bad file.
    """
    if isinstance(source, (str, os.PathLike)):
        return pool_from_config(load_pool_config(source))
    return pool_from_config(source)
