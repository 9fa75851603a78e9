"""Who owns a local workspace: a lock per live backend, so the next one can remove what a dead one left.

A local backend removes its workspaces when it closes; a process that is
killed (SIGKILL, the OOM killer, a Ray worker killed mid-episode) cannot. So:

* every started :class:`~agent_backend.backends.local.LocalHost` holds an
  exclusive ``flock`` on ``agent-backend-owner-<token>.lock`` in its workspace
  root for as long as it is open, and names its directories
  ``agent-backend-ws-<token>-*``, ``agent-backend-spare-<token>-*`` (spare
  workspaces, made ahead), ``agent-backend-trash-<token>-*`` (closed
  workspaces waiting to be removed), ``agent-backend-scratch-<token>-*`` and
  ``agent-backend-layers-<token>-*`` (its layer store: forks and snapshots);
* the kernel releases the lock when the process dies, however it dies;
* a backend that starts takes every owner lock it can in its root: each one
  it gets belongs to an owner that is gone, whose directories it removes
  (what is mounted in them first: overlays, quota tmpfs, layers, found in
  ``/proc/self/mountinfo`` and detached), then the lock file.

``flock`` locks belong to an open file description, so two backends of one
process exclude each other too; the descriptor is close-on-exec, so a tool's
process that outlives its backend does not keep the lock. The lock file is
made under a temporary name, locked, then renamed into place: a sweeper
never finds a live owner's lock unlocked. (A sweeper may take and remove a
temporary file in the instant before its owner locks it; the owner's rename
then fails and it starts over with a new token.)

Blocking calls: run them in a worker thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat

from agent_backend.sandbox.layers import mount_points, unmount_beneath
from agent_backend.sandbox.registry import is_sandbox_uid

__all__ = ["OwnerLock", "remove_tree", "sweep_dead_owners"]

logger = logging.getLogger("agent_backend.backends.local")

_PREFIX = "agent-backend-"
_LOCK = re.compile(r"agent-backend-owner-([0-9a-f]{16})\.lock(\.tmp)?\Z")
_OWNED = re.compile(r"agent-backend-(?:ws|spare|trash|scratch|layers)-([0-9a-f]{16})-")
_ATTEMPTS = 5


class OwnerLock:
    """This backend's claim on the directories it makes under ``root``; :meth:`release` ends it."""

    def __init__(self, root: str, token: str, fd: int) -> None:
        self.root = root
        self.token = token
        self.path = os.path.join(root, f"{_PREFIX}owner-{token}.lock")
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: str) -> OwnerLock:
        """Create, lock and publish a new owner lock in ``root`` (which must exist)."""
        for _ in range(_ATTEMPTS):
            token = secrets.token_hex(8)
            final = os.path.join(root, f"{_PREFIX}owner-{token}.lock")
            temporary = final + ".tmp"
            fd = os.open(
                temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(temporary, final)
            except FileNotFoundError:  # a sweeper took the unlocked temporary file: start over
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            return cls(root, token, fd)
        raise OSError(errno.EAGAIN, f"could not claim an owner lock in {root}")

    def prefix(self, kind: str) -> str:
        """The name prefix of this owner's directories of ``kind``.

        ``ws``, ``spare``, ``trash``, ``scratch`` or ``layers``.
        """
        return f"{_PREFIX}{kind}-{self.token}-"

    def release(self) -> None:
        """Remove the lock file and drop the lock; idempotent. Remove the directories first."""
        self._drop(unlink=True)

    def release_lock_only(self) -> None:
        """Drop the lock but keep the file: some directory is left, and the next sweep removes it."""
        self._drop(unlink=False)

    def _drop(self, *, unlink: bool) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if unlink:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            os.close(fd)


def sweep_dead_owners(root: str) -> list[str]:
    """Remove the directories (and lock files) of every owner in ``root`` that is no longer alive.

    Returns the directories removed. Only this user's entries named by this
    module are touched; symbolic links are never followed (a link with an
    owned name is removed as a link). A directory that cannot be removed is
    logged and its owner's lock file kept, so a later sweep tries again.
    """
    try:
        names = os.listdir(root)
    except OSError as exc:
        logger.warning("cannot list %s for workspaces of dead backends: %s", root, exc)
        return []
    owned: dict[str, list[str]] = {}
    for name in names:
        found = _OWNED.match(name)
        if found is not None:
            owned.setdefault(found.group(1), []).append(name)
    removed: list[str] = []
    for name in names:
        found = _LOCK.match(name)
        if found is not None:
            removed.extend(_sweep_owner(root, name, owned.get(found.group(1), [])))
    return removed


def _sweep_owner(root: str, lock_name: str, directories: list[str]) -> list[str]:
    path = os.path.join(root, lock_name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return []  # gone already, another user's, or a link
    removed: list[str] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # its owner is alive
        if os.fstat(fd).st_uid != os.getuid():
            return []
        complete = True
        # Every mount of the dead owner's (overlays, quota tmpfs, layers) goes before any tree.
        points = mount_points() if directories else []
        unmounted: list[str] = []
        for name in sorted(directories):
            target = os.path.join(root, name)
            try:
                unmount_beneath(target, points)
                unmounted.append(target)
            except OSError as exc:
                complete = False
                logger.warning("could not unmount %s, left by a backend that died: %s", target, exc)
        for target in unmounted:
            try:
                if _remove_owned(target):
                    removed.append(target)
            except OSError as exc:
                complete = False
                logger.warning("could not remove %s, left by a backend that died: %s", target, exc)
        if complete:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)
    if removed:
        logger.info("removed %d workspace(s) left by a local backend that died", len(removed))
    return removed


def _remove_owned(path: str) -> bool:
    info = os.lstat(path)
    # A sandboxed workspace belongs to its session's own uid (isolation = "namespaces").
    if info.st_uid != os.getuid() and not (os.getuid() == 0 and is_sandbox_uid(info.st_uid)):
        return False
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
    else:
        remove_tree(path)
    return True


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything in it, even directories the command made unwritable."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except PermissionError:
        pass
    # A tool may have chmod'ed directories read-only; make ours writable and try again.
    for top, dirs, _files in os.walk(path):
        for name in dirs:
            child = os.path.join(top, name)
            if not os.path.islink(child):
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700)
    os.chmod(path, 0o700)
    shutil.rmtree(path)
