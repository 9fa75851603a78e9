"""ResumeLedger: states, the resume cursor (never ahead of training, never pinned by a dropped
prompt), atomic checkpoints, and SIGKILL.

The crash tests run tests/support/ledger_crash_worker.py's synthetic rollout + train
loop in child processes, SIGKILL them at seeded random points, resume, and
check that no prompt was skipped or trained twice.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import orjson
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.ledger_crash_worker import crash_resume

from agent_backend.errors import LedgerError
from agent_backend.rollout.ledger import LedgerStats, ResumeLedger

# -- states and the cursor ----------------------------------------------------------------------------


def test_a_new_ledger_is_written_at_once(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "ledger.json", num_prompts=5)
    assert (tmp_path / "ledger.json").exists()
    assert ledger.statistics() == LedgerStats(
        cursor=0, trained=0, dropped=0, in_flight=0, num_prompts=5
    )
    assert [ledger.state(i) for i in range(5)] == ["pending"] * 5


def test_claim_hands_out_prompts_in_order_and_never_past_the_end(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    assert ledger.claim(2) == [0, 1]
    assert ledger.claim(2) == [2, 3]
    assert ledger.claim(10) == [4]
    assert ledger.claim(1) == []
    assert ledger.in_flight_count == 5
    assert ledger.in_flight() == [0, 1, 2, 3, 4]


def test_claim_skips_done_and_in_flight_and_reuses_released(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=8)
    ledger.claim(5)
    ledger.mark_trained([3])
    ledger.mark_dropped(1, "stale")
    ledger.release(2)
    ledger.release(0)
    assert ledger.state(2) == "pending"
    assert ledger.claim(4) == [0, 2, 5, 6]


def test_unbounded_ledger_keeps_claiming(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json")
    assert ledger.claim(3) == [0, 1, 2]
    assert ledger.num_prompts is None
    assert not ledger.is_finished()


def test_cursor_is_the_first_prompt_neither_trained_nor_dropped(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=6)
    ledger.claim(6)
    ledger.mark_trained([1, 2])
    assert ledger.cursor == 0
    ledger.mark_trained([0])
    assert ledger.cursor == 3
    ledger.mark_trained([5])
    ledger.mark_dropped(3, "stale")
    assert ledger.cursor == 4
    ledger.mark_trained([4])
    assert ledger.cursor == 6
    assert ledger.is_finished()
    assert (ledger.trained_count, ledger.dropped_count) == (5, 1)


def test_a_dropped_stale_group_never_pins_the_cursor(tmp_path: Path) -> None:
    """A dropped prompt must count as done (else the cursor sticks at it), but never as trained."""
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=10)
    ledger.claim(10)
    ledger.mark_dropped(0, "stale: policy version 1 < 4 - 2")
    ledger.mark_trained(range(1, 10))
    ledger.checkpoint()
    resumed = ResumeLedger.open(path, num_prompts=10)
    assert resumed.cursor == 10
    assert resumed.is_finished()
    assert resumed.claim(5) == []  # nothing is trained again
    assert resumed.trained_count == 9  # the training-example count excludes the dropped one
    assert resumed.state(0) == "dropped"
    assert resumed.drop_reason(0) == "stale: policy version 1 < 4 - 2"
    assert resumed.drop_reasons() == {"stale: policy version 1 < 4 - 2": 1}


def test_in_flight_prompts_are_redone_after_a_crash(tmp_path: Path) -> None:
    """A cursor saved ahead of training would skip the prompts in flight at the crash."""
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=20)
    ledger.claim(10)
    ledger.mark_trained([0, 1, 2, 3, 4, 7])
    ledger.checkpoint()
    ledger.mark_trained([5])  # not checkpointed: lost with the crash, like the trainer's step
    resumed = ResumeLedger.open(path, num_prompts=20)
    assert resumed.cursor == 5
    assert resumed.redone == (5, 6, 8, 9)
    assert resumed.state(7) == "trained"
    assert resumed.claim(6) == [5, 6, 8, 9, 10, 11]
    assert resumed.trained_count == 6


# -- misuse ---------------------------------------------------------------------------------------


def test_training_a_prompt_never_claimed_is_refused(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    with pytest.raises(LedgerError, match="2 was never claimed") as info:
        ledger.mark_trained([2])
    assert info.value.path == str(tmp_path / "l.json")


def test_training_twice_is_refused(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    ledger.claim(3)
    ledger.mark_trained([1])
    with pytest.raises(LedgerError, match="1 is already trained"):
        ledger.mark_trained([1])
    ledger.mark_trained([0])  # below the cursor now
    with pytest.raises(LedgerError, match="0 is already trained"):
        ledger.mark_trained([0])
    with pytest.raises(LedgerError, match="twice in one call"):
        ledger.mark_trained([2, 2])
    assert ledger.trained_count == 2


def test_mark_trained_is_all_or_nothing(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    ledger.claim(2)
    with pytest.raises(LedgerError, match="3 was never claimed"):
        ledger.mark_trained([0, 1, 3])
    assert [ledger.state(i) for i in range(3)] == ["in_flight", "in_flight", "pending"]
    assert ledger.trained_count == 0


def test_dropping_after_training_and_dropping_twice_are_refused(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    ledger.claim(3)
    ledger.mark_trained([0, 1])
    with pytest.raises(LedgerError, match="1 is already trained"):
        ledger.mark_dropped(1, "stale")
    ledger.mark_dropped(2, "stale")
    with pytest.raises(LedgerError, match="already dropped"):
        ledger.mark_dropped(2, "stale")
    with pytest.raises(LedgerError, match="dropped prompt is never trained"):
        ledger.mark_trained([2])
    assert (ledger.trained_count, ledger.dropped_count) == (2, 1)


def test_release_and_indexes_are_checked(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=5)
    with pytest.raises(LedgerError, match="cannot release"):
        ledger.release(0)
    with pytest.raises(LedgerError, match="out of range"):
        ledger.state(5)
    with pytest.raises(LedgerError, match="int >= 0"):
        ledger.state(-1)
    with pytest.raises(LedgerError, match="negative"):
        ledger.claim(-1)


# -- checkpoints ----------------------------------------------------------------------------------


def test_checkpoint_saves_extra_in_the_same_file(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=4)
    ledger.claim(2)
    ledger.mark_trained([0])
    trainer: dict[str, Any] = {"step": 1, "trained": [0]}
    ledger.checkpoint({"trainer": trainer, "writer_position": 120})
    trainer["trained"].append(99)  # later changes to the caller's objects are not saved
    assert ledger.extra == {"trainer": {"step": 1, "trained": [0]}, "writer_position": 120}
    resumed = ResumeLedger.open(path)
    assert resumed.extra == {"trainer": {"step": 1, "trained": [0]}, "writer_position": 120}
    assert resumed.num_prompts == 4
    resumed.checkpoint()  # None keeps the previous extra
    assert ResumeLedger.open(path).extra["writer_position"] == 120
    assert [p.name for p in tmp_path.iterdir()] == ["l.json"]  # no temp file left


def test_extra_with_nan_or_unserialisable_values_is_refused(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json")
    with pytest.raises(LedgerError, match="extra/loss"):
        ledger.checkpoint({"loss": float("nan")})
    with pytest.raises(LedgerError, match="not JSON-serialisable"):
        ledger.checkpoint({"model": object()})


def test_stale_temp_files_of_a_cut_checkpoint_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    ResumeLedger.open(path, num_prompts=3).checkpoint()
    leftover = tmp_path / ".l.json.1234.5678.tmp"
    leftover.write_bytes(b'{"format": "agent-back')
    ledger = ResumeLedger.open(path, num_prompts=3)
    assert not leftover.exists()
    assert ledger.cursor == 0


def _written(tmp_path: Path) -> Path:
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=50)
    ledger.claim(30)
    ledger.mark_trained(range(0, 20))
    ledger.mark_dropped(25, "stale")
    ledger.checkpoint({"step": 3})
    return path


def test_a_torn_checkpoint_names_the_path(tmp_path: Path) -> None:
    path = _written(tmp_path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(LedgerError, match="unreadable") as info:
        ResumeLedger.open(path)
    assert info.value.path == str(path)
    assert str(path) in str(info.value)


def test_a_changed_checkpoint_fails_its_checksum(tmp_path: Path) -> None:
    path = _written(tmp_path)
    doc = orjson.loads(path.read_bytes())
    doc["ledger"]["cursor"] = 40
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(LedgerError, match="checksum"):
        ResumeLedger.open(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"[]", b'{"format": "something else"}', b"\x00\x01\x02"],
)
def test_files_that_are_not_ledgers_are_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "l.json"
    path.write_bytes(content)
    with pytest.raises(LedgerError, match="unreadable"):
        ResumeLedger.open(path)


def test_a_ledger_of_another_prompt_set_is_refused(tmp_path: Path) -> None:
    path = _written(tmp_path)
    with pytest.raises(LedgerError, match="written for 50 prompts, not 40"):
        ResumeLedger.open(path, num_prompts=40)


def test_an_unwritable_directory_fails_at_open(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot write"):
        ResumeLedger.open(tmp_path / "missing-dir" / "l.json")


def test_memory_and_file_stay_small_for_many_prompts(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=300_000)
    while not ledger.is_finished():
        batch = ledger.claim(1000)
        ledger.mark_trained(batch[1:])
        ledger.mark_dropped(batch[0], "stale")
    ledger.checkpoint()
    assert ledger.trained_count == 299_700
    assert ledger.dropped_count == 300
    assert len(ledger._trained) == 0
    assert len(ledger._in_flight) == 0
    assert path.stat().st_size < 20_000
    resumed = ResumeLedger.open(path)
    assert resumed.state(1000) == "dropped"
    assert resumed.state(1001) == "trained"


def test_acheckpoint_never_lets_an_older_snapshot_win(tmp_path: Path) -> None:
    path = tmp_path / "l.json"
    ledger = ResumeLedger.open(path, num_prompts=100)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for step in range(20):
                ledger.claim(1)
                ledger.mark_trained([step])
                tg.start_soon(ledger.acheckpoint, {"step": step})

    anyio.run(main)
    resumed = ResumeLedger.open(path)
    assert resumed.extra == {"step": 19}
    assert resumed.trained_count == 20


def test_repr_and_reconcile(tmp_path: Path) -> None:
    ledger = ResumeLedger.open(tmp_path / "l.json", num_prompts=9)
    ledger.claim(3)
    ledger.mark_trained([0, 2])
    assert repr(ledger).endswith("[cursor 1/9 | trained 2, dropped 0, in flight 1]>")
    ledger.reconcile([0, 2])
    with pytest.raises(LedgerError, match=r"does not record as trained \[1\]"):
        ledger.reconcile([0, 1, 2])
    with pytest.raises(LedgerError, match="missing from the output"):
        ledger.reconcile([0])
    ledger.mark_dropped(1, "stale")
    with pytest.raises(LedgerError, match=r"as trained \[1\]"):
        ledger.reconcile([0, 1, 2])
    ledger.reconcile([0, 1, 2], allow_dropped=True)
    with pytest.raises(LedgerError, match="missing"):
        ledger.reconcile([1, 2], allow_dropped=True)


# -- a state machine against a plain model --------------------------------------------------------


class LedgerMachine(RuleBasedStateMachine):
    """Random claims, trains, drops, releases, checkpoints and crashes, against a dict model."""

    N = 25

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp()
        self.path = Path(self.dir) / "l.json"
        self.ledger = ResumeLedger.open(self.path, num_prompts=self.N)
        self.model = dict.fromkeys(range(self.N), "pending")
        self.saved = dict(self.model)

    def teardown(self) -> None:
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)

    def in_state(self, state: str) -> list[int]:
        return sorted(i for i, s in self.model.items() if s == state)

    @rule(count=st.integers(0, 6))
    def claim(self, count: int) -> None:
        got = self.ledger.claim(count)
        expected = self.in_state("pending")[:count]
        assert got == expected
        for i in got:
            self.model[i] = "in_flight"

    @precondition(lambda self: self.in_state("in_flight"))
    @rule(data=st.data())
    def train(self, data: st.DataObject) -> None:
        flying = self.in_state("in_flight")
        chosen = data.draw(st.lists(st.sampled_from(flying), min_size=1, unique=True))
        self.ledger.mark_trained(chosen)
        for i in chosen:
            self.model[i] = "trained"

    @precondition(lambda self: self.in_state("in_flight"))
    @rule(data=st.data(), drop=st.booleans())
    def drop_or_release(self, data: st.DataObject, drop: bool) -> None:
        i = data.draw(st.sampled_from(self.in_state("in_flight")))
        if drop:
            self.ledger.mark_dropped(i, "stale")
            self.model[i] = "dropped"
        else:
            self.ledger.release(i)
            self.model[i] = "pending"

    @rule(i=st.integers(0, N - 1))
    def misuse_changes_nothing(self, i: int) -> None:
        state = self.model[i]
        if state != "in_flight":
            with pytest.raises(LedgerError):
                self.ledger.mark_trained([i])
            with pytest.raises(LedgerError):
                self.ledger.mark_dropped(i, "x")

    @rule()
    def checkpoint(self) -> None:
        self.ledger.checkpoint({"model": {str(i): s for i, s in self.model.items()}})
        self.saved = dict(self.model)

    @rule()
    def crash_and_resume(self) -> None:
        self.ledger = ResumeLedger.open(self.path, num_prompts=self.N)
        self.model = {i: "pending" if s == "in_flight" else s for i, s in self.saved.items()}

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert [self.ledger.state(i) for i in range(self.N)] == [
            self.model[i] for i in range(self.N)
        ]
        done = [s in ("trained", "dropped") for i, s in sorted(self.model.items())]
        cursor = done.index(False) if False in done else self.N
        assert self.ledger.cursor == cursor
        assert self.ledger.trained_count == len(self.in_state("trained"))
        assert self.ledger.dropped_count == len(self.in_state("dropped"))
        assert self.ledger.in_flight_count == len(self.in_state("in_flight"))


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# -- SIGKILL at random points, then resume ------------------------------------------------------


@pytest.mark.timeout(300)
def test_sigkill_at_50_plus_seeded_points_never_skips_or_repeats(tmp_path: Path) -> None:
    """Kill points land inside writes, between a group's bytes and its fsync, between the
    temp ledger and its rename, between training and the checkpoint; each run resumes to
    the end. Seeds are fixed, so a failure reproduces."""
    runs = []
    seed = 0
    while sum(r.kills for r in runs) < 50:
        run = crash_resume(tmp_path / f"step-{seed}", num_prompts=120, seed=seed, mode="step")
        runs.append(run)
        seed += 1
    for run in runs:
        v = run.verdict
        assert v.finished, run
        assert v.skipped == 0, run
        assert v.trained_twice == 0, run
        assert v.dropped_counted == 0, run
        assert v.trained_count_mismatch == 0, run
        assert v.output_mismatch == 0, run
        assert v.trained + v.dropped == 120, run
        assert v.trained > 0, run
        assert v.dropped > 0, run
    assert sum(r.kills for r in runs) >= 50


@pytest.mark.timeout(300)
def test_sigkill_from_outside_after_random_delays(tmp_path: Path) -> None:
    run = crash_resume(tmp_path, num_prompts=120, seed=100, mode="timer", max_delay=0.04)
    assert run.kills >= 3, run
    assert run.verdict.ok, run


@pytest.mark.timeout(300)
def test_the_crash_test_catches_a_naive_resume(tmp_path: Path) -> None:
    """Resuming without truncating to the checkpointed position writes prompts twice."""
    run = crash_resume(tmp_path, num_prompts=60, seed=7, mode="step", unsafe=True)
    assert run.kills > 0
    assert run.verdict.trained_twice > 0 or run.verdict.output_mismatch > 0, run
    assert not run.verdict.ok
