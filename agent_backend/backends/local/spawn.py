"""Starting a command's process off the event loop: libc's ``posix_spawn``, in one thread per host.

Why not :class:`subprocess.Popen` on the event loop: CPython's spawn
(``_posixsubprocess``, ``vfork``) suspends the calling thread until the child
has exec'd, with the GIL held; on two busy cores, until the child has run
that far and the parent got a core back, which took 0.5-2 ms per command.
With 16 concurrent calls the event loop spent most of its time there,
frozen. Here the spawn runs in a thread of its own, in libc through
:mod:`ctypes` (which lets go of the GIL for the call), so the event loop keeps
reading pipes and reaping children while a child execs; and libc's
``posix_spawn`` (``clone(CLONE_VM|CLONE_VFORK)``) costs less Python around it
than ``Popen`` does.

The child is what :mod:`~agent_backend.backends.local.process` asks of every
spawn: the leader of a process group of its own (``setpgid``), in ``cwd``
(``posix_spawn_file_actions_addchdir_np``), with exactly the environment
given, stdin/stdout/stderr on the pipes given, every other descriptor closed
(``addclosefrom_np``), an empty signal mask, and SIGPIPE and SIGXFSZ back to
their defaults (as ``Popen(restore_signals=True)``: Python ignores them,
and ignored signals survive ``exec``). That needs glibc 2.34+ (where the two
``_np`` actions exist): elsewhere :func:`posix_spawn_supported` is False and
the caller spawns with ``Popen``.

This module must never run a spawn on the event loop, nor leave a child it
started unknown to its caller: a child whose caller went away is killed and
reaped in the spawner's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import os
import queue
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import anyio
import anyio.to_thread

from agent_backend.errors import PoolClosed

__all__ = ["Spawned", "Spawner", "posix_spawn_supported"]

# glibc's <spawn.h> flags.
_SETPGROUP = 0x02
_SETSIGDEF = 0x04
_SETSIGMASK = 0x08
# glibc's posix_spawn_file_actions_t is 80 bytes, posix_spawnattr_t 336 and sigset_t 128 (x86-64,
# aarch64): allocated with room to spare, as libc alone reads and writes them.
_ACTIONS_SIZE = 512
_ATTR_SIZE = 1024
_SIGSET_SIZE = 256


def _bind(libc: ctypes.CDLL, name: str, *argtypes: Any) -> Callable[..., int]:
    """libc's ``name``, typed; AttributeError where this libc has no such function."""
    function = getattr(libc, name)
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return cast("Callable[..., int]", function)


class _Libc:
    """The few libc functions a spawn needs, bound once."""

    def __init__(self) -> None:
        # posix_spawn waits for the child's exec: the GIL is let go for it (CDLL). The rest only
        # fill in structures: through PyDLL they keep the GIL, as a release is a chance for the
        # event loop's thread to take it, and then a wait to get it back, each time.
        libc = ctypes.CDLL(None, use_errno=True)
        held = ctypes.PyDLL(None)
        ptr = ctypes.c_void_p
        strings = ctypes.POINTER(ctypes.c_char_p)
        spawn_args = (ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ptr, ptr, strings, strings)
        self.spawn = _bind(libc, "posix_spawn", *spawn_args)
        # Searches this process's PATH for a bare name, in the child (after its chdir, as Popen's
        # child does): an exec attempt per directory costs less there than a stat here.
        self.spawnp = _bind(libc, "posix_spawnp", *spawn_args)
        self.file_actions_init = _bind(held, "posix_spawn_file_actions_init", ptr)
        self.file_actions_destroy = _bind(held, "posix_spawn_file_actions_destroy", ptr)
        self.file_actions_adddup2 = _bind(
            held, "posix_spawn_file_actions_adddup2", ptr, ctypes.c_int, ctypes.c_int
        )
        self.file_actions_addchdir_np = _bind(
            held, "posix_spawn_file_actions_addchdir_np", ptr, ctypes.c_char_p
        )
        self.file_actions_addclosefrom_np = _bind(
            held, "posix_spawn_file_actions_addclosefrom_np", ptr, ctypes.c_int
        )
        self.spawnattr_init = _bind(held, "posix_spawnattr_init", ptr)
        self.spawnattr_setflags = _bind(held, "posix_spawnattr_setflags", ptr, ctypes.c_short)
        self.spawnattr_setpgroup = _bind(held, "posix_spawnattr_setpgroup", ptr, ctypes.c_int)
        self.spawnattr_setsigdefault = _bind(held, "posix_spawnattr_setsigdefault", ptr, ptr)
        self.spawnattr_setsigmask = _bind(held, "posix_spawnattr_setsigmask", ptr, ptr)
        self.sigemptyset = _bind(held, "sigemptyset", ptr)
        self.sigaddset = _bind(held, "sigaddset", ptr, ctypes.c_int)
        # One attribute set for every child: its own group, a clean signal state.
        self.attr = ctypes.create_string_buffer(_ATTR_SIZE)
        defaults = ctypes.create_string_buffer(_SIGSET_SIZE)
        empty = ctypes.create_string_buffer(_SIGSET_SIZE)
        self.sigemptyset(defaults)
        for signum in (signal.SIGPIPE, signal.SIGXFSZ):
            self.sigaddset(defaults, signum)
        self.sigemptyset(empty)
        checks = (
            self.spawnattr_init(self.attr),
            self.spawnattr_setflags(self.attr, _SETPGROUP | _SETSIGDEF | _SETSIGMASK),
            self.spawnattr_setpgroup(self.attr, 0),
            self.spawnattr_setsigdefault(self.attr, defaults),
            self.spawnattr_setsigmask(self.attr, empty),
        )
        if any(checks):
            raise OSError(next(c for c in checks if c), "posix_spawnattr setup failed")

    def start(
        self,
        path: bytes,
        argv: Sequence[bytes],
        envp: Sequence[bytes],
        cwd: bytes,
        fds: tuple[int, int, int],
        *,
        search: bool = False,
    ) -> int:
        """posix_spawn ``path`` with ``fds`` as its 0, 1 and 2, in ``cwd``: the pid, or the errno.

        ``search``: ``path`` is a bare name, looked for on this process's PATH (posix_spawnp).
        """
        actions = ctypes.create_string_buffer(_ACTIONS_SIZE)
        if self.file_actions_init(actions):
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        try:
            for target, fd in enumerate(fds):
                self.file_actions_adddup2(actions, fd, target)
            self.file_actions_addchdir_np(actions, cwd)
            self.file_actions_addclosefrom_np(actions, 3)
            c_argv = (ctypes.c_char_p * (len(argv) + 1))(*argv, None)
            c_envp = (ctypes.c_char_p * (len(envp) + 1))(*envp, None)
            pid = ctypes.c_int()
            spawn = self.spawnp if search else self.spawn
            code = spawn(ctypes.byref(pid), path, actions, self.attr, c_argv, c_envp)
        finally:
            self.file_actions_destroy(actions)
        return pid.value if code == 0 else -code


_LIBC: _Libc | None = None
_PROBED = False


def posix_spawn_supported() -> bool:
    """Whether this libc has everything a spawn here needs (glibc 2.34+; probed once)."""
    global _LIBC, _PROBED
    if not _PROBED:
        _PROBED = True
        try:
            _LIBC = _Libc()
        except (AttributeError, OSError):
            _LIBC = None
    return _LIBC is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Spawned:
    """A child just started: its pid, a pidfd on it, and our ends of its pipes (all ours to close)."""

    pid: int
    pidfd: int
    stdin: int | None
    """The write end of its stdin, or None (its stdin is ``/dev/null``)."""
    stdout: int
    stderr: int


@dataclasses.dataclass(slots=True)
class _Request:
    """One spawn asked for; encoded to bytes in the spawner's thread, not on the event loop."""

    argv: Sequence[str]
    env: Mapping[str, str]
    cwd: str
    stdin: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Spawned]


_Outcome = tuple[asyncio.Future[Spawned], Spawned | BaseException]


def _no_nul(values: Sequence[bytes]) -> None:
    for value in values:
        if b"\0" in value:
            raise ValueError("embedded null byte")


def _above_stdio(fd: int) -> int:
    """``fd``, moved to 3 or above: a pipe that got 0-2 (our own stdio closed) must not be clobbered
    by the dup2 onto 0-2 of another."""
    if fd >= 3:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _pipe() -> tuple[int, int]:
    read, write = os.pipe()  # O_CLOEXEC: no other child inherits them
    return _above_stdio(read), _above_stdio(write)


def _resolve(name: bytes, dirs: Sequence[bytes], cwd: bytes) -> bytes:
    """The program ``name`` runs, found as ``execvp`` would (PATH of the child's environment)."""
    if b"/" in name:
        return name
    for directory in dirs:
        candidate = os.path.join(directory or b".", name)
        check = candidate if os.path.isabs(candidate) else os.path.join(cwd, candidate)
        if os.access(check, os.X_OK) and not os.path.isdir(check):
            return check
    raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(name))


class Spawner:
    """Starts children in a thread of its own (started here, ended by :meth:`aclose`); one per host.

    :meth:`spawn` must be awaited in a shielded scope: a child once started is
    always handed to its caller, who then owns it (reaping included).
    """

    def __init__(self) -> None:
        if not posix_spawn_supported():
            raise RuntimeError("posix_spawn with addchdir_np/addclosefrom_np is not available here")
        assert _LIBC is not None
        self._libc = _LIBC
        self._queue: queue.SimpleQueue[_Request | int | None] = queue.SimpleQueue()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._closed = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._serve, name="agent-backend-spawner", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<Spawner {state}>"

    def is_closed(self) -> bool:
        return self._closed

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin: bool,
    ) -> Spawned:
        """Start ``argv`` in ``cwd`` with exactly ``env``, as the leader of a new process group.

        Raises what ``Popen`` would for a program that cannot be started
        (``OSError`` with the program's or the ``cwd``'s name, ``ValueError``
        for a NUL byte).
        """
        if self._closed:
            raise PoolClosed("the local backend is closed")
        loop = asyncio.get_running_loop()
        request = _Request(argv, env, cwd, stdin, loop, loop.create_future())
        self._queue.put(request)
        return await request.future

    async def aclose(self) -> None:
        """Stop the thread (after the spawns queued before) and close what it holds; idempotent."""
        if self._closed:
            return
        self._closed = True
        thread, self._thread = self._thread, None
        self._queue.put(None)
        if thread is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(thread.join)
        os.close(self._devnull)

    # -- in the spawner's thread ------------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            # Everything queued meanwhile is done in one go, and handed back in one trip per
            # event loop: under load, one wake-up of the thread and of the loop for many spawns.
            items = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while items[-1] is not None:
                    items.append(self._queue.get_nowait())
            outcomes: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
            for item in items:
                if item is None:
                    break
                if isinstance(item, int):  # a child nobody took
                    self._reap(item)
                    continue
                outcome: Spawned | BaseException
                try:
                    outcome = self._start(item)
                except BaseException as exc:  # handed to the caller, raised there
                    outcome = exc
                outcomes.setdefault(item.loop, []).append((item.future, outcome))
            for loop, done in outcomes.items():
                try:
                    loop.call_soon_threadsafe(self._deliver, done)
                except RuntimeError:  # that event loop is closed: nobody will take these
                    for _, outcome in done:
                        if isinstance(outcome, Spawned):
                            self._abandon(outcome)
                            self._reap(outcome.pid)
            if items[-1] is None:
                return

    def _start(self, request: _Request) -> Spawned:
        argv = [os.fsencode(arg) for arg in request.argv]
        env = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in request.env.items()]
        cwd = os.fsencode(request.cwd)
        _no_nul(argv)
        _no_nul(env)
        _no_nul([cwd])
        path = argv[0]
        search = False
        if b"/" not in path:
            child_path = request.env.get("PATH")
            if child_path is not None and child_path == os.environ.get("PATH"):
                search = True  # the child's PATH is ours: libc searches it
            else:
                dirs = (child_path or os.defpath).split(os.pathsep)
                path = _resolve(path, [os.fsencode(d) for d in dirs], cwd)
        ours: list[int] = []  # closed on failure; on success the parent's ends are handed over
        theirs: list[int] = []  # the child's ends: always closed here
        try:
            if request.stdin:
                child_in, our_in = _pipe()
                ours.append(our_in)
                theirs.append(child_in)
            else:
                child_in = self._devnull
            our_out, child_out = _pipe()
            our_err, child_err = _pipe()
            ours += (our_out, our_err)
            theirs += (child_out, child_err)
            fds = (child_in, child_out, child_err)
            pid = self._libc.start(path, argv, env, cwd, fds, search=search)
            if pid < 0:
                raise self._spawn_error(-pid, cwd, argv[0], path)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                self._queue.put(pid)
                raise
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        for fd in (our_out, our_err):
            os.set_blocking(fd, False)
        if request.stdin:
            os.set_blocking(ours[0], False)
        return Spawned(pid, pidfd, ours[0] if request.stdin else None, our_out, our_err)

    @staticmethod
    def _spawn_error(code: int, cwd: bytes, program: bytes, path: bytes) -> OSError:
        # posix_spawn reports a failed chdir and a failed exec alike: tell them apart as Popen does.
        if code in (errno.ENOENT, errno.ENOTDIR, errno.EACCES) and not (
            os.path.isdir(cwd) and os.access(cwd, os.X_OK)
        ):
            return OSError(code, os.strerror(code), os.fsdecode(cwd))
        if code == errno.ENOENT:
            return FileNotFoundError(code, os.strerror(code), os.fsdecode(program))
        return OSError(code, os.strerror(code), os.fsdecode(path))

    # -- back on the event loop -------------------------------------------------------------------

    def _deliver(self, outcomes: list[_Outcome]) -> None:
        for future, outcome in outcomes:
            if not future.cancelled():
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            elif isinstance(outcome, Spawned):
                # The caller went away (it did not shield the await): the child is nobody's.
                self._abandon(outcome)
                self._queue.put(outcome.pid)  # killed and reaped in the thread

    @staticmethod
    def _abandon(spawned: Spawned) -> None:
        for fd in (spawned.pidfd, spawned.stdin, spawned.stdout, spawned.stderr):
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _reap(pid: int) -> None:
        """Kill ``pid``'s group and reap it (a child of ours nobody took; blocks until it died)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
