"""The file tools are confined by the kernel, not by a path check (PITFALLS 36).

Each attack here worked when a path was resolved with ``realpath``, compared as a
string and then opened by name: a directory swapped for a symlink between the check
and the open, a hard link made inside the workspace to a file outside, a name with a
newline forging entries of ``list_dir``. Now every path is resolved by ``openat2(2)``
beneath the workspace's descriptor (``agent_backend.backends.local.files``), files with
more than one hard link are refused on their opened descriptor, and names are escaped.
The same behaviour of every kind of host is held by tests/test_host_contract.py.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_backend.backends.local import LocalBackend, LocalPoolConfig
from agent_backend.backends.local import files as local_files
from agent_backend.dispatch import Dispatcher, Session, builtin_tools
from agent_backend.dispatch.builtin import escape_name
from agent_backend.errors import BackendUnavailable
from agent_backend.tools import ToolRegistry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

AT_FDCWD = -100
RENAME_EXCHANGE = 2
CALLS = 200
"""Calls of each file tool in the race."""
SWAPS_PER_CALL = 25
"""Exchanges allowed as each call starts: about as many as fit in one call, so that they go
on while it runs (against the old resolve-then-open code, 12 to 50 of 600 calls then
reached outside; with 4, at most one did)."""
SWAPS = 3 * CALLS * SWAPS_PER_CALL
"""Exchanges of the directory and the symlink in the race, at most."""
OUTSIDE = "OUTSIDE THE WORKSPACE"


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[LocalBackend]:
    config = LocalPoolConfig(isolation="none", workspace_root=str(tmp_path / "workspaces"))
    async with LocalBackend(config) as backend:
        yield backend


@pytest.fixture
async def session(pool: LocalBackend) -> AsyncIterator[Session]:
    async with (
        Dispatcher(ToolRegistry(builtin_tools()), pool) as dispatcher,
        dispatcher.session() as opened,
    ):
        yield opened


# -- a directory swapped for a symlink while the tools run ----------------------------------


class Swapper:
    """Exchanges two names with ``renameat2(RENAME_EXCHANGE)`` in a thread of its own.

    It swaps only as often as the caller allows (:meth:`allow`, just before each
    call), so that the swaps happen while the calls run rather than all before
    them; ``limit`` swaps at most. Bounded by count, never by time.
    """

    def __init__(self, first: str, second: str, *, limit: int) -> None:
        self._names = (os.fsencode(first), os.fsencode(second))
        self._limit = limit
        self._allowed = 0
        self._stopped = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="swapper", daemon=True)
        self.swaps = 0
        self.error: int | None = None

    def __enter__(self) -> Swapper:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._condition:
            self._stopped = True
            self._condition.notify()
        self._thread.join()

    def allow(self, swaps: int) -> None:
        with self._condition:
            self._allowed += swaps
            self._condition.notify()

    def _run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        exchange = libc.renameat2
        exchange.argtypes = [ctypes.c_int, ctypes.c_char_p] * 2 + [ctypes.c_uint]
        exchange.restype = ctypes.c_int
        first, second = self._names
        while self.swaps < self._limit:
            with self._condition:
                while self.swaps >= self._allowed and not self._stopped:
                    self._condition.wait()
                if self._stopped:
                    return
            if exchange(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE) != 0:
                self.error = ctypes.get_errno()
                return
            self.swaps += 1


def _race_tree(workspace: str, outside: Path, link: str) -> None:
    """``d/`` (a directory) and ``s`` (a symlink to ``outside``) in the workspace."""
    outside.mkdir()
    (outside / "target.txt").write_text(OUTSIDE)
    (outside / "outside-only").write_text(OUTSIDE)
    inside = Path(workspace, "d")
    inside.mkdir()
    (inside / "target.txt").write_text("inside")
    target = str(outside) if link == "absolute" else os.path.relpath(outside, workspace)
    os.symlink(target, f"{workspace}/s")


def _outside_state(outside: Path) -> tuple[list[str], str]:
    return sorted(os.listdir(outside)), (outside / "target.txt").read_text()


@pytest.mark.parametrize("link", ["absolute", "relative"])
async def test_a_symlink_swap_race_never_reaches_outside(
    session: Session, tmp_path: Path, link: str
) -> None:
    workspace = session.workspace
    outside = tmp_path / "outside"
    _race_tree(workspace, outside, link)
    outcomes: dict[str, list[str]] = {"read_file": [], "write_file": [], "list_dir": []}
    calls: list[tuple[str, dict[str, Any]]] = [
        ("read_file", {"path": "d/target.txt"}),
        ("write_file", {"path": "d/target.txt", "content": "written"}),
        ("list_dir", {"path": "d"}),
    ]
    with Swapper(f"{workspace}/d", f"{workspace}/s", limit=SWAPS) as swapper:
        for number in range(CALLS):
            for call in calls:
                # Odd, then even: whichever way the swaps end, calls see both states.
                swapper.allow(SWAPS_PER_CALL - number % 2)
                result = await session.call(call)
                name = call[0]
                if not result.ok:
                    # Refused while d was the symlink out; nothing else may go wrong.
                    assert result.error_type == "PathOutsideWorkspace", result
                    outcomes[name].append("refused")
                    continue
                assert OUTSIDE not in result.output, (name, result.output)
                if name == "list_dir":  # d's own entry alone, never outside-only
                    assert result.output.startswith("target.txt  "), result.output
                    assert "\n" not in result.output
                outcomes[name].append("inside")
    assert swapper.error is None, os.strerror(swapper.error or 0)
    assert _outside_state(outside) == (["outside-only", "target.txt"], OUTSIDE)
    # The race ran: every tool was both served inside and refused while d pointed out.
    for name, seen in outcomes.items():
        assert len(seen) == CALLS
        assert {"inside", "refused"} <= set(seen), (name, swapper.swaps)


def _swap_workspace(workspace: str, target: Path) -> None:
    os.rename(workspace, f"{workspace}.moved")
    os.symlink(target, workspace)


def _restore_workspace(workspace: str) -> None:
    os.unlink(workspace)
    os.rename(f"{workspace}.moved", workspace)


async def test_a_workspace_replaced_by_a_symlink_is_not_followed(
    session: Session, tmp_path: Path
) -> None:
    # exec can write the workspace's parent where nothing walls it in: it can move the
    # workspace away and leave a symlink in its place. Its descriptor is opened with no
    # symlink followed, so the file tools refuse rather than follow it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "f").write_text(OUTSIDE)
    _swap_workspace(session.workspace, elsewhere)
    try:
        for call in [
            ("read_file", {"path": "f"}),
            ("write_file", {"path": "f", "content": "pwned"}),
            ("list_dir", {}),
        ]:
            result = await session.call(call)
            assert (result.ok, result.error_type) == (False, "FileError"), result
            assert "symbolic links" in result.to_model_message()
            assert OUTSIDE not in result.output
    finally:
        _restore_workspace(session.workspace)
    assert (elsewhere / "f").read_text() == OUTSIDE


# -- a hard link made inside the workspace ----------------------------------------------------


async def test_a_hard_link_to_a_file_outside_is_neither_read_nor_written(
    session: Session, tmp_path: Path
) -> None:
    secret = tmp_path / "passwd-copy"  # the same filesystem as the workspace
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n")
    made = await session.call(("exec", {"argv": ["ln", str(secret), "x"]}))
    assert made.ok, made.error
    for path in ("x", f"{session.workspace}/x"):
        read = await session.call(("read_file", {"path": path}))
        written = await session.call(("write_file", {"path": path, "content": "pwned"}))
        for result in (read, written):
            assert (result.ok, result.error_type) == (False, "FileError")
            assert "more than one hard link" in result.to_model_message()
            assert "root:x" not in result.output
    assert secret.read_text() == "root:x:0:0:root:/root:/bin/bash\n"


async def test_a_hard_link_inside_the_workspace_is_refused_too(session: Session) -> None:
    # A second name cannot tell where the first one lives: every such file is refused.
    made = await session.call(("exec", {"command": "echo data > a && ln a b"}))
    assert made.ok, made.error
    read = await session.call(("read_file", {"path": "a"}))
    assert "more than one hard link" in read.to_model_message()
    removed = await session.call(("exec", {"argv": ["rm", "b"]}))
    assert removed.ok
    again = await session.call(("read_file", {"path": "a"}))
    assert (again.ok, again.output) == (True, "data\n")


# -- names that would forge lines of list_dir -------------------------------------------------

ODD_NAMES = {
    b"x  5\nforged  123": "x  5\\nforged  123  0",
    b"\x1b[31mred": "\\x1b[31mred  0",
    b"back\\slash": "back\\\\slash  0",
    b"del\x7f": "del\\x7f  0",
    "c1\x85".encode(): "c1\\x85  0",
    "line\u2028sep".encode(): "line\\u2028sep  0",
    "bidi\u202eevil".encode(): "bidi\\u202eevil  0",
    b"bad\xffbyte": "bad\\xffbyte  0",
    b"tab\there": "tab\\there  0",
    b"carriage\rreturn": "carriage\\rreturn  0",
    "caf\u00e9 ok".encode(): "caf\u00e9 ok  0",
}


def _make_names(workspace: str) -> None:
    for name in ODD_NAMES:
        os.close(os.open(os.fsencode(workspace) + b"/" + name, os.O_CREAT | os.O_WRONLY))


async def test_list_dir_shows_one_line_per_entry_whatever_the_names(session: Session) -> None:
    _make_names(session.workspace)
    result = await session.call(("list_dir", {}))
    assert result.ok, result.error
    lines = result.output.split("\n")
    assert len(lines) == len(ODD_NAMES)
    assert sorted(lines) == sorted(ODD_NAMES.values())
    assert "forged  123" not in lines


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("plain name.txt", "plain name.txt"),
        ("a\nb", "a\\nb"),
        ("\x00\x1f\x7f\x80\x9f", "\\x00\\x1f\\x7f\\x80\\x9f"),
        ("\\", "\\\\"),
        ("\u2029", "\\u2029"),
        ("\U000e0001", "\\U000e0001"),  # a format character outside the BMP
        ("\udc80", "\\x80"),  # the surrogate escape of byte 0x80
        ("\u00e9\u4e2d\U0001f600", "\u00e9\u4e2d\U0001f600"),
    ],
)
def test_escape_name(name: str, shown: str) -> None:
    assert escape_name(name) == shown


# -- what stays inside keeps working, without running a command -------------------------------


async def test_symlinks_inside_and_the_workspaces_own_absolute_path_work(
    session: Session,
) -> None:
    made = await session.call(
        ("exec", {"command": "mkdir -p sub && echo hi > sub/f && ln -s sub/f l"})
    )
    assert made.ok, made.error
    workspace = session.workspace
    for path in ("l", "sub/../l", f"{workspace}/l", f"{workspace}//sub/f"):
        read = await session.call(("read_file", {"path": path}))
        assert (read.ok, read.output) == (True, "hi\n"), path
    listed = await session.call(("list_dir", {"path": workspace}))
    assert listed.output == "l@\nsub/"
    written = await session.call(("write_file", {"path": "l", "content": "through"}))
    assert written.ok, written.error
    assert await anyio.Path(workspace, "sub", "f").read_text() == "through"


async def test_write_file_makes_missing_parents_without_a_command(
    session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def no_commands(*args: object, **kwargs: object) -> None:
        raise AssertionError("write_file ran a command")

    monkeypatch.setattr(session.host, "run", no_commands)
    result = await session.call(("write_file", {"path": "a/b/../c/d.txt", "content": "deep"}))
    assert result.ok, result.error
    assert await anyio.Path(session.workspace, "a", "c", "d.txt").read_text() == "deep"
    assert await anyio.Path(session.workspace, "a", "b").is_dir()
    outside = await session.call(("write_file", {"path": "new/../../x/y", "content": "no"}))
    assert outside.error_type == "PathOutsideWorkspace"
    assert not await anyio.Path(session.workspace).parent.joinpath("x").exists()


# -- no openat2, no file tools: never a fallback to a path check ------------------------------


@pytest.fixture
def without_openat2(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """openat2 fails with the errno this fixture's list holds (ENOSYS unless changed)."""
    answer = [errno.ENOSYS]

    def missing(dirfd: int, path: bytes, how: object) -> tuple[int, int]:
        return -1, answer[0]

    monkeypatch.setattr(local_files, "_openat2", missing)
    return answer


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.EPERM], ids=["old-kernel", "seccomp"])
async def test_without_openat2_the_file_tools_fail_closed(
    session: Session, without_openat2: list[int], code: int
) -> None:
    without_openat2[0] = code
    await anyio.Path(session.workspace, "f").write_text("never read")
    for call in [
        ("read_file", {"path": "f"}),
        ("write_file", {"path": "g", "content": "never written"}),
        ("list_dir", {}),
    ]:
        with pytest.raises(BackendUnavailable, match=r"openat2.*Linux 5\.6") as raised:
            await session.call(call)
        assert raised.value.host == "local"
    assert not await anyio.Path(session.workspace, "g").exists()
