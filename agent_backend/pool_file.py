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
file's directory (every config is a :class:`~agent_backend.config.ConfigModel`,
its paths :data:`~agent_backend.config.ConfigPath` fields).

:data:`DEFAULT_POOL` is the local pool with every default, as a config
object, so an installed package needs no data file for it; ``pools/local.toml``
spells out the same configuration key by key, and a test keeps the two equal.

A *set* of pools lives in one file too (``pools/mixed.example.toml``): one
table per pool under ``[pools.NAME]``, each a pool as above, and
``default = "NAME"`` (the pool host tools go to unless their route says
otherwise; absent: the first). :func:`load_pools` reads either kind of file
(a single pool becomes the set ``{"default": pool}``) and gives a
:class:`PoolSet`, which opens and closes its backends together, for
``Dispatcher(registry, pools=set.backends, default=set.default)``.

This module reads files and builds objects; it must never start a backend
(that is ``async with``) or open a connection.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import pydantic

from agent_backend.backends.local.config import LocalPoolConfig
from agent_backend.config import config_context, import_object
from agent_backend.dispatch import DEFAULT_POOL_NAME
from agent_backend.dispatch.backend import Backend
from agent_backend.dispatch.spec import config_error
from agent_backend.errors import ConfigError, clip
from agent_backend.lifecycle import AsyncResource
from agent_backend.sandbox import Isolation

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
    "PoolSet",
    "PoolSetConfig",
    "load_pool",
    "load_pool_config",
    "load_pools",
    "load_pools_config",
    "pool_config_from_dict",
    "pool_from_config",
    "pool_set_config_from_dict",
    "with_isolation",
]

logger = logging.getLogger("agent_backend.pool_file")

#: The embedded default: a local pool with every default (what ``pools/local.toml`` says).
DEFAULT_POOL = LocalPoolConfig()

# type -> (config class, backend class): each imported when first needed.
_KINDS: dict[str, tuple[str, str]] = {
    "local": (
        "agent_backend.backends.local.config:LocalPoolConfig",
        "agent_backend.backends.local:LocalBackend",
    ),
    "ssh": ("agent_backend.backends.ssh:SSHPoolConfig", "agent_backend.backends.ssh:SSHBackend"),
    "ray": ("agent_backend.backends.ray:RayPoolConfig", "agent_backend.backends.ray:RayBackend"),
}

#: Every pool ``type`` a file may name.
POOL_TYPES: tuple[str, ...] = tuple(_KINDS)


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
    config_class = import_object(_KINDS[tag][0])
    try:
        config: PoolConfig = config_class.model_validate(data, context=config_context(config_dir))
    except pydantic.ValidationError as exc:
        raise config_error(exc, file=file) from None
    return config


def _read_toml(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
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
    return file, data


def load_pool_config(path: str | os.PathLike[str]) -> PoolConfig:
    """The pool config in the TOML file at ``path``; :class:`ConfigError` if it is wrong."""
    file, data = _read_toml(path)
    return pool_config_from_dict(data, file=file, config_dir=Path(file).resolve().parent)


def pool_from_config(config: PoolConfig) -> Backend:
    """The (not yet started) backend for a pool config."""
    tag = getattr(config, "type", None)
    if isinstance(tag, str) and tag in _KINDS:
        config_class, backend_class = _KINDS[tag]
        if isinstance(config, import_object(config_class)):
            backend: Backend = import_object(backend_class).from_config(config)
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


# -- sets of pools ---------------------------------------------------------------------------

_POOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSetConfig:
    """Named pool configs and the default's name: what a pool-set file holds."""

    pools: Mapping[str, PoolConfig]
    default: str

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("a pool set needs at least one pool")
        if self.default not in self.pools:
            raise ValueError(f"default pool {self.default!r} is not one of {', '.join(self.pools)}")

    @classmethod
    def single(cls, config: PoolConfig = DEFAULT_POOL) -> PoolSetConfig:
        """One pool as a set, under the default pool's name (the built-in local pool if none)."""
        return cls({DEFAULT_POOL_NAME: config}, DEFAULT_POOL_NAME)


def pool_set_config_from_dict(
    data: object, *, file: str | None = None, config_dir: str | os.PathLike[str] | None = None
) -> PoolSetConfig:
    """The pool set ``data`` describes (``pools`` tables and ``default``), or a single pool as
    the set ``{"default": pool}``; :class:`ConfigError` (naming ``file`` and the key) if wrong."""
    where = file or "<config>"
    if not isinstance(data, dict) or "pools" not in data:
        return PoolSetConfig.single(pool_config_from_dict(data, file=file, config_dir=config_dir))
    unknown = sorted(set(data) - {"pools", "default"})
    if unknown:
        raise ConfigError(
            f"{where}: {unknown[0]}: no such key in a pool set (it has [pools.NAME] tables "
            "and default); a single pool's keys go in a file of their own",
            file=file,
            key=unknown[0],
            expected="no such key (unknown keys are refused)",
        )
    tables = data["pools"]
    if not isinstance(tables, dict) or not tables:
        raise ConfigError(
            f"{where}: pools: expected one [pools.NAME] table per pool",
            file=file,
            key="pools",
            expected="a table of pools, at least one",
        )
    pools: dict[str, PoolConfig] = {}
    for name, table in tables.items():
        if _POOL_NAME.fullmatch(name) is None:
            raise ConfigError(
                f"{where}: pools.{clip(name, 70)}: a pool name is 1-64 of A-Z a-z 0-9 _ . -",
                file=file,
                key=f"pools.{name}",
                expected="a name of 1-64 characters from A-Z a-z 0-9 _ . -",
            )
        try:
            pools[name] = pool_config_from_dict(table, file=file, config_dir=config_dir)
        except ConfigError as exc:
            key = f"pools.{name}.{exc.key}" if exc.key else f"pools.{name}"
            message = exc.message.replace(f"{where}: ", f"{where}: pools.{name}.")
            raise ConfigError(message, file=file, key=key, expected=exc.expected) from None
    default = data.get("default", next(iter(pools)))
    if not isinstance(default, str) or default not in pools:
        names = ", ".join(repr(name) for name in pools)
        raise ConfigError(
            f"{where}: default: expected the name of one of the pools ({names}), "
            f"got {clip(repr(default), 60)}",
            file=file,
            key="default",
            expected=f"one of {names}",
        )
    return PoolSetConfig(pools, default)


def load_pools_config(path: str | os.PathLike[str]) -> PoolSetConfig:
    """The pool set in the TOML file at ``path`` (a pool-set file, or one pool's file)."""
    file, data = _read_toml(path)
    return pool_set_config_from_dict(data, file=file, config_dir=Path(file).resolve().parent)


class PoolSet(AsyncResource):
    """Named backends opened and closed together: ``async with load_pools(file) as pools``.

    Entering starts each backend in file order; if one fails to start, the
    ones started are closed and the error is raised. Closing closes every
    backend, shielded, each on its own: one that fails is logged and never
    keeps the others open.
    """

    def __init__(self, backends: Mapping[str, Backend], default: str) -> None:
        if default not in backends:
            raise ValueError(f"default pool {default!r} is not one of {', '.join(backends)}")
        self.backends: dict[str, Backend] = dict(backends)
        self.default = default

    def __repr__(self) -> str:
        return f"<PoolSet {self.describe()} default={self.default}>"

    def describe(self) -> str:
        """``local`` for one pool; ``cmd: ssh, gpu: ray`` for several."""
        if len(self.backends) == 1:
            return next(iter(self.backends.values())).kind
        return ", ".join(f"{name}: {backend.kind}" for name, backend in self.backends.items())

    def describe_walls(self) -> str:
        """The isolation of each pool, for the start banner: ``walls: isolation: namespaces ...``
        (the first guarantee line of each pool that declares any; ``pool check`` lists all)."""
        parts = []
        for name, backend in self.backends.items():
            lines = backend.guarantees()
            if lines:
                head = lines[0] + ("" if len(lines) == 1 else f" (+{len(lines) - 1} guarantees)")
                parts.append(head if len(self.backends) == 1 else f"{name}: {head}")
        return "walls: " + ("; ".join(parts) if parts else "none declared")

    def has_hosts(self) -> bool:
        """Some pool runs commands (not only its own tools)."""
        return any(backend.hosts for backend in self.backends.values())

    def dispatcher_options(self) -> dict[str, Any]:
        """``Dispatcher(registry, **pools.dispatcher_options())``."""
        return {"pools": self.backends, "default": self.default}

    async def __aenter__(self) -> PoolSet:
        try:
            for backend in self.backends.values():
                await backend.__aenter__()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for name, backend in self.backends.items():
                    group.start_soon(_close_one, name, backend)


async def _close_one(name: str, backend: Backend) -> None:
    try:
        await backend.aclose()
    except Exception:
        logger.warning("closing pool %r (%s) failed", name, backend.kind, exc_info=True)


def load_pools(
    source: str | os.PathLike[str] | PoolConfig | PoolSetConfig | None = None,
    *,
    isolation: Isolation | None = None,
) -> PoolSet:
    """The backends a pool-set file (or one pool's file, or a config object) describes;
    None: :data:`DEFAULT_POOL`.

    ``isolation``: the tier every local and SSH pool of the set runs at, over what
    its file says (``--isolation`` on the command line); None: as the file says.
    Start them with ``async with``; :class:`ConfigError` for a bad file.
    """
    if isinstance(source, (str, os.PathLike)):
        source = load_pools_config(source)
    elif source is None:
        source = PoolSetConfig.single()
    if not isinstance(source, PoolSetConfig):
        source = PoolSetConfig.single(source)
    configs = dict(source.pools)
    if isolation is not None:
        configs = {name: with_isolation(config, isolation) for name, config in configs.items()}
    backends = {name: pool_from_config(config) for name, config in configs.items()}
    return PoolSet(backends, source.default)


def with_isolation(config: PoolConfig, isolation: Isolation) -> PoolConfig:
    """``config`` at isolation tier ``isolation`` if it is a local or an SSH pool's (an SSH
    pool's every host); else (a Ray pool) ``config``.

    Checked as a file would be: a local pool's ``default_cwd`` cannot be kept under walls
    (:class:`ConfigError`).
    """
    if getattr(config, "type", None) == "ssh":
        # Imported already (config is one): asyncssh is loaded only for files that name SSH.
        from agent_backend.backends.ssh import SSHPoolConfig

        assert isinstance(config, SSHPoolConfig)
        if config.isolation == isolation and all(h.isolation == isolation for h in config.hosts):
            return config
        hosts = tuple(host.model_copy(update={"isolation": isolation}) for host in config.hosts)
        return config.model_copy(update={"isolation": isolation, "hosts": hosts})
    if not isinstance(config, LocalPoolConfig) or config.isolation == isolation:
        return config
    try:
        return LocalPoolConfig.model_validate({**config.model_dump(), "isolation": isolation})
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        raise ConfigError(
            f"--isolation {isolation}: {error['msg'].removeprefix('Value error, ')}",
            key="isolation",
            expected="a pool that can run at that tier",
        ) from None
