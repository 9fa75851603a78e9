"""One command as a child process in its own process group, its output read as it arrives.

The local backend's spawn and read. stdout and stderr are fed into
:class:`~agent_backend.dispatch.output.OutputBuffer` from event-loop
callbacks, so a command costs no reader task; its exit and the closing of its
pipes are events to wait on.

**No thread per command.** On Linux (``os.pidfd_open``, kernel 5.3+) the
child is started by the host's :class:`~agent_backend.backends.local.spawn.Spawner`
(libc's ``posix_spawn`` in one thread per host, off the event loop; where
libc lacks what it needs, :class:`subprocess.Popen` here) and watched
through a pidfd registered with the event loop: readable when the child
exits, then reaped with ``waitpid(WNOHANG)``; its pipes are raw non-blocking
descriptors read by ``add_reader`` callbacks. Python 3.11's asyncio instead starts a thread per
child to wait for it (``ThreadedChildWatcher``), and connects each pipe in a
transport of its own. Beside a busy vLLM server on two cores, those threads
fought the event loop for the GIL: in ``bench/rollout_vllm_bench.py`` at 64
concurrent episodes, starting an ``echo`` took 58 ms on average that way.
Where no pidfd can be had (another OS, an older kernel, a sandbox refusing the
call), asyncio's own subprocess transport is used, with the same interface.

Reaping the child ourselves also means its pid cannot be reused while we
still hold it: signalling the leader (or its group, whose id is its pid)
before the reap can never hit another process.

Why a process group and not ``start_new_session``: with the scheduler's
autogroups on (Linux's default), every new session is a new scheduling group,
made and torn down per command, and concurrent commands took 2-4x longer to
spawn, run and reap beside a busy server (measured with a throwaway script).
A group of its own (``process_group=0``, ``setpgid`` in the child; CPython's
fast ``vfork`` spawn path is kept) gives the backend what it needs, one group
to signal; the child stays in this process's session, so with a terminal it
is in a background group there (a command reading ``/dev/tty`` is stopped by
``SIGTTIN`` and ends at its timeout).

asyncio only, as the rest of the backends (asyncssh, aiohttp) are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import anyio

from agent_backend.backends.local.spawn import Spawned, Spawner
from agent_backend.dispatch.output import OutputBuffer

__all__ = ["ChildPipes", "ChildProcess", "PipedChild", "child_pipes", "pidfd_supported", "spawn"]

logger = logging.getLogger("agent_backend.backends.local")

_READ_SIZE = 256 * 1024  # as asyncio's pipe transports read
_PIDFD: bool | None = None  # probed once: can this process open pidfds?


def pidfd_supported() -> bool:
    """Whether children can be watched through pidfds here (probed once per process)."""
    global _PIDFD
    if _PIDFD is None:
        try:
            fd = os.pidfd_open(os.getpid())
        except (AttributeError, OSError):
            _PIDFD = False
        else:
            os.close(fd)
            _PIDFD = True
    return _PIDFD


class ChildProcess(Protocol):
    """A spawned command: wait for its exit, then for its pipes; :meth:`close` always."""

    pid: int

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: the signal), once the leader is reaped."""

    def has_exited(self) -> bool:
        """Whether the leader has exited and is reaped (or was reaped elsewhere)."""

    def pipes_closed(self) -> bool:
        """Whether stdout and stderr are both closed."""

    async def wait_exit(self) -> int | None:
        """Until the leader has exited and is reaped: its returncode (None if reaped elsewhere)."""

    async def wait_pipes_closed(self) -> None:
        """Until stdout and stderr are closed: the command and all it started let go of them."""

    def feed_stdin(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin (in the background), then close it."""

    def close(self) -> None:
        """Close the pipes (a leader still running is killed, and reaped when it dies); idempotent."""


# -- on Linux: a pidfd and non-blocking pipes on the event loop --------------------------------------


class PipedChild:
    """A command's pipes on the event loop (raw non-blocking descriptors, all ours to close), and
    the events its exit and their closing set. How the exit is learnt is the subclass's:
    :meth:`_exit_known` records it; :meth:`_kill_unfinished` ends a leader still running."""

    def __init__(
        self,
        pid: int,
        loop: asyncio.AbstractEventLoop,
        pipes: tuple[int | None, int, int],
        stdout: OutputBuffer,
        stderr: OutputBuffer,
    ) -> None:
        self.pid: int = pid
        self._loop = loop
        self._exited = anyio.Event()
        self._pipes_closed = anyio.Event()
        self._code: int | None = None
        self._readers: dict[int, OutputBuffer] = {}
        self._stdin_fd = pipes[0]
        self._stdin: memoryview | None = None
        self._writing = False
        # Both pipes tracked before either is registered: a failure closes them both.
        self._readers[pipes[1]] = stdout
        self._readers[pipes[2]] = stderr
        try:
            for fd in pipes[1:]:
                loop.add_reader(fd, self._on_readable, fd)
        except BaseException:
            self.close()
            raise

    @property
    def returncode(self) -> int | None:
        return self._code

    # Not waited on once set: anyio's Event.wait() yields to the event loop even then, and
    # beside a busy server every trip through the loop costs milliseconds.

    def has_exited(self) -> bool:
        return self._exited.is_set()

    def pipes_closed(self) -> bool:
        return self._pipes_closed.is_set()

    async def wait_exit(self) -> int | None:
        if not self._exited.is_set():
            await self._exited.wait()
        return self._code

    async def wait_pipes_closed(self) -> None:
        if not self._pipes_closed.is_set():
            await self._pipes_closed.wait()

    def _exit_known(self, code: int | None) -> None:
        if not self._exited.is_set():
            self._code = code
            self._exited.set()

    def _on_readable(self, fd: int) -> None:
        buffer = self._readers.get(fd)
        if buffer is None:
            return
        try:
            data = os.read(fd, _READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            buffer.feed(data)
        else:
            self._close_reader(fd)

    def _close_reader(self, fd: int) -> None:
        del self._readers[fd]
        self._loop.remove_reader(fd)
        os.close(fd)
        if not self._readers:
            self._pipes_closed.set()

    def feed_stdin(self, data: bytes) -> None:
        if self._stdin_fd is None or self._stdin is not None:
            return
        self._stdin = memoryview(data)
        self._write_stdin()

    def _write_stdin(self) -> None:
        if self._stdin is None or self._stdin_fd is None:
            return
        fd, rest = self._stdin_fd, self._stdin
        try:
            while rest:
                rest = rest[os.write(fd, rest) :]
        except (BlockingIOError, InterruptedError):  # the pipe is full: on when it drains
            self._stdin = rest
            if not self._writing:
                self._writing = True
                self._loop.add_writer(fd, self._write_stdin)
            return
        except OSError:  # the command closed its stdin (EPIPE): it stopped reading
            pass
        self._close_stdin()

    def _close_stdin(self) -> None:
        fd, self._stdin_fd = self._stdin_fd, None
        self._stdin = None
        if fd is None:
            return
        if self._writing:
            self._writing = False
            self._loop.remove_writer(fd)
        os.close(fd)

    def close(self) -> None:
        for fd in list(self._readers):
            self._close_reader(fd)
        self._pipes_closed.set()
        self._close_stdin()
        if not self._exited.is_set():
            self._kill_unfinished()

    def _kill_unfinished(self) -> None:
        raise NotImplementedError


class _PidfdChild(PipedChild):
    """A child watched through its pidfd: readable when it exits, then reaped here."""

    def __init__(
        self,
        spawned: Spawned,
        loop: asyncio.AbstractEventLoop,
        stdout: OutputBuffer,
        stderr: OutputBuffer,
        popen: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self._popen = popen
        self._pidfd = spawned.pidfd
        self._watching = False
        self._reaped_elsewhere = False
        super().__init__(
            spawned.pid, loop, (spawned.stdin, spawned.stdout, spawned.stderr), stdout, stderr
        )
        try:
            loop.add_reader(self._pidfd, self._on_exit)
            self._watching = True
        except BaseException:
            self.close()
            raise

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # someone else reaped it (a waitpid(-1) of other code)
            pid, status = self.pid, -1
            self._reaped_elsewhere = True
        if pid == 0:  # not yet (a spurious wake-up)
            return
        self._loop.remove_reader(self._pidfd)
        self._watching = False
        self._close_pidfd()
        code = None
        if self._reaped_elsewhere:
            logger.warning("pid %d was reaped by other code: its exit status is lost", self.pid)
        else:
            code = os.waitstatus_to_exitcode(status)
        if self._popen is not None:
            # Popen gets a returncode too: it must not poll (or warn about) a pid it no longer owns.
            self._popen.returncode = code if code is not None else -1
        self._exit_known(code)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def _kill_unfinished(self) -> None:
        # Not reaped, so the pid is still ours to signal.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if not self._watching:  # failed before the pidfd was watched: reap it here
            self._close_pidfd()
            code = None
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                code = os.waitstatus_to_exitcode(status)
            if self._popen is not None:
                self._popen.returncode = code if code is not None else -1
            self._exit_known(code)
        # Otherwise the pidfd reader stays registered and reaps the leader when it dies.


@dataclasses.dataclass(frozen=True, slots=True)
class ChildPipes:
    """A command's three pipes: the child's ends (to hand over) and ours (raw descriptors)."""

    theirs: tuple[int | None, int, int]
    """stdin's read end (None: no stdin pipe), stdout's and stderr's write ends."""
    ours: tuple[int | None, int, int]
    """stdin's write end (or None), stdout's and stderr's read ends."""


@contextlib.contextmanager
def child_pipes(stdin: bool) -> Iterator[ChildPipes]:
    """Pipes for one command. The child's ends are closed on the way out, whatever happens (the
    child holds its own copies by then); ours are closed only on an error, and are left
    non-blocking otherwise, for the caller to own."""
    ours: list[int] = []
    theirs: list[int] = []
    try:
        child_in = our_in = None
        if stdin:
            child_in, our_in = os.pipe()
            ours.append(our_in)
            theirs.append(child_in)
        our_out, child_out = os.pipe()
        our_err, child_err = os.pipe()
        ours += (our_out, our_err)
        theirs += (child_out, child_err)
        yield ChildPipes((child_in, child_out, child_err), (our_in, our_out, our_err))
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    for fd in ours:
        os.set_blocking(fd, False)


def _popen_spawn(
    argv: Sequence[str], options: dict[str, Any], stdin: bool
) -> tuple[subprocess.Popen[bytes], Spawned]:
    """Popen on this thread (the event loop's): the fallback where libc's posix_spawn falls short."""
    # Our own pipes, handed to Popen as descriptors: the parent's ends stay raw fds, as the
    # Spawner's do, and Popen holds no file object to close.
    with child_pipes(stdin) as pipes:
        child_in, child_out, child_err = pipes.theirs
        # Popen returns once the child has exec'd (vfork): asyncio's spawn calls it the same way.
        popen = subprocess.Popen(
            list(argv),
            **options,
            stdin=child_in if child_in is not None else subprocess.DEVNULL,
            stdout=child_out,
            stderr=child_err,
        )
        try:
            pidfd = os.pidfd_open(popen.pid)
        except BaseException:
            popen.kill()
            popen.wait()
            raise
    our_in, our_out, our_err = pipes.ours
    return popen, Spawned(popen.pid, pidfd, our_in, our_out, our_err)


# -- elsewhere: asyncio's subprocess transport -------------------------------------------------------


class _Protocol(asyncio.SubprocessProtocol):
    """Feeds the buffers; sets an event on exit and one per pipe closed."""

    def __init__(self, stdout: OutputBuffer, stderr: OutputBuffer) -> None:
        self.buffers = {1: stdout, 2: stderr}
        self.exited = anyio.Event()
        self.pipes_open = {1, 2}
        self.pipes_closed = anyio.Event()

    def pipe_data_received(self, fd: int, data: bytes | bytearray) -> None:
        buffer = self.buffers.get(fd)
        if buffer is not None:
            buffer.feed(data if isinstance(data, bytes) else bytes(data))

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        # fd 0 (stdin) closing means the command stopped reading: not our concern here.
        self.pipes_open.discard(fd)
        if not self.pipes_open:
            self.pipes_closed.set()

    def process_exited(self) -> None:
        self.exited.set()


class _AsyncioChild:
    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.pid: int = transport.get_pid()

    @property
    def returncode(self) -> int | None:
        return self._transport.get_returncode()

    def has_exited(self) -> bool:
        return self._protocol.exited.is_set()

    def pipes_closed(self) -> bool:
        return self._protocol.pipes_closed.is_set()

    async def wait_exit(self) -> int | None:
        if not self._protocol.exited.is_set():
            await self._protocol.exited.wait()
        return self._transport.get_returncode()

    async def wait_pipes_closed(self) -> None:
        if not self._protocol.pipes_closed.is_set():
            await self._protocol.pipes_closed.wait()

    def feed_stdin(self, data: bytes) -> None:
        pipe = self._transport.get_pipe_transport(0)
        if not isinstance(pipe, asyncio.WriteTransport):
            return
        if data:
            pipe.write(data)
        pipe.write_eof()

    def close(self) -> None:
        self._transport.close()


async def spawn(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    stdin: bool,
    stdout: OutputBuffer,
    stderr: OutputBuffer,
    spawner: Spawner | None = None,
) -> ChildProcess:
    """Start ``argv`` as the leader of a new process group (its pid is the group id).

    With a ``spawner`` (and pidfds), in its thread by libc's posix_spawn; else
    with :class:`subprocess.Popen` here. Must be awaited shielded from
    cancellation (a child once started is the caller's). Raises what
    :class:`subprocess.Popen` raises when the program cannot be started
    (``OSError``, ``ValueError``).
    """
    loop = asyncio.get_running_loop()
    if pidfd_supported():
        if spawner is not None and cwd is not None:
            spawned = await spawner.spawn(argv, cwd=cwd, env=env, stdin=stdin)
            return _PidfdChild(spawned, loop, stdout, stderr)
        options: dict[str, Any] = {
            "cwd": cwd,
            "env": dict(env),
            "process_group": 0,
            "close_fds": True,
            "bufsize": 0,
        }
        popen, spawned = _popen_spawn(argv, options, stdin)
        return _PidfdChild(spawned, loop, stdout, stderr, popen)
    # The same child either way: its own group, only the pipes asked for, no inherited fds.
    protocol = _Protocol(stdout, stderr)
    transport, _ = await loop.subprocess_exec(
        lambda: protocol,
        *argv,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=dict(env),
        process_group=0,
        close_fds=True,
    )
    return _AsyncioChild(transport, protocol)
