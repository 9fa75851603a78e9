"""The local backend: tool commands run as subprocesses of this process, on this machine.

One :class:`LocalHost` per backend: it admits at most ``max_concurrent_calls``
commands at once (more wait, and the wait counts against their timeout), makes
and removes session workspaces, and reads, writes and lists files. Each
command is run by :func:`~agent_backend.backends.local_command.run_in_group`,
in its own process group that is ended on every way out, so nothing a call
started outlives it. Commands start in the session workspace, or in a private
scratch directory outside a session.

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
import logging
import os
import stat
import tempfile
import time
from collections.abc import Sequence
from typing import ClassVar, Literal

import anyio
import anyio.to_thread

from agent_backend.backends.local_command import DRAIN_SECONDS, run_in_group
from agent_backend.backends.local_config import LocalPoolConfig
from agent_backend.backends.local_owner import OwnerLock, remove_tree, sweep_dead_owners
from agent_backend.backends.local_spawn import Spawner, posix_spawn_supported
from agent_backend.backends.local_workspaces import WorkspaceKeeper
from agent_backend.dispatch.backend import (
    Backend,
    Command,
    CommandResult,
    DirEntry,
    FileData,
    Host,
    absolute_path,
)
from agent_backend.errors import BackendUnavailable, PoolClosed, PoolError

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


def _read_file(path: str, limit: int) -> FileData:
    # O_NONBLOCK: opening a FIFO must not hang a worker thread forever.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        chunks: list[bytes] = []
        remaining = limit
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return FileData(b"".join(chunks), info.st_size)
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _list_dir(path: str) -> list[DirEntry]:
    entries: list[DirEntry] = []
    with os.scandir(path) as scan:
        for entry in scan:
            kind: Literal["file", "dir", "symlink", "other"]
            size = 0
            if entry.is_symlink():
                kind = "symlink"
            elif entry.is_dir(follow_symlinks=False):
                kind = "dir"
            elif entry.is_file(follow_symlinks=False):
                kind = "file"
                with contextlib.suppress(OSError):
                    size = entry.stat(follow_symlinks=False).st_size
            else:
                kind = "other"
            entries.append(DirEntry(entry.name, kind, size))
    entries.sort(key=lambda e: e.name)
    return entries


def _make_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)


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
        )

    async def start(self) -> None:
        if self._closing:
            raise PoolClosed("the local backend is closed")
        if self._started:
            return
        root = self.config.workspace_root
        try:
            if root is not None:
                await anyio.to_thread.run_sync(_make_dir, root)
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
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot prepare the local workspace root: {exc}", backend="local", host=self.name
            ) from exc
        if self._spawner is None and posix_spawn_supported():
            self._spawner = Spawner()
        if self._keeper is None:  # last: nothing after it can fail and leave its threads
            # Looked up when called: tests slow them down to prove they are off the loop.
            self._keeper = WorkspaceKeeper(
                lambda: self._mkdtemp("spare"),
                self._activate,
                lambda path: remove_tree(path),
                max_spares=self.config.spare_workspaces,
                loop=asyncio.get_running_loop(),
                discard=self._discard,
            )
        self._started = True

    def _mkdtemp(self, kind: str) -> str:
        owner = self._owner
        if owner is None:  # closed while the directory was being asked for
            raise PoolClosed("the local backend is closed")
        return os.path.realpath(tempfile.mkdtemp(prefix=owner.prefix(kind), dir=owner.root))

    def _activate(self, spare: str) -> str:
        """Rename a spare to its workspace name (``-spare-<token>-X`` to ``-ws-<token>-X``)."""
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
                    try:
                        await anyio.to_thread.run_sync(remove_tree, path)
                    except OSError as exc:
                        complete = False
                        logger.warning("could not remove %s at close: %s", path, exc)
                if self._owner is not None:
                    owner, self._owner = self._owner, None
                    # Released either way; with a workspace left, the lock file stays and the
                    # next backend to start in this root removes it (as a dead owner's).
                    await anyio.to_thread.run_sync(
                        owner.release if complete else owner.release_lock_only
                    )
        finally:
            self._closed.set()

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
                    return await run_in_group(
                        command,
                        config=self.config,
                        cwd=command.cwd or self.config.default_cwd or self._scratch,
                        host=self.name,
                        started=started,
                        spawner=self._spawner,
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
                    await anyio.to_thread.run_sync(remove_tree, path)
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
        keeper = self._keeper
        if keeper is None:  # closing: remove it here
            await anyio.to_thread.run_sync(remove_tree, path)
            return
        await keeper.remove(path)

    async def realpath(self, path: str) -> str:
        self._check_open()
        if path in self._workspaces:  # made here, resolved when made: no thread hop
            return path
        return await anyio.to_thread.run_sync(
            os.path.realpath, absolute_path(path), abandon_on_cancel=True
        )

    async def read_file(self, path: str, *, limit: int) -> FileData:
        self._check_open()
        return await anyio.to_thread.run_sync(
            _read_file, absolute_path(path), limit, abandon_on_cancel=True
        )

    async def write_file(self, path: str, data: bytes) -> None:
        self._check_open()
        await anyio.to_thread.run_sync(
            _write_file, absolute_path(path), data, abandon_on_cancel=True
        )

    async def list_dir(self, path: str) -> list[DirEntry]:
        self._check_open()
        return await anyio.to_thread.run_sync(
            _list_dir, absolute_path(path), abandon_on_cancel=True
        )

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
