"""Overlay layers of workspaces: frozen directories, and copy-on-write workspaces mounted over them.

A *layer* is a directory frozen once and never written again, kept in one
backend's *layer store*: ``<root>/agent-backend-layers-<token>-*``, root's,
mode 0700, which no sandbox binds (a sandbox sees its own workspace only), so
no sandbox can reach a layer. A *stack* is a tuple of layers, top first. An
*overlay workspace* is an overlayfs mount at the workspace's path whose lower
directories are a stack, and whose upper and work directories are its own
*area* in the store (a directory; a tmpfs of the workspace quota when there is
one). So:

* :meth:`LayerStore.freeze` turns what a workspace holds of its own into a new
  layer on top of its stack: a plain directory is renamed into the store (one
  ``rename``, whatever its size); a quota tmpfs is bound into the store
  read-only; an overlay workspace's area is frozen where it is, read-only when
  it is a mount. The workspace is then mounted again, as an overlay over the
  new stack with an empty area of its own: it keeps its content and its path.
* :meth:`LayerStore.mount` makes a new overlay workspace over a stack;
  :meth:`LayerStore.fork` is a freeze of its base and one such mount per
  copy, each a few system calls. A fork of a fork stacks one more layer.
* Each layer is counted: every overlay workspace and every snapshot holds its
  stack; a layer nobody holds any more is removed (unmounted first).
* The files of a layer belong to the uid of the workspace it was frozen from
  (its *owner*). A workspace of another uid (a fork's, a grader's) reads the
  layer through an *idmapped* mount, which shows the owner's files as its own
  uid's and every other id as itself: its sandbox can write what the base's
  could, copied up into its own area. The user namespaces that say so are
  made by ``unshare --user cat`` processes (one shell starts them all), which
  this module maps and lets go.

Overlay mounts need root (``CAP_SYS_ADMIN``) and overlayfs; idmapped layers
Linux 5.19 and a filesystem that supports them (ext4, xfs, btrfs, tmpfs since
6.3). Where there is none of that, :func:`copy_tree` is the fallback: a full
``cp -a --reflink=auto`` (reflinks where the filesystem has them).

:func:`mounts_beneath` and :func:`unmount_beneath` read ``/proc/self/mountinfo``:
what a backend that died left mounted is found there and detached before its
directories are removed (:mod:`agent_backend.backends.local.owner`).

This module must never mount outside the store or a workspace path it is
given, never write a frozen layer, and never run a model's command.
Blocking: call it from worker threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Literal, TypeAlias

__all__ = [
    "MAX_LAYERS",
    "Layer",
    "LayerStore",
    "Method",
    "Stack",
    "copy_tree",
    "mount_points",
    "mounts_beneath",
    "unmount_beneath",
]

Method: TypeAlias = Literal["overlay", "copy"]
"""How a store copies a workspace: copy-on-write overlay layers, or whole copies (``cp -a``)."""

MAX_LAYERS = 128
"""The most layers a stack may have (a workspace forked or snapshotted after changes that many
times): each is one lower directory of the overlay, whose options must fit in a page."""

_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MNT_DETACH = 0x2
_UMOUNT_NOFOLLOW = 0x8
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_OPEN_TREE_CLONE = 0x1
_OPEN_TREE_CLOEXEC = os.O_CLOEXEC
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_IDMAP = 0x00100000
# The same numbers on every Linux architecture (the syscall table is shared from 424 on).
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_MOUNT_SETATTR = 442
_LAST_ID = 4294967295  # (uid_t) -1: never a valid id
_USERNS_SECONDS = 60.0  # a backstop: an unshare is ready in a few milliseconds
# Directory renames work in overlay workspaces (redirects, followed by every later mount of
# the layer); no metadata-only copy-ups and no index, so a frozen upper is a plain tree.
_OVERLAY_OPTIONS = "redirect_dir=on,metacopy=off,index=off"
_ESCAPE = re.compile(rb"\\([0-7]{3})")


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _Libc:
    mount: Callable[..., int]
    umount2: Callable[..., int]
    syscall: Callable[..., int]


_LIBC: _Libc | None = None


def _libc() -> _Libc:
    global _LIBC
    if _LIBC is None:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "overlay layers need Linux")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.syscall.restype = ctypes.c_long
        _LIBC = _Libc(libc.mount, libc.umount2, libc.syscall)
    return _LIBC


def _check(result: int, what: str, path: str | None = None) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}", path)
    return result


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str) -> None:
    encode = os.fsencode
    _check(
        _libc().mount(
            encode(source) if source is not None else None,
            encode(target),
            encode(fstype) if fstype is not None else None,
            flags,
            os.fsencode(data) if data else None,
        ),
        f"mount {fstype or 'bind'}",
        target,
    )


def _unmount(path: str) -> None:
    """Detach the mount at ``path`` (lazily: whoever still holds it keeps it until they let go);
    nothing mounted there is not an error."""
    if _libc().umount2(os.fsencode(path), _MNT_DETACH | _UMOUNT_NOFOLLOW) < 0:
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOENT):
            raise OSError(code, f"umount: {os.strerror(code)}", path)


def _read_only(path: str) -> None:
    """Make the mount at ``path`` read-only (this mount only)."""
    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "")


# -- the mount table -------------------------------------------------------------------------------


def mount_points() -> list[str]:
    """Every mount point in this process's mount namespace, in the table's order."""
    try:
        with open("/proc/self/mountinfo", "rb") as file:
            lines = file.read().splitlines()
    except FileNotFoundError:  # not Linux: nothing of ours is mounted
        return []
    points: list[str] = []
    for line in lines:
        fields = line.split(b" ", 5)
        if len(fields) > 4:
            raw = _ESCAPE.sub(lambda found: bytes([int(found.group(1), 8)]), fields[4])
            points.append(os.fsdecode(raw))
    return points


def mounts_beneath(path: str, points: Sequence[str] | None = None) -> list[str]:
    """The mount points at ``path`` or below it, the last mounted first (the order to unmount
    them in); ``points``: the table already read (:func:`mount_points`), or None to read it."""
    inside = path.rstrip("/") + "/"
    table = mount_points() if points is None else points
    return [point for point in reversed(table) if point == path or point.startswith(inside)]


def unmount_beneath(path: str, points: Sequence[str] | None = None) -> list[str]:
    """Detach every mount at ``path`` or below it, deepest and latest first; those detached."""
    found = mounts_beneath(path, points)
    for point in found:
        _unmount(point)
    return found


# -- copies ----------------------------------------------------------------------------------------


def copy_tree(source: str, target: str) -> None:
    """Copy what directory ``source`` holds into the existing directory ``target``, as ``cp -a``
    does (modes, owners where allowed, times, symbolic links, hard links), sharing the blocks
    (reflinks) where the filesystem can. Time and space grow with the tree: the fallback."""
    done = subprocess.run(
        ["cp", "-a", "--reflink=auto", "--", os.path.join(source, "."), target],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[-500:]
        raise OSError(errno.EIO, f"cp -a failed: {why}", source)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


# -- user namespaces for idmapped layers -----------------------------------------------------------


def _id_map(owner: int, uid: int) -> str:
    """A map that shows ``owner`` as ``uid`` and every other id as itself (but ``uid``, which
    nothing may show as twice)."""
    low, high = sorted((owner, uid))
    lines = [f"{owner} {uid} 1"]
    for first, count in ((0, low), (low + 1, high - low - 1), (high + 1, _LAST_ID - high - 1)):
        if count > 0:
            lines.append(f"{first} {first} {count}")
    return "\n".join(lines) + "\n"


# One shell starts ``$1`` times ``unshare --user -- cat`` in the background, each one's pid on
# a line, then waits for them: they end at the end of their shared input, on descriptor 3 (a
# job's own stdin would be /dev/null).
_SPAWN_NAMESPACES = (
    'i=0; while [ "$i" -lt "$1" ]; do "$2" --user -- "$3" <&3 3<&- & echo $!; i=$((i+1)); done;'
    " exec 3<&-; wait"
)


class _UserNamespaces:
    """New user namespaces, each to map one ``owner`` to one ``uid``.

    :meth:`start` spawns one shell that starts ``count`` times ``unshare --user cat``, in the
    background (one spawn here, their start-ups overlapping each other and whatever the
    caller does next); :meth:`collect` maps them, once each has unshared, to the pairs it is
    given; :meth:`close` lets them go (each ``cat`` ends at the end of its input and the shell
    reaps them; the namespaces live on in the descriptors :meth:`collect` gave, until closed).
    """

    def __init__(self) -> None:
        self._count = 0
        self._pids: list[int] = []
        self._shell: int | None = None
        self._fds: dict[str, int] = {}  # input (theirs to read), pids, errors (ours to read)
        self._found: dict[tuple[int, int], int] = {}

    @classmethod
    def start(cls, count: int) -> _UserNamespaces:
        namespaces = cls()
        if count <= 0:
            return namespaces
        shell, unshare, cat = shutil.which("sh"), shutil.which("unshare"), shutil.which("cat")
        if shell is None or unshare is None or cat is None:
            raise OSError(errno.ENOENT, "idmapped layers need sh, unshare and cat (util-linux)")
        theirs: list[int] = []
        try:
            for name in ("input", "pids", "errors"):
                read, write = os.pipe()
                namespaces._fds[name] = write if name == "input" else read
                theirs.append(read if name == "input" else write)
            namespaces._shell = os.posix_spawn(
                shell,
                [shell, "-c", _SPAWN_NAMESPACES, "sh", str(count), unshare, cat],
                {"PATH": os.defpath},
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, theirs[1], 1),
                    (os.POSIX_SPAWN_DUP2, theirs[2], 2),
                    (os.POSIX_SPAWN_DUP2, theirs[0], 3),
                ],
            )
        except BaseException:
            namespaces.close()
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        namespaces._count = count
        return namespaces

    def _why(self) -> str:
        """What the shell or an ``unshare`` said on stderr (never blocks)."""
        errors = self._fds.get("errors")
        if errors is None:
            return ""
        os.set_blocking(errors, False)
        with contextlib.suppress(OSError):
            return os.read(errors, 4096).decode(errors="replace").strip()
        return ""

    def _read_pids(self) -> None:
        data = b""
        while data.count(b"\n") < self._count:
            chunk = os.read(self._fds["pids"], 4096)
            if not chunk:
                raise OSError(errno.EPERM, f"no user namespace: {self._why() or 'sh failed'}")
            data += chunk
        self._pids = [int(line) for line in data.split()]

    def collect(self, pairs: Sequence[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """A namespace per pair ``(owner, uid)``, mapping ``owner`` to ``uid`` (every other id to
        itself): their descriptors, which :meth:`close` closes."""
        if len(pairs) > self._count:
            raise ValueError(f"{len(pairs)} user namespaces asked for, {self._count} started")
        if not pairs:
            return {}
        if not self._pids:
            self._read_pids()
        mine = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + _USERNS_SECONDS
        for pair, pid in zip(pairs, self._pids, strict=False):
            namespace = f"/proc/{pid}/ns/user"
            while (current := _namespace_of(namespace)) == mine:
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, "no user namespace for an idmapped layer")
                time.sleep(0.0001)  # no event says "unshared": its start takes about a millisecond
            if not current:
                why = self._why() or "unshare exited"
                raise OSError(errno.EPERM, f"no user namespace for an idmapped layer: {why}")
            mapping = _id_map(*pair)
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{pid}/{name}", "w") as file:
                    file.write(mapping)
            self._found[pair] = os.open(namespace, os.O_RDONLY | os.O_CLOEXEC)
        return dict(self._found)

    def close(self) -> None:
        found, self._found = self._found, {}
        for fd in found.values():
            os.close(fd)
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
        shell, self._shell = self._shell, None
        if shell is not None and os.waitpid(shell, os.WNOHANG) == (0, 0):
            # Its cats end at the end of their input, it then: reaped by a thread of its own.
            threading.Thread(
                target=os.waitpid, args=(shell, 0), name="agent-backend-userns-reaper", daemon=True
            ).start()


def _namespace_of(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:  # exiting: its exit status says why
        return ""


def _idmapped_clone(path: str, namespace: int) -> int:
    """A detached clone of the mount at ``path``, idmapped through ``namespace``: its descriptor."""
    libc = _libc()
    fd = _check(
        libc.syscall(
            _SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(path), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC
        ),
        "open_tree",
        path,
    )
    try:
        attr = _MountAttr(_MOUNT_ATTR_IDMAP, 0, 0, namespace)
        _check(
            libc.syscall(
                _SYS_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
            ),
            "an idmapped layer (mount_setattr)",
            path,
        )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _attach(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` at ``target`` (overlayfs before Linux 6.15 takes only
    attached layers)."""
    _check(
        _libc().syscall(
            _SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH
        ),
        "move_mount",
        target,
    )


@contextlib.contextmanager
def _opened(*paths: str) -> Iterator[list[str]]:
    """``/proc/self/fd`` names of ``paths``, opened meanwhile: mount options that hold any path
    (a ``,`` or a ``:`` in it included) and stay short."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        yield [f"/proc/self/fd/{fd}" for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


_DETACHED_LAYERS: list[bool] = [True]
"""Whether overlayfs takes a detached (idmapped) mount as a layer (Linux 6.15 on): found out at
the first overlay that needs one, and remembered."""


@contextlib.contextmanager
def _directories(
    stack: Sequence[Layer],
    uid: int | None,
    namespaces: dict[tuple[int, int], int],
    entry: Callable[[str], str],
    *,
    attach: bool = False,
) -> Iterator[str]:
    """The ``lowerdir`` option's value for ``stack`` as ``uid`` sees it: each layer itself, or
    an idmapped clone of it (attached meanwhile at a new store ``entry`` when ``attach``; the
    overlay keeps private clones of its layers)."""
    attached: list[str] = []
    clones: list[int] = []
    try:
        paths: list[str] = []
        for layer in stack:
            namespace = namespaces.get((layer.owner, uid)) if uid is not None else None
            if namespace is None:
                paths.append(layer.data)
                continue
            clone = _idmapped_clone(layer.data, namespace)
            clones.append(clone)
            if not attach:
                paths.append(f"/proc/self/fd/{clone}")
                continue
            point = entry("m")
            attached.append(point)
            _attach(clone, point)
            paths.append(point)
        with _opened(*paths) as names:
            yield ":".join(names)
    finally:
        for fd in clones:
            os.close(fd)
        for point in attached:
            _unmount(point)
            with contextlib.suppress(OSError):
                os.rmdir(point)


# -- the store -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    """One frozen directory of the store."""

    home: str
    """Its entry in the store, removed (unmounted first if :attr:`mounted`) once nobody holds it."""
    data: str
    """The directory an overlay reads: :attr:`home`, or the ``upper`` directory in it."""
    owner: int
    """The uid its files belong to: the uid of the workspace it was frozen from."""
    mounted: bool
    """:attr:`home` is a mount (a quota tmpfs, read-only now)."""


Stack: TypeAlias = tuple[Layer, ...]
"""Layers, top first: what an overlay workspace or a snapshot shows."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Area:
    """An overlay workspace's own writable part: ``upper`` and ``work`` in one store entry."""

    path: str
    mounted: bool  # a tmpfs of the workspace quota

    @property
    def upper(self) -> str:
        return os.path.join(self.path, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.path, "work")


@dataclasses.dataclass(frozen=True, slots=True)
class _Overlay:
    stack: Stack
    area: _Area
    uid: int


class LayerStore:
    """One backend's layers, overlay workspaces and snapshots, in a store directory of its own.

    ``root``: where the store is made (the workspace root: a plain workspace is renamed into
    it, so it must be on the same filesystem); ``prefix``: the name the owner gives it
    (``agent-backend-layers-<token>-``), so that a successor finds and removes it. The store
    is made at its first use. ``quota_mb``: the size of every workspace's own writable part
    (a tmpfs), None: unbounded. Thread-safe; the operations on one workspace must not overlap
    (the host makes sure: no call runs in a workspace while it is frozen).
    """

    def __init__(
        self, root: str, prefix: str, *, method: Method, quota_mb: int | None = None
    ) -> None:
        self.root = root
        self.prefix = prefix
        self.method: Method = method
        self.quota_mb = quota_mb
        self._directory: str | None = None
        self._lock = threading.Lock()
        self._refs: dict[str, int] = {}  # layer home -> holders
        self._layers: dict[str, Layer] = {}
        self._overlays: dict[str, _Overlay] = {}  # workspace path -> what it is mounted over
        self._tmpfs: set[str] = set()  # workspace paths with a quota tmpfs of their own
        self._mounted: set[str] = set()  # directories with mounts of ours beneath (assets)
        self._snapshots: dict[str, Stack] = {}  # snapshot path -> what it shows

    def __repr__(self) -> str:
        return (
            f"<LayerStore {self.method} [layers: {len(self._refs)} | overlays:"
            f" {len(self._overlays)} | snapshots: {len(self._snapshots)}]>"
        )

    @property
    def directory(self) -> str | None:
        """The store's directory, once made."""
        return self._directory

    def layers(self) -> list[Layer]:
        """The layers held now."""
        with self._lock:
            return [self._layers[home] for home in self._refs]

    def stack(self, path: str) -> Stack:
        """What the overlay workspace ``path`` is mounted over (empty: not an overlay)."""
        with self._lock:
            overlay = self._overlays.get(path)
        return overlay.stack if overlay is not None else ()

    def snapshot_stack(self, snapshot: str) -> Stack:
        """What snapshot ``snapshot`` shows; KeyError if it is not one of this store's."""
        with self._lock:
            return self._snapshots[snapshot]

    def snapshots(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._snapshots)

    def _store(self) -> str:
        with self._lock:
            if self._directory is None:
                self._directory = tempfile.mkdtemp(prefix=self.prefix, dir=self.root)
            return self._directory

    def _entry(self, kind: str) -> str:
        """A new, empty directory in the store (``kind``: a letter that says what it holds)."""
        store = self._store()
        while True:
            path = os.path.join(store, kind + secrets.token_hex(4))
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            return path

    # -- holding layers --------------------------------------------------------------------------

    def _hold(self, stack: Stack) -> None:
        with self._lock:
            for layer in stack:
                self._layers[layer.home] = layer
                self._refs[layer.home] = self._refs.get(layer.home, 0) + 1

    def _drop(self, stack: Stack) -> None:
        """Let go of ``stack``; remove the layers nobody holds any more."""
        freed: list[Layer] = []
        with self._lock:
            for layer in stack:
                left = self._refs.get(layer.home, 0) - 1
                if left > 0:
                    self._refs[layer.home] = left
                elif layer.home in self._refs:
                    del self._refs[layer.home]
                    freed.append(self._layers.pop(layer.home))
        for layer in freed:
            if layer.mounted:
                _unmount(layer.home)
            _remove(layer.home)

    # -- workspaces ------------------------------------------------------------------------------

    def limit(self, path: str, uid: int) -> None:
        """Mount a tmpfs of the quota at the empty workspace ``path``, owned by ``uid`` (0700);
        nothing without a quota."""
        if self.quota_mb is None:
            return
        options = f"size={self.quota_mb}m,mode=0700,uid={uid},gid={uid}"
        _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        with self._lock:
            self._tmpfs.add(path)

    def is_overlay(self, path: str) -> bool:
        """Whether workspace ``path`` is an overlay (a fork, or a workspace that was forked)."""
        with self._lock:
            return path in self._overlays

    def needs_freeze(self, path: str) -> bool:
        """Whether workspace ``path`` holds anything of its own that its stack does not: what
        it holds (not an overlay yet), or an overlay's changes since it was last frozen."""
        with self._lock:
            overlay = self._overlays.get(path)
        if overlay is None:
            return True
        with os.scandir(overlay.area.upper) as entries:
            return next(entries, None) is not None

    def freeze(self, path: str, uid: int) -> Stack:
        """Freeze what workspace ``path`` (of ``uid``) holds into a new layer on top of its stack,
        and mount it again as an overlay over the new stack with an empty area of its own; the
        new stack. Nothing that runs in the workspace may be left (its sandbox stopped): its
        old mount is detached."""
        with self._lock:
            overlay = self._overlays.get(path)
            tmpfs = path in self._tmpfs
        if overlay is not None and not self.needs_freeze(path):
            return overlay.stack
        below = overlay.stack if overlay is not None else ()
        if len(below) >= MAX_LAYERS:
            raise OSError(
                errno.E2BIG,
                f"workspace {path} already stands on {len(below)} layers, the most there may be"
                " (it was forked or snapshotted after a change that many times)",
            )
        if overlay is not None:  # its area becomes the layer, where it is
            _unmount(path)
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(overlay.area.work)
            if overlay.area.mounted:
                _read_only(overlay.area.path)
            layer = Layer(overlay.area.path, overlay.area.upper, overlay.uid, overlay.area.mounted)
            with self._lock:
                del self._overlays[path]
        elif tmpfs:  # bound into the store read-only, then the workspace's own mount detached
            home = self._entry("l")
            _mount(path, home, None, _MS_BIND, "")
            try:
                _read_only(home)
            finally:
                _unmount(path)
            with self._lock:
                self._tmpfs.discard(path)
            layer = Layer(home, home, uid, True)
        else:  # a plain directory: renamed into the store, the workspace made again in its place
            home = self._entry("l")
            info = os.stat(path)
            os.rename(path, home)  # over the empty entry
            os.mkdir(path, 0o700)
            os.chown(path, info.st_uid, info.st_gid)
            layer = Layer(home, home, uid, False)
        stack = (layer, *below)
        # Held meanwhile by the freeze itself. Should the mount fail, the workspace has lost its
        # content's mount but not its content: it stays held, in the store, until close.
        self._hold((layer,))
        self._mount_overlays([(path, uid)], stack)
        self._drop(stack)  # the freeze's hold, and the workspace's hold of its old stack
        return stack

    def fork(
        self,
        path: str,
        uid: int,
        n: int,
        *,
        make: Callable[[], tuple[str, int]],
        stop: Callable[[], None],
    ) -> Stack:
        """Freeze workspace ``path`` (of ``uid``) and mount an overlay over it at each of ``n``
        new empty directories, each made by ``make()`` (``(its path, its uid)``); the stack
        they all stand on now.

        ``stop()`` ends whatever could still write in ``path`` (its sandbox), and is called
        only if there is something to freeze. The user namespaces the copies need are started
        first, and start up while ``make()`` and ``stop()`` run.
        """
        below = self.stack(path)
        owners = sorted({uid, *(layer.owner for layer in below)})
        namespaces = _UserNamespaces.start(n * len(owners))
        try:
            copies = [make() for _ in range(n)]
            if self.needs_freeze(path):
                stop()
                stack = self.freeze(path, uid)
            else:
                stack = below
            self._mount_overlays(copies, stack, namespaces)
        finally:
            namespaces.close()
        return stack

    def mount(self, workspaces: Sequence[tuple[str, int]], stack: Stack) -> None:
        """Mount an overlay over ``stack`` at each empty directory ``path`` of ``(path, uid)``,
        its area owned by ``uid``: copies of what ``stack`` shows, private to each."""
        self._mount_overlays(workspaces, stack)

    def _mount_overlays(
        self,
        workspaces: Sequence[tuple[str, int]],
        stack: Stack,
        namespaces: _UserNamespaces | None = None,
    ) -> None:
        if not stack:
            raise ValueError("an overlay workspace needs at least one layer")
        pairs = sorted(
            {(layer.owner, uid) for layer in stack for _, uid in workspaces if layer.owner != uid}
        )
        own = namespaces is None
        if namespaces is None:
            namespaces = _UserNamespaces.start(len(pairs))
        try:
            found = namespaces.collect(pairs)
            done: list[str] = []
            try:
                for path, uid in workspaces:
                    self._mount_one(path, uid, stack, found)
                    done.append(path)
            except BaseException:
                for path in done:
                    self.release(path)
                raise
        finally:
            if own:
                namespaces.close()

    def _mount_one(
        self, path: str, uid: int, stack: Stack, namespaces: dict[tuple[int, int], int]
    ) -> None:
        area = self._make_area(uid)
        self._hold(stack)
        idmapped = any((layer.owner, uid) in namespaces for layer in stack)
        try:
            try:
                self._mount_overlay(path, stack, uid, namespaces, area, attach=False)
            except OSError as exc:
                if not (idmapped and exc.errno == errno.EINVAL and _DETACHED_LAYERS[0]):
                    raise
                # An older kernel: its layers must be attached (a mount and an unmount each).
                self._mount_overlay(path, stack, uid, namespaces, area, attach=True)
                _DETACHED_LAYERS[0] = False
        except BaseException:
            self._drop(stack)
            self._remove_area(area)
            raise
        with self._lock:
            self._overlays[path] = _Overlay(stack, area, uid)

    def _mount_overlay(
        self,
        path: str,
        stack: Stack,
        uid: int,
        namespaces: dict[tuple[int, int], int],
        area: _Area,
        *,
        attach: bool,
    ) -> None:
        attach = attach or not _DETACHED_LAYERS[0]
        with (
            _directories(stack, uid, namespaces, self._entry, attach=attach) as lowers,
            _opened(area.upper, area.work) as (upper, work),
        ):
            options = f"lowerdir={lowers},upperdir={upper},workdir={work},{_OVERLAY_OPTIONS}"
            _mount("overlay", path, "overlay", _MS_NOSUID | _MS_NODEV, options)

    def _make_area(self, uid: int) -> _Area:
        path = self._entry("a")
        mounted = self.quota_mb is not None
        try:
            if mounted:
                options = f"size={self.quota_mb}m,mode=0700"
                _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, options)
            area = _Area(path, mounted)
            os.mkdir(area.upper, 0o700)
            os.chown(area.upper, uid, uid)
            os.mkdir(area.work, 0o700)
        except BaseException:
            if mounted:
                _unmount(path)
            _remove(path)
            raise
        return area

    def _remove_area(self, area: _Area) -> None:
        if area.mounted:
            _unmount(area.path)
        _remove(area.path)

    def show(self, directory: str, owner: str, sources: Sequence[str]) -> None:
        """Make ``directory`` (0755) and show each host path of ``sources`` in it, read-only, as
        its base name: a read-only bind mount (``copy``: a symbolic link, which enforces
        nothing). ``owner``: the workspace the mounts go with (:meth:`release` of it removes them).
        """
        os.mkdir(directory, 0o755)
        with self._lock:
            self._mounted.add(owner)
        for source in sources:
            target = os.path.join(directory, os.path.basename(source.rstrip("/")))
            if self.method == "copy":
                os.symlink(source, target)
                continue
            if os.path.isdir(source):
                os.mkdir(target, 0o755)
            else:
                os.close(
                    os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o444)
                )
            _mount(source, target, None, _MS_BIND, "")
            _read_only(target)

    def release(self, path: str) -> None:
        """Unmount what is mounted at or beneath workspace ``path``, remove the areas of this
        store's overlays there, and let go of their stacks (their layers go once nobody holds
        them): after it, removing the tree cannot reach into a mount (a grader's assets).
        Idempotent; with the ``copy`` method nothing is ever mounted, and nothing is looked up."""
        inside = path.rstrip("/") + "/"
        with self._lock:
            overlays = [p for p in self._overlays if p == path or p.startswith(inside)]
            found = [self._overlays.pop(p) for p in overlays]
            self._mounted.discard(path)
            self._tmpfs.discard(path)
        if self.method == "overlay":
            unmount_beneath(path)
        for overlay in found:
            self._remove_area(overlay.area)
            self._drop(overlay.stack)

    # -- snapshots -------------------------------------------------------------------------------

    def snapshot(self, stack: Stack) -> str:
        """A read-only view of ``stack`` in the store, holding it: its path."""
        view = self._entry("s")
        self._hold(stack)
        try:
            if len(stack) == 1:
                _mount(stack[0].data, view, None, _MS_BIND, "")
                _read_only(view)
            else:
                with _directories(stack, None, {}, self._entry) as lowers:
                    options = f"lowerdir={lowers},{_OVERLAY_OPTIONS}"
                    _mount("overlay", view, "overlay", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, options)
        except BaseException:
            self._drop(stack)
            _unmount(view)
            _remove(view)
            raise
        with self._lock:
            self._snapshots[view] = stack
        return view

    def copy_snapshot(self, path: str) -> str:
        """A copy of workspace ``path`` in the store (the ``copy`` method's snapshot): its path."""
        view = self._entry("s")
        try:
            copy_tree(path, view)
        except BaseException:
            _remove(view)
            raise
        with self._lock:
            self._snapshots[view] = ()
        return view

    def remove_snapshot(self, snapshot: str) -> None:
        """Remove snapshot ``snapshot`` and let go of its stack; idempotent."""
        with self._lock:
            stack = self._snapshots.pop(snapshot, None)
        if stack is None:
            return
        if stack:
            _unmount(snapshot)
        _remove(snapshot)
        self._drop(stack)

    def close(self) -> None:
        """Remove everything left: snapshots, overlays, layers, then the store; idempotent."""
        for snapshot in sorted(self.snapshots()):
            self.remove_snapshot(snapshot)
        with self._lock:
            left = sorted({*self._overlays, *self._tmpfs, *self._mounted})
        for path in left:
            self.release(path)
        with self._lock:
            directory, self._directory = self._directory, None
            held = list(self._layers.values())
            self._refs.clear()
            self._layers.clear()
        for layer in held:
            if layer.mounted:
                _unmount(layer.home)
        if directory is not None:
            unmount_beneath(directory)
            _remove(directory)
