"""ToolResult and output bounding: pure, no processes."""

from __future__ import annotations

import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_backend.dispatch import CommandResult, Output, OutputBuffer, ToolResult
from agent_backend.dispatch.result import (
    ERROR_TYPES,
    STDERR_LABEL,
    combine_streams,
    command_result,
    rebound,
)
from agent_backend.errors import PathOutsideWorkspace, UnknownToolError

MARKER = re.compile(r"\n\[\.\.\. \d+ bytes omitted \.\.\.\]\n")


def captured(data: bytes, limit: int) -> Output:
    buffer = OutputBuffer(limit)
    for start in range(0, len(data), 7):  # fed in small chunks, as a pipe would
        buffer.feed(data[start : start + 7])
    return buffer.result()


def test_result_is_frozen_json_and_pickle_safe() -> None:
    result = ToolResult(
        call_id="c1", tool="exec", ok=True, output="hi", exit_status=0, host="local"
    )
    with pytest.raises(Exception, match="frozen"):
        result.ok = False
    assert ToolResult.model_validate_json(result.model_dump_json()) == result
    assert pickle.loads(pickle.dumps(result)) == result
    assert set(ToolResult.model_json_schema()["properties"]) == {
        "call_id",
        "tool",
        "ok",
        "output",
        "exit_status",
        "duration",
        "truncated",
        "output_bytes",
        "error",
        "error_type",
        "host",
    }


def test_value_stays_in_process_and_out_of_equality() -> None:
    """ToolResult.value holds a tool's Python value (a PayloadRef, say) without touching the wire."""
    held = object()  # not JSON: it must never reach the serialized form
    result = ToolResult(call_id="c", tool="t", ok=True, output="x").with_value(held)
    assert result.value is held
    assert result.model_copy(update={"duration": 1.5}).value is held
    assert "value" not in result.model_dump()
    back = ToolResult.model_validate_json(result.model_dump_json())
    assert back.value is None
    assert back == result
    assert hash(back) == hash(result)
    assert result != ToolResult(call_id="c", tool="t", ok=True, output="y")
    assert "value" not in ToolResult.model_json_schema()["properties"]


def test_model_message() -> None:
    ok = ToolResult(call_id="c", tool="t", ok=True, output="42")
    assert ok.to_model_message() == "42"
    assert ToolResult(call_id="c", tool="t", ok=True).to_model_message() == "(no output)"
    failed = ToolResult.failure(
        call_id="c", tool="t", error="exited with status 1", error_type="NonZeroExit", output="boom"
    )
    assert failed.to_model_message() == "Error: exited with status 1\nboom"
    bare = ToolResult.from_error(PathOutsideWorkspace("/etc/passwd"), call_id="c", tool="t")
    assert bare.error_type == "PathOutsideWorkspace"
    assert bare.to_model_message().startswith("Error: path '/etc/passwd' is outside")


def test_errors_are_bounded() -> None:
    huge = UnknownToolError("x" * 100_000, available=[f"tool_{i}" for i in range(5000)])
    result = ToolResult.from_error(huge, call_id="c", tool="x")
    assert result.error is not None
    assert len(result.error) <= 2048
    long = ToolResult.failure(call_id="c", tool="t", error="e" * 10_000, error_type="ToolFailed")
    assert long.error is not None
    assert len(long.error) <= 2048


def test_every_error_type_is_documented() -> None:
    assert set(ERROR_TYPES) >= {
        "ToolArgumentError",
        "UnknownToolError",
        "NonZeroExit",
        "Timeout",
        "PathOutsideWorkspace",
    }


def test_rebound_keeps_the_full_size_and_one_marker() -> None:
    data = b"".join(b"%d\n" % i for i in range(10_000))
    out = captured(data, 1000)
    smaller = rebound(out, 100, captured_limit=1000)
    assert smaller.total_bytes == len(data)
    assert smaller.truncated
    assert smaller.data.startswith(data[:50])
    assert smaller.data.endswith(data[-50:])
    assert smaller.data.count(b"omitted") == 1
    assert f"[... {len(data) - 100} bytes omitted ...]".encode() in smaller.data
    assert rebound(out, 1000, captured_limit=1000) == out


@given(
    st.binary(max_size=3000),
    st.integers(min_value=64, max_value=1000),
    st.integers(min_value=0, max_value=1000),
)
def test_rebound_equals_capturing_with_the_smaller_bound(data: bytes, big: int, small: int) -> None:
    small = min(small, big)
    assert rebound(captured(data, big), small, captured_limit=big) == captured(data, small)


def test_combined_streams_stay_within_the_bound() -> None:
    limit = 200
    stdout = captured(b"o" * 5000, limit)
    stderr = captured(b"e" * 5000, limit)
    text, truncated, total = combine_streams(stdout, stderr, limit=limit, captured_limit=limit)
    assert truncated
    assert total == 10_000
    body = MARKER.sub("", text.replace(STDERR_LABEL, ""))
    assert body.count("o") == 100
    assert body.count("e") == 100
    # A short stdout leaves its share to stderr.
    short = captured(b"ok\n", limit)
    text, truncated, _ = combine_streams(short, stderr, limit=limit, captured_limit=limit)
    assert text.startswith("ok\n[stderr]\n")
    assert MARKER.sub("", text.removeprefix("ok\n[stderr]\n")) == "e" * (limit - 3)
    # Nothing cut: both whole, no marker.
    text, truncated, total = combine_streams(
        captured(b"a", limit), captured(b"b", limit), limit=limit, captured_limit=limit
    )
    assert (text, truncated, total) == ("a\n[stderr]\nb", False, 2)


def test_command_result_classification() -> None:
    def make(**kwargs: object) -> ToolResult:
        return command_result(
            CommandResult(host="local", **kwargs),  # type: ignore[arg-type]
            call_id="c",
            tool="exec",
            timeout=2.0,
            limit=100,
            captured_limit=100,
        )

    assert make(exit_status=0).ok
    nonzero = make(exit_status=2)
    assert (nonzero.ok, nonzero.error_type, nonzero.exit_status) == (False, "NonZeroExit", 2)
    killed = make(exit_status=None, signal="SIGSEGV")
    assert (killed.error_type, killed.error) == ("Signal", "the command was killed by SIGSEGV")
    timed = make(exit_status=None, signal="SIGTERM", timed_out=True)
    assert timed.error_type == "Timeout"
    assert "2 s" in (timed.error or "")
