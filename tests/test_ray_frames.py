"""A call's request and outcome as bytes (backends/ray/frames.py): what goes as bytes, what
must go through Ray's serializer, and that either way the pool returns what the tool did."""

from __future__ import annotations

import pickle
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import ray_tools
from support.ray_fixtures import RayCluster, pool_config, ray_cluster, require_ray

ray = require_ray()

from agent_backend.backends.ray import RayBackend  # noqa: E402
from agent_backend.backends.ray import backend as backend_module  # noqa: E402
from agent_backend.backends.ray.actor import ERROR, VALUE, ToolActor  # noqa: E402
from agent_backend.backends.ray.frames import decode, encode  # noqa: E402
from agent_backend.errors import ToolFailed  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
__all__ = ["ray_cluster"]  # the fixture, imported for this module

REF = ray.ObjectRef(b"\x01" * 28)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    "value",
    [
        ("echo", {"text": "hi", "n": [1, 2.5, None, True, 2**80]}, False),
        (VALUE, (1, "a", b"b")),  # a tuple stays a tuple: no JSON on the way
        (VALUE, ray_tools.Reading("t", (1.0,))),
        (VALUE, {"nested": [{"deep": [[["x"]]]}]}),
    ],
)
def test_plain_values_go_as_bytes_and_come_back_equal(value: Any) -> None:
    data = encode(value)
    assert isinstance(data, bytes)
    assert decode(data) == value
    assert type(decode(data)[1]) is type(value[1])


class HoldsRef:
    def __init__(self) -> None:
        self.inner = {"refs": [REF]}


@pytest.mark.parametrize(
    "value",
    [
        REF,
        [1, REF],
        {"a": {"b": (REF,)}},
        HoldsRef(),  # inside an object's state
        lambda: 1,  # only cloudpickle pickles it
        threading.Lock(),  # nobody pickles it: Ray's serializer says so, as before
    ],
    ids=["ref", "in-list", "in-dict-tuple", "in-object", "lambda", "lock"],
)
def test_what_only_ray_may_carry_is_refused_and_the_next_encode_is_clean(value: Any) -> None:
    assert encode(value) is None
    assert decode(encode({"after": 1}) or b"") == {"after": 1}  # nothing left in the buffer


def test_a_subclass_of_a_ray_handle_is_refused_too() -> None:
    try:

        class MyRef(ray.ObjectRef):  # type: ignore[misc]
            pass

    except TypeError:
        pytest.skip("ray.ObjectRef cannot be subclassed in this Ray")
    assert encode([MyRef(b"\x02" * 28)]) is None


def test_threads_encode_concurrently_without_mixing_their_values() -> None:
    errors: list[str] = []

    def work(index: int) -> None:
        for round_ in range(2000):
            value = {"thread": index, "round": round_, "pad": "x" * (index * 10)}
            if pickle.loads(encode(value) or b"") != value:
                errors.append(f"{index}/{round_}")

    threads = [threading.Thread(target=work, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


# -- both sides on a real Ray ----------------------------------------------------------------------


async def test_the_actor_reads_bytes_and_answers_bytes_unless_ray_must_carry_it(
    ray_cluster: RayCluster,
) -> None:
    """ToolActor.run in this process (Ray is up, for ray.put): the same class the actors run."""
    actor = ToolActor(
        "frames-test",
        [("support.ray_tools:echo", None), ("support.ray_tools:put_and_return", None)],
        1 << 20,
    )
    outcome, kept = await actor.run(encode(("echo", {"text": "bytes in"}, False)) or b"")
    assert isinstance(outcome, bytes)
    assert kept is None
    assert decode(outcome) == (VALUE, "bytes in")
    outcome, _ = await actor.run(("echo", {"text": "tuple in"}, False))  # as before: still read
    assert decode(outcome) == (VALUE, "tuple in")
    outcome, _ = await actor.run(encode(("put_and_return", {"value": 7}, False)) or b"")
    assert isinstance(outcome, tuple)  # holds an ObjectRef: Ray's serializer carries it
    assert outcome[0] == VALUE
    assert ray.get(outcome[1]["ref"]) == 7
    outcome, _ = await actor.run(encode(("missing", {}, False)) or b"")
    assert isinstance(outcome, tuple)
    assert outcome[0] == ERROR


@pytest.fixture(scope="module")
async def pool(ray_cluster: RayCluster) -> AsyncIterator[RayBackend]:
    config = pool_config(
        "support.ray_tools:echo",
        "support.ray_tools:sync_hold",
        "support.ray_tools:read_sensor",
        "support.ray_tools:put_and_return",
        "support.ray_tools:local_class",
        "support.ray_tools:return_lock",
        name="frames",
    )
    async with RayBackend.from_config(config) as backend:
        yield backend


async def test_every_kind_of_result_comes_back_as_the_tool_returned_it(
    pool: RayBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded: list[bool] = []

    def spy(value: Any) -> bytes | None:
        data = encode(value)
        encoded.append(data is not None)
        return data

    monkeypatch.setattr(backend_module, "encode", spy)
    assert (await pool.call("echo", {"text": "plain"})).value == "plain"
    assert encoded == [True]  # the request went as bytes
    started, _, _ = (await pool.call("sync_hold", {"seconds": 0})).value
    assert isinstance(started, int)
    reading = (await pool.call("read_sensor", {"sensor": "s1"})).value
    assert reading == ray_tools.Reading("s1", (1.5, 2.5))
    assert type(reading.values) is tuple
    held = (await pool.call("put_and_return", {"value": 11})).value
    assert held["value"] == 11
    assert await held["ref"] == 11  # borrowed properly: readable after the call
    assert (await pool.call("local_class", {})).value.answer == 42
    with pytest.raises(ToolFailed):
        await pool.call("return_lock", {})
