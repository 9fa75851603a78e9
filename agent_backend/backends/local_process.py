"""One command as a child process in its own process group, its output read as it arrives.

The local backend's spawn and read, on asyncio's subprocess transport with a
protocol of our own: stdout and stderr are fed into
:class:`~agent_backend.dispatch.output.OutputBuffer` from the transport's
callbacks, so a command costs no reader task, and its exit and the closing of
its pipes are events to wait on.

Why not ``anyio.open_process(start_new_session=True)``, which this replaced:
beside a busy vLLM server on two cores, concurrent ``echo`` commands took
2-4x longer to spawn, run and reap that way than with asyncio's own spawn
(measured with a throwaway script, not a benchmark of this repository; in
``bench/rollout_vllm_bench.py`` our tool time per turn is still about 5x the
peer's bare subprocess in most runs, the rest being elsewhere). ``setsid`` is the larger part: with the
scheduler's autogroups on (Linux's default), every new session is a new
scheduling group, made and torn down per command. A process group of
its own (``process_group=0``, ``setpgid`` in the child; CPython's fast
``vfork`` spawn path is kept) gives the same thing the backend needs, one
group to signal; the child stays in this process's session, so with a
terminal it is in a background group there (a command reading ``/dev/tty`` is
stopped by ``SIGTTIN`` and ends at its timeout).

asyncio only, as the rest of the backends (asyncssh, aiohttp) are.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Mapping, Sequence

import anyio

from agent_backend.dispatch.output import OutputBuffer

__all__ = ["ChildProcess", "spawn"]


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


class ChildProcess:
    """A spawned command: wait for its exit, then for its pipes; :meth:`close` always."""

    def __init__(self, transport: asyncio.SubprocessTransport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self.pid: int = transport.get_pid()

    @property
    def returncode(self) -> int | None:
        return self._transport.get_returncode()

    async def wait_exit(self) -> int:
        await self._protocol.exited.wait()
        code = self._transport.get_returncode()
        assert code is not None
        return code

    async def wait_pipes_closed(self) -> None:
        """Until stdout and stderr are closed: the command and all it started let go of them."""
        await self._protocol.pipes_closed.wait()

    def feed_stdin(self, data: bytes) -> None:
        """Write ``data`` to the command's stdin (buffered by the transport), then close it."""
        pipe = self._transport.get_pipe_transport(0)
        if not isinstance(pipe, asyncio.WriteTransport):
            return
        if data:
            pipe.write(data)
        pipe.write_eof()

    def close(self) -> None:
        """Close the pipes and the transport (a leader still running is killed); idempotent."""
        self._transport.close()


async def spawn(
    argv: Sequence[str],
    *,
    cwd: str | None,
    env: Mapping[str, str],
    stdin: bool,
    stdout: OutputBuffer,
    stderr: OutputBuffer,
) -> ChildProcess:
    """Start ``argv`` as the leader of a new process group (its pid is the group id).

    Raises what :class:`subprocess.Popen` raises when the program cannot be started
    (``OSError``, ``ValueError``).
    """
    loop = asyncio.get_running_loop()
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
    return ChildProcess(transport, protocol)
