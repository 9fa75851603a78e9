"""This process's plumbing to Ray, shared by the Ray tool pool and the Ray rollout workers.

One connection per process (:data:`CONNECTION`: who opened it, how many pools
use it, closed by the last of them; joining a cluster bounded by
:data:`CONNECT_TIMEOUT`, its failure told in Ray's own words), loopback-only local clusters, the Ray
exceptions that mean an actor is gone, a short cause for an error message,
and where actors go (their options, what the cluster and an actor hold). Blocking calls (``ray.init``, ``ray.kill``) are meant for worker
threads.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

import anyio
import anyio.to_thread
import ray
import ray.exceptions

from agent_backend.backends.ray.config import RayPoolConfig, RayToolConfig
from agent_backend.backends.ray.placement import NodeShape, check_nodes
from agent_backend.backoff import backoff_delay
from agent_backend.errors import BackendUnavailable, ConfigError, ResourceUnavailable, clip

__all__ = [
    "ACTOR_DEATHS",
    "CAUSE_LIMIT",
    "CLIENT_START_ATTEMPTS",
    "CONNECTION",
    "CONNECT_TIMEOUT",
    "NODE_ID_LABEL",
    "ActorConfig",
    "ConnectConfig",
    "RayConnection",
    "actor_options",
    "check_cluster",
    "client_server_died",
    "connect",
    "describe_cause",
    "describe_when_ready",
    "kill_actors",
    "loopback_only",
    "node_died",
    "pool_placement_group",
    "probe_node",
    "remove_placement_groups",
    "render_resources",
    "replica_placement_group",
    "tool_shortage",
]

#: The longest cause :func:`describe_cause` returns.
CAUSE_LIMIT: Final = 500
#: Seconds joining a cluster (``address`` set) may take before it fails with
#: ``BackendUnavailable``: first a TCP connection to the address, then Ray's own attempts to
#: reach the cluster's GCS (one a second: ``RAY_gcs_server_port_wait_time_s``, unless set).
#: Ray Client (``ray://``) keeps its own limit (about 30 s when the server never accepts).
CONNECT_TIMEOUT: Final = 15.0
#: Ray's knob for how many seconds (attempts) a driver tries to reach a GCS; 20 by default.
_GCS_WAIT: Final = "RAY_gcs_server_port_wait_time_s"
#: Ray's token authentication: mode, token, token file (default: ~/.ray/auth_token).
_AUTH_MODE: Final = "RAY_AUTH_MODE"
_CLIENT_PORT: Final = 10001
_REASON_LIMIT: Final = 1500


class LocalSpec(Protocol):
    """How to start a local Ray (``RayPoolConfig.local``)."""

    @property
    def num_cpus(self) -> int | None: ...
    @property
    def num_gpus(self) -> int | None: ...
    @property
    def object_store_memory(self) -> int | None: ...
    @property
    def resources(self) -> Mapping[str, float]: ...


class ConnectConfig(Protocol):
    """What opening the connection reads from a pool config (``RayPoolConfig``)."""

    @property
    def address(self) -> str | None: ...
    @property
    def local(self) -> LocalSpec: ...
    @property
    def log_to_driver(self) -> bool: ...


def loopback_only() -> None:
    """Make a Ray that this pool starts itself listen and talk on 127.0.0.1 only.

    Ray binds a single-node cluster to the machine's primary address unless
    told it is not a cluster; a laptop or CI run has no reason to expose its
    GCS and raylet beyond loopback. Workers inherit the environment variable;
    the driver's already-imported constant is set too. A joined cluster
    (``address`` set) is left as its operator configured it.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = getattr(getattr(ray, "_private", None), "ray_constants", None)
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False


def describe_cause(exc: BaseException) -> str:
    """Ray's reason, short: ``ActorDiedError: The actor is dead because it was killed by ...``.

    Ray's messages open with a generic line and tab-indented ids; the lines
    after those say why, so those are kept when there are any.
    """
    text = str(getattr(exc, "error_msg", None) or exc)
    lines = [line for line in text.splitlines() if line.strip()]
    reasons = [line.strip() for line in lines[1:] if not line[:1].isspace()]
    picked = reasons or [line.strip() for line in lines[:1]]
    return clip(f"{type(exc).__name__}: {' '.join(picked)}".rstrip(": "), CAUSE_LIMIT)


ACTOR_DEATHS: Final[tuple[type[BaseException], ...]] = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.OutOfMemoryError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.LocalRayletDiedError,
)
"""Ray exceptions that mean the actor (its process or its node) is gone."""


class RayConnection:
    """This process's connection to Ray, as pools see it: who opened it, how many pools use it.

    A pool either finds Ray connected by someone else (a trainer's ``ray.init()``:
    used, never closed), or opens the connection itself: joining ``address``, or
    starting a local Ray. A connection pools opened is shared by every pool of the
    process and closed (``ray.shutdown()``: disconnect, and stop a local Ray) when
    the last of them closes. Blocking: called in worker threads, under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened = False
        self._users = 0

    def open(self, config: ConnectConfig) -> bool:
        """Connect if needed; True when the caller must :meth:`close` (a pool-opened connection)."""
        with self._lock:
            if ray.is_initialized():
                if not self._opened:
                    return False
                self._users += 1
                return True
            if config.address is not None:
                _join(config.address, log_to_driver=config.log_to_driver)
            else:
                local = config.local
                loopback_only()
                ray.init(
                    # A new local Ray, always: without "local", ray.init joins the last
                    # cluster `ray start` left on this machine (or fails on a dead one).
                    address="local",
                    num_cpus=local.num_cpus,
                    num_gpus=local.num_gpus,
                    object_store_memory=local.object_store_memory,
                    resources=dict(local.resources) or None,
                    include_dashboard=False,
                    log_to_driver=config.log_to_driver,
                )
            self._opened, self._users = True, 1
            return True

    def close(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._opened:
                self._opened = False
                ray.shutdown()


CONNECTION: Final = RayConnection()
"""The process's one connection to Ray, shared by tool pools and rollout workers."""


def kill_actors(handles: Sequence[Any]) -> None:
    """``ray.kill`` each actor (never restarted); errors ignored (it may be gone already).

    A no-op when this process is not connected to Ray: ``ray.kill`` would
    otherwise start a local Ray of its own just to fail.
    """
    if not ray.is_initialized():
        return
    for handle in handles:
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)


class _Unreachable(ConnectionError):
    """Nothing accepts connections at a cluster's address (found before Ray tries)."""


def _probe_target(address: str) -> tuple[str, int] | None:
    """The ``(host, port)`` joining ``address`` connects to first; None when Ray resolves it
    some other way (``auto`` with no cluster recorded) or it is not ``HOST:PORT``."""
    if address.startswith("ray://"):
        host, _, port = address.removeprefix("ray://").partition(":")
        return (host, int(port)) if port.isdigit() else (host, _CLIENT_PORT)
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            resolved = canonicalize_bootstrap_address("auto")
        except Exception:  # Ray's own ray.init says what is wrong
            return None
        if resolved is None:
            return None
        address = resolved
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def _probe(address: str) -> None:
    """Fail at once, within :data:`CONNECT_TIMEOUT`, when nothing listens at ``address``: Ray
    itself would retry for minutes (each attempt waits out its own gRPC timeouts)."""
    target = _probe_target(address)
    if target is None:
        return
    host, port = target
    try:
        with socket.create_connection(target, timeout=CONNECT_TIMEOUT):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _Unreachable(
            f"nothing accepts connections at {host}:{port} ({reason}, within {CONNECT_TIMEOUT:g}s)"
        ) from None


@contextlib.contextmanager
def _gcs_budget() -> Iterator[None]:
    """Ray's attempts to reach the GCS bounded by :data:`CONNECT_TIMEOUT` (one a second), for
    the one ``ray.init`` that joins; an operator's own setting is kept."""
    if _GCS_WAIT in os.environ:
        yield
        return
    os.environ[_GCS_WAIT] = str(max(1, round(CONNECT_TIMEOUT)))
    try:
        yield
    finally:
        os.environ.pop(_GCS_WAIT, None)


#: How often joining through Ray Client tries when the server it is given dies at birth.
CLIENT_START_ATTEMPTS: Final = 3
#: What Ray Client says when the per-driver server its proxy starts is gone before it serves.
#: The proxy forks that server from a process whose gRPC threads are running, and the child
#: sometimes aborts in gRPC's poller (ray-project/ray#63202); the proxy then reports the
#: child's exit, its zombie or its missing channel. Another attempt gets another server.
_CLIENT_START_DEATHS: Final = (
    "Starting Ray client server failed",
    "ZombieProcess",
    "NoSuchProcess",
    "Proxy failed to Connect to backend",
)


def client_server_died(exc: BaseException) -> bool:
    """Whether ``exc`` from ``ray.init("ray://...")`` means Ray Client's server for this driver
    died as it started (worth a new attempt), not that the cluster refused this driver."""
    text = str(exc)
    return (
        isinstance(exc, ConnectionAbortedError)
        and "Initialization failure from server" in text
        and any(marker in text for marker in _CLIENT_START_DEATHS)
    )


def _join(address: str, *, log_to_driver: bool) -> None:
    _probe(address)
    attempts = CLIENT_START_ATTEMPTS if address.startswith("ray://") else 1
    with _gcs_budget():
        for attempt in range(1, attempts + 1):
            try:
                ray.init(address=address, log_to_driver=log_to_driver)
                return
            except ConnectionAbortedError as exc:
                # Ray Client disconnects a failed attempt itself; the next one starts clean.
                if attempt == attempts or not client_server_died(exc):
                    raise
            time.sleep(backoff_delay(attempt, first=0.5, ceiling=2.0))


def _ray_reason(exc: BaseException) -> str:
    """What Ray says went wrong, whole (its hints included): the innermost cause, and for a
    GCS it could not reach, the last line of the attempt's traceback that Ray quotes."""
    messages: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current).strip()
        head, marker, trace = text.partition("Last connection error: Traceback")
        if marker:
            lines = [line.strip() for line in trace.splitlines() if line.strip()]
            text = " ".join(part for part in (head.strip(), lines[-1] if lines else "") if part)
        if text:
            messages.append(text if messages else f"{type(current).__name__}: {text}")
        current = current.__cause__ or current.__context__
    return clip(": ".join(dict.fromkeys(messages)), _REASON_LIMIT)


def _auth_hint(reason: str) -> str:
    """Where to look when Ray did not say, and this process is not in token mode."""
    if os.environ.get(_AUTH_MODE, "").lower() == "token" or _AUTH_MODE in reason:
        return ""
    return (
        f". If the cluster uses Ray's token authentication ({_AUTH_MODE}=token, which `ray "
        "start` turns on when it finds a token), set RAY_AUTH_MODE=token here too, with the "
        "cluster's token in RAY_AUTH_TOKEN, in the file RAY_AUTH_TOKEN_PATH names, or in "
        "~/.ray/auth_token"
    )


def connect(config: ConnectConfig) -> bool:
    """Join or start Ray, or use this process's connection (blocking: call it in a worker thread).

    True when the caller must ``CONNECTION.close()`` when done. A failure is
    :class:`~agent_backend.errors.BackendUnavailable` naming where, with Ray's
    reason and hint; joining fails within :data:`CONNECT_TIMEOUT` when nothing
    listens at the address or the GCS does not let this driver in.
    """
    try:
        return CONNECTION.open(config)
    except Exception as exc:
        where = config.address or "a local Ray"
        reason = _ray_reason(exc)
        hint = "" if config.address is None or isinstance(exc, _Unreachable) else _auth_hint(reason)
        raise BackendUnavailable(
            f"cannot connect to {where}: {reason}{hint}",
            backend="ray",
            host=config.address,
        ) from None


class ActorConfig(Protocol):
    """What placing an actor reads from a pool config (``RayPoolConfig``)."""

    @property
    def num_cpus(self) -> float: ...
    @property
    def num_gpus(self) -> float: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def resources(self) -> Mapping[str, float]: ...
    @property
    def start_timeout(self) -> float: ...
    @property
    def replicas(self) -> int: ...
    @property
    def strategy(self) -> str: ...
    @property
    def node_labels(self) -> Mapping[str, str]: ...
    @property
    def bundles(self) -> Sequence[Mapping[str, float]]: ...
    @property
    def bundle_strategy(self) -> str: ...
    def actor_resources(self) -> dict[str, float]: ...


def actor_options(
    config: ActorConfig,
    ray_name: str,
    *,
    control_slots: int,
    runtime_env: Mapping[str, Any] | None,
    avoid_nodes: frozenset[str] = frozenset(),
    placement_group: Any = None,
    bundle_index: int = 0,
) -> dict[str, Any]:
    """Ray ``.options()`` for one actor of ``config``: its reservation, concurrency, env, place.

    ``control_slots`` are concurrency kept beyond ``max_concurrency`` for the
    driver's own calls (describe, the death sentinel, close). ``runtime_env``
    is the pool's as shipped at start (``ActorSupervisor.shipped_runtime_env``:
    local folders replaced by their URIs in the cluster), never the config's
    own, which Ray refuses per actor when it names local paths. Ray never
    restarts the actor: its owner replaces it and keeps serving meanwhile.
    ``avoid_nodes`` keeps it off nodes known dead or being judged;
    ``placement_group`` (its own, or the pool's for ``strategy = "pack"``)
    places it in bundle ``bundle_index``, and what it starts in the group's bundles.
    """
    options: dict[str, Any] = {
        "name": ray_name,
        "num_cpus": config.num_cpus,
        "num_gpus": config.num_gpus,
        "max_concurrency": config.max_concurrency + control_slots,
        "max_restarts": 0,
        "max_task_retries": 0,
    }
    if config.resources:
        options["resources"] = dict(config.resources)
    if runtime_env is not None:
        options["runtime_env"] = dict(runtime_env)
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )
        return options
    if config.strategy == "spread":
        options["scheduling_strategy"] = "SPREAD"
    selector = dict(config.node_labels)
    if avoid_nodes:
        ids = sorted(avoid_nodes)
        selector[NODE_ID_LABEL] = f"!{ids[0]}" if len(ids) == 1 else f"!in({', '.join(ids)})"
    if selector:
        options["label_selector"] = selector
    return options


#: The label Ray gives every node: its id.
NODE_ID_LABEL: Final = "ray.io/node-id"


def pool_placement_group(config: ActorConfig) -> Any:
    """The pool-wide placement group of ``strategy = "pack"`` (one bundle per replica, Ray's
    ``PACK``), or None. Blocking (an RPC); Ray moves its bundles off a node that dies."""
    if config.strategy != "pack":
        return None
    from ray.util.placement_group import placement_group

    bundle = config.actor_resources() or {"CPU": 0.001}
    return placement_group(
        [dict(bundle) for _ in range(config.replicas)],
        strategy="PACK",
        bundle_label_selector=[dict(config.node_labels)] * config.replicas
        if config.node_labels
        else None,
    )


def replica_placement_group(config: ActorConfig) -> Any:
    """A replica's own placement group (``bundles``), or None. Blocking (an RPC)."""
    if not config.bundles:
        return None
    from ray.util.placement_group import placement_group

    bundles = [dict(bundle) for bundle in config.bundles]
    return placement_group(
        bundles,
        strategy=config.bundle_strategy.upper(),
        bundle_label_selector=[dict(config.node_labels)] * len(bundles)
        if config.node_labels
        else None,
    )


async def describe_when_ready(handle: Any, *, label: str, config: ActorConfig) -> Any:
    """Await ``handle.describe`` (the actor has started and loaded its code), bounded.

    ``label`` names the actor in errors: a runtime_env that cannot be set up
    is a :class:`ConfigError`; an actor that fails or does not start within
    ``config.start_timeout`` is :class:`BackendUnavailable`, saying what it
    needs and what the cluster has free.
    """
    timeout = config.start_timeout
    with anyio.move_on_after(timeout) as scope:
        try:
            return await handle.describe.remote()
        except ray.exceptions.RuntimeEnvSetupError as exc:
            raise ConfigError(
                f"{label}: its runtime_env could not be set up: {describe_cause(exc)}",
                key="runtime_env",
                expected="a runtime_env Ray can set up on the cluster's nodes",
            ) from None
        except ray.exceptions.RayError as exc:
            raise BackendUnavailable(
                f"{label} did not start: {describe_cause(exc)}", backend="ray"
            ) from None
    assert scope.cancelled_caught
    available = await anyio.to_thread.run_sync(ray.available_resources)
    raise BackendUnavailable(
        f"{label} did not start within {timeout:g}s: it needs "
        f"{render_resources(config.actor_resources())}; the cluster has "
        f"{render_resources(available)} available now",
        backend="ray",
    )


def render_resources(resources: Mapping[str, float]) -> str:
    """``CPU=1, GPU=0.5`` (sorted; whole numbers without a fraction), or ``nothing``."""
    if not resources:
        return "nothing"
    return ", ".join(
        f"{name}={int(amount) if math.isclose(amount, round(amount)) else amount:g}"
        for name, amount in sorted(resources.items())
    )


def check_cluster(config: RayPoolConfig, nodes: Sequence[NodeShape]) -> None:
    """Refuse, at start, replicas that the alive ``nodes`` could never hold (one by one)."""
    check_nodes(config, nodes)


def tool_shortage(
    config: RayPoolConfig, name: str, spec: RayToolConfig
) -> ResourceUnavailable | None:
    """The error for calls of a tool that needs more than an actor holds; None if it fits."""
    held = config.actor_resources()
    needed = spec.needs()
    if all(held.get(res, 0.0) + 1e-9 >= amount for res, amount in needed.items()):
        return None
    return ResourceUnavailable(
        f"tool {name!r} needs {render_resources(needed)}, but the actors of pool "
        f"{config.name!r} each hold {render_resources(held)}",
        needed=needed,
        available=held,
        backend="ray",
    )


# -- nodes as failure domains -------------------------------------------------------------------

#: What Ray's death messages say when an actor died with its node.
_NODE_DEATH_MARKERS: Final = ("its node has died", "NodeDiedError", "node was terminated")


def node_died(cause: str) -> bool:
    """True when an actor's death cause (:func:`describe_cause`) says its node died."""
    return any(marker in cause for marker in _NODE_DEATH_MARKERS)


def _node_probe() -> None:
    """Runs on the probed node: that it ran is the answer."""


@functools.cache
def _probe_task() -> Any:
    return ray.remote(num_cpus=0, max_retries=0)(_node_probe)


async def probe_node(node_id: str) -> str | None:
    """Whether the node ``node_id`` lives: None once a task pinned to it ran; Ray's reason
    when it cannot run there (the node died: Ray says so once it has marked it dead). Not
    bounded here: bound it with a cancel scope (a node that is hung, not dead, never answers)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    ref = _probe_task().options(scheduling_strategy=strategy).remote()
    try:
        await ref
    except ray.exceptions.RayError as exc:
        return f"its node has died ({describe_cause(exc)})"
    except BaseException:
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
        raise
    return None


def remove_placement_groups(groups: Sequence[Any]) -> None:
    """Remove placement groups (blocking; errors ignored: they may be gone with their node)."""
    if not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)
