"""File operations beneath a directory descriptor: the file tools' wall, held by the kernel.

Every path a model gives is resolved by ``openat2(2)`` beneath a descriptor of
the session workspace, with ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``. The
kernel refuses, with ``EXDEV``, a ``..`` that climbs out, an absolute path, an
absolute symlink and a symlink that points out, at every step of the walk, so a
directory swapped for a symlink while a call runs cannot lead it outside.
Symlinks that stay inside keep working. The workspace itself is opened with
no symlink followed (``RESOLVE_NO_SYMLINKS``: hosts make it at a symlink-free
path), so a workspace moved away and replaced by a symlink is refused. A
regular file with more than one hard link is refused (``EMLINK``), checked
with ``fstat`` on the opened descriptor: a hard link made inside the workspace
may be another name of a file outside it. A file is created by name only
relative to its opened parent, with ``O_NOFOLLOW``; missing parents are made
one ``mkdirat`` at a time, each below a parent opened beneath the workspace.

Errors are plain ``OSError``: ``EXDEV`` for a path that leaves the workspace,
``EMLINK`` for a file with other names, ``ENOSYS`` when openat2 cannot be
called here (Linux before 5.6, or a seccomp filter that blocks it). The hosts
turn them into the Host contract's errors
(:func:`agent_backend.dispatch.backend.file_error`).

The local host runs these functions in worker threads. The SSH host sends this
file's source to the remote host and runs it there with ``python3`` (see
``ssh/remote.py``), so this module imports nothing but the standard library and
keeps to what Python 3.7 runs.

This module must never open, create, stat or list a model-given path by name
from outside the workspace descriptor (no ``os.open(path)``, no
``os.path.realpath``, no check before an open), never follow a symlink at the
last component of a file it creates, and never fall back to a path check when
openat2 is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator

__all__ = [
    "HARD_LINKS_REFUSED",
    "OPENAT2_MISSING",
    "list_dir",
    "open_beneath",
    "read_file",
    "write_file",
]

SYS_OPENAT2 = 437
"""openat2's number on every Linux architecture but alpha (x86_64 and aarch64 alike)."""
AT_FDCWD = -100
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
_RETRIES = 64
"""Tries of one openat2 that the kernel answers EAGAIN (a rename raced a ``..``) or EINTR."""

HARD_LINKS_REFUSED = "refusing a file with more than one hard link"
OPENAT2_MISSING = (
    "openat2(2) cannot be called here: the file tools need Linux 5.6 or later, "
    "with openat2 not blocked by a seccomp filter"
)
_DIR_MODE = 0o777  # less the umask, as `mkdir -p` makes them
_FILE_MODE = 0o644


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


def _load_syscall() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.syscall
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_long
    function.argtypes = [
        ctypes.c_long,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.POINTER(_OpenHow),
        ctypes.c_size_t,
    ]
    syscall: Callable[..., int] = function
    return syscall


_SYSCALL = _load_syscall()


def _openat2(dirfd: int, path: bytes, how: _OpenHow) -> tuple[int, int]:
    """One ``openat2`` call: (the new descriptor, 0), or (-1, errno)."""
    if _SYSCALL is None:
        return -1, errno.ENOSYS
    fd = _SYSCALL(SYS_OPENAT2, dirfd, path, ctypes.byref(how), ctypes.sizeof(how))
    return (fd, 0) if fd >= 0 else (-1, ctypes.get_errno())


def _blocked() -> bool:
    """True when openat2 fails even for ``/`` with no resolve flags: a seccomp filter's EPERM."""
    fd, code = _openat2(AT_FDCWD, b"/", _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, 0))
    if fd >= 0:
        os.close(fd)
        return False
    return code in (errno.ENOSYS, errno.EPERM)


def open_beneath(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    """``openat2(dirfd, path)`` resolved beneath ``dirfd``: a new close-on-exec descriptor.

    ``OSError(EXDEV)`` when the path leaves ``dirfd`` (``..``, absolute, a symlink
    out), ``OSError(ENOSYS)`` (:data:`OPENAT2_MISSING`) when openat2 cannot be called.
    """
    return _open(dirfd, path, flags, mode, _RESOLVE)


def _open(dirfd: int, path: str, flags: int, mode: int, resolve: int) -> int:
    encoded = os.fsencode(path)
    if b"\0" in encoded:
        raise ValueError("a path must not contain NUL characters")
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    code = errno.EAGAIN
    for _ in range(_RETRIES):
        fd, code = _openat2(dirfd, encoded, how)
        if fd >= 0:
            return fd
        if code not in (errno.EAGAIN, errno.EINTR):
            break
    if code == errno.ENOSYS or (code == errno.EPERM and _blocked()):
        raise OSError(errno.ENOSYS, OPENAT2_MISSING)
    raise OSError(code, os.strerror(code), path)


@contextlib.contextmanager
def _root(root: str) -> Iterator[int]:
    """A descriptor of the workspace ``root``: a path the host made, not a model's.

    Hosts make workspaces at symlink-free paths, so no symlink is followed on the
    way: a workspace renamed away and replaced by a symlink (``exec`` can write
    the workspace's parent where it is not walled in) is refused, not followed.
    """
    fd = _open(AT_FDCWD, root, os.O_PATH | os.O_DIRECTORY, 0, RESOLVE_NO_SYMLINKS)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_file(info: os.stat_result, path: str) -> None:
    """Refuse what the file tools do not read or write: directories, non-files, hard links."""
    if stat.S_ISDIR(info.st_mode):
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(info.st_mode):
        raise OSError(errno.EINVAL, "not a regular file", path)
    if info.st_nlink > 1:
        raise OSError(errno.EMLINK, HARD_LINKS_REFUSED, path)


def read_file(root: str, path: str, limit: int) -> tuple[bytes, int]:
    """At most ``limit`` bytes from the start of file ``path`` beneath ``root``, and its size."""
    with _root(root) as root_fd:
        # O_NONBLOCK: opening a FIFO must not hang a worker thread forever.
        fd = open_beneath(root_fd, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        info = os.fstat(fd)
        _check_file(info, path)
        chunks: list[bytes] = []
        remaining = limit
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks), info.st_size
    finally:
        os.close(fd)


def _split(path: str) -> tuple[str, str]:
    """(the parent, the last name) of ``path``; the name may be "", "." or ".."."""
    head, _, name = path.rpartition("/")
    if not head:
        head = "/" if path.startswith("/") else "."
    return head, name


def _owner_of(root_fd: int) -> tuple[int, int] | None:
    """Who must own what the file tools make beneath the root: its owner, when that is not
    this process (a sandbox's uid, the workspace made for it by root); None: this process."""
    info = os.fstat(root_fd)
    return None if info.st_uid == os.geteuid() else (info.st_uid, info.st_gid)


def _make_dirs(root_fd: int, path: str) -> None:
    """Make directory ``path`` and its missing parents, each with mkdirat below an opened parent
    (owned as the root is: the session's own commands can write there)."""
    owner = _owner_of(root_fd)
    names = [name for name in path.split("/") if name not in ("", ".")]
    for depth in range(1, len(names) + 1):
        with contextlib.suppress(FileNotFoundError):
            os.close(open_beneath(root_fd, "/".join(names[:depth]), os.O_PATH | os.O_DIRECTORY))
            continue
        above = "/".join(names[: depth - 1]) or "."
        parent = open_beneath(root_fd, above, os.O_PATH | os.O_DIRECTORY)
        try:
            with contextlib.suppress(FileExistsError):  # made meanwhile: opened next round
                os.mkdir(names[depth - 1], _DIR_MODE, dir_fd=parent)
                if owner is not None:  # a symlink swapped in meanwhile: itself, not its target
                    os.chown(names[depth - 1], *owner, dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)


def _open_parent(root_fd: int, parent: str, make_parents: bool) -> int:
    try:
        return open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        if not make_parents:
            raise
    _make_dirs(root_fd, parent)
    return open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY)


def write_file(root: str, path: str, data: bytes, make_parents: bool = False) -> None:
    """Create or replace file ``path`` beneath ``root`` with ``data`` (new files: mode 0644,
    owned as the root is, so that the session's commands can write them too).

    ``make_parents``: make missing parent directories (beneath ``root``) first.
    An existing symlink is written through only to an existing file it
    resolves to beneath ``root``.
    """
    parent, name = _split(path)
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY  # O_NONBLOCK: a FIFO fails at once
    with _root(root) as root_fd:
        if name in ("", ".", ".."):  # a directory, unless it leaves the root (EXDEV first)
            os.close(open_beneath(root_fd, path, os.O_PATH))
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        parent_fd = _open_parent(root_fd, parent, make_parents)
        try:
            fd = open_beneath(parent_fd, name, flags | os.O_CREAT | os.O_NOFOLLOW, _FILE_MODE)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            # The name is a symlink: its target, if it exists and resolves beneath the root.
            fd = open_beneath(root_fd, path, flags)
        finally:
            os.close(parent_fd)
        owner = _owner_of(root_fd)
    try:
        info = os.fstat(fd)
        _check_file(info, path)  # before anything is written: no O_TRUNC at the open
        if owner is not None and info.st_uid == os.geteuid():  # made by this call
            os.fchown(fd, *owner)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def list_dir(root: str, path: str) -> list[tuple[str, str, int]]:
    """(name, kind, size) of each entry of directory ``path`` beneath ``root``, sorted by name.

    ``kind`` is ``file``, ``dir``, ``symlink`` or ``other``; ``size`` is 0 but for files.
    Names are as the directory holds them (undecodable bytes as surrogate escapes).
    """
    with _root(root) as root_fd:
        fd = open_beneath(root_fd, path, os.O_RDONLY | os.O_DIRECTORY)
    entries: list[tuple[str, str, int]] = []
    try:
        with os.scandir(fd) as scan:  # entries are looked at relative to fd
            for entry in scan:
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
                entries.append((entry.name, kind, size))
    finally:
        os.close(fd)
    entries.sort()
    return entries
