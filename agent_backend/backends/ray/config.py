"""The configuration of a Ray pool (``type = "ray"``): where, how many actors, what each holds.

:class:`RayPoolConfig` is what a pool file's ``type = "ray"`` table loads
into; the tool pool (:class:`~agent_backend.backends.ray.RayBackend`) and the
rollout workers (:class:`~agent_backend.rollout.ray_workers.RayRolloutWorkers`)
both read it. Pure data: this module imports neither Ray nor anything that
does I/O. The one thing it looks at on disk is that the local folders and
files a ``runtime_env`` ships (``working_dir``, ``py_modules``) exist, so
that a wrong path fails at load, naming its key, rather than at start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Final, Literal

import pydantic
from typing_extensions import TypedDict

from agent_backend.config import ConfigModel, ConfigPath, ImportPath

__all__ = [
    "INLINE_FLOOR",
    "URI_SCHEMES",
    "LocalRayConfig",
    "RayPoolConfig",
    "RayRuntimeEnv",
    "RayToolConfig",
]

#: Ray returns objects below this size inside the task reply, into the
#: caller's own memory (``max_direct_call_object_size``): a by-reference
#: threshold below it would put the bytes in the driver after all.
INLINE_FLOOR: Final = 100 * 1024

_RESOURCE_NAME: Final = r"^[A-Za-z_][\w.:/-]*$"
# Ray's label keys (an optional DNS prefix, then a name) and plain label values.
_LABEL_KEY: Final = r"^([a-z0-9]([a-z0-9.-]*[a-z0-9])?/)?[A-Za-z0-9]([\w.-]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE: Final = r"^[A-Za-z0-9]([\w.-]{0,61}[A-Za-z0-9])?$"


def _check_gpus(value: float) -> float:
    if value > 1 and not float(value).is_integer():
        raise ValueError("a fraction of a GPU must be below 1 (Ray shares one GPU, never several)")
    return value


GPUs = Annotated[float, pydantic.Field(ge=0), pydantic.AfterValidator(_check_gpus)]
Resources = dict[
    Annotated[str, pydantic.StringConstraints(pattern=_RESOURCE_NAME)],
    Annotated[float, pydantic.Field(ge=0)],
]


def _no_builtin_resources(value: dict[str, float]) -> dict[str, float]:
    for name in ("CPU", "GPU", "memory", "object_store_memory"):
        if name in value:
            raise ValueError(f"{name!r} is not a custom resource: use its own key")
    return value


class RayToolConfig(ConfigModel):
    """One tool of a Ray pool: a Python function and what it needs."""

    function: ImportPath
    """Import path ``package.module:function`` (``module:Class.method`` for a static method),
    importable where the actors run (installed, or shipped with ``runtime_env``). Sync or async;
    its schema comes from its signature and docstring. Imported once per actor."""
    name: str | None = None
    """The tool's name; None: the function's ``__name__``."""
    num_cpus: float = pydantic.Field(default=0, ge=0)
    """CPUs a call needs its actor to have; a call no actor can satisfy fails at dispatch."""
    num_gpus: GPUs = 0
    """GPUs (fractions allowed) a call needs its actor to have; checked like ``num_cpus``."""
    resources: Annotated[Resources, pydantic.AfterValidator(_no_builtin_resources)] = (
        pydantic.Field(default_factory=dict)
    )
    """Custom Ray resources a call needs its actor to have (``{accelerator_A100 = 1}``)."""
    idempotent: bool = False
    """True when running a call twice is harmless: a call whose actor died is then retried once
    on another actor instead of failing with ``WorkerLost``."""

    def needs(self) -> dict[str, float]:
        needed = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in needed.items() if amount > 0}


#: The URI schemes Ray fetches a ``working_dir`` or a ``py_modules`` entry from (Ray 2.60:
#: its package store, remote storage, and ``local://`` for a folder already on every node).
URI_SCHEMES: Final = ("gcs", "http", "https", "s3", "gs", "azure", "abfss", "file", "local")
_MODULE_FILES: Final = (".py", ".zip", ".whl")
_PATH: Final = pydantic.TypeAdapter(ConfigPath)


def _uri_or_path(value: str, info: pydantic.ValidationInfo) -> tuple[str, Path | None]:
    """``value`` as it will be used: a URI of a scheme Ray fetches (no path), or the local path
    resolved like any path of a pool file (``~`` expanded, relative to the file's folder)."""
    scheme, separator, _ = value.partition("://")
    if separator:
        if scheme.lower() not in URI_SCHEMES:
            raise ValueError(
                f"a URI Ray cannot fetch: {scheme!r} (Ray fetches {', '.join(URI_SCHEMES)}://)"
            )
        return value, None
    resolved = _PATH.validate_python(value, context=info.context)
    return resolved, Path(resolved)


def _check_working_dir(value: str, info: pydantic.ValidationInfo) -> str:
    value, path = _uri_or_path(value, info)
    if path is not None and not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise ValueError(f"{what}: {value} (a local working_dir is a folder, uploaded at start)")
    return value


def _check_py_module(value: str, info: pydantic.ValidationInfo) -> str:
    value, path = _uri_or_path(value, info)
    if path is None or path.is_dir():
        return value
    if not path.exists():
        raise ValueError(f"no such folder or file: {value}")
    if not path.is_file() or path.suffix not in _MODULE_FILES:
        raise ValueError(f"neither a folder nor a .py, .zip or .whl file: {value}")
    return value


@pydantic.with_config(pydantic.ConfigDict(extra="allow"))
class RayRuntimeEnv(TypedDict, total=False):
    """A Ray ``runtime_env`` (a dict): the keys that ship code are checked at load, every other
    key (``pip``, ``env_vars``, ``excludes``...) is passed to Ray as it is."""

    working_dir: Annotated[str, pydantic.AfterValidator(_check_working_dir)]
    """A local folder (uploaded to the cluster at start) or a URI Ray fetches (``s3://...zip``)."""
    py_modules: list[Annotated[str, pydantic.AfterValidator(_check_py_module)]]
    """Local folders (packages), ``.py``, ``.zip`` or ``.whl`` files (uploaded), or URIs."""


def _tool_entry(value: object) -> object:
    return {"function": value} if isinstance(value, str) else value


class LocalRayConfig(ConfigModel):
    """The Ray this pool starts when it has no ``address`` (and none runs in this process)."""

    num_cpus: int | None = pydantic.Field(default=None, ge=1)
    """Logical CPUs of the local node; None: the machine's cores."""
    num_gpus: int | None = pydantic.Field(default=None, ge=0)
    """Logical GPUs of the local node; None: the GPUs Ray detects. Set it on a machine without
    a GPU to try a GPU pool (placement and ``ray.get_gpu_ids()`` work; CUDA does not)."""
    object_store_memory: int | None = pydantic.Field(default=None, ge=75 * 1024 * 1024)
    """Bytes of shared memory for the object store (payloads live there); None: Ray's default,
    30% of the machine's memory. Size it above the payloads alive at once, or Ray spills to disk."""
    resources: Annotated[Resources, pydantic.AfterValidator(_no_builtin_resources)] = (
        pydantic.Field(default_factory=dict)
    )
    """Custom resources the local node advertises."""


class RayPoolConfig(ConfigModel):
    """A pool of Ray actors running Python tools (``type = "ray"``)."""

    type: Literal["ray"] = "ray"
    """Selects the Ray backend."""
    name: str = pydantic.Field(default="ray", pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    """Names the pool's actors (``NAME-REPLICA.GENERATION``) in errors, logs and ``ray list``."""
    address: str | None = pydantic.Field(default=None, min_length=1)
    """The cluster to join: ``"auto"`` (the one started on this machine by ``ray start``),
    ``"HOST:PORT"`` (its GCS) or ``"ray://HOST:10001"`` (Ray Client); never shut down by the
    pool. None: a local Ray is started. A connection pools opened is shared by the process's
    pools and closed (disconnected; a local Ray stopped) when the last of them closes. When
    this process was already connected to Ray by other code, that connection is used and kept."""
    local: LocalRayConfig = pydantic.Field(default_factory=LocalRayConfig)
    """How to start the local Ray when ``address`` is None."""
    num_cpus: float = pydantic.Field(default=1, ge=0)
    """CPUs reserved by each actor (fractions allowed)."""
    num_gpus: GPUs = 0
    """GPUs reserved by each actor: fractions below 1 share a GPU (0.5: two actors per GPU),
    whole numbers give each actor its own. Inside, ``ray.get_gpu_ids()`` and
    ``CUDA_VISIBLE_DEVICES`` name the GPUs granted."""
    resources: Annotated[Resources, pydantic.AfterValidator(_no_builtin_resources)] = (
        pydantic.Field(default_factory=dict)
    )
    """Custom Ray resources reserved by each actor."""
    replicas: int = pydantic.Field(default=1, ge=1, le=1024)
    """How many actors: calls are spread over them, least-loaded first."""
    max_concurrency: int = pydantic.Field(default=1, ge=1, le=1000)
    """Calls one actor runs at once; more wait in the pool's queue (counting against their
    timeout). Sync tools run in the actor's threads, async ones on its event loop."""
    runtime_env: RayRuntimeEnv | None = None
    """Ray ``runtime_env`` of the actors (``pip``, ``working_dir``, ``py_modules``,
    ``env_vars``...): how the tools' code reaches a cluster's nodes. A local ``working_dir``
    (a folder) and local ``py_modules`` (folders, ``.py``/``.zip``/``.whl`` files) are checked
    at load (relative paths: from the pool file's folder) and uploaded to the cluster once
    per start (content-addressed: an unchanged folder is not sent again)."""
    tools: tuple[Annotated[RayToolConfig, pydantic.BeforeValidator(_tool_entry)], ...] = (
        pydantic.Field(min_length=1)
    )
    """The tools every actor hosts: import paths ``"module:function"``, or tables with
    ``function`` and any of ``name``, ``num_cpus``, ``num_gpus``, ``resources``, ``idempotent``."""
    inline_limit: int = pydantic.Field(default=1024 * 1024, ge=INLINE_FLOOR)
    """Results of at least this many bytes (arrays, tensors, bytes, str, and containers of them)
    stay in the object store and come back as a ``PayloadRef``; smaller ones come back inline.
    At least 100 KiB: below that Ray copies objects into the caller's memory anyway."""
    call_timeout: float = pydantic.Field(default=300.0, gt=0)
    """Default seconds for a call (queueing, a retry and the tool's run), over which it fails
    with ``ToolTimeout`` and its Ray task is cancelled."""
    start_timeout: float = pydantic.Field(default=120.0, gt=0)
    """Seconds for the actors to start (runtime env set-up, tool imports) at ``start()`` and
    for each replacement."""
    max_restarts: int = pydantic.Field(default=3, ge=0)
    """Replacements per replica after its actor dies; after that the replica stays dead and the
    pool serves with the rest (with none left, calls fail with ``BackendUnavailable``)."""
    autoscaling: bool = False
    """True when the cluster adds nodes on demand: actors it cannot hold yet are waited for
    (up to ``start_timeout``). False: a pool whose replicas do not fit the cluster's alive nodes
    (each actor on one node; packed node by node, not against the cluster's totals) fails at
    start with ``ResourceUnavailable`` naming every node's shape, instead of waiting."""
    strategy: Literal["default", "spread", "pack"] = "default"
    """Where replicas go: ``"default"`` (Ray's: fill the least-used nodes up to half, then
    spread), ``"spread"`` (over as many nodes as possible: a node's loss costs the fewest
    actors) or ``"pack"`` (onto the nodes already holding the pool's actors while they have room:
    frees whole nodes, e.g. for training)."""
    node_labels: dict[
        Annotated[str, pydantic.StringConstraints(pattern=_LABEL_KEY)],
        Annotated[str, pydantic.StringConstraints(pattern=_LABEL_VALUE)],
    ] = pydantic.Field(default_factory=dict)
    """Node labels every actor's node must carry (``{zone = "a", "ray.io/accelerator-type" =
    "A100"}``): Ray's label selectors, set on nodes with ``ray start --labels``."""
    bundles: tuple[Resources, ...] = ()
    """A placement group per replica: its resource bundles (``[{CPU = 1, GPU = 1}, {GPU = 1}]``)
    reserved together before the actor starts. The actor runs in the first bundle (which must
    hold its ``num_cpus``/``num_gpus``/``resources``); tasks and actors it starts itself go to the
    group's other bundles. For a tool that drives several GPUs of one node (``bundle_strategy =
    "strict_pack"``). Empty: no placement group."""
    bundle_strategy: Literal["strict_pack", "pack", "spread", "strict_spread"] = "strict_pack"
    """How a replica's bundles are placed: all on one node (``strict_pack``), on as few nodes as
    possible (``pack``), over several (``spread``) or each on its own node (``strict_spread``)."""
    unavailable_timeout: float = pydantic.Field(default=30.0, gt=0)
    """Seconds an actor Ray reports temporarily unavailable (its connection lost, its node not
    yet confirmed dead) is kept out of rotation and waited for, before it is declared dead and
    replaced. Its calls meanwhile go elsewhere (idempotent ones) or fail with ``WorkerLost``."""
    log_to_driver: bool = True
    """Show the actors' stdout and stderr in this process (when this pool connects to Ray)."""

    def actor_resources(self) -> dict[str, float]:
        """What each actor reserves, in Ray's resource names."""
        held = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {name: amount for name, amount in held.items() if amount > 0}

    @pydantic.model_validator(mode="after")
    def _actor_fits_first_bundle(self) -> RayPoolConfig:
        if self.bundles and self.strategy != "default":
            raise ValueError(
                "strategy: a pool with bundles is placed by bundle_strategy (each replica its "
                "own placement group); leave strategy at its default"
            )
        if self.bundles:
            first = self.bundles[0]
            short = {
                name: amount
                for name, amount in self.actor_resources().items()
                if first.get(name, 0.0) + 1e-9 < amount
            }
            if short:
                raise ValueError(
                    f"bundles: the actor runs in the first bundle, which must hold what it "
                    f"reserves ({short} more than {dict(first)})"
                )
        return self
