"""The policy servers a rollout samples from: replicas, failover, and weights kept in step.

:class:`PolicyServers` is a list of data-parallel replicas of one policy
(vLLM or SGLang servers serving the same weights) and the policy version they
serve. Every request of a policy client (:class:`~agent_backend.rollout.policy.OpenAICompatiblePolicy`,
:class:`~agent_backend.rollout.tokens.VLLMTokenSampler`) takes a :class:`Lease` on one of them:

* **Load balancing**: the server with the fewest requests in flight; an
  episode stays on the server of its previous turn while that one is up
  (its prompt is a prefix the server has cached), through a :class:`Sticky`.
* **Failover**: a server that cannot be connected to is taken out at once
  (:meth:`PolicyServers.failed`) and the request goes to another; a server
  out is probed (``GET /health``) when a request comes after its probe time,
  the interval doubling up to ``max_probe_interval``, and put back when it
  answers, after its weights were brought to the current version.
* **Weight updates**: :meth:`PolicyServers.update_weights` loads a checkpoint
  into every server that is up, together, and bumps the version. While it
  runs no new request is sent; the requests in flight are handled as
  ``in_flight`` says (:data:`~agent_backend.rollout.weight_sync.InFlight`):
  ``drain`` waits for them first (they finish on the old weights),
  ``abort`` aborts them and their callers send them again on the new
  weights, ``continue`` freezes them and lets them go on, on the new weights.
  A lease records the version when its request was sent and when its
  answer came (:attr:`Lease.versions`): equal, except for a request that a
  ``continue`` update crossed. A server out at an update is brought to the
  new weights before it serves again.

State changes are synchronous (no await between a check and its change);
I/O comes after. Taking a lease when nothing is updating and the sticky
server is up takes no trip through the event loop. Probing happens in the
task that asks for a lease (no background task): a request that comes after
a server's probe time pays for the probe (a refused connection answers at
once; a silent host costs ``probe_timeout``). This module must never send a
request while weights are being loaded, and never put a server back whose
weights are not the current version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Literal

import aiohttp
import anyio
import anyio.abc

from agent_backend.errors import PolicyError, clip
from agent_backend.lifecycle import AsyncResource
from agent_backend.rollout.weight_sync import (
    IN_FLIGHT_POLICIES,
    InFlight,
    ServerUnreachable,
    WeightSync,
    weight_sync,
)

__all__ = [
    "Lease",
    "PolicyServers",
    "ServerState",
    "ServersStatistics",
    "Sticky",
    "UpdateReport",
    "base_url",
    "servers_of",
]

_ENDPOINT_SUFFIXES = ("/chat/completions", "/completions", "/generate")


def base_url(url: str) -> str:
    """A server's root URL: ``http://h:8000/v1/completions`` and ``http://h:8000/v1`` give
    ``http://h:8000``."""
    base = url.rstrip("/")
    for suffix in _ENDPOINT_SUFFIXES:
        if base.endswith(suffix):
            base = base[: -len(suffix)]
            break
    return base.removesuffix("/v1")


@dataclasses.dataclass(slots=True, eq=False)
class ServerState:
    """One replica and what the pool knows of it."""

    url: str
    """Its root URL (no ``/v1``)."""
    in_flight: int = 0
    """Requests sent to it and not answered yet."""
    up: bool = True
    """In rotation. A server out gets no request until a probe puts it back."""
    version: int = 0
    """The policy version of its weights."""
    probe_at: float = 0.0
    """``time.monotonic()`` from which a request probes it (when out)."""
    probe_interval: float = 0.0
    probing: bool = False
    requests: int = 0
    """Requests sent to it, in all."""
    failures: int = 0
    """Times it was taken out."""
    last_error: str | None = None


@dataclasses.dataclass(slots=True)
class Sticky:
    """Which server an episode's last turn went to (what keeps the episode there)."""

    server: ServerState | None = None


@dataclasses.dataclass(slots=True, eq=False)
class Lease:
    """One request's hold on a server: where to send it, and under which weights."""

    server: ServerState
    version: int
    """The policy version when the request was sent."""
    epoch: int
    """The abort count when the request was sent (an abort-mode update since: resend)."""
    version_end: int | None = None
    """The policy version when the answer came (set by :meth:`PolicyServers.lease` on exit)."""

    @property
    def versions(self) -> tuple[int, int]:
        """``(sent, answered)`` policy versions; equal unless a ``continue`` update crossed it."""
        end = self.version if self.version_end is None else self.version_end
        return self.version, end

    def endpoint(self, path: str) -> str:
        """``path`` (``chat/completions``, ``completions``) under this server's ``/v1``."""
        return f"{self.server.url}/v1/{path}"


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateReport:
    """What one :meth:`PolicyServers.update_weights` did."""

    version: int
    """The policy version now."""
    updated: tuple[str, ...]
    """The servers that loaded the checkpoint."""
    out: tuple[str, ...]
    """The servers out of rotation (they load it before they serve again)."""
    drained: int
    """Requests waited for (``drain``) or in flight when the update began."""
    seconds: float
    """Wall time from the call to the servers serving again."""
    load_seconds: float
    """Of which loading the weights (every server, together)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServersStatistics:
    version: int
    up: int
    servers: int
    updates: int
    resent_after_abort: int
    requests: dict[str, int]
    failures: dict[str, int]


class PolicyServers(AsyncResource):
    """Replicas of one policy, load-balanced, failed over, updated together (module docstring).

    ``PolicyServers(["http://127.0.0.1:8000", "http://127.0.0.1:8001"], weights="vllm")``;
    give it to the policy clients in place of a URL, and to
    :class:`~agent_backend.rollout.pool.RolloutPool` (found through the policy) for
    :meth:`~agent_backend.rollout.pool.RolloutPool.update_weights`.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        weights: Literal["vllm", "sglang"] | WeightSync | None = "vllm",
        version: int = 0,
        checkpoint: str | Path | None = None,
        probe_interval: float = 0.5,
        max_probe_interval: float = 30.0,
        probe_timeout: float = 2.0,
        update_timeout: float = 600.0,
        drain_timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        """
        Args:
            urls: the replicas (``http://host:port``, with or without ``/v1``).
            weights: how a checkpoint is loaded into them: ``"vllm"`` (vLLM's RL endpoints,
                ``VLLM_SERVER_DEV_MODE=1``), ``"sglang"``, a :class:`WeightSync`, or None
                (weights are not updated through this object; versions still are).
            version: the policy version the servers serve now.
            checkpoint: the checkpoint they serve now (what a server probed back loads when
                its version is behind); None: the weights they were started with.
            probe_interval, max_probe_interval: seconds before the first probe of a server
                taken out, doubled per failed probe up to the maximum.
            probe_timeout: seconds a probe may take.
            update_timeout: seconds one server's part of an update may take.
            drain_timeout: seconds a ``drain`` update (and a restore) waits for the requests
                in flight to end; past it the update is refused (:class:`PolicyError`) and
                nothing changes: a request that never ends must not stall the trainer forever.
            api_key: sent as ``Authorization: Bearer`` on probes and updates.
        """
        given = [urls] if isinstance(urls, str) else list(urls)
        if not given:
            raise ValueError("PolicyServers needs at least one server URL")
        bases = [base_url(u) for u in given]
        if len(set(bases)) != len(bases):
            raise ValueError(f"a server is listed twice: {given}")
        if not probe_interval > 0 or not max_probe_interval >= probe_interval:
            raise ValueError("probe_interval must be > 0 and <= max_probe_interval")
        self.servers = [ServerState(b, version=version) for b in bases]
        self.weights: WeightSync | None = None if weights is None else weight_sync(weights)
        self.checkpoint = None if checkpoint is None else str(checkpoint)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.probe_timeout = probe_timeout
        self.update_timeout = update_timeout
        if not drain_timeout > 0:
            raise ValueError("drain_timeout must be positive")
        self.drain_timeout = drain_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._version = version
        self._updating = False
        self._gate = anyio.Event()
        self._gate.set()
        self._idle: anyio.Event | None = None
        self._in_flight = 0
        self._waiting = 0
        self._epoch = 0
        self._updates = 0
        self._resent = 0
        # fast_acquire: uncontended, an update closes the gate (and counts an abort) in the step
        # it is called in, before any answer to a request sent earlier is read.
        self._update_lock = anyio.Lock(fast_acquire=True)
        self._http: aiohttp.ClientSession | None = None
        self._closed = False
        self._turn = 0

    def __repr__(self) -> str:
        up = sum(s.up for s in self.servers)
        state = " updating" if self._updating else (" closed" if self._closed else "")
        return f"<PolicyServers {up}/{len(self.servers)} up version={self._version}{state}>"

    # -- state --------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The policy version every server in rotation serves."""
        return self._version

    @property
    def updating(self) -> bool:
        return self._updating

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests held back while weights are being loaded."""
        return self._waiting

    def up_count(self) -> int:
        """Servers in rotation."""
        return sum(s.up for s in self.servers)

    def set_version(self, version: int) -> None:
        """Record weights loaded by someone else (the trainer's own sync): no request is
        changed, the servers are labelled ``version``."""
        if version < self._version:
            raise ValueError(f"policy versions only go up ({self._version} -> {version})")
        self._version = version
        for server in self.servers:
            server.version = version

    def statistics(self) -> ServersStatistics:
        return ServersStatistics(
            version=self._version,
            up=sum(s.up for s in self.servers),
            servers=len(self.servers),
            updates=self._updates,
            resent_after_abort=self._resent,
            requests={s.url: s.requests for s in self.servers},
            failures={s.url: s.failures for s in self.servers},
        )

    def interrupted(self, lease: Lease) -> bool:
        """True when an ``abort`` update began after ``lease``'s request was sent: its answer
        (aborted, or sampled on the old weights) must be thrown away and the request resent.
        Counted once per call that says so."""
        if lease.epoch == self._epoch:
            return False
        self._resent += 1
        return True

    def failed(self, server: ServerState, error: str) -> None:
        """``server`` could not be reached: out of rotation until a probe brings it back.

        The last server up stays in: with nowhere else to go, the caller's retries (with
        backoff) go to it directly."""
        server.last_error = clip(error, 300)
        if not server.up or not any(s.up and s is not server for s in self.servers):
            return
        server.up = False
        server.failures += 1
        server.probe_interval = self.probe_interval
        server.probe_at = time.monotonic() + server.probe_interval

    # -- leases -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, sticky: Sticky | None = None) -> AsyncIterator[Lease]:
        """Hold a server for one request (module docstring); :class:`PolicyError` (retryable)
        when none is up."""
        if self._closed:
            raise PolicyError("the policy servers are closed")
        await self._through_gate()
        server = self._pick(sticky)
        if server is None or self._probe_due():
            await self._probe_due_servers()
            await self._through_gate()  # a probe awaited: an update may have begun meanwhile
            server = self._pick(sticky)
        if server is None:
            raise self._none_up()
        lease = Lease(server, self._version, self._epoch)
        server.in_flight += 1
        server.requests += 1
        self._in_flight += 1
        if sticky is not None:
            sticky.server = server
        try:
            yield lease
        finally:
            # The weights the server had when it answered (set before it resumed from an update).
            lease.version_end = max(lease.version, server.version)
            server.in_flight -= 1
            self._in_flight -= 1
            if self._in_flight == 0 and self._idle is not None:
                self._idle.set()

    async def _through_gate(self) -> None:
        """Wait while weights are being loaded (no trip through the loop when they are not)."""
        while self._updating:
            self._waiting += 1
            try:
                await self._gate.wait()
            finally:
                self._waiting -= 1

    def _pick(self, sticky: Sticky | None) -> ServerState | None:
        if sticky is not None and sticky.server is not None and sticky.server.up:
            return sticky.server
        best: ServerState | None = None
        count = len(self.servers)
        self._turn = (self._turn + 1) % count
        for offset in range(count):  # ties go round the list
            server = self.servers[(self._turn + offset) % count]
            if server.up and (best is None or server.in_flight < best.in_flight):
                best = server
        return best

    def _probe_due(self) -> bool:
        now = time.monotonic()
        return any(not s.up and not s.probing and s.probe_at <= now for s in self.servers)

    def _none_up(self) -> PolicyError:
        errors = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers if not s.up)
        return PolicyError(
            f"no policy server is up ({errors})", url=self.servers[0].url, retryable=True
        )

    async def _probe_due_servers(self) -> None:
        now = time.monotonic()
        for server in self.servers:
            if server.up or server.probing or server.probe_at > now:
                continue
            server.probing = True
            try:
                healthy = await self._healthy(server)
                if healthy and server.version != self._version:
                    healthy = await self._bring_up_to_date(server)
            finally:
                server.probing = False
            if healthy and not self._updating and server.version == self._version:
                server.up = True
                server.last_error = None
            else:
                server.probe_interval = min(server.probe_interval * 2, self.max_probe_interval)
                server.probe_at = time.monotonic() + server.probe_interval

    async def _healthy(self, server: ServerState) -> bool:
        try:
            with anyio.fail_after(self.probe_timeout):
                async with self._session().get(
                    f"{server.url}/health", headers=self._headers
                ) as response:
                    await response.read()
                    ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            server.last_error = f"probe: {type(exc).__name__}: {clip(str(exc), 200)}"
            return False
        if not ok:
            server.last_error = f"probe: /health answered HTTP {response.status}"
        return ok

    async def _bring_up_to_date(self, server: ServerState) -> bool:
        """Load the current checkpoint into a server probed back behind the current version."""
        if self.weights is None or self.checkpoint is None:
            server.last_error = (
                f"its weights are version {server.version}, the policy is at {self._version}, "
                "and no checkpoint to load is known"
            )
            return False
        version = self._version
        try:
            # Nothing of ours is in flight on a server out of rotation: drained at once.
            await self.weights.update(
                self._session(),
                server.url,
                self.checkpoint,
                version,
                "drain",
                step_timeout=self.update_timeout,
            )
        except PolicyError as exc:
            server.last_error = exc.message
            return False
        server.version = version
        return True

    # -- weight updates -----------------------------------------------------------------------

    async def update_weights(
        self,
        checkpoint: str | Path,
        *,
        version: int | None = None,
        in_flight: InFlight = "drain",
    ) -> UpdateReport:
        """Load ``checkpoint`` into every server in rotation and serve it as ``version``
        (default: the current one + 1). See the module docstring for ``in_flight``.

        A server that cannot be reached is taken out (it loads the checkpoint before it
        serves again); if a server refuses the checkpoint (missing files, no such endpoint),
        :class:`PolicyError` is raised with its answer, the version is not bumped, and the
        servers that did load it are taken out until a probe reloads the current one.
        """
        new = self._version + 1 if version is None else version
        if new <= self._version:
            raise ValueError(f"policy versions only go up ({self._version} -> {new})")
        return await self._update(checkpoint, new, in_flight)

    async def restore(self, checkpoint: str | Path, *, version: int) -> UpdateReport:
        """Load a trainer's checkpoint after a resume and serve it as ``version``, which may
        be below the current one (the servers may hold weights of steps the crashed run took
        after its last checkpoint). Turns in flight are drained first."""
        return await self._update(checkpoint, version, "drain")

    async def _update(self, checkpoint: str | Path, new: int, in_flight: InFlight) -> UpdateReport:
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_POLICIES}, not {in_flight!r}")
        if self.weights is None:
            raise PolicyError(
                "these policy servers have no weight loader (weights=None): pass "
                "weights='vllm' or 'sglang', or sync the weights yourself and call set_version()"
            )
        path = str(checkpoint)
        started = time.perf_counter()
        async with self._update_lock:
            self._updating = True
            self._gate = anyio.Event()
            try:
                drained = self._in_flight
                if in_flight == "drain" and self._in_flight:
                    self._idle = anyio.Event()
                    with anyio.move_on_after(self.drain_timeout):
                        await self._idle.wait()
                    if self._in_flight:
                        raise PolicyError(
                            f"weight update to version {new} refused: {self._in_flight} "
                            f"request(s) still in flight after {self.drain_timeout:g} s of "
                            "draining (nothing was changed)",
                            retryable=True,
                        )
                elif in_flight == "abort":
                    self._epoch += 1  # every answer of a request sent before is resent
                targets = [s for s in self.servers if s.up]
                loading = time.perf_counter()
                refused = await self._load_all(targets, path, new, in_flight)
                load_seconds = time.perf_counter() - loading
                if refused:
                    for server in targets:
                        if server.up and server.version == new:
                            self.failed(server, f"loaded {path}, which another server refused")
                    raise PolicyError(
                        f"weight update to version {new} refused: {refused[0].message}",
                        status=refused[0].status,
                        url=refused[0].url,
                    )
                self._version = new
                self.checkpoint = path
                self._updates += 1
            finally:
                self._idle = None
                self._updating = False
                self._gate.set()
        return UpdateReport(
            version=self._version,
            updated=tuple(s.url for s in targets if s.up),
            out=tuple(s.url for s in self.servers if not s.up),
            drained=drained,
            seconds=time.perf_counter() - started,
            load_seconds=load_seconds,
        )

    async def _load_all(
        self, targets: list[ServerState], path: str, version: int, in_flight: InFlight
    ) -> list[PolicyError]:
        assert self.weights is not None
        weights = self.weights
        refused: list[PolicyError] = []

        async def one(server: ServerState) -> None:
            def loaded() -> None:
                # Before the server resumes: an answer that comes after is of this version.
                server.version = version

            try:
                await weights.update(
                    self._session(),
                    server.url,
                    path,
                    version,
                    in_flight,
                    step_timeout=self.update_timeout,
                    on_loaded=loaded,
                )
            except ServerUnreachable as exc:
                self.failed(server, exc.message)
            except PolicyError as exc:
                refused.append(exc)

        # Shielded: a cancelled trainer must not leave servers paused or half updated.
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as group:
                for server in targets:
                    group.start_soon(one, server)
        return refused

    # -- resources ----------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None),  # bounded by anyio.fail_after
            )
        return self._http

    async def aclose(self) -> None:
        """Close the HTTP session of probes and updates; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._http is not None:
            with anyio.CancelScope(shield=True):
                await self._http.close()


def servers_of(policy: object) -> PolicyServers | None:
    """The :class:`PolicyServers` a policy samples from (its own, or its sampler's), if any."""
    for part in (policy, getattr(policy, "sampler", None)):
        found = getattr(part, "servers", None)
        if isinstance(found, PolicyServers):
            return found
    return None
