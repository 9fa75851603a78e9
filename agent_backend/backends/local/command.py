"""One command on this machine, from its spawn to its :class:`CommandResult`.

The command is the leader of its own process group
(:mod:`~agent_backend.backends.local.process` says why a group and not a
session), so that a timeout, a cancellation or the end of the call can signal
everything it started: SIGTERM to the group, then SIGKILL after
``kill_grace`` seconds. The leader's exit is not the end of a call: anything
left in its group (``sleep 100 &``) is ended the same way. stdout and stderr
are read as they arrive into
:class:`~agent_backend.dispatch.output.OutputBuffer`, so a command that prints
a gigabyte costs ``output_limit`` bytes of memory.

The command sees only the environment the config lets through
(``env_passthrough`` and ``extra_env``) plus its own ``env``.

This module must never return while a process of the call is still in its
group, nor leave a pipe open; waiting on the group happens in a worker thread
(``/proc`` is read there), never on the event loop.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Mapping

import anyio
import anyio.to_thread

from agent_backend.backends.local.config import LocalPoolConfig
from agent_backend.backends.local.process import ChildProcess, spawn
from agent_backend.backends.local.sandbox import SandboxChild, SandboxDied, SandboxProcess
from agent_backend.backends.local.spawn import Spawner
from agent_backend.dispatch.backend import Command, CommandResult, Output
from agent_backend.dispatch.output import OutputBuffer
from agent_backend.errors import BackendUnavailable

__all__ = ["DRAIN_SECONDS", "run_in_group"]

logger = logging.getLogger("agent_backend.backends.local")

# Spawn failures that mean this machine is out of something: infrastructure, raised.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
# After the group is ended, how long pipes still held by an escaped process
# (one that left the group with setsid or setpgid) may keep the call from returning.
DRAIN_SECONDS = 1.0
# How long a leader's exit status may take to be collected once its group is gone.
_REAP_SECONDS = 5.0


async def run_in_group(
    command: Command,
    *,
    config: LocalPoolConfig,
    cwd: str | None,
    host: str,
    started: float,
    spawner: Spawner | None = None,
    sandbox: SandboxProcess | None = None,
) -> CommandResult:
    """Run ``command`` in ``cwd`` until it exits or its time (counted from ``started``) is up.

    On every way out (exit, timeout, cancellation) the group is ended and its
    pipes closed before this returns or raises. A program that cannot be
    started is a result (exit status 127 or 126, the reason on stderr); a
    machine out of processes or descriptors raises :class:`BackendUnavailable`.
    With a ``spawner``, the process is started in its thread (:mod:`.spawn`).
    With a ``sandbox``, the session's sandbox runs it (:mod:`.sandbox`), ``cwd``
    being a path there.
    """
    argv = _argv(command, config)
    env = _environment(config, command.env)
    stdout = OutputBuffer(command.output_limit)
    stderr = OutputBuffer(command.output_limit)
    try:
        # Shielded: a cancellation landing mid-spawn would lose a process
        # that is already running (and its pipes). It lands just below
        # instead, where the group is ended on the way out.
        with anyio.CancelScope(shield=True):
            process: ChildProcess | SandboxChild
            if sandbox is not None:
                assert cwd is not None
                process = await sandbox.run(
                    argv, cwd=cwd, env=env, stdin=command.stdin is not None,
                    stdout=stdout, stderr=stderr,
                )  # fmt: skip
            else:
                process = await spawn(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=command.stdin is not None,
                    stdout=stdout,
                    stderr=stderr,
                    spawner=spawner,
                )
    except SandboxDied as exc:
        return _failure(f"cannot run: {exc.strerror}", 126, started, host)
    except (OSError, ValueError) as exc:
        return _spawn_failure(exc, argv[0], cwd, started, host)
    timed_out = False
    try:
        if command.stdin is not None:
            process.feed_stdin(command.stdin)
        with anyio.move_on_after(command.timeout - (time.monotonic() - started)) as limit:
            await process.wait_exit()
        timed_out = limit.cancelled_caught
    finally:
        # On every way out (exit, timeout, cancellation): end the group, then
        # let the pipes drain, bounded, and close them.
        with anyio.CancelScope(shield=True):
            try:
                if isinstance(process, SandboxChild):
                    await _end_in_sandbox(process, config.kill_grace)
                else:
                    await _end_group(process, config.kill_grace)
                # (Each wait only when there is something to wait for: a scope costs CPU.)
                if not process.pipes_closed():
                    with anyio.move_on_after(DRAIN_SECONDS):
                        await process.wait_pipes_closed()
                # The group is gone, but a leader that died of the SIGTERM may be a
                # zombie not collected yet: its status comes in a moment.
                if not process.has_exited():
                    with anyio.move_on_after(_REAP_SECONDS):
                        await process.wait_exit()
            finally:
                process.close()
    returncode = process.returncode
    exit_status: int | None
    signal_name: str | None
    if returncode is None:  # not collected in time: ended by us, status unknown
        logger.warning("pid %d: exit status not collected after its group ended", process.pid)
        exit_status, signal_name = None, "unknown (exit status not collected)"
    else:
        exit_status, signal_name = _exit_of(returncode)
    return CommandResult(
        exit_status=exit_status,
        signal=signal_name,
        stdout=stdout.result(),
        stderr=stderr.result(),
        duration=time.monotonic() - started,
        timed_out=timed_out,
        host=host,
    )


def _argv(command: Command, config: LocalPoolConfig) -> list[str]:
    if command.argv is not None:
        return list(command.argv)
    assert command.shell is not None
    return [config.shell, "-c", command.shell]


def _environment(config: LocalPoolConfig, extra: Mapping[str, str]) -> dict[str, str]:
    get = os.environ.get  # one lookup per name (``in`` then ``[]`` encoded each name twice)
    env = {k: v for k in config.env_passthrough if (v := get(k)) is not None}
    env.update(config.extra_env)
    env.update(extra)
    return env


def _spawn_failure(
    exc: OSError | ValueError, program: str, cwd: str | None, started: float, host: str
) -> CommandResult:
    if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
        raise BackendUnavailable(
            f"cannot start a process: {exc}", backend="local", host=host
        ) from exc
    if isinstance(exc, OSError) and exc.filename is not None and exc.filename == cwd:
        message, status = f"cannot run: working directory {cwd}: {exc.strerror}", 127
    elif isinstance(exc, FileNotFoundError):
        message, status = f"{program}: command not found", 127
    elif isinstance(exc, OSError):
        message, status = f"{program}: {exc.strerror or exc}", 126
    else:
        message, status = f"cannot run {program}: {exc}", 126
    return _failure(message, status, started, host)


def _failure(message: str, status: int, started: float, host: str) -> CommandResult:
    data = message.encode()
    return CommandResult(
        exit_status=status,
        stderr=Output(data, len(data), False),
        duration=time.monotonic() - started,
        host=host,
    )


def _exit_of(returncode: int) -> tuple[int | None, str | None]:
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"signal {-returncode}"


# -- the process group ---------------------------------------------------------------------------


async def _end_group(process: ChildProcess, kill_grace: float) -> None:
    """End everything left in the call's process group: SIGTERM, grace, SIGKILL."""
    pgid = process.pid
    if not await _group_alive(pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    with anyio.move_on_after(kill_grace):
        delay = 0.005
        while await _group_alive(pgid):
            await anyio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return
    _signal_group(pgid, signal.SIGKILL)
    # SIGKILL cannot be caught; wait (bounded) only so the leader's status is known.
    with anyio.move_on_after(1.0):
        await process.wait_exit()


async def _end_in_sandbox(process: SandboxChild, kill_grace: float) -> None:
    """End a sandboxed command's group: SIGTERM, grace, SIGKILL, each sent by the agent, which
    kills what the group (or the session, when no other call runs) left once the leader exits."""
    if process.has_exited():
        return
    process.signal_group(signal.SIGTERM)
    with anyio.move_on_after(kill_grace):
        await process.wait_exit()
        return
    process.signal_group(signal.SIGKILL)
    with anyio.move_on_after(1.0):
        await process.wait_exit()


async def _group_alive(pgid: int) -> bool:
    if not _signal_group(pgid, 0):
        return False
    return await anyio.to_thread.run_sync(_live_member, pgid, abandon_on_cancel=True)


def _signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to the group; False when the group has no member left."""
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        return False
    return True


def _live_member(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    Orphans of a call are reparented to init, and an init that does not reap
    (as in some containers) leaves them as zombies that still count as group
    members for ``killpg(pgid, 0)``. A zombie has let go of its pipes and runs
    nothing, so only live members matter. Without ``/proc``, assume alive.
    """
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                raw = file.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = raw[raw.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False
