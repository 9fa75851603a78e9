"""The local backend: tool commands run as subprocesses of this process, on this machine.

One :class:`LocalHost` per backend: it admits at most ``max_concurrent_calls``
commands at once (more wait, and the wait counts against their timeout), makes
and removes session workspaces, and reads, writes and lists files. Each
command is run by :func:`~agent_backend.backends.local.command.run_in_group`,
in its own process group that is ended on every way out, so nothing a call
started outlives it. Commands start in the session workspace, or in a private
scratch directory outside a session.

With ``isolation = "namespaces"`` (docs/sandboxes.md) every workspace, and the
scratch directory, gets a sandbox when it is made (a uid of its own, cgroups,
and a running :class:`~agent_backend.backends.local.sandbox.SandboxProcess`
whose agent starts each of its commands); the pool refuses to start where the
host cannot build one, and a start first removes what dead owners left
(:mod:`agent_backend.sandbox.registry`).

This module must never block the event loop: file operations run in worker
threads (workspaces in those of
:class:`~agent_backend.backends.local.workspaces.WorkspaceKeeper`, which also
keeps spares made ahead); and it must never leave a process, a pipe or a
workspace behind after :meth:`LocalBackend.aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import posixpath
import secrets
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import ClassVar

import anyio
import anyio.to_thread

from agent_backend.backends.local import files
from agent_backend.backends.local.command import DRAIN_SECONDS, run_in_group
from agent_backend.backends.local.config import LocalPoolConfig
from agent_backend.backends.local.owner import OwnerLock, remove_tree, sweep_dead_owners
from agent_backend.backends.local.sandbox import (
    AGENT_VARIABLE,
    InitShell,
    SandboxDied,
    SandboxProcess,
    agent_argv,
    agent_source,
)
from agent_backend.backends.local.spawn import Spawner, posix_spawn_supported
from agent_backend.backends.local.workspaces import WorkspaceKeeper
from agent_backend.dispatch.backend import (
    Backend,
    Command,
    CommandResult,
    DirEntry,
    FileData,
    Host,
    Output,
    absolute_path,
    file_error,
)
from agent_backend.errors import BackendUnavailable, PoolClosed, PoolError, SandboxUnavailable
from agent_backend.sandbox import (
    AGENT_PYTHON,
    Cgroup,
    CgroupTree,
    EgressRelay,
    Guarantees,
    LayerStore,
    Registry,
    closed_ancestor,
    guarantees_of,
    missing_for_namespaces,
    remove_dead_owner,
    sandbox_argv,
)
from agent_backend.sandbox.bwrap import INIT_PATH, SYSTEM_PATHS
from agent_backend.sandbox.layers import Method, Stack, copy_tree

__all__ = ["LocalBackend", "LocalHost", "LocalStatistics"]

logger = logging.getLogger("agent_backend.backends.local")


@dataclasses.dataclass(frozen=True, slots=True)
class LocalStatistics:
    calls_active: int
    """Commands running now."""
    calls_queued: int
    """Commands waiting for a slot."""
    max_concurrent_calls: int
    workspaces: int
    """Workspaces made and not yet removed."""
    closed: bool
    guarantees: Guarantees | None = None
    """The walls around every command (``isolation`` and ``limits`` in force)."""


def _make_dir(path: str, mode: int = 0o700) -> None:
    os.makedirs(path, mode=mode, exist_ok=True)


@dataclasses.dataclass(slots=True)
class _Walls:
    """One sandbox: the uid its commands run as, its cgroups, and its running process."""

    uid: int
    cgroup: Cgroup
    process: SandboxProcess | None = None


def _suffix(path: str) -> str:
    """The random part of one of our directory names, kept when a spare becomes a workspace and
    a workspace becomes trash (``agent-backend-<kind>-<token>-<suffix>``)."""
    return os.path.basename(path).rsplit("-", 1)[-1]


def _outside_workspace(started: float, host: str) -> CommandResult:
    message = b"cannot run: the working directory must be inside the session workspace"
    return CommandResult(
        exit_status=126,
        stderr=Output(message, len(message), False),
        duration=time.monotonic() - started,
        host=host,
    )


def _lower_own_oom_score() -> None:
    """Make this process the OOM killer's last choice among ours (its sandboxes' are 1000)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/oom_score_adj") as file:
            current = int(file.read())
        if current > -500:
            with open("/proc/self/oom_score_adj", "w") as file:
                file.write("-500")


class LocalHost(Host):
    """This machine. Runs at most ``max_concurrent_calls`` commands at once."""

    def __init__(self, config: LocalPoolConfig) -> None:
        self.name = "local"
        self.config = config
        self._slots = anyio.Semaphore(config.max_concurrent_calls)
        self._active = 0
        self._queued = 0
        self._workspaces: set[str] = set()
        # Held from start to close: lets a later backend tell our directories from a dead one's.
        self._owner: OwnerLock | None = None
        # Calls in flight, so that aclose() can end them (their processes die with them).
        self._calls: set[anyio.CancelScope] = set()
        self._calls_done: anyio.Event | None = None
        self._scratch: str | None = None
        self._keeper: WorkspaceKeeper | None = None
        # Starts commands in a thread of its own (libc's posix_spawn), where this libc can.
        self._spawner: Spawner | None = None
        self._started = False
        self._closing = False
        self._closed = anyio.Event()
        # isolation = "namespaces": this owner's records and cgroups, and each sandbox's identity
        # by its directory's suffix (set in the keeper's threads, read on the event loop).
        self._sandboxed = config.isolation == "namespaces"
        self._registry: Registry | None = None
        self._cgroups: CgroupTree | None = None
        self._walls: dict[str, _Walls] = {}
        # Sandboxes counted from the moment one is asked for (max_sandboxes), under this lock:
        # the keeper's threads make them too.
        self._sandbox_count = 0
        self._count_lock = threading.Lock()
        # The loop that reads the sandboxes' agents (set at start; they are made in threads).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._egress: EgressRelay | None = None  # egress_allow: every sandbox's relays
        self._init: InitShell | None = None  # every sandbox's init, execute-only
        # Forks and snapshots (agent_backend.sandbox.layers), and what may not overlap them: the
        # calls and file operations in flight per workspace, and the forks in progress.
        self._layers: LayerStore | None = None
        self._busy: dict[str, int] = {}
        self._gates: dict[str, anyio.Event] = {}
        self._starting: dict[str, anyio.Lock] = {}  # a sandbox (re)started for its next call
        self._unkept: set[str] = set()  # workspaces not the keeper's (forks', graders')

    def __repr__(self) -> str:
        return (
            f"<LocalHost [calls: {self._active} active, {self._queued} queued"
            f" | workspaces: {len(self._workspaces)}]{' closed' if self._closing else ''}>"
        )

    # -- lifecycle --------------------------------------------------------------------------------

    def is_closed(self) -> bool:
        return self._closing

    def is_up(self) -> bool:
        return not self._closing

    def calls_in_flight(self) -> int:
        return self._active + self._queued

    def statistics(self) -> LocalStatistics:
        return LocalStatistics(
            calls_active=self._active,
            calls_queued=self._queued,
            max_concurrent_calls=self.config.max_concurrent_calls,
            workspaces=len(self._workspaces),
            closed=self._closing,
            guarantees=self.guarantees(),
        )

    def guarantees(self) -> Guarantees:
        """The walls in force around every command of this host."""
        return guarantees_of(
            self.config.isolation,
            self.config.limits,
            egress=self.config.egress_allow,
            workspace_quota_mb=self.config.workspace_quota_mb,
        )

    async def start(self) -> None:
        if self._closing:
            raise PoolClosed("the local backend is closed")
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        root = self.config.workspace_root
        if self._sandboxed and self._registry is None:
            await anyio.to_thread.run_sync(self._open_walls)
        try:
            if root is not None:
                # A sandbox's own uid must be able to reach its workspace (not list the root).
                await anyio.to_thread.run_sync(_make_dir, root, 0o711 if self._sandboxed else 0o700)
            base = root if root is not None else tempfile.gettempdir()
            if self._owner is None:
                self._owner = await anyio.to_thread.run_sync(OwnerLock.acquire, base)
                self._layers = LayerStore(
                    self._owner.root,
                    self._owner.prefix("layers"),
                    method=self.fork_method,
                    quota_mb=self.config.workspace_quota_mb if self._sandboxed else None,
                )
                # Workspaces of backends that died without closing (killed, OOM) go now.
                await anyio.to_thread.run_sync(sweep_dead_owners, base)
            if self.config.default_cwd is None and self._scratch is None:
                self._scratch = await anyio.to_thread.run_sync(self._mkdtemp, "scratch")
            elif (
                self.config.default_cwd is not None
                and not await anyio.Path(self.config.default_cwd).is_dir()
            ):
                raise BackendUnavailable(
                    f"default_cwd {self.config.default_cwd!r} is not a directory", backend="local"
                )
        except SandboxDied as exc:  # the scratch directory's sandbox: the first one made
            raise SandboxUnavailable(
                f"isolation = 'namespaces': a trial sandbox failed on this host: {exc.strerror}",
                missing=[f"a working sandbox ({exc.strerror})"],
                backend="local",
                host=self.name,
            ) from exc
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot prepare the local workspace root: {exc}", backend="local", host=self.name
            ) from exc
        if self._spawner is None and posix_spawn_supported():
            self._spawner = Spawner()
        if self._sandboxed and not self._started:
            await self._trial()
        if self._keeper is None:  # last: nothing after it can fail and leave its threads
            # Looked up when called: tests slow them down to prove they are off the loop.
            self._keeper = WorkspaceKeeper(
                lambda: self._mkdtemp("spare"),
                self._activate,
                lambda path: self._remove_tree(path),
                max_spares=self.config.spare_workspaces,
                loop=asyncio.get_running_loop(),
                discard=self._discard,
                respare=lambda path: self._rename_kind(path, "ws", "spare"),
            )
        self._started = True

    def _mkdtemp(self, kind: str, *, layered: bool = False) -> str:
        owner = self._owner
        if owner is None:  # closed while the directory was being asked for
            raise PoolClosed("the local backend is closed")
        path = os.path.realpath(tempfile.mkdtemp(prefix=owner.prefix(kind), dir=owner.root))
        if self._sandboxed:
            try:
                self._wall_in(path, layered=layered)
            except BaseException:
                remove_tree(path)
                raise
        return path

    # -- walls (isolation = "namespaces") ---------------------------------------------------------

    def _open_walls(self) -> None:
        """Check the host can enforce the walls, register as an owner, reconcile dead owners."""
        missing = missing_for_namespaces()
        root = self.config.workspace_root or tempfile.gettempdir()
        closed = closed_ancestor(root)
        if closed is not None:
            missing.append(
                f"a workspace_root other users can pass through: {closed} has no o+x, so no "
                "sandbox's own uid could reach its workspace (chmod o+x it, or choose another "
                "workspace_root)"
            )
        if missing:
            raise SandboxUnavailable(
                "isolation = 'namespaces' cannot be enforced on this host; missing: "
                + "; ".join(missing),
                missing=missing,
                backend="local",
                host=self.name,
            )
        if self.config.egress_allow and self._egress is None:
            try:  # names resolved now, once; closed by _close_walls
                self._egress = EgressRelay.start(self.config.egress_allow)
            except OSError as exc:
                raise SandboxUnavailable(
                    f"isolation = 'namespaces': egress_allow: {exc.strerror or exc}",
                    missing=[f"egress_allow destinations this host can resolve ({exc.strerror})"],
                    backend="local",
                    host=self.name,
                ) from exc
        if self._init is None:
            self._init = InitShell()  # closed by _close_walls
        token = secrets.token_hex(8)
        cgroups = CgroupTree(token)
        try:
            registry = Registry.open(
                self.config.sandbox_state_dir, token, note=json.dumps({"cgroups": cgroups.parents})
            )
        except OSError as exc:
            raise SandboxUnavailable(
                f"cannot record sandbox owners in the sandbox_state_dir: {exc.strerror or exc}",
                missing=["a writable sandbox_state_dir"],
                backend="local",
                host=self.name,
            ) from exc
        # What dead owners left: their cgroups' members killed, their uids' processes too.
        for dead, uids, note in registry.dead_owners():
            try:
                parents = json.loads(note).get("cgroups", {})
            except ValueError:
                parents = {}
            remove_dead_owner(dead, parents)
            registry.forget(dead, uids)
        cgroups.create()
        _lower_own_oom_score()
        self._registry, self._cgroups = registry, cgroups

    def _wall_in(self, path: str, *, layered: bool = False) -> None:
        """Give the new directory ``path`` a sandbox: a uid of its own (owning it), cgroups, and
        its process started (in a worker thread: spares are made ahead).

        ``layered``: an overlay is mounted there next (a fork, a grader), and its sandbox is
        started at its first call. With a workspace quota, a spare's tmpfs could not be renamed
        with it: :meth:`make_workspace` mounts it, and its sandbox starts at its first call.
        """
        registry, cgroups, layers = self._registry, self._cgroups, self._layers
        if registry is None or cgroups is None or layers is None:
            raise PoolClosed("the local backend is closed")
        self._count_sandbox()
        walls: _Walls | None = None
        uid: int | None = None
        try:
            uid = registry.claim_uid()
            os.chown(path, uid, uid)
            walls = _Walls(uid, cgroups.make(_suffix(path), self.config.limits))
            if not (layered or (layers.quota_mb is not None and self._is_spare(path))):
                layers.limit(path, uid)  # the quota's tmpfs, if any
                self._start_sandbox(path, walls)
        except BaseException:
            layers.release(path)
            if walls is not None:
                cgroups.remove(walls.cgroup)
            if uid is not None:
                registry.release_uid(uid)
            self._uncount_sandbox()
            raise
        self._walls[_suffix(path)] = walls

    def _count_sandbox(self) -> None:
        """Count one more sandbox, or refuse it: ``max_sandboxes`` are live or being made."""
        limit = self.config.max_sandboxes
        with self._count_lock:
            if self._sandbox_count >= limit:
                raise BackendUnavailable(
                    f"the local pool holds its most sandboxes (max_sandboxes = {limit}); "
                    "close a session, or retry later",
                    backend="local",
                    host=self.name,
                )
            self._sandbox_count += 1

    def _uncount_sandbox(self) -> None:
        with self._count_lock:
            self._sandbox_count -= 1

    def _start_sandbox(self, root: str, walls: _Walls) -> None:
        cgroups = self._cgroups
        if cgroups is None:
            raise PoolClosed("the local backend is closed")
        egress, init = self._egress, self._init
        if init is None:
            raise PoolClosed("the local backend is closed")
        with contextlib.ExitStack() as stack:
            # egress_allow: the names of its destinations in the sandbox's own /etc/hosts.
            hosts = stack.enter_context(egress.hosts_fd()) if egress is not None else None
            init_fd = stack.enter_context(init.fd())
            # A spare is bound where it will be once it is a workspace (renamed, its sandbox kept).
            at = self._in_use_path(root)
            argv = sandbox_argv(
                agent_argv(AGENT_PYTHON, idle=self.config.sandbox_agent_idle, shell=INIT_PATH),
                uid=walls.uid,
                workspace=root,
                workspace_at=at,
                cwd=at,
                limits=self.config.limits,
                read_only=self.config.sandbox_read_only,
                hosts_fd=hosts,
                init_fd=init_fd,
            )
            walls.process = SandboxProcess.start(
                argv,
                env={"PATH": os.defpath, AGENT_VARIABLE: agent_source()},
                cwd=root,
                born_in=lambda: cgroups.born_in(walls.cgroup),
                egress=egress,
                pass_fds=(init_fd,) if hosts is None else (init_fd, hosts),
                loop=self._loop,
            )
            walls.process.use(at == root)  # a spare's agent stays until a session takes it

    def _in_use_path(self, path: str) -> str:
        """The path the directory ``path`` has while a session uses it: a spare's workspace name
        (``-spare-<token>-X`` to ``-ws-<token>-X``), any other directory's own."""
        owner = self._owner
        head, name = os.path.split(path)
        if owner is not None and name.startswith(owner.prefix("spare")):
            return os.path.join(head, owner.prefix("ws") + name.removeprefix(owner.prefix("spare")))
        return path

    def _remove_tree(self, path: str) -> None:
        """Remove one of our directories, and its sandbox: processes, cgroups, then its uid."""
        walls = self._walls.pop(_suffix(path), None)
        if walls is not None:
            if walls.process is not None:
                walls.process.stop()
            if self._cgroups is not None:
                self._cgroups.remove(walls.cgroup)
        if self._layers is not None:  # its mounts (overlay, quota, a grader's assets)
            self._layers.release(path)
        remove_tree(path)
        if walls is not None:
            if self._registry is not None:
                self._registry.release_uid(walls.uid)
            self._uncount_sandbox()  # its processes gone, its uid free

    def _detach(self, path: str) -> None:
        """On the event loop: stop watching the sandbox of ``path`` before a thread ends it."""
        walls = self._walls.get(_suffix(path))
        if walls is not None and walls.process is not None:
            walls.process.detach()

    def _restart_sandbox(self, root: str, walls: _Walls) -> None:
        """A sandbox that died (its agent killed): end what is left and start it again."""
        old, walls.process = walls.process, None
        if old is not None:
            old.stop()
        if self._cgroups is not None:
            self._cgroups.empty(walls.cgroup)
        self._start_sandbox(root, walls)

    def _sandbox_of(self, cwd: str) -> tuple[str, _Walls] | None:
        """The workspace (or scratch directory) ``cwd`` is in, with its walls."""
        path = cwd
        for _ in range(256):
            if path in self._workspaces or path == self._scratch:
                walls = self._walls.get(_suffix(path))
                return (path, walls) if walls is not None else None
            parent = posixpath.dirname(path)
            if parent == path:
                return None
            path = parent
        return None

    async def _trial(self) -> None:
        """Run ``true`` in a sandbox once: the proof that the walls can be built here."""
        scratch = self._scratch
        assert scratch is not None
        result = await run_in_group(
            Command(argv=("true",), timeout=60.0, output_limit=4096),
            config=self.config,
            cwd=scratch,
            host=self.name,
            started=time.monotonic(),
            sandbox=await self._sandbox_for(scratch),
        )
        if result.exit_status != 0:
            walls = self._walls.get(_suffix(scratch))
            why = ""
            if walls is not None and walls.process is not None:
                why = await anyio.to_thread.run_sync(walls.process.why_dead)
            why = why or result.stderr.text().strip() or f"exit status {result.exit_status}"
            raise SandboxUnavailable(
                f"isolation = 'namespaces': a trial sandbox failed on this host: {why}",
                missing=[f"a working sandbox ({why})"],
                backend="local",
                host=self.name,
            )

    async def _sandbox_for(self, cwd: str) -> SandboxProcess | None:
        """The sandbox of the workspace ``cwd`` is in, started again if it died; None: ``cwd``
        is in no workspace of ours."""
        found = self._sandbox_of(cwd)
        if found is None:
            return None
        root, walls = found
        if walls.process is None or walls.process.is_dead():
            # One start for the calls that find it stopped together (after a fork, all at once).
            async with self._starting.setdefault(root, anyio.Lock()):
                if walls.process is None or walls.process.is_dead():
                    if walls.process is not None:
                        walls.process.detach()
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(self._restart_sandbox, root, walls)
        return walls.process

    def _activate(self, spare: str) -> str:
        """Rename a spare to its workspace name (``-spare-<token>-X`` to ``-ws-<token>-X``): under
        walls, where its sandbox has seen it from the start (:meth:`_in_use_path`)."""
        return self._rename_kind(spare, "spare", "ws")

    def _discard(self, path: str) -> str:
        """Rename a closed workspace to a trash name (``-ws-<token>-X`` to ``-trash-<token>-X``)."""
        return self._rename_kind(path, "ws", "trash")

    def _rename_kind(self, path: str, old: str, new: str) -> str:
        """Rename this owner's directory ``path`` of kind ``old`` to kind ``new``; the new path."""
        owner = self._owner
        if owner is None:
            raise PoolClosed("the local backend is closed")
        head, name = os.path.split(path)
        prefix = owner.prefix(old)
        if not name.startswith(prefix):
            raise OSError(errno.EINVAL, f"not a {old} directory of this backend: {name!r}")
        renamed = os.path.join(head, owner.prefix(new) + name.removeprefix(prefix))
        os.rename(path, renamed)
        return renamed

    async def aclose(self) -> None:
        """End every call in flight, then remove every workspace left; idempotent."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            with anyio.CancelScope(shield=True):
                if self._calls:
                    self._calls_done = anyio.Event()
                    for scope in self._calls:
                        scope.cancel()
                    # Each call ends its own process group within kill_grace (+ drain).
                    with anyio.move_on_after(self.config.kill_grace + DRAIN_SECONDS + 5):
                        await self._calls_done.wait()
                leftovers = sorted(self._workspaces)
                if self._scratch is not None:
                    leftovers.append(self._scratch)
                self._workspaces.clear()
                self._scratch = None
                if self._spawner is not None:  # no call is left to spawn with it
                    spawner, self._spawner = self._spawner, None
                    await spawner.aclose()
                if self._keeper is not None:
                    keeper, self._keeper = self._keeper, None
                    leftovers.extend(await keeper.aclose())  # its spares
                complete = True
                for path in leftovers:
                    self._detach(path)
                for path in leftovers:
                    try:
                        await anyio.to_thread.run_sync(self._remove_tree, path)
                    except OSError as exc:
                        complete = False
                        logger.warning("could not remove %s at close: %s", path, exc)
                if self._layers is not None:  # snapshots, and the layers they held
                    try:
                        await anyio.to_thread.run_sync(self._layers.close)
                    except OSError as exc:
                        complete = False
                        logger.warning("could not remove the layer store at close: %s", exc)
                await anyio.to_thread.run_sync(self._close_walls, complete)
                if self._owner is not None:
                    owner, self._owner = self._owner, None
                    # Released either way; with a workspace left, the lock file stays and the
                    # next backend to start in this root removes it (as a dead owner's).
                    await anyio.to_thread.run_sync(
                        owner.release if complete else owner.release_lock_only
                    )
        finally:
            self._closed.set()

    def _close_walls(self, complete: bool) -> None:
        init, self._init = self._init, None
        if init is not None:
            init.close()
        egress, self._egress = self._egress, None
        if egress is not None:  # every sandbox's relays are closed: this ends its thread
            egress.close()
        registry, self._registry = self._registry, None
        cgroups, self._cgroups = self._cgroups, None
        if cgroups is not None:
            cgroups.close()
        if registry is not None:
            # With a directory left, its uid stays recorded: the next owner to start kills
            # whatever has it and forgets it.
            if complete and not registry.uids():
                registry.close()
            else:
                registry.close_lock_only()

    def _check_open(self) -> None:
        if self._closing:
            raise PoolClosed("the local backend is closed")
        if not self._started:
            raise PoolError(
                "the local backend is not started: use `async with` (or await start()) first"
            )

    # -- commands ---------------------------------------------------------------------------------

    async def run(self, command: Command) -> CommandResult:
        self._check_open()
        started = time.monotonic()
        with anyio.CancelScope() as call_scope:
            self._calls.add(call_scope)
            try:
                # The timeout covers waiting for a slot too: a call never takes
                # much longer than its timeout, however busy the host is.
                try:  # a free slot is taken without a trip through the event loop
                    self._slots.acquire_nowait()
                except anyio.WouldBlock:
                    with anyio.move_on_after(command.timeout) as queue:
                        self._queued += 1
                        try:
                            await self._slots.acquire()
                        finally:
                            self._queued -= 1
                    if queue.cancelled_caught:
                        return CommandResult.not_started(
                            self.name, time.monotonic() - started, "the host was busy"
                        )
                workspace = None
                try:
                    self._active += 1
                    cwd = command.cwd or self.config.default_cwd or self._scratch
                    workspace = await self._enter(cwd)  # after a fork of it, if one is under way
                    sandbox = None
                    if self._sandboxed:
                        assert cwd is not None
                        sandbox = await self._sandbox_for(cwd)
                        if sandbox is None:
                            return _outside_workspace(started, self.name)
                    return await run_in_group(
                        command,
                        config=self.config,
                        cwd=cwd,
                        host=self.name,
                        started=started,
                        spawner=self._spawner,
                        sandbox=sandbox,
                    )
                finally:
                    self._leave(workspace)
                    self._active -= 1
                    self._slots.release()
            finally:
                self._calls.discard(call_scope)
                if not self._calls and self._calls_done is not None:
                    self._calls_done.set()
        raise PoolClosed("the local backend was closed while the command ran")

    # -- files ------------------------------------------------------------------------------------

    async def make_workspace(self) -> str:
        self._check_open()
        try:
            # Shielded so that a cancellation cannot lose a directory just made:
            # once tracked, it is removed by remove_workspace or at close.
            with anyio.CancelScope(shield=True):
                assert self._keeper is not None
                path = await self._keeper.take()
                if self._closing:  # closed while it was being made: do not leak it
                    await anyio.to_thread.run_sync(self._remove_tree, path)
                    raise PoolClosed("the local backend is closed")
                if self._sandboxed and self.config.workspace_quota_mb is not None:
                    await self._limit_taken(path)
                walls = self._walls.get(_suffix(path))
                if walls is not None and walls.process is not None:
                    walls.process.use(True)
                self._workspaces.add(path)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot create a workspace: {exc}", backend="local", host=self.name
            ) from exc
        return path

    async def remove_workspace(self, path: str) -> None:
        """Remove a workspace this host made; any other path is left alone (never removed)."""
        if path not in self._workspaces:
            return
        while (gate := self._gates.get(path)) is not None:  # a fork of it under way
            await gate.wait()
        if path not in self._workspaces:
            return
        self._workspaces.discard(path)
        self._starting.pop(path, None)
        keeper = self._keeper
        process = self._reusable(path) if keeper is not None and path not in self._unkept else None
        if keeper is not None and process is not None:
            spare = keeper.recycle(path)
            if spare is not None:  # made new while the caller goes on; removed if that fails
                process.use(False)
                process.reset(path, lambda ok: keeper.made_new(spare, ok))
                return
        self._detach(path)
        if path in self._unkept or keeper is None:  # not the keeper's, or closing: here
            self._unkept.discard(path)
            await anyio.to_thread.run_sync(self._remove_tree, path)
            return
        await keeper.remove(path)

    def _reusable(self, path: str) -> SandboxProcess | None:
        """Under walls: the sandbox of the closed workspace ``path``, if both can be made new
        in place for a next session (its sandbox costs more to make than to reset: the agent
        kills what the session left and empties the workspace and the sandbox's own scratch
        places; a keeper thread then sees the workspace empty from here too). None where that
        cannot be: a file operation still in flight, a fork's overlay, a quota's tmpfs, a
        sandbox not running."""
        walls, layers = self._walls.get(_suffix(path)), self._layers
        if (
            not self._sandboxed
            or self._closing
            or self.config.workspace_quota_mb is not None
            or self._busy.get(path)
            or walls is None
            or walls.process is None
            or walls.process.is_dead()
            or layers is None
            or layers.is_overlay(path)
        ):
            return None
        return walls.process

    # Beneath the workspace's descriptor, by the kernel (agent_backend.backends.local.files).

    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        self._check_open()
        try:
            async with self._using(workspace):
                data, size = await anyio.to_thread.run_sync(
                    files.read_file,
                    absolute_path(workspace),
                    path,
                    limit,
                    abandon_on_cancel=True,
                )
        except OSError as exc:
            raise file_error(exc, path, backend="local", host=self.name) from None
        return FileData(data, size)

    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        self._check_open()
        try:
            async with self._using(workspace):
                await anyio.to_thread.run_sync(
                    files.write_file,
                    absolute_path(workspace),
                    path,
                    data,
                    make_parents,
                    abandon_on_cancel=True,
                )
        except OSError as exc:
            raise file_error(exc, path, backend="local", host=self.name) from None

    async def list_dir(self, workspace: str, path: str) -> list[DirEntry]:
        self._check_open()
        try:
            async with self._using(workspace):
                entries = await anyio.to_thread.run_sync(
                    files.list_dir, absolute_path(workspace), path, abandon_on_cancel=True
                )
        except OSError as exc:
            raise file_error(exc, path, backend="local", host=self.name) from None
        return [DirEntry.of(*entry) for entry in entries]

    def workspaces(self) -> frozenset[str]:
        """The workspaces made and not yet removed."""
        return frozenset(self._workspaces)

    def spare_workspaces(self) -> frozenset[str]:
        """Empty workspaces made ahead, not yet handed out (``spare_workspaces``); gone at close."""
        keeper = self._keeper
        return keeper.spare_paths() if keeper is not None else frozenset()

    # -- forks and snapshots (agent_backend.sandbox.layers) ----------------------------------------

    @property
    def fork_method(self) -> Method:
        """How forks and snapshots copy a workspace: ``overlay`` (copy-on-write layers, under
        ``isolation = "namespaces"``, as root), or ``copy`` (``cp -a``: ``isolation = "none"``)."""
        return "overlay" if self._sandboxed else "copy"

    async def fork_workspace(self, path: str, n: int) -> list[str]:
        """See :meth:`Host.fork_workspace`. Under walls, each copy is an overlay over the
        frozen layers (:attr:`fork_method`), with a uid, cgroups and a sandbox of its own
        (started at its first call), as :meth:`make_workspace` gives; without walls, a copy
        (``cp -a``)."""
        if n < 1:
            raise ValueError(f"a fork makes at least one workspace (n = {n})")
        async with self._frozen(path):
            try:
                children = await anyio.to_thread.run_sync(self._fork, path, n)
            except OSError as exc:
                raise BackendUnavailable(
                    f"cannot fork workspace {path}: {exc}", backend="local", host=self.name
                ) from exc
            self._workspaces.update(children)
            self._unkept.update(children)
        if self._closing:  # they are removed with the rest
            raise PoolClosed("the local backend was closed while the workspace was forked")
        return children

    async def snapshot_workspace(self, path: str) -> str:
        """See :meth:`Host.snapshot_workspace`. Under walls, a read-only view (in the layer
        store, which no sandbox is shown) of the layers the workspace is frozen into (it goes
        on as an overlay over them); without walls, a copy."""
        async with self._frozen(path):
            try:
                return await anyio.to_thread.run_sync(self._snapshot, path)
            except OSError as exc:
                raise BackendUnavailable(
                    f"cannot snapshot workspace {path}: {exc}", backend="local", host=self.name
                ) from exc

    async def remove_snapshot(self, snapshot: str) -> None:
        """Remove a snapshot this host made; any other path is left alone (never removed)."""
        layers = self._layers
        if layers is None or snapshot not in layers.snapshots():
            return
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(layers.remove_snapshot, snapshot)

    async def run_on_snapshot(
        self, snapshot: str, command: Command, *, assets: Sequence[str] = ()
    ) -> CommandResult:
        """See :meth:`Host.run_on_snapshot`. Under walls, the grader's sandbox is a new one
        (uid, cgroups), its workspace an overlay over the snapshot's layers, the assets bound
        read-only into it alone; an asset that some sandbox is shown (a system directory,
        ``sandbox_read_only``, a workspace) is refused with ValueError. Without walls, the
        workspace is a copy and the assets are symbolic links (nothing is hidden)."""
        self._check_open()
        layers = self._layers
        if layers is None or snapshot not in layers.snapshots():
            raise PoolError(f"{snapshot!r} is not a snapshot of this host (or it was removed)")
        shown = [absolute_path(asset) for asset in assets]
        names = [posixpath.basename(asset.rstrip("/")) for asset in shown]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"assets must have distinct, non-empty base names: {names}")
        if command.cwd is not None and (
            posixpath.isabs(command.cwd) or posixpath.normpath(command.cwd).startswith("..")
        ):
            raise ValueError("a grading command's cwd is relative to its fresh workspace")
        # What some sandbox is shown: system directories, sandbox_read_only, each workspace.
        visible = [*SYSTEM_PATHS, *self.config.sandbox_read_only, *self._workspaces]
        visible += [self._scratch] if self._scratch is not None else []
        with anyio.CancelScope(shield=True):  # once made, it is removed below (or at close)
            try:
                grader = await anyio.to_thread.run_sync(
                    self._make_grader, snapshot, shown, visible if self._sandboxed else []
                )
            except OSError as exc:
                raise BackendUnavailable(
                    f"cannot make a grading workspace: {exc}", backend="local", host=self.name
                ) from exc
            self._workspaces.add(grader)
            self._unkept.add(grader)
        try:
            workspace = posixpath.join(grader, "workspace")
            cwd = posixpath.normpath(posixpath.join(workspace, command.cwd or "."))
            env = {"GRADER_ASSETS": posixpath.join(grader, "assets"), **command.env}
            return await self.run(dataclasses.replace(command, cwd=cwd, env=env))
        finally:
            with anyio.CancelScope(shield=True):
                # Its mounts first: the workspace is then a plain tree, renamed away and removed.
                await anyio.to_thread.run_sync(layers.release, grader)
                await self.remove_workspace(grader)

    def _is_spare(self, path: str) -> bool:
        owner = self._owner
        return owner is not None and os.path.basename(path).startswith(owner.prefix("spare"))

    async def _limit_taken(self, path: str) -> None:
        """Mount the quota's tmpfs at a workspace just taken (its sandbox starts at its first
        call, and binds it then)."""
        walls, layers = self._walls.get(_suffix(path)), self._layers
        if walls is None or layers is None:
            raise PoolClosed("the local backend is closed")
        try:
            await anyio.to_thread.run_sync(layers.limit, path, walls.uid)
        except BaseException:
            self._workspaces.add(path)  # to go the way every workspace goes
            await self.remove_workspace(path)
            raise

    def _workspace_of(self, cwd: str) -> str | None:
        """The workspace ``cwd`` is in (None: none of ours)."""
        path = cwd
        for _ in range(256):
            if path in self._workspaces:
                return path
            parent = posixpath.dirname(path)
            if parent == path:
                return None
            path = parent
        return None

    async def _enter(self, cwd: str | None) -> str | None:
        """Count a call or file operation in the workspace ``cwd`` is in, once no fork of it is
        under way; that workspace, for :meth:`_leave`."""
        workspace = self._workspace_of(cwd) if cwd else None
        if workspace is None:
            return None
        while (gate := self._gates.get(workspace)) is not None:
            await gate.wait()
        self._busy[workspace] = self._busy.get(workspace, 0) + 1
        return workspace

    def _leave(self, workspace: str | None) -> None:
        if workspace is not None:
            left = self._busy.pop(workspace, 1) - 1
            if left:
                self._busy[workspace] = left

    @contextlib.asynccontextmanager
    async def _using(self, workspace: str) -> AsyncIterator[None]:
        entered = await self._enter(workspace)
        try:
            yield
        finally:
            self._leave(entered)

    @contextlib.asynccontextmanager
    async def _frozen(self, path: str) -> AsyncIterator[None]:
        """Workspace ``path`` with no call or file operation in flight, none started until the
        end (they wait), its sandbox's watcher detached; shielded, and waited for by aclose()."""
        self._check_open()
        if path not in self._workspaces:
            raise PoolError(f"{path!r} is not a workspace of this host")
        busy = self._busy.get(path, 0)
        if busy or path in self._gates:
            raise PoolError(
                f"workspace {path} is busy ({busy} call(s) or file operation(s) in flight, or "
                "a fork or snapshot of it under way): fork or snapshot it between calls"
            )
        gate = self._gates[path] = anyio.Event()
        with anyio.CancelScope() as scope:
            self._calls.add(scope)
            try:
                with anyio.CancelScope(shield=True):
                    self._detach(path)
                    yield
            finally:
                del self._gates[path]
                gate.set()
                self._calls.discard(scope)
                if not self._calls and self._calls_done is not None:
                    self._calls_done.set()

    def _fork(self, path: str, n: int) -> list[str]:
        """In a worker thread: ``n`` new workspaces, copies of ``path``."""
        layers = self._layers
        assert layers is not None
        children: list[str] = []
        try:
            if layers.method == "copy":
                for _ in range(n):
                    children.append(self._mkdtemp("ws"))
                    copy_tree(path, children[-1])
                return children
            walls = self._walls.get(_suffix(path))
            if walls is None:
                raise PoolClosed("the local backend is closed")
            if walls.process is not None and layers.needs_freeze(path):
                # Ended first: its processes exit while the copies' walls are made.
                walls.process.stop()
                walls.process = None

            def make() -> tuple[str, int]:
                children.append(self._mkdtemp("ws", layered=True))
                return children[-1], self._walls[_suffix(children[-1])].uid

            layers.fork(path, walls.uid, n, make=make, stop=lambda: self._stop_sandbox(walls))
        except BaseException:
            for child in children:
                try:
                    self._remove_tree(child)
                except OSError as exc:
                    logger.warning("could not remove %s after a failed fork: %s", child, exc)
            raise
        return children

    def _freeze(self, path: str) -> Stack:
        """In a worker thread: what workspace ``path`` shows, frozen."""
        walls, layers = self._walls.get(_suffix(path)), self._layers
        if walls is None or layers is None:
            raise PoolClosed("the local backend is closed")
        if not layers.needs_freeze(path):
            return layers.stack(path)
        self._stop_sandbox(walls)
        return layers.freeze(path, walls.uid)

    def _stop_sandbox(self, walls: _Walls) -> None:
        """In a worker thread, before a freeze: end the sandbox (it binds the directory about
        to be frozen); it starts again, over the new mount, at its next call.

        Every process left in its cgroups is sent SIGKILL, once: none runs again, so none can
        write what is frozen next; waiting for them to be gone (and emptying the cgroups) is
        left to the next start (:meth:`_restart_sandbox`).
        """
        if walls.process is not None:
            walls.process.stop()
            walls.process = None
        for directory in walls.cgroup.directories:
            with contextlib.suppress(FileNotFoundError), open(f"{directory}/cgroup.procs") as procs:
                for pid in procs.read().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def _snapshot(self, path: str) -> str:
        layers = self._layers
        assert layers is not None
        if layers.method == "copy":
            return layers.copy_snapshot(path)
        return layers.snapshot(self._freeze(path))

    def _make_grader(self, snapshot: str, assets: list[str], visible: list[str]) -> str:
        """In a worker thread: a fresh sandbox's directory, ``workspace/`` in it a writable copy of
        ``snapshot``, ``assets/`` the ``assets`` read-only, none of them at or below a path of
        ``visible`` (some sandbox is shown those)."""
        layers = self._layers
        assert layers is not None
        _check_assets(assets, visible)
        grader = self._mkdtemp("ws", layered=True)
        try:
            workspace = os.path.join(grader, "workspace")
            os.mkdir(workspace, 0o700)
            if layers.method == "copy":
                copy_tree(snapshot, workspace)
            else:
                uid = self._walls[_suffix(grader)].uid
                os.chown(workspace, uid, uid)
                try:
                    stack = layers.snapshot_stack(snapshot)
                except KeyError:
                    raise PoolError(f"snapshot {snapshot!r} was removed meanwhile") from None
                layers.mount([(workspace, uid)], stack)
            layers.show(os.path.join(grader, "assets"), grader, assets)
        except BaseException:
            self._remove_tree(grader)
            raise
        return grader


def _check_assets(assets: list[str], visible: list[str]) -> None:
    """Refuse an asset that does not exist, or that is at or below a path of ``visible``."""
    for asset in assets:
        if not os.path.exists(asset):
            raise ValueError(f"asset {asset!r} does not exist")
        real = os.path.realpath(asset)
        for seen in visible:
            top = os.path.realpath(seen).rstrip("/") + "/"
            if (real + "/").startswith(top):
                raise ValueError(
                    f"asset {asset!r} is in {seen}, which a sandbox is shown: keep grading "
                    "assets where no agent's sandbox can see them"
                )


class LocalBackend(Backend):
    """The local pool: one :class:`LocalHost`."""

    kind: ClassVar[str] = "local"

    def __init__(self, config: LocalPoolConfig | None = None) -> None:
        self.config = config or LocalPoolConfig()
        self.host = LocalHost(self.config)

    @classmethod
    def from_config(cls, config: LocalPoolConfig) -> LocalBackend:
        return cls(config)

    def __repr__(self) -> str:
        stats = self.host.statistics()
        state = " closed" if stats.closed else ""
        return (
            f"<LocalBackend [calls: {stats.calls_active} active, {stats.calls_queued} queued"
            f" | workspaces: {stats.workspaces}]{state}>"
        )

    @property
    def hosts(self) -> Sequence[Host]:
        return (self.host,)

    async def start(self) -> None:
        await self.host.start()

    async def aclose(self) -> None:
        await self.host.aclose()

    def is_closed(self) -> bool:
        return self.host.is_closed()

    def statistics(self) -> LocalStatistics:
        return self.host.statistics()

    def guarantees(self) -> list[str]:
        return self.host.guarantees().lines()
