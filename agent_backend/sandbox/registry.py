"""Who owns what on this host, kept on disk before the first side effect: owners and their uids.

Every sandboxing backend on a host registers in one host-wide directory
(``/run/agent-backend``, a tmpfs emptied at boot, as are the processes its
records name):

* ``owners/<token>.lock``: held with an exclusive ``flock`` by the live owner
  for as long as it runs; the kernel drops the lock when the owner dies,
  however it dies (SIGKILL, the OOM killer).
* ``uids/<uid>``: a symbolic link to the owning token, made with one
  ``symlink(2)`` (atomic and exclusive): a uid is claimed by exactly one
  sandbox of one owner on this host, before any file or process has it.

A successor takes every owner lock it can: each one it gets belongs to a dead
owner, whose uids' processes it kills (:mod:`agent_backend.sandbox.cgroups`
removes its cgroups) before it removes the records. It never touches what a
live owner holds. Blocking calls: run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import signal

__all__ = ["UID_BASE", "UID_COUNT", "Registry", "is_sandbox_uid", "kill_uids"]

logger = logging.getLogger("agent_backend.sandbox")

#: Sandbox uids are ``UID_BASE + n`` for ``n < UID_COUNT``: far above login users, systemd's
#: dynamic users (61184-65519) and the usual subordinate ranges (100000 + 65536 k, k < 8000).
UID_BASE = 1_600_000_000
UID_COUNT = 1 << 24


def is_sandbox_uid(uid: int) -> bool:
    """Whether ``uid`` is in the range sandboxes' uids are claimed from."""
    return UID_BASE <= uid < UID_BASE + UID_COUNT


_TOKEN = re.compile(r"([0-9a-f]{16})\.lock\Z")
_ATTEMPTS = 64


class Registry:
    """This owner's records in ``directory``; :meth:`close` drops the owner lock (idempotent)."""

    def __init__(self, directory: str, token: str, fd: int) -> None:
        self.directory = directory
        self.token = token
        self._fd: int | None = fd

    @classmethod
    def open(cls, directory: str, token: str | None = None, *, note: str = "") -> Registry:
        """Make the directories if missing, then create and lock this owner's lock file, which
        holds ``note`` (where the owner keeps what a successor must find, e.g. its cgroups)."""
        for sub in ("owners", "uids"):
            os.makedirs(os.path.join(directory, sub), mode=0o700, exist_ok=True)
        token = token or secrets.token_hex(8)
        path = os.path.join(directory, "owners", f"{token}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, note.encode())
        except BaseException:
            os.close(fd)
            raise
        return cls(directory, token, fd)

    def claim_uid(self) -> int:
        """A uid no other sandbox on this host has, recorded as this owner's."""
        for _ in range(_ATTEMPTS):
            uid = UID_BASE + secrets.randbelow(UID_COUNT)
            try:
                os.symlink(self.token, self._uid_path(uid))
            except FileExistsError:
                continue
            return uid
        raise OSError(errno.EAGAIN, "no free sandbox uid found")

    def release_uid(self, uid: int) -> None:
        """Forget ``uid`` (its processes must be gone); only this owner's claim is removed."""
        path = self._uid_path(uid)
        with contextlib.suppress(OSError):
            if os.readlink(path) == self.token:
                os.unlink(path)

    def uids(self) -> list[int]:
        """The uids this owner holds now."""
        return _uids_of(self.directory, self.token)

    def _uid_path(self, uid: int) -> str:
        return os.path.join(self.directory, "uids", str(uid))

    def close(self) -> None:
        """Remove this owner's lock file and let it go; its uids must have been released."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, "owners", f"{self.token}.lock"))
        finally:
            os.close(fd)

    def close_lock_only(self) -> None:
        """Drop the lock and keep the records: the next owner to start reconciles them."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def dead_owners(self) -> list[tuple[str, list[int], str]]:
        """Each owner whose lock is free (it died): its token, the uids it held, its note."""
        owners = os.path.join(self.directory, "owners")
        dead: list[tuple[str, list[int], str]] = []
        for name in sorted(os.listdir(owners)):
            found = _TOKEN.match(name)
            if found is None or found.group(1) == self.token:
                continue
            try:
                fd = os.open(os.path.join(owners, name), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue  # alive
            try:
                note = os.read(fd, 1 << 16).decode(errors="replace")
            finally:
                os.close(fd)
            dead.append((found.group(1), _uids_of(self.directory, found.group(1)), note))
        return dead

    def forget(self, token: str, uids: list[int]) -> bool:
        """Kill every process of ``uids``, then remove ``token``'s records; False if some remain."""
        left = kill_uids(uids)
        if left:
            logger.warning("%d process(es) of a dead owner's sandboxes would not die", len(left))
            return False
        for uid in uids:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._uid_path(uid))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, "owners", f"{token}.lock"))
        return True


def _uids_of(directory: str, token: str) -> list[int]:
    base = os.path.join(directory, "uids")
    found: list[int] = []
    for name in os.listdir(base):
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(os.path.join(base, name)) == token:
                found.append(int(name))
    return sorted(found)


def _processes_of(uids: set[int]) -> list[int]:
    pids: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{name}").st_uid in uids and not _is_zombie(name):
                pids.append(int(name))
    return pids


def _is_zombie(pid: str) -> bool:
    """Dead and waiting to be reaped (by a parent that may be gone): nothing left to kill."""
    with open(f"/proc/{pid}/stat", "rb") as file:
        raw = file.read()
    return raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3] in (b"Z", b"X")


def kill_uids(uids: list[int], *, rounds: int = 50) -> list[int]:
    """SIGKILL every process whose owner is one of ``uids`` until none is left (bounded); what
    is left. A process forking as it is killed is caught by a later round."""
    wanted = set(uids)
    if not wanted:
        return []
    left: list[int] = []
    for _ in range(rounds):
        left = _processes_of(wanted)
        if not left:
            return []
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.sched_yield()
    return _processes_of(wanted)
