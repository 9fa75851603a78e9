"""Trajectories to disk, safe to resume: :class:`JsonlWriter` and :class:`ParquetWriter`.

Both have the same small interface: :meth:`~JsonlWriter.write` buffers a
record, :meth:`~JsonlWriter.write_group` buffers a group and (by default)
flushes it, :meth:`~JsonlWriter.flush` makes everything written so far
durable (fsync), and :attr:`~JsonlWriter.position` is an integer that names
that durable point (a byte offset for JSONL, a count of part files for
Parquet).

**Resume without writing a prompt twice or skipping one.** The order that
makes a crash harmless at any instant is::

    writer.write_group(group)                  # flushed: durable
    ledger.mark_trained([prompt_index])
    ledger.checkpoint(extra={"writer_position": writer.position, ...})

and on resume::

    ledger = ResumeLedger.open(ledger_path)
    writer = JsonlWriter.open(out, truncate_to=ledger.extra.get("writer_position", 0))
    ledger.reconcile(writer.prompt_indexes())  # raises if they disagree

A crash after the group was written but before the checkpoint leaves records
past the checkpointed position whose prompts the ledger still holds in
flight (pending again once loaded). Truncating to the position removes them;
the prompts are redone and written once. Keeping them and marking them
trained instead would be wrong under a trainer, which rolls back to its own
checkpoint and never trained on them, and unsafe in any case, since a crash
can cut a group in the middle (a SIGKILL can interrupt a large write) and a
JSONL file cannot say whether a group is complete. Without ``truncate_to``
the writer only cuts a torn last line.

This module must never write a NaN or infinite float (JSON would get
``null``, which crashes tensor creation in a trainer): every record is
checked just before it is encoded.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final, Protocol

import orjson

from agent_backend.errors import LedgerError
from agent_backend.lifecycle import SyncResource
from agent_backend.rollout.trajectory import Trajectory

__all__ = [
    "JsonlWriter",
    "ParquetWriter",
    "TrajectoryWriter",
    "open_writer",
    "read_trajectories",
]

#: Bytes read at a time when looking for the last newline of a file.
_TAIL_CHUNK: Final[int] = 64 * 1024


class TrajectoryWriter(Protocol):
    """What :class:`JsonlWriter` and :class:`ParquetWriter` both offer."""

    path: Path

    @property
    def position(self) -> int: ...
    def write(self, trajectory: Trajectory) -> None: ...
    def write_group(self, trajectories: Iterable[Trajectory], *, flush: bool = True) -> None: ...
    def flush(self) -> None: ...
    def prompt_indexes(self) -> set[int]: ...
    def close(self) -> None: ...


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _encode(trajectory: Trajectory) -> bytes:
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"writers take Trajectory records, got {type(trajectory).__name__}")
    trajectory.check_finite()
    return trajectory.model_dump_json().encode() + b"\n"


class JsonlWriter(SyncResource):
    """Append :class:`Trajectory` records to a JSON Lines file, one record per line."""

    def __init__(self, path: Path, fd: int, position: int) -> None:
        """Use :meth:`open`."""
        self.path = path
        self._fd: int | None = fd
        self._position = position
        self._buffer: list[bytes] = []
        self.records = 0
        """Records made durable by this writer (since open)."""

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, truncate_to: int | None = None) -> JsonlWriter:
        """Open ``path`` for appending, creating it (and its directory) when missing.

        An existing file loses a torn last line (one without its newline).
        With ``truncate_to`` (a :attr:`position` saved in a checkpoint) it is
        cut back to exactly that offset instead. Raises
        :class:`~agent_backend.errors.LedgerError` naming the file when it is
        shorter than ``truncate_to`` or the offset is not at a line boundary.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        created = not target.exists()
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if truncate_to is not None:
                keep = cls._checked_offset(target, fd, size, truncate_to)
            else:
                keep = cls._last_line_end(fd, size)
            if keep != size:
                os.ftruncate(fd, keep)
                os.fsync(fd)
            if created:
                _fsync_dir(target.parent)
        except BaseException:
            os.close(fd)
            raise
        return cls(target, fd, keep)

    @staticmethod
    def _checked_offset(target: Path, fd: int, size: int, offset: int) -> int:
        if offset < 0 or offset > size:
            raise LedgerError(
                f"{target} is {size} bytes but the checkpoint says {offset} were written: the "
                "output lost committed records (is it the file this ledger was written with?)",
                path=str(target),
            )
        if offset and os.pread(fd, 1, offset - 1) != b"\n":
            raise LedgerError(
                f"{target}: offset {offset} from the checkpoint is not at the end of a line",
                path=str(target),
            )
        return offset

    @staticmethod
    def _last_line_end(fd: int, size: int) -> int:
        """The offset just past the last newline (0 when there is none)."""
        end = size
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            chunk = os.pread(fd, end - start, start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                return start + newline + 1
            end = start
        return 0

    @property
    def position(self) -> int:
        """Bytes of the file made durable: save it in a checkpoint, pass it back as ``truncate_to``."""
        return self._position

    def is_closed(self) -> bool:
        return self._fd is None

    def write(self, trajectory: Trajectory) -> None:
        """Buffer one record (checked finite, encoded now); durable at the next :meth:`flush`."""
        if self._fd is None:
            raise ValueError(f"write() on a closed writer ({self.path})")
        self._buffer.append(_encode(trajectory))

    def write_group(self, trajectories: Iterable[Trajectory], *, flush: bool = True) -> None:
        """Buffer a group's records (all checked before any is buffered), then flush by default."""
        encoded = [_encode(t) for t in trajectories]
        if self._fd is None:
            raise ValueError(f"write_group() on a closed writer ({self.path})")
        self._buffer.extend(encoded)
        if flush:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records and fsync: after this, :attr:`position` covers them."""
        if self._fd is None:
            raise ValueError(f"flush() on a closed writer ({self.path})")
        if not self._buffer:
            return
        data = memoryview(b"".join(self._buffer))
        count = len(self._buffer)
        self._buffer.clear()
        offset = self._position
        while data:
            written = os.pwrite(self._fd, data, offset)
            offset += written
            data = data[written:]
        os.fsync(self._fd)
        self._position = offset
        self.records += count

    def prompt_indexes(self) -> set[int]:
        """The prompt indexes of the records durably in the file (for :meth:`ResumeLedger.reconcile`)."""
        return {record["prompt_index"] for record in _iter_jsonl(self.path, self._position)}

    def close(self) -> None:
        """Flush and close; idempotent. Buffered records are flushed, not lost."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __repr__(self) -> str:
        state = "closed" if self._fd is None else f"{len(self._buffer)} buffered"
        return f"<JsonlWriter path={str(self.path)!r} [position {self._position} | {state}]>"


def _iter_jsonl(path: Path, limit: int | None = None) -> Iterator[dict[str, Any]]:
    with path.open("rb") as file:
        read = 0
        for number, line in enumerate(file, 1):
            read += len(line)
            if limit is not None and read > limit:
                return
            if not line.endswith(b"\n"):
                return  # a torn last line: not a record
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise LedgerError(
                    f"{path}:{number}: not a JSON record ({exc})", path=str(path)
                ) from exc
            if not isinstance(record, dict):
                raise LedgerError(f"{path}:{number}: not a JSON object", path=str(path))
            yield record


# -- Parquet -------------------------------------------------------------------------------------


def _import_pyarrow() -> tuple[Any, Any]:
    try:
        pa = importlib.import_module("pyarrow")
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError as exc:
        raise ImportError(
            "ParquetWriter needs pyarrow: pip install 'agent-backend[parquet]'"
        ) from exc
    return pa, pq


def _arrow_schema(pa: Any) -> Any:
    text, i64, f64 = pa.string(), pa.int64(), pa.float64()
    return pa.schema(
        [
            ("rollout_id", text),
            ("group_id", text),
            ("sample_idx", i64),
            ("prompt_index", i64),
            ("segment_idx", i64),
            ("prompt_ids", pa.list_(i64)),
            ("completion_ids", pa.list_(i64)),
            ("completion_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(f64)),
            ("turn_spans", pa.list_(pa.list_(i64))),
            ("reward", f64),
            ("rewards", pa.map_(text, f64)),
            ("policy_version_start", i64),
            ("policy_version_end", i64),
            ("stop_reason", text),
            ("num_turns", i64),
            ("tool_calls", i64),
            ("tool_failures", i64),
            ("messages", text),  # JSON text: free-form OpenAI messages
            ("error", text),
            ("timing", pa.map_(text, f64)),
            ("extras", text),  # JSON text: free-form
        ]
    )


#: Columns kept as JSON text in Parquet (free-form nested values).
_JSON_COLUMNS: Final[frozenset[str]] = frozenset({"messages", "extras"})
_MAP_COLUMNS: Final[frozenset[str]] = frozenset({"rewards", "timing"})


def _row(trajectory: Trajectory) -> dict[str, Any]:
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"writers take Trajectory records, got {type(trajectory).__name__}")
    trajectory.check_finite()
    row = trajectory.model_dump()
    for name in _JSON_COLUMNS:
        row[name] = orjson.dumps(row[name]).decode()
    for name in _MAP_COLUMNS:
        row[name] = list(row[name].items())
    return row


def _from_row(row: dict[str, Any]) -> Trajectory:
    for name in _JSON_COLUMNS:
        row[name] = orjson.loads(row[name])
    for name in _MAP_COLUMNS:
        row[name] = dict(row[name])
    return Trajectory.model_validate(row)


class ParquetWriter(SyncResource):
    """Write :class:`Trajectory` records as a directory of Parquet part files (needs pyarrow).

    A Parquet file cannot be appended to and is unreadable until its footer
    is written, so each :meth:`flush` writes one new part
    (``part-000000.parquet``, ...) to a temp name, fsyncs it and renames it:
    a crash leaves whole parts only. :attr:`position` is the number of parts.
    """

    def __init__(self, path: Path, parts: int) -> None:
        """Use :meth:`open`."""
        self._pa, self._pq = _import_pyarrow()
        self._schema = _arrow_schema(self._pa)
        self.path = path
        self._parts = parts
        self._buffer: list[dict[str, Any]] = []
        self._closed = False
        self.records = 0
        """Records made durable by this writer (since open)."""

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, truncate_to: int | None = None) -> ParquetWriter:
        """Open (or create) the directory ``path``; ``truncate_to`` removes parts past that count.

        Raises ``ImportError`` naming the ``parquet`` extra when pyarrow is
        missing, and :class:`~agent_backend.errors.LedgerError` when the parts
        are not numbered 0..n-1 or fewer than ``truncate_to`` exist.
        """
        _import_pyarrow()
        target = Path(path)
        target.mkdir(parents=True, exist_ok=True)
        for leftover in target.glob(".part-*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()
        parts = sorted(target.glob("part-*.parquet"))
        expected = [target / _part_name(i) for i in range(len(parts))]
        if parts != expected:
            raise LedgerError(
                f"{target}: part files are not numbered part-000000 .. part-{len(parts) - 1:06d}",
                path=str(target),
            )
        if truncate_to is not None:
            if truncate_to < 0 or truncate_to > len(parts):
                raise LedgerError(
                    f"{target} has {len(parts)} parts but the checkpoint says {truncate_to} were "
                    "written: the output lost committed records",
                    path=str(target),
                )
            for extra in parts[truncate_to:]:
                extra.unlink()
            if len(parts) > truncate_to:
                _fsync_dir(target)
            count = truncate_to
        else:
            count = len(parts)
        return cls(target, count)

    @property
    def position(self) -> int:
        """Parts made durable: save it in a checkpoint, pass it back as ``truncate_to``."""
        return self._parts

    def is_closed(self) -> bool:
        return self._closed

    def write(self, trajectory: Trajectory) -> None:
        """Buffer one record (checked finite now); durable at the next :meth:`flush`."""
        if self._closed:
            raise ValueError(f"write() on a closed writer ({self.path})")
        self._buffer.append(_row(trajectory))

    def write_group(self, trajectories: Iterable[Trajectory], *, flush: bool = True) -> None:
        """Buffer a group's records (all checked before any is buffered), then flush by default."""
        rows = [_row(t) for t in trajectories]
        if self._closed:
            raise ValueError(f"write_group() on a closed writer ({self.path})")
        self._buffer.extend(rows)
        if flush:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records as one new part file, durably."""
        if self._closed:
            raise ValueError(f"flush() on a closed writer ({self.path})")
        if not self._buffer:
            return
        table = self._pa.Table.from_pylist(self._buffer, schema=self._schema)
        final = self.path / _part_name(self._parts)
        tmp = self.path / f".{final.name}.tmp"
        self._pq.write_table(table, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(self.path)
        self.records += len(self._buffer)
        self._buffer.clear()
        self._parts += 1

    def prompt_indexes(self) -> set[int]:
        """The prompt indexes of the records in the durable parts."""
        found: set[int] = set()
        for i in range(self._parts):
            table = self._pq.read_table(self.path / _part_name(i), columns=["prompt_index"])
            found.update(table.column("prompt_index").to_pylist())
        return found

    def close(self) -> None:
        """Flush and close; idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._buffer)} buffered"
        return f"<ParquetWriter path={str(self.path)!r} [parts {self._parts} | {state}]>"


def _part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def open_writer(
    path: str | os.PathLike[str], *, truncate_to: int | None = None
) -> JsonlWriter | ParquetWriter:
    """A :class:`ParquetWriter` for a path ending in ``.parquet``, else a :class:`JsonlWriter`."""
    if str(path).endswith(".parquet"):
        return ParquetWriter.open(path, truncate_to=truncate_to)
    return JsonlWriter.open(path, truncate_to=truncate_to)


def read_trajectories(path: str | os.PathLike[str]) -> Iterator[Trajectory]:
    """Every record of a JSONL file or a Parquet directory, validated (a torn last line is skipped)."""
    target = Path(path)
    if target.is_dir():
        _, pq = _import_pyarrow()
        for part in sorted(target.glob("part-*.parquet")):
            for row in pq.read_table(part).to_pylist():
                yield _from_row(row)
        return
    for record in _iter_jsonl(target):
        yield Trajectory.model_validate(record)
