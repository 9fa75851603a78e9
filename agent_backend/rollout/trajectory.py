"""One trainer-ready record per episode segment: :class:`Trajectory`, and :class:`SegmentBuilder`.

A trajectory is what an RL trainer consumes: the prompt's token ids, the
completion's token ids with a loss mask (1 on tokens the policy sampled, 0 on
tool output and chat-template tokens) and the sampler's logprobs aligned with
them, the reward, and enough bookkeeping (``group_id``, ``prompt_index``,
policy versions) for GRPO grouping, staleness and resume.

:class:`SegmentBuilder` assembles those token streams turn by turn. Each turn
of a multi-turn episode sends the whole conversation again, so each turn's
prompt ids must start with the previous prompt plus everything appended since
(the policy's completion, then tool and template tokens). When a chat
template rewrites history (drops earlier reasoning, re-tokenizes a turn), the
prefix no longer matches: the builder closes the segment and starts a new one
(``segment_idx + 1``) instead of mis-aligning tokens and logprobs.

The JSON Schema of the record is checked in at ``schemas/wire/rollout.json``
(:data:`TRAJECTORY_SCHEMA_PATH`) and kept in sync by a test. Regenerate it with::

    .venv/bin/python -m agent_backend.rollout.trajectory > schemas/wire/rollout.json

This module must never do I/O (printing the schema under ``__main__`` aside)
and must never let a NaN or infinite float into a record: they would reach
JSON as ``null`` (or a server's HTTP 500) and crash tensor creation in a
trainer. Non-finite logprobs are handled where they are
produced, by :mod:`agent_backend.rollout.logprobs`; a record refuses them.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import pydantic

from agent_backend.errors import NonFiniteLogprobs

__all__ = [
    "STOP_REASONS",
    "TRAJECTORY_SCHEMA_PATH",
    "Segment",
    "SegmentBuilder",
    "StopReason",
    "Trajectory",
    "non_finite_paths",
    "non_finite_positions",
    "schema_text",
]

#: Why an episode ended. ``stop``: the policy ended its turn without tool calls;
#: ``length``: the policy or the episode's token budget ran out; ``max_turns``:
#: the turn limit; ``timeout``: the episode's wall-clock limit; ``tool_error``:
#: tools failed in a way that ends the episode; ``env_error``: the environment
#: (session, workspace, reward tool) failed; ``rollout_error``: the rollout
#: layer or the policy server failed, or the rollout was dropped (non-finite
#: logprobs under the ``drop`` policy). ``error`` says what happened.
StopReason = Literal[
    "stop", "length", "max_turns", "timeout", "tool_error", "env_error", "rollout_error"
]
STOP_REASONS: Final[tuple[str, ...]] = get_args(StopReason)

#: The checked-in JSON Schema of :class:`Trajectory` (a test keeps it equal to
#: ``Trajectory.model_json_schema()``): a file of the source tree, beside this package, which a
#: wheel does not ship (:func:`schema_text` gives the same text anywhere).
TRAJECTORY_SCHEMA_PATH: Final[Path] = (
    Path(__file__).resolve().parents[2] / "schemas" / "wire" / "rollout.json"
)

# Token lists are validated as plain ints (several times faster than per-item constraints
# on long completions) and range-checked in one pass by ``_check_alignment``; the schema
# still states the ranges.
_TokenId = Annotated[int, pydantic.WithJsonSchema({"type": "integer", "minimum": 0})]
_MaskValue = Annotated[
    int, pydantic.WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 1})
]
_Count = Annotated[int, pydantic.Field(ge=0)]
_FiniteFloat = Annotated[float, pydantic.Field(allow_inf_nan=False)]

#: How many offending positions an error message lists before "... and N more".
_SHOWN = 10


def _positions_text(positions: Sequence[int]) -> str:
    shown = ", ".join(str(p) for p in positions[:_SHOWN])
    more = f", ... and {len(positions) - _SHOWN} more" if len(positions) > _SHOWN else ""
    return f"[{shown}{more}]"


def non_finite_positions(values: Sequence[float | None]) -> list[int]:
    """The indexes of ``values`` that are NaN, infinite or missing (``None``); empty when none is.

    The common case costs one C-level ``sum``: a sum of finite floats of
    logprob size is finite, so only a non-finite (or failing) sum pays for the scan.
    """
    try:
        if math.isfinite(sum(values)):  # type: ignore[arg-type]
            return []
    except TypeError:
        pass
    return [
        i for i, v in enumerate(values) if not isinstance(v, int | float) or not math.isfinite(v)
    ]


def non_finite_paths(value: Any, path: str = "") -> list[str]:
    """JSON-pointer-like paths of every NaN/inf float nested in dicts, lists and tuples."""
    found: list[str] = []
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                found.append(where or "/")
        elif isinstance(item, Mapping):
            stack.extend((f"{where}/{key}", sub) for key, sub in item.items())
        elif isinstance(item, list | tuple):
            stack.extend((f"{where}/{index}", sub) for index, sub in enumerate(item))
    return sorted(found)


class Trajectory(pydantic.BaseModel):
    """One segment of one sampled episode, ready for a trainer (see docs/rollout-records.md).

    ``(rollout_id, segment_idx)`` is unique. An episode whose chat template
    never rewrote history has one segment (``segment_idx == 0``); otherwise
    each segment is its own record carrying the same episode-level fields
    (reward, stop reason, counts, messages).
    """

    model_config = pydantic.ConfigDict(
        frozen=True,
        extra="forbid",
        use_attribute_docstrings=True,
        title="Trajectory",
    )

    rollout_id: str
    """Unique id of the sampled episode (shared by its segments)."""
    group_id: str
    """Id of the GRPO group: the samples of one prompt drawn together."""
    sample_idx: _Count
    """Index of this sample within its group (0 .. n-1)."""
    prompt_index: _Count
    """Index of the prompt in the prompt set (what the resume ledger tracks)."""
    segment_idx: _Count = 0
    """Index of this segment within the episode; a new one starts when a chat template
    rewrote history, so that tokens and logprobs never mis-align."""

    prompt_ids: list[_TokenId]
    """Token ids of the prompt this segment starts from."""
    completion_ids: list[_TokenId]
    """Token ids after the prompt: the policy's samples, tool output and template tokens."""
    completion_mask: list[_MaskValue]
    """1 on tokens the policy sampled (trained on), 0 on tool output and template tokens."""
    logprobs: list[float]
    """The sampler's logprob of each completion token; 0.0 where the mask is 0. Always finite."""
    turn_spans: list[tuple[_Count, _Count]] = []
    """``(start, stop)`` in ``completion_ids`` of each policy turn's sampled tokens, in order:
    a turn's boundaries even where a token inside it was masked (a non-finite logprob)."""
    turn_versions: list[tuple[int, int]] = []
    """Per turn of ``turn_spans``: the policy versions when it was sent and when it was
    answered. Equal for every turn unless a ``continue`` weight update crossed it (its first
    tokens then came from the first version, its last from the second); empty in records
    written before versions were kept per turn."""

    reward: _FiniteFloat
    """The episode's scalar reward."""
    rewards: dict[str, _FiniteFloat] = {}
    """Named reward components, when the reward function gives them."""

    policy_version_start: int
    """Policy (weights) version that sampled the first turn."""
    policy_version_end: int
    """Policy version that sampled the last turn (>= start)."""

    stop_reason: StopReason
    """Why the episode ended."""
    num_turns: _Count
    """Policy turns in the whole episode."""
    tool_calls: _Count = 0
    """Tool calls the policy made in the whole episode."""
    tool_failures: _Count = 0
    """Tool calls that did not succeed (their error went back to the policy)."""

    messages: list[dict[str, Any]] = []
    """The episode's conversation in OpenAI chat format."""
    error: str | None = None
    """What went wrong, as plain text; None when the episode ended normally."""
    timing: dict[str, _FiniteFloat] = {}
    """Seconds spent, by part (``policy``, ``tools``, ``reward``, ``total`` ...)."""
    extras: dict[str, Any] = {}
    """Anything else worth keeping (JSON values, all floats finite)."""

    @pydantic.model_validator(mode="after")
    def _check_alignment(self) -> Trajectory:
        n = len(self.completion_ids)
        if len(self.completion_mask) != n or len(self.logprobs) != n:
            raise ValueError(
                "completion_ids, completion_mask and logprobs must have the same length, "
                f"got {n}, {len(self.completion_mask)} and {len(self.logprobs)}"
            )
        for name in ("prompt_ids", "completion_ids"):
            ids: list[int] = getattr(self, name)
            if ids and min(ids) < 0:
                negative = [i for i, t in enumerate(ids) if t < 0]
                raise ValueError(f"{name} holds negative token ids at {_positions_text(negative)}")
        mask = self.completion_mask
        zeros = mask.count(0)
        if zeros + mask.count(1) != n:
            wrong = [i for i, m in enumerate(mask) if m not in (0, 1)]
            raise ValueError(
                f"completion_mask values must be 0 or 1; not at {_positions_text(wrong)}"
            )
        bad = non_finite_positions(self.logprobs)
        if bad:
            raise ValueError(
                f"{len(bad)} logprobs are NaN or infinite, at completion positions "
                f"{_positions_text(bad)}: they must never reach JSON or a trainer; apply a "
                "NonFinitePolicy where they are produced (agent_backend.rollout.logprobs)"
            )
        if zeros and any(compress(self.logprobs, map(operator.not_, mask))):
            unmasked = [
                i for i, (m, lp) in enumerate(zip(mask, self.logprobs, strict=True)) if not m and lp
            ]
            raise ValueError(
                f"logprobs must be 0.0 where completion_mask is 0; not at positions "
                f"{_positions_text(unmasked)}"
            )
        stop = 0
        for start, end in self.turn_spans:
            if not stop <= start <= end <= n:
                raise ValueError(
                    f"turn_spans must be ordered, non-overlapping spans within the {n} "
                    f"completion tokens; got {self.turn_spans[:_SHOWN]}"
                )
            stop = end
        if self.turn_versions:
            if len(self.turn_versions) != len(self.turn_spans):
                raise ValueError(
                    f"turn_versions has {len(self.turn_versions)} entries for "
                    f"{len(self.turn_spans)} turn_spans; they must align one to one"
                )
            if any(
                not self.policy_version_start <= sent <= answered <= self.policy_version_end
                for sent, answered in self.turn_versions
            ):
                raise ValueError(
                    f"turn_versions must be (sent, answered) pairs with sent <= answered, within "
                    f"policy_version_start..policy_version_end ({self.policy_version_start}.."
                    f"{self.policy_version_end}); got {self.turn_versions[:_SHOWN]}"
                )
        if self.policy_version_end < self.policy_version_start:
            raise ValueError(
                f"policy_version_end ({self.policy_version_end}) is before "
                f"policy_version_start ({self.policy_version_start})"
            )
        if self.tool_failures > self.tool_calls:
            raise ValueError(
                f"tool_failures ({self.tool_failures}) exceeds tool_calls ({self.tool_calls})"
            )
        for name in ("messages", "extras"):
            paths = non_finite_paths(getattr(self, name), name)
            if paths:
                raise ValueError(
                    f"NaN or infinite floats at {', '.join(paths[:_SHOWN])}: "
                    "they must never reach JSON"
                )
        return self

    @property
    def sampled_tokens(self) -> int:
        """How many completion tokens the policy sampled (mask 1)."""
        return sum(self.completion_mask)

    def check_finite(self) -> None:
        """Re-check that every float is finite, in case a list or dict was changed in place.

        A frozen model still holds mutable lists; writers call this before
        serialising, because JSON encoders turn NaN into ``null`` silently.
        Raises :class:`~agent_backend.errors.NonFiniteLogprobs` for logprobs,
        ``ValueError`` for any other float.
        """
        bad = non_finite_positions(self.logprobs)
        if bad:
            raise NonFiniteLogprobs(
                f"trajectory {self.rollout_id!r} segment {self.segment_idx}: logprobs at "
                f"{_positions_text(bad)} are NaN or infinite and must never be written",
                positions=bad,
            )
        paths = [
            *non_finite_paths(self.reward, "reward"),
            *non_finite_paths(self.rewards, "rewards"),
            *non_finite_paths(self.timing, "timing"),
            *non_finite_paths(self.messages, "messages"),
            *non_finite_paths(self.extras, "extras"),
        ]
        if paths:
            raise ValueError(
                f"trajectory {self.rollout_id!r}: NaN or infinite floats at "
                f"{', '.join(paths[:_SHOWN])} must never be written"
            )


# -- building token streams turn by turn -----------------------------------------------------------


@dataclass(slots=True)
class Segment:
    """The token streams of one segment, as :class:`SegmentBuilder` assembled them."""

    segment_idx: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_versions: list[tuple[int, int]] = field(default_factory=list)
    turns: int = 0
    """Policy turns sampled in this segment."""

    def token_fields(self) -> dict[str, Any]:
        """The :class:`Trajectory` fields this segment supplies (copies of the lists)."""
        return {
            "segment_idx": self.segment_idx,
            "prompt_ids": list(self.prompt_ids),
            "completion_ids": list(self.completion_ids),
            "completion_mask": list(self.completion_mask),
            "logprobs": list(self.logprobs),
            "turn_spans": list(self.turn_spans),
            "turn_versions": list(self.turn_versions),
        }

    def _extends(self, prompt_ids: Sequence[int]) -> bool:
        """True when ``prompt_ids`` starts with this segment's prompt + completion so far."""
        lp, lc = len(self.prompt_ids), len(self.completion_ids)
        if len(prompt_ids) < lp + lc:
            return False
        return list(prompt_ids[:lp]) == self.prompt_ids and (
            list(prompt_ids[lp : lp + lc]) == self.completion_ids
        )


class SegmentBuilder:
    """Assembles an episode's token streams turn by turn, one :class:`Segment` per history rewrite.

    Per policy turn call :meth:`add_turn` with the prompt ids the server
    rendered and the completion it sampled. Tokens between the previous
    turn's end and this turn's prompt end (tool results, template tokens) are
    taken from the new prompt and masked out (mask 0, logprob 0.0). Callers
    that tokenize tool output themselves may append it with
    :meth:`add_env_tokens` instead; the next prompt must then extend it.

    When a prompt does not extend the current segment, the segment is closed
    and a new one starts from that prompt: ``segment_idx`` counts up, and
    :attr:`rewrites` counts how often it happened.
    """

    def __init__(self) -> None:
        self._segments: list[Segment] = []
        self.rewrites = 0
        """How many times a prompt did not extend its segment (a new segment was started)."""

    @property
    def segments(self) -> list[Segment]:
        """The segments so far (the last one is open)."""
        return list(self._segments)

    @property
    def current(self) -> Segment | None:
        """The open segment, or None before the first turn."""
        return self._segments[-1] if self._segments else None

    @property
    def turns(self) -> int:
        """Policy turns added over all segments."""
        return sum(s.turns for s in self._segments)

    @property
    def context_tokens(self) -> int:
        """Tokens in the open segment (prompt + completion): what the next turn's prompt holds at least."""
        seg = self.current
        return 0 if seg is None else len(seg.prompt_ids) + len(seg.completion_ids)

    def add_turn(
        self,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        mask: Sequence[int] | None = None,
        versions: tuple[int, int] | None = None,
    ) -> Segment:
        """Add one policy turn; returns the segment it went into.

        ``mask`` (default all 1) lets a caller exclude sampled tokens, e.g.
        the ones a non-finite logprob policy masked; masked tokens must carry
        a 0.0 logprob. Raises :class:`~agent_backend.errors.NonFiniteLogprobs`
        if a logprob is NaN/inf (apply :func:`~agent_backend.rollout.logprobs.check_logprobs`
        first) and ``ValueError`` on mismatched lengths. ``versions``: the policy versions
        when the turn was sent and answered (kept in ``turn_versions``; a builder whose turns
        all came without them keeps none).
        """
        if len(logprobs) != len(completion_ids):
            raise ValueError(
                f"a turn has {len(completion_ids)} completion ids but {len(logprobs)} logprobs"
            )
        turn_mask = [1] * len(completion_ids) if mask is None else list(mask)
        if len(turn_mask) != len(completion_ids):
            raise ValueError(
                f"a turn has {len(completion_ids)} completion ids but a mask of {len(turn_mask)}"
            )
        if any(m not in (0, 1) for m in turn_mask):
            raise ValueError("mask values must be 0 or 1")
        bad = non_finite_positions(logprobs)
        if bad:
            raise NonFiniteLogprobs(
                f"logprobs at turn positions {_positions_text(bad)} are NaN or infinite; "
                "apply check_logprobs() with a NonFinitePolicy before building segments",
                positions=bad,
            )
        turn_logprobs = [float(lp) if m else 0.0 for lp, m in zip(logprobs, turn_mask, strict=True)]

        seg = self.current
        if seg is not None and seg._extends(prompt_ids):
            seg.completion_ids.extend(
                int(t) for t in prompt_ids[len(seg.prompt_ids) + len(seg.completion_ids) :]
            )
            pad = len(seg.completion_ids) - len(seg.completion_mask)
            seg.completion_mask.extend([0] * pad)
            seg.logprobs.extend([0.0] * pad)
        else:
            if seg is not None:
                self.rewrites += 1
            seg = Segment(segment_idx=len(self._segments), prompt_ids=[int(t) for t in prompt_ids])
            self._segments.append(seg)
        start = len(seg.completion_ids)
        seg.completion_ids.extend(int(t) for t in completion_ids)
        seg.turn_spans.append((start, len(seg.completion_ids)))
        if versions is not None:
            if len(seg.turn_versions) != len(seg.turn_spans) - 1:
                raise ValueError("give versions for every turn of a segment, or for none")
            seg.turn_versions.append((int(versions[0]), int(versions[1])))
        elif seg.turn_versions:
            raise ValueError("give versions for every turn of a segment, or for none")
        seg.completion_mask.extend(turn_mask)
        seg.logprobs.extend(turn_logprobs)
        seg.turns += 1
        return seg

    def add_env_tokens(self, token_ids: Sequence[int]) -> None:
        """Append tokens the policy did not sample (tool output, template) to the open segment.

        Masked out (0) with 0.0 logprobs. Raises ``ValueError`` before the first turn.
        """
        seg = self.current
        if seg is None:
            raise ValueError("add_env_tokens() before the first add_turn(): there is no segment")
        seg.completion_ids.extend(int(t) for t in token_ids)
        seg.completion_mask.extend([0] * len(token_ids))
        seg.logprobs.extend([0.0] * len(token_ids))

    def build(self, **episode: Any) -> list[Trajectory]:
        """One :class:`Trajectory` per segment, each with the episode-level fields in ``episode``.

        ``episode`` holds every field but the token ones (``rollout_id``,
        ``group_id``, ``reward``, ``stop_reason`` ...). With no turn at all
        (an episode that failed before the policy answered) there is one
        record with empty token lists.
        """
        reserved = {
            "segment_idx",
            "prompt_ids",
            "completion_ids",
            "completion_mask",
            "logprobs",
            "turn_spans",
            "turn_versions",
        }
        clash = reserved & episode.keys()
        if clash:
            raise TypeError(f"build() sets {', '.join(sorted(clash))} itself")
        segments = self._segments or [Segment(segment_idx=0, prompt_ids=[])]
        return [Trajectory(**episode, **seg.token_fields()) for seg in segments]


def schema_text() -> str:
    """The JSON Schema of :class:`Trajectory` exactly as checked in at :data:`TRAJECTORY_SCHEMA_PATH`."""
    return json.dumps(Trajectory.model_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(schema_text())
