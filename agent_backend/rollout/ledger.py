"""Which prompts are done, and where to resume: :class:`ResumeLedger`.

Every prompt index is in one of four states::

    pending --claim()--> in_flight --mark_trained()--> trained
       ^                     |
       +-----release()-------+----mark_dropped()----> dropped

The resume **cursor** is the first prompt that is neither trained nor
dropped. Two peer failures shaped that rule:

* a cursor saved at "the next prompt to hand out" runs ahead of training, so
  the prompts in flight at a crash were never trained and never redone (one
  run skipped 736 prompts, 30% of what it reached). Here in-flight prompts
  are not done: after a crash they are pending again and are redone;
* a stale group dropped by async GRPO that never counts as done pins a cursor
  of "first not trained" forever, so every later prompt was trained again
  after a resume. Here dropped prompts are done (never redone) but are never
  counted as trained: :attr:`ResumeLedger.trained_count` counts trained
  prompts only.

:meth:`ResumeLedger.checkpoint` writes the whole ledger atomically (a temp file
in the same directory, fsync, rename, fsync of the directory) together with
``extra``, the caller's own state (the trainer's step, the output writer's
position), so that the ledger and what it describes can never disagree after
a crash: both come back from the same file. Marking prompts trained without a
checkpoint changes memory only; a crash before the next checkpoint rolls back
to the previous one, as a trainer rolls back to its last saved weights.

Memory stays small for millions of prompts: the ledger keeps the cursor, the
trained and in-flight indexes past it, and the dropped indexes (a minority)
in compact arrays. It is not thread-safe: use it from one thread (the event
loop); :meth:`ResumeLedger.acheckpoint` snapshots there and does its file I/O
in a worker thread.

This module must never let a prompt be both trained and dropped, nor count
one twice.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import heapq
import os
import threading
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import anyio.to_thread
import orjson

from agent_backend.errors import LedgerError
from agent_backend.rollout.trajectory import non_finite_paths

__all__ = ["LEDGER_FORMAT", "LedgerStats", "PromptState", "ResumeLedger"]

PromptState = Literal["pending", "in_flight", "trained", "dropped"]

#: The ``format`` key of a ledger file, and the version this module writes.
LEDGER_FORMAT: Final[str] = "agent-backend-resume-ledger"
_VERSION: Final[int] = 1
_SHOWN = 10


@dataclasses.dataclass(frozen=True, slots=True)
class LedgerStats:
    """A snapshot of a ledger's counts."""

    cursor: int
    trained: int
    dropped: int
    in_flight: int
    num_prompts: int | None


def _ranges(indexes: Iterable[int]) -> list[list[int]]:
    """Sorted indexes as ``[[first, last], ...]`` runs (inclusive): compact on disk."""
    out: list[list[int]] = []
    for i in sorted(indexes):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def _expand(runs: Any, where: str) -> Iterator[int]:
    if not isinstance(runs, list):
        raise ValueError(f"{where} is not a list of [first, last] runs")
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
            or run[0] > run[1]
            or run[0] < 0
        ):
            raise ValueError(f"{where} holds a bad run {run!r}")
        yield from range(run[0], run[1] + 1)


def _clip_list(indexes: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indexes[:_SHOWN])
    more = f", ... and {len(indexes) - _SHOWN} more" if len(indexes) > _SHOWN else ""
    return f"[{shown}{more}]"


class ResumeLedger:
    """The state of every prompt of a run, and a crash-safe checkpoint of it (module docstring)."""

    def __init__(self, path: Path, *, num_prompts: int | None = None) -> None:
        """An empty ledger for ``path``; use :meth:`open`, which also loads an existing file."""
        if num_prompts is not None and num_prompts < 0:
            raise LedgerError(f"num_prompts must be >= 0, got {num_prompts}", path=str(path))
        self.path = path
        self._num_prompts = num_prompts
        self._cursor = 0
        self._trained_count = 0
        self._trained: set[int] = set()  # trained indexes >= cursor
        self._in_flight: set[int] = set()
        self._high_dropped: dict[int, int] = {}  # dropped indexes >= cursor -> reason id
        self._low_dropped = array("q")  # dropped indexes < cursor, ascending
        self._low_reason = array("I")  # their reason ids
        self._reasons: list[str] = []
        self._reason_ids: dict[str, int] = {}
        self._frontier = 0  # every index >= frontier is unclaimed since open
        self._released: list[int] = []  # heap of pending indexes below the frontier
        self._extra: dict[str, Any] = {}
        self._redone: tuple[int, ...] = ()
        self._write_lock = threading.Lock()
        self._snapshot_seq = 0
        self._written_seq = 0

    # -- opening -------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, num_prompts: int | None = None) -> ResumeLedger:
        """Load the ledger at ``path``, or create it (and write it at once, to fail fast).

        In-flight prompts of a loaded ledger go back to pending: they were not
        trained before the crash, so they are redone (:attr:`redone` lists
        them). ``num_prompts`` bounds :meth:`claim`; it must agree with the
        file's when both are known. Raises :class:`~agent_backend.errors.LedgerError`
        naming the path when the file is unreadable, torn or inconsistent.
        """
        target = Path(path)
        cls._remove_stale_temps(target)
        try:
            raw = target.read_bytes()
        except FileNotFoundError:
            ledger = cls(target, num_prompts=num_prompts)
            ledger.checkpoint()
            return ledger
        except OSError as exc:
            raise LedgerError(
                f"cannot read the resume ledger {target}: {exc}", path=str(target)
            ) from exc
        ledger = cls._load(target, raw)
        if num_prompts is not None:
            if ledger._num_prompts is not None and ledger._num_prompts != num_prompts:
                raise LedgerError(
                    f"the resume ledger {target} was written for {ledger._num_prompts} prompts, "
                    f"not {num_prompts}: is it the ledger of another prompt set?",
                    path=str(target),
                )
            if ledger._cursor > num_prompts or any(
                i >= num_prompts for i in (*ledger._trained, *ledger._high_dropped)
            ):
                raise LedgerError(
                    f"the resume ledger {target} records prompts beyond {num_prompts}",
                    path=str(target),
                )
            ledger._num_prompts = num_prompts
        return ledger

    @staticmethod
    def _remove_stale_temps(target: Path) -> None:
        """Temp files of a checkpoint cut by a crash: never the ledger, always safe to remove."""
        directory = target.parent if str(target.parent) else Path(".")
        try:
            names = os.listdir(directory)
        except OSError:
            return
        prefix = f".{target.name}."
        for name in names:
            if name.startswith(prefix) and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(directory / name)

    @classmethod
    def _load(cls, target: Path, raw: bytes) -> ResumeLedger:
        def bad(why: str) -> LedgerError:
            return LedgerError(
                f"the resume ledger {target} is unreadable ({why}); it was not written by "
                "ResumeLedger.checkpoint() or was damaged after",
                path=str(target),
            )

        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad(f"not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != LEDGER_FORMAT:
            raise bad("not a ledger file")
        if doc.get("version") != _VERSION:
            raise bad(f"version {doc.get('version')!r}, this code reads {_VERSION}")
        body = doc.get("ledger")
        if not isinstance(body, dict) or doc.get("sha256") != _digest(body):
            raise bad("its checksum does not match its content")
        try:
            num_prompts = body["num_prompts"]
            if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 0):
                raise ValueError("num_prompts is not a count")
            ledger = cls(target, num_prompts=num_prompts)
            cursor = body["cursor"]
            trained_count = body["trained_count"]
            if not isinstance(cursor, int) or cursor < 0:
                raise ValueError("cursor is not an index")
            if not isinstance(trained_count, int) or trained_count < 0:
                raise ValueError("trained_count is not a count")
            ledger._cursor = cursor
            ledger._frontier = cursor
            ledger._trained_count = trained_count
            ledger._trained = set(_expand(body["trained"], "trained"))
            dropped = body["dropped"]
            if not isinstance(dropped, dict):
                raise ValueError("dropped is not an object")
            low: list[tuple[int, int]] = []
            for reason, runs in dropped.items():
                rid = ledger._reason_id(reason)
                for i in _expand(runs, f"dropped[{reason!r}]"):
                    if i in ledger._trained or i in ledger._high_dropped:
                        raise ValueError(f"prompt {i} is recorded twice")
                    if i < cursor:
                        low.append((i, rid))
                    else:
                        ledger._high_dropped[i] = rid
            low.sort()
            for i, rid in low:
                ledger._low_dropped.append(i)
                ledger._low_reason.append(rid)
            if len(ledger._low_dropped) != len(set(ledger._low_dropped)):
                raise ValueError("a dropped prompt is recorded twice")
            if any(i < cursor for i in ledger._trained):
                raise ValueError("a trained prompt past the cursor is below it")
            if trained_count != cursor - len(ledger._low_dropped) + len(ledger._trained):
                raise ValueError("trained_count disagrees with the cursor and the recorded prompts")
            redone = sorted(_expand(body["in_flight"], "in_flight"))
            extra = body.get("extra", {})
            if not isinstance(extra, dict):
                raise ValueError("extra is not an object")
            ledger._extra = extra
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(str(exc) if not isinstance(exc, KeyError) else f"missing {exc}") from exc
        ledger._advance()
        ledger._redone = tuple(i for i in redone if ledger.state(i) == "pending")
        return ledger

    def _reason_id(self, reason: str) -> int:
        if not isinstance(reason, str):
            raise TypeError(f"a drop reason must be a string, got {type(reason).__name__}")
        rid = self._reason_ids.get(reason)
        if rid is None:
            rid = self._reason_ids[reason] = len(self._reasons)
            self._reasons.append(reason)
        return rid

    # -- reading -------------------------------------------------------------------------------------

    @property
    def cursor(self) -> int:
        """The first prompt index that is neither trained nor dropped: where a resumed run starts."""
        return self._cursor

    @property
    def num_prompts(self) -> int | None:
        """How many prompts the run has, when known."""
        return self._num_prompts

    @property
    def trained_count(self) -> int:
        """Prompts trained: the count of training examples (dropped ones never count)."""
        return self._trained_count

    @property
    def dropped_count(self) -> int:
        """Prompts dropped (stale groups, failures): done, never trained, never redone."""
        return len(self._low_dropped) + len(self._high_dropped)

    @property
    def in_flight_count(self) -> int:
        """Prompts claimed and not yet trained, dropped or released."""
        return len(self._in_flight)

    @property
    def extra(self) -> dict[str, Any]:
        """The ``extra`` of the last checkpoint written or loaded (a copy)."""
        return dict(self._extra)

    @property
    def redone(self) -> tuple[int, ...]:
        """Prompts that were in flight at the loaded checkpoint, now pending again (to be redone)."""
        return self._redone

    def in_flight(self) -> list[int]:
        """The in-flight prompt indexes, ascending."""
        return sorted(self._in_flight)

    def is_finished(self) -> bool:
        """True when the number of prompts is known and every one is trained or dropped."""
        return self._num_prompts is not None and self._cursor >= self._num_prompts

    def state(self, prompt_index: int) -> PromptState:
        """The state of one prompt."""
        self._check_index(prompt_index)
        if prompt_index < self._cursor:
            pos = bisect.bisect_left(self._low_dropped, prompt_index)
            found = pos < len(self._low_dropped) and self._low_dropped[pos] == prompt_index
            return "dropped" if found else "trained"
        if prompt_index in self._in_flight:
            return "in_flight"
        if prompt_index in self._trained:
            return "trained"
        if prompt_index in self._high_dropped:
            return "dropped"
        return "pending"

    def drop_reason(self, prompt_index: int) -> str | None:
        """Why a dropped prompt was dropped (None when it is not dropped)."""
        if self.state(prompt_index) != "dropped":
            return None
        if prompt_index >= self._cursor:
            return self._reasons[self._high_dropped[prompt_index]]
        pos = bisect.bisect_left(self._low_dropped, prompt_index)
        return self._reasons[self._low_reason[pos]]

    def drop_reasons(self) -> dict[str, int]:
        """How many prompts were dropped for each reason."""
        counts = dict.fromkeys(self._reasons, 0)
        for rid in (*self._low_reason, *self._high_dropped.values()):
            counts[self._reasons[rid]] += 1
        return {reason: n for reason, n in counts.items() if n}

    def statistics(self) -> LedgerStats:
        """The counts, as a frozen snapshot."""
        return LedgerStats(
            cursor=self._cursor,
            trained=self._trained_count,
            dropped=self.dropped_count,
            in_flight=len(self._in_flight),
            num_prompts=self._num_prompts,
        )

    def __repr__(self) -> str:
        total = "?" if self._num_prompts is None else str(self._num_prompts)
        return (
            f"<ResumeLedger path={str(self.path)!r} [cursor {self._cursor}/{total} | "
            f"trained {self._trained_count}, dropped {self.dropped_count}, "
            f"in flight {len(self._in_flight)}]>"
        )

    # -- changing state ------------------------------------------------------------------------------

    def _check_index(self, prompt_index: int) -> None:
        if not isinstance(prompt_index, int) or isinstance(prompt_index, bool) or prompt_index < 0:
            raise LedgerError(
                f"a prompt index must be an int >= 0, got {prompt_index!r}", path=str(self.path)
            )
        if self._num_prompts is not None and prompt_index >= self._num_prompts:
            raise LedgerError(
                f"prompt {prompt_index} is out of range: the run has {self._num_prompts} prompts",
                path=str(self.path),
            )

    def _is_pending(self, i: int) -> bool:
        return not (
            i < self._cursor
            or i in self._in_flight
            or i in self._trained
            or i in self._high_dropped
        )

    def claim(self, count: int) -> list[int]:
        """Mark the next ``count`` pending prompts in flight and return them, ascending.

        Starts from the cursor: released and redone prompts come first, then
        ones never handed out. Returns fewer (or none) when the prompt set is
        exhausted.
        """
        if count < 0:
            raise LedgerError(f"claim() of a negative count ({count})", path=str(self.path))
        out: list[int] = []
        while len(out) < count:
            while self._released and not self._is_pending(self._released[0]):
                heapq.heappop(self._released)
            if self._released:
                index = heapq.heappop(self._released)
            else:
                while not self._is_pending(self._frontier):
                    self._frontier += 1
                if self._num_prompts is not None and self._frontier >= self._num_prompts:
                    break
                index = self._frontier
                self._frontier += 1
            self._in_flight.add(index)
            out.append(index)
        return out

    def _misuse(self, verb: str, indexes: Sequence[int]) -> LedgerError:
        described = []
        for i in indexes[:_SHOWN]:
            state = self.state(i)
            why = {
                "pending": "was never claimed (or was released)",
                "trained": "is already trained",
                "dropped": "was dropped, and a dropped prompt is never trained",
                "in_flight": "is in flight",
            }[state]
            described.append(f"{i} {why}")
        more = f"; ... and {len(indexes) - _SHOWN} more" if len(indexes) > _SHOWN else ""
        return LedgerError(
            f"cannot {verb} prompts out of order: {'; '.join(described)}{more}", path=str(self.path)
        )

    def mark_trained(self, prompt_indexes: Iterable[int]) -> None:
        """Record in-flight prompts as trained (all or none: a misuse changes nothing).

        Raises :class:`~agent_backend.errors.LedgerError` for a prompt that is
        not in flight (never claimed, trained already, dropped) or repeated.
        """
        batch = list(prompt_indexes)
        for i in batch:
            self._check_index(i)
        if len(set(batch)) != len(batch):
            repeated = sorted({i for i in batch if batch.count(i) > 1})
            raise LedgerError(
                f"cannot mark prompts trained twice in one call: {_clip_list(repeated)}",
                path=str(self.path),
            )
        wrong = [i for i in batch if i not in self._in_flight]
        if wrong:
            raise self._misuse("mark trained", wrong)
        for i in batch:
            self._in_flight.discard(i)
            self._trained.add(i)
        self._trained_count += len(batch)
        self._advance()

    def mark_dropped(self, prompt_index: int, reason: str) -> None:
        """Record an in-flight prompt as dropped: done, never trained, never redone.

        Raises :class:`~agent_backend.errors.LedgerError` when it is not in
        flight (dropping a trained prompt would un-count a training example).
        """
        self._check_index(prompt_index)
        if prompt_index not in self._in_flight:
            if self.state(prompt_index) == "dropped":
                raise LedgerError(f"prompt {prompt_index} is already dropped", path=str(self.path))
            raise self._misuse("mark dropped", [prompt_index])
        self._in_flight.discard(prompt_index)
        self._high_dropped[prompt_index] = self._reason_id(str(reason))
        self._advance()

    def release(self, prompt_index: int) -> None:
        """Put an in-flight prompt back to pending (its rollout was abandoned, not dropped)."""
        self._check_index(prompt_index)
        if prompt_index not in self._in_flight:
            raise self._misuse("release", [prompt_index])
        self._in_flight.discard(prompt_index)
        heapq.heappush(self._released, prompt_index)

    def reconcile(
        self, prompt_indexes_in_output: Iterable[int], *, allow_dropped: bool = False
    ) -> None:
        """Check an output file against the ledger after a resume; raise when they disagree.

        The safe order is: write a group, flush it, mark its prompt trained,
        checkpoint with ``extra`` holding the writer's ``position``; on resume
        open the writer with ``truncate_to=ledger.extra[...]`` (records
        written after the last checkpoint are cut, and their prompts, pending
        again, are redone). After that, the output holds exactly the trained
        prompts. This checks it: a prompt in the output that the ledger does
        not hold trained would be written twice, and a trained prompt missing
        from the output was lost. ``allow_dropped=True`` accepts dropped
        prompts in the output too (an output that also records dropped
        groups). Raises :class:`~agent_backend.errors.LedgerError`.
        """
        present = set(prompt_indexes_in_output)
        accepted = ("trained", "dropped") if allow_dropped else ("trained",)
        unexpected = sorted(i for i in present if self.state(i) not in accepted)
        if unexpected:
            raise LedgerError(
                f"the output holds prompts the ledger does not record as "
                f"{' or '.join(accepted)} {_clip_list(unexpected)}: they would be written "
                "twice. Open the writer with truncate_to= the position saved in the "
                "checkpoint's extra",
                path=str(self.path),
            )
        trained = sum(1 for i in present if self.state(i) == "trained")
        if trained != self._trained_count:
            raise LedgerError(
                f"the output holds {trained} trained prompts but the ledger records "
                f"{self._trained_count}: trained prompts are missing from the output "
                "(another file, or one cut below the checkpoint's position?)",
                path=str(self.path),
            )

    def _advance(self) -> None:
        cursor = self._cursor
        while True:
            if cursor in self._trained:
                self._trained.discard(cursor)
            elif cursor in self._high_dropped:
                self._low_dropped.append(cursor)
                self._low_reason.append(self._high_dropped.pop(cursor))
            else:
                break
            cursor += 1
        self._cursor = cursor
        if self._frontier < cursor:
            self._frontier = cursor

    # -- checkpoints ---------------------------------------------------------------------------------

    def _snapshot(self, extra: Mapping[str, Any] | None) -> tuple[int, bytes, dict[str, Any]]:
        source = self._extra if extra is None else extra
        paths = non_finite_paths(source, "extra")
        if paths:
            raise LedgerError(
                f"checkpoint extra holds NaN or infinite floats at {', '.join(paths[:_SHOWN])}",
                path=str(self.path),
            )
        dropped: dict[str, list[int]] = {}
        for i, rid in zip(self._low_dropped, self._low_reason, strict=True):
            dropped.setdefault(self._reasons[rid], []).append(i)
        for i, rid in self._high_dropped.items():
            dropped.setdefault(self._reasons[rid], []).append(i)
        try:
            # A deep, JSON-normalised copy: what a reload would give, unaffected by later
            # changes to the caller's objects.
            saved = orjson.loads(orjson.dumps(dict(source)))
        except TypeError as exc:
            raise LedgerError(
                f"checkpoint extra is not JSON-serialisable: {exc}", path=str(self.path)
            ) from exc
        body = {
            "num_prompts": self._num_prompts,
            "cursor": self._cursor,
            "trained_count": self._trained_count,
            "trained": _ranges(self._trained),
            "dropped": {reason: _ranges(ids) for reason, ids in sorted(dropped.items())},
            "in_flight": _ranges(self._in_flight),
            "extra": saved,
        }
        digest = _digest(body)
        doc = {"format": LEDGER_FORMAT, "version": _VERSION, "sha256": digest, "ledger": body}
        self._snapshot_seq += 1
        return self._snapshot_seq, orjson.dumps(doc), saved

    def _write(self, seq: int, data: bytes) -> bool:
        """Write a snapshot atomically unless a newer one already was; True when written."""
        with self._write_lock:
            if seq <= self._written_seq:
                return False
            _atomic_write(self.path, data)
            self._written_seq = seq
            return True

    def checkpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """Write the ledger, with ``extra``, atomically to :attr:`path` (blocking).

        ``extra`` (JSON values, floats finite) is saved in the same file and
        read back by :attr:`extra`; None keeps the previous one. Raises
        :class:`~agent_backend.errors.LedgerError` for an ``extra`` that cannot
        be saved or a file that cannot be written.
        """
        seq, data, saved = self._snapshot(extra)
        self._write(seq, data)
        self._extra = saved

    async def acheckpoint(self, extra: Mapping[str, Any] | None = None) -> None:
        """:meth:`checkpoint` for async code: snapshot now, file I/O in a worker thread.

        Concurrent calls are safe: an older snapshot never replaces a newer one.
        """
        seq, data, saved = self._snapshot(extra)
        self._extra = saved
        await anyio.to_thread.run_sync(self._write, seq, data)


def _digest(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync dir."""
    directory = path.parent if str(path.parent) else Path(".")
    tmp = directory / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise LedgerError(f"cannot write the resume ledger {path}: {exc}", path=str(path)) from exc
