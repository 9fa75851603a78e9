"""JsonlWriter and ParquetWriter: durable appends, torn lines, truncation on resume, no NaN."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from agent_backend.errors import LedgerError, NonFiniteLogprobs
from agent_backend.rollout.ledger import ResumeLedger
from agent_backend.rollout.trajectory import Trajectory
from agent_backend.rollout.writers import (
    JsonlWriter,
    ParquetWriter,
    open_writer,
    read_trajectories,
)

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
needs_pyarrow = pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")


def traj(prompt_index: int, sample: int = 0, **overrides: Any) -> Trajectory:
    fields: dict[str, Any] = {
        "rollout_id": f"r{prompt_index}-{sample}",
        "group_id": f"g{prompt_index}",
        "sample_idx": sample,
        "prompt_index": prompt_index,
        "prompt_ids": [1, 2],
        "completion_ids": [3, 4, 5],
        "completion_mask": [1, 0, 1],
        "logprobs": [-0.5, 0.0, -0.25],
        "reward": float(sample),
        "rewards": {"tests": 1.0},
        "policy_version_start": 1,
        "policy_version_end": 2,
        "stop_reason": "stop",
        "num_turns": 2,
        "tool_calls": 1,
        "tool_failures": 1,
        "messages": [{"role": "user", "content": "ünïcode \n and newlines"}],
        "error": None,
        "timing": {"total": 1.5},
        "extras": {"nested": {"a": [1, 2.5, None]}},
    }
    fields.update(overrides)
    return Trajectory(**fields)


def group(prompt_index: int, n: int = 3) -> list[Trajectory]:
    return [traj(prompt_index, s) for s in range(n)]


# -- JSONL --------------------------------------------------------------------------------------


def test_jsonl_round_trip_one_record_per_line(tmp_path: Path) -> None:
    path = tmp_path / "out" / "rollouts.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
        writer.write(traj(1))
        assert writer.position == path.stat().st_size  # the single record is still buffered
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    assert len(lines) == 5
    assert all(b"NaN" not in line for line in lines)
    assert list(read_trajectories(path)) == [*group(0), traj(1)]
    assert json.loads(lines[0])["prompt_index"] == 0


def test_position_moves_only_on_flush(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    writer = JsonlWriter.open(path)
    writer.write_group(group(0), flush=False)
    assert writer.position == 0
    assert path.stat().st_size == 0
    writer.flush()
    assert writer.position == path.stat().st_size > 0
    assert writer.records == 3
    writer.close()
    writer.close()  # idempotent
    assert writer.is_closed()
    with pytest.raises(ValueError, match="closed"):
        writer.write(traj(1))


def test_reopen_appends(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
    with JsonlWriter.open(path) as writer:
        assert writer.position == path.stat().st_size
        writer.write_group(group(1))
        assert writer.prompt_indexes() == {0, 1}
    assert [t.prompt_index for t in read_trajectories(path)] == [0, 0, 0, 1, 1, 1]


def test_a_torn_last_line_is_cut_on_open(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(traj(1).model_dump_json().encode()[:40])  # a crash mid-line
    assert [t.prompt_index for t in read_trajectories(path)] == [0, 0, 0]  # readers skip it too
    with JsonlWriter.open(path) as writer:
        assert writer.position == whole == path.stat().st_size
        writer.write_group(group(2))
    assert [t.prompt_index for t in read_trajectories(path)] == [0, 0, 0, 2, 2, 2]


def test_a_file_of_one_torn_line_becomes_empty(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"rollout_id": "x"' * 10_000)  # longer than one tail chunk, no newline
    with JsonlWriter.open(path) as writer:
        assert writer.position == 0
    assert path.read_bytes() == b""


def test_truncate_to_cuts_records_written_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
        saved = writer.position
        writer.write_group(group(1))
    with JsonlWriter.open(path, truncate_to=saved) as writer:
        assert writer.prompt_indexes() == {0}
    assert path.stat().st_size == saved


def test_truncate_to_beyond_the_file_or_mid_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
    size = path.stat().st_size
    with pytest.raises(LedgerError, match="lost committed records") as info:
        JsonlWriter.open(path, truncate_to=size + 10)
    assert info.value.path == str(path)
    with pytest.raises(LedgerError, match="not at the end of a line"):
        JsonlWriter.open(path, truncate_to=size - 5)
    assert path.stat().st_size == size  # nothing was cut


def test_nan_never_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    bad = traj(1)
    bad.logprobs[2] = float("nan")  # mutated after validation
    with JsonlWriter.open(path) as writer:
        with pytest.raises(NonFiniteLogprobs):
            writer.write_group([traj(1, 0), bad])  # the whole group is refused
        worse = traj(2)
        worse.timing["total"] = float("inf")
        with pytest.raises(ValueError, match="timing/total"):
            writer.write(worse)
        writer.flush()
    assert path.read_bytes() == b""


def test_only_trajectories_are_written(tmp_path: Path) -> None:
    with JsonlWriter.open(tmp_path / "r.jsonl") as writer, pytest.raises(TypeError):
        writer.write({"prompt_index": 1})  # type: ignore[arg-type]


def test_a_corrupt_line_is_reported_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    with JsonlWriter.open(path) as writer:
        writer.write_group(group(0))
    with path.open("ab") as file:
        file.write(b"{broken\n")
    with pytest.raises(LedgerError, match=r"r\.jsonl:4"):
        JsonlWriter.open(path).prompt_indexes()


def test_crash_between_write_and_checkpoint_is_redone_once(tmp_path: Path) -> None:
    """The documented reconciliation: truncate to the checkpointed position, then reconcile."""
    out, ledger_path = tmp_path / "r.jsonl", tmp_path / "ledger.json"
    ledger = ResumeLedger.open(ledger_path, num_prompts=3)
    writer = JsonlWriter.open(out, truncate_to=0)
    for i in ledger.claim(2):
        writer.write_group(group(i))
        ledger.mark_trained([i])
    ledger.checkpoint({"writer_position": writer.position})
    (late,) = ledger.claim(1)
    writer.write_group(group(late))  # durable, but the process dies before mark + checkpoint
    writer.close()

    ledger = ResumeLedger.open(ledger_path, num_prompts=3)
    assert ledger.state(late) == "pending"
    naive = JsonlWriter.open(out)
    with pytest.raises(LedgerError, match="written twice"):
        ledger.reconcile(naive.prompt_indexes())
    naive.close()
    writer = JsonlWriter.open(out, truncate_to=ledger.extra["writer_position"])
    ledger.reconcile(writer.prompt_indexes())
    assert ledger.claim(5) == [late]
    writer.write_group(group(late))
    ledger.mark_trained([late])
    ledger.checkpoint({"writer_position": writer.position})
    writer.close()
    counts: dict[int, int] = {}
    for t in read_trajectories(out):
        counts[t.prompt_index] = counts.get(t.prompt_index, 0) + 1
    assert counts == {0: 3, 1: 3, 2: 3}


def test_open_writer_picks_the_format(tmp_path: Path) -> None:
    with open_writer(tmp_path / "a.jsonl") as writer:
        assert isinstance(writer, JsonlWriter)
    if HAS_PYARROW:
        with open_writer(tmp_path / "a.parquet") as writer:
            assert isinstance(writer, ParquetWriter)


def test_repr(tmp_path: Path) -> None:
    writer = JsonlWriter.open(tmp_path / "r.jsonl")
    writer.write(traj(0))
    assert repr(writer).endswith("[position 0 | 1 buffered]>")
    writer.close()
    assert repr(writer).endswith("| closed]>")


# -- Parquet ------------------------------------------------------------------------------------


@needs_pyarrow
def test_parquet_round_trip_in_parts(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.parquet"
    with ParquetWriter.open(path) as writer:
        writer.write_group(group(0))
        writer.write_group(group(1), flush=False)
        assert writer.position == 1
    assert sorted(p.name for p in path.iterdir()) == ["part-000000.parquet", "part-000001.parquet"]
    assert list(read_trajectories(path)) == [*group(0), *group(1)]
    with ParquetWriter.open(path) as writer:
        assert writer.position == 2
        assert writer.prompt_indexes() == {0, 1}


@needs_pyarrow
def test_parquet_columns_are_typed(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "r.parquet"
    with ParquetWriter.open(path) as writer:
        writer.write_group(group(0))
    table = pq.read_table(path / "part-000000.parquet")
    assert table.schema.field("logprobs").type.value_type == pa.float64()
    assert table.schema.field("completion_mask").type.value_type == pa.int8()
    assert table.schema.field("rewards").type == pa.map_(pa.string(), pa.float64())
    assert table.column("prompt_index").to_pylist() == [0, 0, 0]


@needs_pyarrow
def test_parquet_truncate_and_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "r.parquet"
    with ParquetWriter.open(path) as writer:
        writer.write_group(group(0))
        saved = writer.position
        writer.write_group(group(1))
    (path / ".part-000002.parquet.tmp").write_bytes(b"half a part")
    with ParquetWriter.open(path, truncate_to=saved) as writer:
        assert writer.prompt_indexes() == {0}
    assert sorted(p.name for p in path.iterdir()) == ["part-000000.parquet"]
    with pytest.raises(LedgerError, match="lost committed records"):
        ParquetWriter.open(path, truncate_to=3)


@needs_pyarrow
def test_parquet_refuses_gaps_and_nan(tmp_path: Path) -> None:
    path = tmp_path / "r.parquet"
    with ParquetWriter.open(path) as writer:
        writer.write_group(group(0))
        bad = traj(1)
        bad.logprobs[0] = float("-inf")
        with pytest.raises(NonFiniteLogprobs):
            writer.write(bad)
    (path / "part-000000.parquet").rename(path / "part-000005.parquet")
    with pytest.raises(LedgerError, match="not numbered"):
        ParquetWriter.open(path)


def test_parquet_without_pyarrow_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        if name.startswith("pyarrow"):
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"agent-backend\[parquet\]"):
        ParquetWriter.open(tmp_path / "r.parquet")
    assert not (tmp_path / "r.parquet").exists()
