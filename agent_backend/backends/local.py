"""The local backend: tool commands run as subprocesses of this process, on this machine.

One :class:`LocalHost` per backend: it admits at most ``max_concurrent_calls``
commands at once (more wait, and the wait counts against their timeout), makes
and removes session workspaces, and reads, writes and lists files. Each
command is run by :func:`~agent_backend.backends.local_command.run_in_group`,
in its own process group that is ended on every way out, so nothing a call
started outlives it. Commands start in the session workspace, or in a private
scratch directory outside a session.

With ``isolation = "namespaces"`` (docs/sandboxes.md) every workspace, and the
scratch directory, gets a sandbox when it is made (a uid of its own, cgroups,
and a running :class:`~agent_backend.backends.local_sandbox.SandboxProcess`
whose agent starts each of its commands); the pool refuses to start where the
host cannot build one, and a start first removes what dead owners left
(:mod:`agent_backend.sandbox.registry`).

This module must never block the event loop: file operations run in worker
threads (workspaces in those of
:class:`~agent_backend.backends.local_workspaces.WorkspaceKeeper`, which also
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
import tempfile
import time
from collections.abc import Sequence
from typing import ClassVar

import anyio
import anyio.to_thread

from agent_backend.backends import local_files
from agent_backend.backends.local_command import DRAIN_SECONDS, run_in_group
from agent_backend.backends.local_config import LocalPoolConfig
from agent_backend.backends.local_owner import OwnerLock, remove_tree, sweep_dead_owners
from agent_backend.backends.local_sandbox import (
    AGENT_VARIABLE,
    SandboxDied,
    SandboxProcess,
    agent_argv,
    agent_source,
)
from agent_backend.backends.local_spawn import Spawner, posix_spawn_supported
from agent_backend.backends.local_workspaces import WorkspaceKeeper
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
    Guarantees,
    Registry,
    closed_ancestor,
    guarantees_of,
    missing_for_namespaces,
    remove_dead_owner,
    sandbox_argv,
)

__all__ = ["LocalBackend", "LocalHost", "LocalPoolConfig", "LocalStatistics"]

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
        return guarantees_of(self.config.isolation, self.config.limits)

    async def start(self) -> None:
        if self._closing:
            raise PoolClosed("the local backend is closed")
        if self._started:
            return
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
                # A sandbox binds its workspace by path when it starts, ahead of need: under
                # walls a spare has its workspace's name from the start, and keeps it.
                lambda: self._mkdtemp("ws" if self._sandboxed else "spare"),
                self._activate,
                lambda path: self._remove_tree(path),
                max_spares=self.config.spare_workspaces,
                loop=asyncio.get_running_loop(),
                discard=self._discard,
            )
        self._started = True

    def _mkdtemp(self, kind: str) -> str:
        owner = self._owner
        if owner is None:  # closed while the directory was being asked for
            raise PoolClosed("the local backend is closed")
        path = os.path.realpath(tempfile.mkdtemp(prefix=owner.prefix(kind), dir=owner.root))
        if self._sandboxed:
            try:
                self._wall_in(path)
            except BaseException:
                remove_tree(path)
                raise
        return path

    # -- walls (isolation = "namespaces") ---------------------------------------------------------

    def _open_walls(self) -> None:
        """Check the host can enforce the walls, register as an owner, reconcile dead owners."""
        missing = missing_for_namespaces()
        root = self.config.workspace_root or tempfile.gettempdir()
        closed = closed_ancestor(os.path.dirname(os.path.realpath(root)))
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

    def _wall_in(self, path: str) -> None:
        """Give the new directory ``path`` a sandbox: a uid of its own (owning it), cgroups, and
        its process started (in a worker thread: spares are made ahead)."""
        registry, cgroups = self._registry, self._cgroups
        if registry is None or cgroups is None:
            raise PoolClosed("the local backend is closed")
        uid = registry.claim_uid()
        walls: _Walls | None = None
        try:
            os.chown(path, uid, uid)
            walls = _Walls(uid, cgroups.make(_suffix(path), self.config.limits))
            self._start_sandbox(path, walls)
        except BaseException:
            if walls is not None:
                cgroups.remove(walls.cgroup)
            registry.release_uid(uid)
            raise
        self._walls[_suffix(path)] = walls

    def _start_sandbox(self, root: str, walls: _Walls) -> None:
        cgroups = self._cgroups
        if cgroups is None:
            raise PoolClosed("the local backend is closed")
        argv = sandbox_argv(
            agent_argv(AGENT_PYTHON),
            uid=walls.uid,
            workspace=root,
            cwd=root,
            limits=self.config.limits,
            read_only=self.config.sandbox_read_only,
        )
        walls.process = SandboxProcess.start(
            argv,
            env={"PATH": os.defpath, AGENT_VARIABLE: agent_source()},
            cwd=root,
            born_in=lambda: cgroups.born_in(walls.cgroup),
        )

    def _remove_tree(self, path: str) -> None:
        """Remove one of our directories, and its sandbox: processes, cgroups, then its uid."""
        walls = self._walls.pop(_suffix(path), None)
        if walls is not None:
            if walls.process is not None:
                walls.process.stop()
            if self._cgroups is not None:
                self._cgroups.remove(walls.cgroup)
        remove_tree(path)
        if walls is not None and self._registry is not None:
            self._registry.release_uid(walls.uid)

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
            if walls.process is not None:
                walls.process.detach()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._restart_sandbox, root, walls)
        return walls.process

    def _activate(self, spare: str) -> str:
        """Rename a spare to its workspace name (``-spare-<token>-X`` to ``-ws-<token>-X``);
        under walls it has that name already."""
        if self._sandboxed:
            return spare
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
                try:
                    self._active += 1
                    cwd = command.cwd or self.config.default_cwd or self._scratch
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
        self._workspaces.discard(path)
        self._detach(path)
        keeper = self._keeper
        if keeper is None:  # closing: remove it here
            await anyio.to_thread.run_sync(self._remove_tree, path)
            return
        await keeper.remove(path)

    # Beneath the workspace's descriptor, by the kernel (agent_backend.backends.local_files).

    async def read_file(self, workspace: str, path: str, *, limit: int) -> FileData:
        self._check_open()
        try:
            data, size = await anyio.to_thread.run_sync(
                local_files.read_file, absolute_path(workspace), path, limit, abandon_on_cancel=True
            )
        except OSError as exc:
            raise file_error(exc, path, backend="local", host=self.name) from None
        return FileData(data, size)

    async def write_file(
        self, workspace: str, path: str, data: bytes, *, make_parents: bool = False
    ) -> None:
        self._check_open()
        try:
            await anyio.to_thread.run_sync(
                local_files.write_file,
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
            entries = await anyio.to_thread.run_sync(
                local_files.list_dir, absolute_path(workspace), path, abandon_on_cancel=True
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
