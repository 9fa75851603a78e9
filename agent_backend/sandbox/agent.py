"""The agent inside a session's sandbox: starts each command of the session, reports its exit.

It runs as the sandbox's own uid, as the child of the sandbox's init (a shell,
PID 1 of its PID namespace, which the commands cannot signal), started by the
host's ``python3 -I -S -c SOURCE [IDLE]``: this
file's text is its program, so it imports the standard library only and
nothing of the host's (whose files the sandbox cannot see). Its stdin is a
``SOCK_SEQPACKET`` socket to the backend; one message is one JSON object:

* first, unasked, ``{"ready": pid}`` with the sandbox's network namespace
  (``/proc/self/ns/net``) as ``SCM_RIGHTS``: the agent is up, and the backend
  may give the namespace its egress relays (sent before anything else runs here).
* ``{"op": "run", "id", "argv", "env", "cwd", "stdin"}`` with the command's
  pipes as ``SCM_RIGHTS`` (stdin's read end if asked for, stdout's and stderr's
  write ends): the command is started in a process group of its own; answered
  ``{"id", "pid"}``, or ``{"id", "errno", "strerror", "filename"}`` when it
  cannot be started.
* ``{"op": "signal", "id", "signal"}``: the signal to the command's group.
* When a command's leader exits, its group is SIGKILLed, and when no other
  command of the session runs, so is every process in the sandbox but the
  init and this agent (``kill(-1)``): ``setsid`` and double forks included.
  Then ``{"id", "exit"}`` (negative: the signal that ended it).

* After ``IDLE`` seconds without a command running or a message: ``{"idle": true}``,
  once; answered ``{"op": "leave"}`` when the backend has no call for it, and
  then the agent exits (the shell reports it, and starts it again when the backend
  wakes it for its next call: an idle sandbox holds no Python). Left unanswered
  (a spare's agent stays), it asks again only after its next message, such as
  ``{"op": "stay"}`` (nothing else).

End of file on the socket (the backend closed it, or died) ends the agent,
and with it the sandbox: the init exits when its child does, and the kernel
kills whatever is left in the PID namespace.

This program must never run anything but what it is asked to, never keep a
descriptor it was handed, and never outlive its socket.
"""

from __future__ import annotations

# The C modules under the standard ones (``_socket``, ``_signal``, ``_json``, ``_ctypes``): the
# agent starts at every sandbox's birth and wake-up, and ``socket``, ``signal``, ``json``,
# ``contextlib``, ``typing`` and ``ctypes`` would double its start (their enums, regular
# expressions and classes: ~30 ms of a ~60 ms start here). So no contextlib.suppress either:
# ruff: noqa: SIM105
import _ctypes
import _json
import _signal  # type: ignore[import-not-found]  # no stubs: signal.py re-exports it
import _socket
import array
import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MAX_MESSAGE = 1 << 20
_MAX_FDS = 3


class _JsonContext:
    """What ``_json``'s scanner reads of ``json.JSONDecoder``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float


def _not_serializable(value: object) -> object:
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


_scan = _json.make_scanner(_JsonContext())  # type: ignore[arg-type]
_encode = _json.make_encoder(
    None, _not_serializable, _json.encode_basestring_ascii, None, ":", ",", False, False, True
)


def _loads(data: bytes) -> Any:
    """``json.loads`` of one whole message (``ValueError`` when it is not one JSON value)."""
    text = data.decode()
    try:
        value, end = _scan(text, 0)
    except StopIteration as exc:
        raise ValueError(f"not JSON at {exc.value}") from None
    if text[end:].strip():
        raise ValueError(f"not JSON past {end}")
    return value


def _dumps(message: dict[str, Any]) -> bytes:
    return "".join(_encode(message, 0)).encode()


def _send(control: _socket.socket, message: dict[str, Any]) -> None:
    try:
        control.send(_dumps(message))
    except OSError:
        pass


def _send_ready(control: _socket.socket) -> None:
    """``{"ready": pid}``, with this sandbox's network namespace when it can be opened (without
    it, a backend with egress relays refuses the sandbox)."""
    message = _dumps({"ready": os.getpid()})
    try:
        netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        _send(control, {"ready": os.getpid()})
        return
    try:
        rights = array.array("i", [netns]).tobytes()
        control.sendmsg([message], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    except OSError:
        pass
    finally:
        os.close(netns)


def _receive(control: _socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors it carried; None at end of file."""
    fds = array.array("i")
    data, ancillary, _flags, _address = control.recvmsg(
        _MAX_MESSAGE, _socket.CMSG_SPACE(_MAX_FDS * fds.itemsize), _socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    if not data.strip():  # a wake-up meant for the shell: nothing to do
        return {"op": "wake"}, list(fds)
    message = _loads(data)
    if not isinstance(message, dict):
        raise ValueError("a message is a JSON object")
    return message, list(fds)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _kill(pid: int, signum: int, *, group: bool) -> None:
    try:
        (os.killpg if group else os.kill)(pid, signum)
    except ProcessLookupError:
        pass


class Agent:
    """The commands running in this sandbox, by the backend's call id."""

    def __init__(self, control: _socket.socket) -> None:
        self.control = control
        self.leaders: dict[int, int] = {}  # pid -> call id

    def run(self, message: dict[str, Any], fds: list[int]) -> None:
        call = message["id"]
        try:
            stdin = fds.pop(0) if message.get("stdin") else os.open(os.devnull, os.O_RDONLY)
            fds.insert(0, stdin)
            if len(fds) != 3:
                raise OSError(0, "the command's pipes did not arrive")
            env = {str(k): str(v) for k, v in message["env"].items()}
            os.chdir(message["cwd"])
            # posix_spawnp searches the PATH of this process: the command's own.
            os.environ["PATH"] = env.get("PATH", os.defpath)
            pid = os.posix_spawnp(
                message["argv"][0],
                message["argv"],
                env,
                file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)],
                setpgroup=0,
                setsigmask=(),
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGCHLD),
            )
        except OSError as exc:
            filename = exc.filename if exc.filename is not None else message["argv"][0]
            if exc.filename is None and not os.path.isdir(message.get("cwd", "/")):
                filename = message.get("cwd")
            _send(
                self.control,
                {"id": call, "errno": exc.errno, "strerror": exc.strerror, "filename": filename},
            )
            return
        finally:
            for fd in fds:
                _close(fd)
            try:
                os.chdir("/")
            except OSError:
                pass
        self.leaders[pid] = call
        _send(self.control, {"id": call, "pid": pid})

    def signal(self, message: dict[str, Any]) -> None:
        for pid, call in self.leaders.items():
            if call == message["id"]:
                _kill(pid, int(message["signal"]), group=True)

    def reap(self) -> None:
        while self.leaders:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            call = self.leaders.pop(pid, None)
            _kill(pid, _signal.SIGKILL, group=True)
            if not self.leaders:
                kill_everything_else()
            if call is not None:
                _send(self.control, {"id": call, "exit": os.waitstatus_to_exitcode(status)})


# -- reset: the sandbox made new for another session of the same pool ------------------------------

#: What a session may leave in its sandbox besides its workspace: emptied by a reset.
_SCRATCH = ("/tmp", "/dev/shm", "/dev/mqueue")
_MAX_DEPTH = 256


def reset(workspace: str) -> list[str]:
    """Leave nothing of the session that used this sandbox: every process but the init and
    this agent killed, ``workspace``, the private ``/tmp``, ``/dev/shm`` and the message queues
    emptied, its System V IPC objects removed. What could not be done, as messages (then the
    backend destroys the sandbox instead)."""
    kill_everything_else()
    errors: list[str] = []
    for path in (workspace, *_SCRATCH):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
            continue
        try:
            _empty(fd, path, errors, 0)
        finally:
            os.close(fd)
    _remove_ipc(errors)
    _clear_keys(errors)
    return errors


def _empty(directory: int, path: str, errors: list[str], depth: int) -> bool:
    """Remove everything in the open ``directory`` (never following a symbolic link) but the
    mount points in it (the workspace, when it lives under ``/tmp``), and the directories on
    the way to them; whether it kept such a way."""
    if depth > _MAX_DEPTH:
        errors.append(f"{path}: more than {_MAX_DEPTH} levels deep")
        return False
    try:
        os.fchmod(directory, 0o700)  # a directory the session made read-only
        names = os.listdir(directory)
        device = os.fstat(directory).st_dev
        if depth == 0:  # the directory itself stays: so must nothing of the session's on it
            for attribute in os.listxattr(directory):  # user.*, an ACL
                os.removexattr(directory, attribute)
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror}")
        return False
    kept = False
    for name in names:
        try:
            os.unlink(name, dir_fd=directory)
            continue
        except IsADirectoryError:
            pass
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{path}/{name}: {exc.strerror}")
            continue
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                sub = os.open(name, flags, dir_fd=directory)
            except PermissionError:  # a directory the session made unreadable (nothing else
                os.chmod(name, 0o700, dir_fd=directory)  # runs here now to swap it for a link)
                sub = os.open(name, flags, dir_fd=directory)
        except OSError as exc:
            errors.append(f"{path}/{name}: {exc.strerror}")
            continue
        try:
            mount_point = os.fstat(sub).st_dev != device
            way = mount_point or _empty(sub, f"{path}/{name}", errors, depth + 1)
        finally:
            os.close(sub)
        if way:
            kept = True
            continue
        try:
            os.rmdir(name, dir_fd=directory)
        except OSError as exc:
            errors.append(f"{path}/{name}: {exc.strerror}")
    return kept


def _remove_ipc(errors: list[str]) -> None:
    """``IPC_RMID`` every System V object of this IPC namespace (``/proc/sysvipc``)."""
    # The third argument is IPC_RMID for semctl (after semnum 0), a null pointer for the others.
    for kind, remove, last in (
        ("shm", "shmctl", None),
        ("msg", "msgctl", None),
        ("sem", "semctl", 0),
    ):
        try:
            with open(f"/proc/sysvipc/{kind}", "rb") as file:
                rows = file.read().splitlines()[1:]
        except OSError as exc:
            errors.append(f"/proc/sysvipc/{kind}: {exc.strerror}")
            continue
        call = _Function((remove, _Libc()))  # type: ignore[arg-type]  # what CDLL gives it
        for row in rows:
            ipc_id = int(row.split()[1])
            if call(ipc_id, 0, last) != 0:  # IPC_RMID is 0
                errors.append(f"{kind} {ipc_id}: errno {_ctypes.get_errno()}")


#: keyctl(2)'s number, per machine (a machine not listed: no reset, the sandbox is made anew).
_KEYCTL = {"x86_64": 250, "aarch64": 219}
_KEYCTL_CLEAR, _KEYCTL_GET_PERSISTENT = 7, 22
_USER_KEYRING, _USER_SESSION_KEYRING = -4, -5


def _clear_keys(errors: list[str]) -> None:
    """Empty the uid's keyrings (they belong to the user namespace, which the next session
    shares): the user and user-session keyrings, and the persistent one if the session made it."""
    number = _KEYCTL.get(os.uname().machine)
    if number is None:
        errors.append(f"keyrings: no keyctl number known for {os.uname().machine}")
        return
    syscall = _Function(("syscall", _Libc()))  # type: ignore[arg-type]  # what CDLL gives it
    persistent = syscall(number, _KEYCTL_GET_PERSISTENT, -1, _USER_KEYRING)
    rings = ([persistent] if persistent > 0 else []) + [_USER_KEYRING, _USER_SESSION_KEYRING]
    for ring in rings:  # a failure is caught below: a key still shown
        syscall(number, _KEYCTL_CLEAR, ring)
    # What counts: no key of this uid is left (the kernel collects an unlinked key a moment
    # later; until then /proc/keys still shows it). Bounded: past it, the sandbox is made anew.
    for _ in range(400):
        try:
            with open("/proc/keys", "rb") as file:
                kinds = {line.split()[7] for line in file.read().splitlines() if line.strip()}
        except (OSError, IndexError):
            errors.append("keyrings: /proc/keys unreadable")
            return
        if kinds <= {b"keyring"}:
            return
        time.sleep(0.005)
    errors.append("keyrings: a key is left (not cleared, or not collected within 2 s)")


def kill_everything_else() -> None:
    """SIGKILL every process of this PID namespace but its init and this agent, and return once
    they are dead (bounded): a process forking as it is killed is caught by a later round."""
    for _ in range(2000):
        _kill(-1, _signal.SIGKILL, group=False)
        if not _others_alive():
            return
        time.sleep(0.001)


def _others_alive() -> bool:
    me = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in ("1", me):
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as file:
                raw = file.read()
        except OSError:
            continue
        if raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3] not in (b"Z", b"X"):
            return True
    return False


class _Int(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_int
    _type_ = "i"


class _Function(_ctypes.CFuncPtr):  # a libc function returning int, errno kept
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Int


class _Libc:
    _handle = _ctypes.dlopen(None)  # type: ignore[arg-type]  # this process's symbols


def _not_dumpable() -> None:
    """No ptrace of this agent by the commands, though they share its uid (``PR_SET_DUMPABLE``
    0; each command is dumpable again after its exec)."""
    prctl = _Function(("prctl", _Libc()))  # type: ignore[arg-type]  # what CDLL gives it
    if prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(_ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def main() -> None:
    _not_dumpable()
    control = _socket.socket(fileno=os.dup(0))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)  # the socket stays ours alone (close-on-exec), not the commands'
    os.close(devnull)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    _signal.set_wakeup_fd(wake_write)
    _signal.signal(_signal.SIGCHLD, lambda *_: None)
    agent = Agent(control)
    idle = float(sys.argv[1]) if len(sys.argv) > 1 else None
    _send_ready(control)
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    asked = False  # to leave, since the last message
    while True:
        timeout = None if idle is None or agent.leaders or asked else int(idle * 1000)
        events = poller.poll(timeout)
        if not events:
            _send(control, {"idle": True})
            asked = True
            continue
        for fd, _events in events:
            if fd == wake_read:
                os.read(wake_read, 4096)
                agent.reap()
                continue
            try:
                message, fds = _receive(control)
            except (OSError, ValueError):
                message, fds = None, []
            if message is None:
                kill_everything_else()
                sys.exit(0)
            asked = False
            if message.get("op") == "leave" and not agent.leaders:
                sys.exit(0)  # nothing of ours runs: the reap after each command's exit saw to it
            if message.get("op") == "run":
                agent.run(message, fds)
            else:
                for extra in fds:
                    _close(extra)
                if message.get("op") == "signal":
                    agent.signal(message)
                elif message.get("op") == "reset" and not agent.leaders:
                    errors = reset(str(message["workspace"]))
                    _send(control, {"id": message["id"], "reset": not errors, "why": errors[:3]})
        agent.reap()


if __name__ == "__main__":
    main()
