"""A session's sandbox kept for its whole life: one bubblewrap and its agent, started once.

The sandbox (``isolation = "namespaces"``, :mod:`agent_backend.sandbox`) is made
when its workspace is, ahead of need for spares: the outer process (``sh``
lowering limits, ``setpriv``, ``bwrap``) is started by a workspace thread that
has moved into the sandbox's cgroups, so everything in it is born there. In it
runs the agent (:mod:`agent_backend.sandbox.agent`), whose stdin is one end of
a ``SOCK_SEQPACKET`` socket pair; this module holds the other end. A call then
costs no spawn here: two pipes, one message with them attached, one reply with
the pid, one with the exit status. The agent starts each command in a process
group of its own, and kills what a command leaves once it is the session's
only one to have run.

Ending a sandbox is killing its outer process and closing its socket: the
sandbox's init (a shell, PID 1) reads end of file and exits, and the kernel
ends the whole PID namespace; the backend then empties the cgroups
(:meth:`CgroupTree.remove` freezes them first). A sandbox whose agent dies on
its own (killed, out of memory) ends the same way (its init exits), fails the
calls in flight and is started again for the next one. An agent idle for
``sandbox_agent_idle`` seconds asks to leave and is let go when no call is
pending; the next message is preceded by a wake-up (one newline) that makes the
init start it again.

With an egress allow-list, the agent's ready message carries its network
namespace, which the pool's :class:`~agent_backend.sandbox.EgressRelay` gives its
listeners before the sandbox is used; they are closed when the sandbox is stopped
(and opened anew in a sandbox started again).

This module must never block the event loop (a sandbox is started and stopped
in a worker thread); its messages are read by an event-loop callback.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import fcntl
import importlib.resources
import json
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from agent_backend.backends.local.process import PipedChild, child_pipes
from agent_backend.dispatch.output import OutputBuffer
from agent_backend.sandbox import EgressRelay, SandboxRelays

__all__ = [
    "AGENT_VARIABLE",
    "InitShell",
    "SandboxChild",
    "SandboxDied",
    "SandboxProcess",
    "agent_argv",
    "agent_source",
]

logger = logging.getLogger("agent_backend.backends.local")

_AGENT_SOURCE: str | None = None
_READY_SECONDS = 60.0
_READY_FDS = 4
_DETACH_SECONDS = 5.0


#: The variable that hands the agent its program (the sandbox cannot see this package's files);
#: the agent takes it out of its environment before it starts anything.
AGENT_VARIABLE = "AGENT_BACKEND_AGENT"


# The sandbox's PID 1: runs the agent, says when it exited, and waits for a wake-up (one
# message of one newline on the socket, its stdin) to run it again; an agent that failed (killed,
# out of memory) ends it, and the kernel the whole namespace. An idle sandbox is then this shell
# alone. $1..: the agent's argv.
_INIT = (
    'while :; do "$@"; s=$?; printf \'{"exited": %d}\' "$s" >&0; '
    '[ "$s" -eq 0 ] || exit "$s"; read -r _ || exit 0; done'
)
_WAKE = b"\n"


class InitShell:
    """The host's shell (``/bin/sh``), held in a sealed memory file, that every sandbox runs as
    its init from an execute-only copy (:data:`~agent_backend.sandbox.bwrap.INIT_PATH`,
    ``sandbox_argv(init_fd=...)``): an init that is not dumpable, which the commands cannot
    ptrace or write into through ``/proc/1/mem``, though they share its uid."""

    def __init__(self, path: str = "/bin/sh") -> None:
        with open(path, "rb") as file:
            data = file.read()
        self._fd = os.memfd_create("agent-backend-init", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            fcntl.fcntl(
                self._fd,
                fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
            )
        except BaseException:
            os.close(self._fd)
            raise

    @contextlib.contextmanager
    def fd(self) -> Iterator[int]:
        """A descriptor of its own (bubblewrap reads it from its start), closed on leaving."""
        fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def agent_argv(python: str, *, idle: float | None = None, shell: str = "/bin/sh") -> list[str]:
    """The argv of a sandbox's program: a shell as its PID 1 that runs the agent (``python``
    running the program in :data:`AGENT_VARIABLE`), and again whenever it is woken.

    ``idle``: seconds without a call after which the agent asks to leave (its sandbox then
    holds no Python, only the shell); None: it stays. ``shell``: where the sandbox sees the
    shell that is its init (:class:`InitShell`'s copy).
    """
    agent = [python, "-I", "-S", "-c", f"import os; exec(os.environ.pop({AGENT_VARIABLE!r}))"]
    if idle is not None:
        agent.append(repr(float(idle)))
    return [shell, "-c", _INIT, "sandbox-init", *agent]


def agent_source() -> str:
    """The agent's program (:mod:`agent_backend.sandbox.agent`), read once."""
    global _AGENT_SOURCE
    if _AGENT_SOURCE is None:
        source = importlib.resources.files("agent_backend.sandbox").joinpath("agent.py")
        _AGENT_SOURCE = source.read_text()
    return _AGENT_SOURCE


class SandboxDied(OSError):
    """The sandbox's agent is gone (killed, or out of memory): no answer will come."""


class SandboxChild(PipedChild):
    """A command run by a sandbox's agent: its pipes are ours, its exit is the agent's message."""

    def __init__(
        self,
        sandbox: SandboxProcess,
        call: int,
        loop: asyncio.AbstractEventLoop,
        pipes: tuple[int | None, int, int],
        stdout: OutputBuffer,
        stderr: OutputBuffer,
    ) -> None:
        super().__init__(0, loop, pipes, stdout, stderr)
        self.sandbox = sandbox
        self.call = call

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the command's process group, inside the sandbox."""
        if not self.has_exited():
            self.sandbox.send({"op": "signal", "id": self.call, "signal": int(signum)})

    def _kill_unfinished(self) -> None:
        self.signal_group(signal.SIGKILL)


@dataclasses.dataclass(slots=True)
class _Pending:
    started: asyncio.Future[int]
    child: SandboxChild | None = None
    exited: bool = False
    """The exit came before the caller took the start (both read in one go)."""
    code: int | None = None


class SandboxProcess:
    """One session's sandbox: its outer process, and the socket to its agent.

    Made by :meth:`start` in a worker thread; used on the event loop that
    first calls :meth:`run`; :meth:`stop` (in a worker thread) ends it.
    """

    def __init__(self, popen: subprocess.Popen[bytes], control: socket.socket) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._control = control
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, _Pending] = {}
        self._next = 0
        self._dead = False
        self._lock = threading.Lock()
        self.relays: SandboxRelays | None = None
        """Its egress listeners and relayed connections (a pool with ``egress_allow``)."""
        self._asleep = False
        """The agent was let go: the next message is preceded by a wake-up."""
        self._leaving = 0
        """Agents let go whose exit has not been reported yet."""
        self._resets: dict[int, Callable[[bool], None]] = {}
        """What to call when the agent answers a reset (or dies first: with False)."""
        self._in_use = False
        """A session holds it (:meth:`use`): its agent may leave when idle. A spare's stays, so
        that a session's first call never waits for an agent to start."""
        self._kept_awake = False
        """Its agent asked to leave while it was a spare, and was kept."""

    def __repr__(self) -> str:
        state = "dead" if self._dead else "asleep" if self._asleep else "alive"
        return f"<SandboxProcess pid={self.pid} [calls: {len(self._calls)}] {state}>"

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        born_in: Callable[[], contextlib.AbstractContextManager[None]],
        egress: EgressRelay | None = None,
        pass_fds: Sequence[int] = (),
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> SandboxProcess:
        """Start the sandbox ``argv`` (its agent's stdin our socket), inside ``born_in()``: the
        calling thread in the sandbox's cgroups for the spawn. Blocks: call from a thread.

        ``egress``: the relay that gives the sandbox's network namespace its listeners once the
        agent is up. ``pass_fds``: descriptors ``argv`` reads (bubblewrap's ``--ro-bind-data``).
        ``loop``: the event loop that reads the agent's messages from the start (an idle agent
        asks it to leave), before any call.
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with born_in():
                popen = subprocess.Popen(
                    list(argv),
                    stdin=theirs.fileno(),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    cwd=cwd,
                    env=dict(env),
                    close_fds=True,
                    pass_fds=tuple(pass_fds),
                    process_group=0,
                )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        sandbox = cls(popen, ours)
        try:
            netns = sandbox._wait_ready()
            try:
                if egress is not None:
                    sandbox.relays = sandbox._open_relays(egress, netns)
            finally:
                if netns is not None:
                    os.close(netns)
        except BaseException:
            sandbox.stop()
            raise
        ours.setblocking(False)
        if loop is not None:
            loop.call_soon_threadsafe(sandbox._attach_to, loop)
        return sandbox

    def _wait_ready(self) -> int | None:
        """Until the agent says it is ready (a spare is warm: its first call waits for nothing);
        the descriptor of its network namespace that came with it (the caller closes it)."""
        self._control.settimeout(_READY_SECONDS)
        fds = array.array("i")
        try:
            data, ancillary, _flags, _address = self._control.recvmsg(
                1 << 12, socket.CMSG_SPACE(_READY_FDS * fds.itemsize), socket.MSG_CMSG_CLOEXEC
            )
        except TimeoutError as exc:
            raise SandboxDied(
                0, f"the sandbox's agent did not start in {_READY_SECONDS:g} s"
            ) from exc
        except OSError:
            data, ancillary = b"", []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        for extra in fds[1:]:
            os.close(extra)
        netns = fds[0] if fds else None
        try:
            if not data:
                raise SandboxDied(0, self.why_dead() or "the sandbox exited as it started")
            try:
                ready = json.loads(data).get("ready")
            except (ValueError, AttributeError):
                ready = None
            if ready is None:
                raise SandboxDied(0, "the sandbox's agent did not say it was ready")
        except BaseException:
            if netns is not None:
                os.close(netns)
            raise
        return netns

    @staticmethod
    def _open_relays(egress: EgressRelay, netns: int | None) -> SandboxRelays:
        if netns is None:
            raise SandboxDied(0, "the sandbox's agent did not hand over its network namespace")
        try:
            return egress.open(netns)
        except OSError as exc:
            raise SandboxDied(exc.errno or 0, exc.strerror or str(exc)) from exc

    def is_dead(self) -> bool:
        return self._dead or self.popen.poll() is not None

    def why_dead(self) -> str:
        """What the outer process said on stderr (bubblewrap's reason) once it has exited (waited
        for, bounded: blocks; call from a thread)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        if self.popen.poll() is None or self.popen.stderr is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            return self.popen.stderr.read(4096).decode(errors="replace").strip()
        return ""

    # -- on the event loop ------------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._attach_to(loop)
        elif self._loop is not loop:
            raise RuntimeError("a sandbox is used from one event loop only")
        return loop

    def _attach_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the agent's messages on ``loop`` (which runs this)."""
        if self._loop is None and not self._dead:
            self._loop = loop
            loop.add_reader(self._control.fileno(), self._on_message)

    async def run(
        self,
        argv: Sequence[str],
        *,
        cwd: str,
        env: Mapping[str, str],
        stdin: bool,
        stdout: OutputBuffer,
        stderr: OutputBuffer,
    ) -> SandboxChild:
        """Start ``argv`` in the sandbox; the running command. Raises :class:`OSError` as a spawn
        would (the program or ``cwd`` missing), :class:`SandboxDied` when the agent is gone."""
        if self.is_dead():
            raise SandboxDied(0, "the session's sandbox is gone")
        loop = self._attach()
        self._next += 1
        call = self._next
        pending = _Pending(loop.create_future())
        with child_pipes(stdin) as pipes:
            message = {"op": "run", "id": call, "argv": list(argv), "env": dict(env)}
            message.update(cwd=cwd, stdin=stdin)
            self._calls[call] = pending
            try:
                self.send(message, fds=[fd for fd in pipes.theirs if fd is not None])
            except BaseException:
                self._calls.pop(call, None)
                raise
        try:
            pid = await pending.started
        except BaseException:
            self._calls.pop(call, None)
            for fd in pipes.ours:
                if fd is not None:
                    os.close(fd)
            raise
        child = SandboxChild(self, call, loop, pipes.ours, stdout, stderr)
        child.pid = pid
        pending.child = child
        if pending.exited:
            child._exit_known(pending.code)
        return child

    def reset(self, workspace: str, done: Callable[[bool], None]) -> None:
        """Make the sandbox new for another session, without waiting: its agent kills every
        process of the session, empties ``workspace`` (as the sandbox sees it), ``/tmp``,
        ``/dev/shm`` and ``/dev/mqueue``, removes its System V IPC objects and clears the uid's
        keyrings. ``done(ok)`` is called on the event loop with the outcome (False: something
        failed, or the sandbox died first; the caller then ends it). Only between calls."""
        if self.is_dead() or self._calls:
            self._attach().call_soon(done, False)
            return
        self._attach()
        self._next += 1
        call = self._next
        self._resets[call] = done
        try:
            self.send({"op": "reset", "id": call, "workspace": workspace})
        except SandboxDied:
            if self._resets.pop(call, None) is not None:  # not yet told by _died
                self._attach().call_soon(done, False)

    def send(self, message: dict[str, Any], *, fds: Sequence[int] = ()) -> None:
        data = json.dumps(message).encode()
        ancillary = (
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
        )
        try:
            if self._asleep:  # its shell starts the agent again, which reads what follows
                self._control.send(_WAKE)
                self._asleep = False
            self._control.sendmsg([data], ancillary)
        except BlockingIOError as exc:  # 200 KB of unread requests: the agent is stuck
            raise SandboxDied(exc.errno, "the session's sandbox does not answer") from exc
        except OSError as exc:
            self._died()
            raise SandboxDied(exc.errno, "the session's sandbox is gone") from exc

    def _on_message(self) -> None:
        try:
            data = self._control.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._died()
            return
        try:
            message = json.loads(data)
            pending = self._calls.get(message.get("id"))
        except (ValueError, AttributeError, TypeError):
            # The agent shares its sandbox with what it runs: a message that is not its own
            # means it is not itself any more. The sandbox is ended (and made again).
            logger.warning("a sandbox's agent sent a malformed message; ending that sandbox")
            self._died()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            return
        if pending is None:
            reset = self._resets.pop(message.get("id"), None)
            if reset is not None:
                if message.get("reset") is not True:
                    logger.info("a sandbox could not be reset: %s", message.get("why"))
                reset(message.get("reset") is True)
            elif message.get("idle") is not None:
                self._let_go()
            elif "exited" in message:
                self._agent_exited(message["exited"])
            return
        if "pid" in message:
            if not pending.started.done():
                pending.started.set_result(int(message["pid"]))
        elif "errno" in message:
            self._calls.pop(message["id"], None)
            if not pending.started.done():
                error = OSError(message["errno"], message["strerror"], message.get("filename"))
                pending.started.set_exception(error)
        elif "exit" in message:
            self._calls.pop(message["id"], None)
            pending.exited, pending.code = True, int(message["exit"])
            if pending.child is not None:
                pending.child._exit_known(pending.code)

    def use(self, in_use: bool) -> None:
        """A session takes this sandbox (True), or gives it back to be a spare (False). Taken,
        its agent's idle time starts again (a message, no wake-up): the session's first call
        comes after a model's turn, and must find the agent up."""
        self._in_use = in_use
        self._kept_awake = False
        if in_use and not (self._dead or self._asleep):
            with contextlib.suppress(SandboxDied):
                self.send({"op": "stay"})

    def _let_go(self) -> None:
        """An idle agent asks to leave: let it, unless a call came meanwhile (it gets that) or
        no session holds the sandbox (a spare's agent stays: starting it again costs the first
        call of the session that takes it tens of ms, seconds on a loaded machine)."""
        if self._calls or self._resets or self._asleep or self._dead:
            return
        if not self._in_use:
            self._kept_awake = True
            return
        self.send({"op": "leave"})
        self._asleep, self._leaving = True, self._leaving + 1

    def _agent_exited(self, status: object) -> None:
        """The sandbox's shell says its agent exited: as let go, or it died (killed, out of
        memory): then the sandbox is ended, and made again for the next call."""
        if self._leaving and status == 0:
            self._leaving -= 1
            return
        logger.warning("a sandbox's agent exited unasked (status %s); ending that sandbox", status)
        self._died()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    def _died(self) -> None:
        """The agent is gone: every call in flight ends with its status unknown."""
        if self._dead:
            return
        self._dead = True
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._control.fileno())
        resets, self._resets = self._resets, {}
        for reset in resets.values():
            reset(False)
        calls, self._calls = self._calls, {}
        for pending in calls.values():
            pending.exited = True
            if not pending.started.done():
                pending.started.set_exception(SandboxDied(0, "the session's sandbox died"))
            if pending.child is not None:
                pending.child._exit_known(None)

    def detach(self) -> None:
        """Stop reading the socket: on the event loop, before :meth:`stop` in a thread (whose
        close of the socket must not leave the loop watching a descriptor number reused)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._control.fileno())

    def _detach_from_thread(self) -> None:
        """:meth:`detach`, run by the loop that reads the socket, from any thread: waited for
        (bounded), unless that loop is closed."""
        loop = self._loop
        if loop is None or loop.is_closed():
            self._loop = None
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.detach()
            return
        done = threading.Event()

        def detach() -> None:
            self.detach()
            done.set()

        try:
            loop.call_soon_threadsafe(detach)
        except RuntimeError:  # closed meanwhile
            self._loop = None
            return
        done.wait(_DETACH_SECONDS)

    def stop(self) -> None:
        """Kill the sandbox (its outer process; the kernel takes the rest), reap it and close its
        egress relays. Blocks."""
        self._dead = True
        self._detach_from_thread()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()
        relays, self.relays = self.relays, None
        if relays is not None:
            try:
                relays.close()
            except OSError as exc:  # the relay's thread is stuck: its close() ends them all
                logger.warning("cannot close a sandbox's egress relays: %s", exc)
        if self.popen.stderr is not None:
            self.popen.stderr.close()
        self._control.close()
