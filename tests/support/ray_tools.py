"""Tools the Ray tests run inside Ray actors (imported there as ``ray_tools:NAME``).

Module state (counters) is per actor process: each actor imports this
module once, which is also what the tests check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import ray

from agent_backend.backends.ray.payload import checksum

IMPORTS = time.time()  # set once per actor process, when the tools are loaded
_running = 0
_peak = 0


def echo(text: str) -> str:
    """Return the text.

    Args:
        text: What to return.
    """
    return text


async def async_echo(text: str) -> str:
    return text


def whoami() -> dict[str, Any]:
    """Where this call ran, as seen inside the actor."""
    return {
        "pid": os.getpid(),
        "imports": IMPORTS,
        "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "actor": ray.get_runtime_context().get_actor_name(),
    }


async def hold(seconds: float) -> dict[str, Any]:
    """Sleep ``seconds`` and report the pid and the peak of calls running at once here."""
    global _running, _peak
    _running += 1
    _peak = max(_peak, _running)
    try:
        await asyncio.sleep(seconds)
    finally:
        _running -= 1
    return {"pid": os.getpid(), "peak": _peak}


def sync_hold(seconds: float) -> tuple[int, float, float]:
    """Block ``seconds``; (pid, start, end) on the machine-wide monotonic clock."""
    start = time.monotonic()
    time.sleep(seconds)
    return os.getpid(), start, time.monotonic()


def make_array(n: int, seed: int = 0) -> Any:
    """``n`` pseudo-random bytes as a uint8 array (same seed, same bytes)."""
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def make_matrix(rows: int, cols: int) -> Any:
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)


def make_bundle(n: int) -> Any:
    """A container of arrays (a teacher's top-k: values and indices)."""
    return {
        "values": np.ones(n, dtype=np.float32),
        "indices": np.arange(n, dtype=np.int32),
        "note": "top-k",
    }


def make_bytes(n: int) -> bytes:
    return b"\x07" * n


def inspect_payload(data: Any) -> dict[str, Any]:
    """What arrived: the checksum, the type and where the bytes live (zero-copy: read-only)."""
    info: dict[str, Any] = {"checksum": checksum(data), "type": type(data).__name__}
    if isinstance(data, np.ndarray):
        info.update(nbytes=int(data.nbytes), writeable=bool(data.flags.writeable))
    return info


def sum_payloads(parts: list[Any]) -> int:
    """Payloads nested in a list argument."""
    return int(sum(int(np.asarray(part, dtype=np.int64).sum()) for part in parts))


def raise_sample(index: int) -> None:
    """Raise the index-th project error of ``test_public_api.ERROR_SAMPLES``."""
    from test_public_api import ERROR_SAMPLES

    raise ERROR_SAMPLES[index]


class LockedError(Exception):
    """Holds a lock: cannot be pickled."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


class SocketError(Exception):
    """Holds an open socket: cannot be pickled."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)


class _Headers:
    """Stands in for aiohttp's ``CIMultiDictProxy``, which refuses to be pickled."""

    def __init__(self, items: dict[str, str]) -> None:
        self._items = items
        self._lock = threading.Lock()

    def __reduce__(self) -> Any:
        raise TypeError("can't pickle _Headers objects")


class ClientResponseError(Exception):
    """Shaped like ``aiohttp.ClientResponseError``: positional request info, keyword status,
    message and headers (unpicklable), so neither pickling nor re-construction works."""

    def __init__(
        self,
        request_info: Any,
        history: tuple[Any, ...],
        *,
        status: int,
        message: str,
        headers: Any,
    ) -> None:
        super().__init__(request_info, history)
        self.request_info = request_info
        self.history = history
        self.status = status
        self.message = message
        self.headers = headers

    def __str__(self) -> str:
        return f"{self.status}, message={self.message!r}, url={self.request_info!r}"


def raise_locked() -> None:
    raise LockedError("the reward server is locked")


def raise_socket() -> None:
    raise SocketError("the tool server hung up")


async def raise_http(status: int) -> None:
    """An HTTP error from a tool server, as aiohttp raises it."""
    raise ClientResponseError(
        "http://127.0.0.1:9/score",
        (),
        status=status,
        message="Service Unavailable",
        headers=_Headers({"Retry-After": "1"}),
    )


async def raise_wrapped_http() -> None:
    """A tool that wraps the HTTP error in its own: the status is found on the cause."""
    try:
        await raise_http(502)
    except ClientResponseError as exc:
        raise RuntimeError("scoring failed") from exc


def return_lock() -> Any:
    """A result Ray cannot serialize."""
    return threading.Lock()


def crash() -> None:
    """The actor's process dies mid-call (a segfault or the OOM killer, as far as Ray can tell)."""
    os._exit(1)


def getenv(name: str) -> str | None:
    """An environment variable as the actor sees it (runtime_env ``env_vars``)."""
    return os.environ.get(name)


async def node_hold(seconds: float) -> dict[str, Any]:
    """Sleep ``seconds`` (a call in flight while a node is killed); the node it ran on."""
    await asyncio.sleep(seconds)
    return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


@ray.remote(num_gpus=1, num_cpus=0)
def _child_gpu() -> dict[str, Any]:
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
    }


async def group_gpus() -> dict[str, Any]:
    """Where this actor runs and where a 1-GPU task it starts lands (its placement group's
    second bundle, when it has one)."""
    child = await _child_gpu.remote()
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
        "child": child,
    }


@dataclasses.dataclass
class Reading:
    """A result of a class the driver imports too (pickled by the actor, read by the pool)."""

    sensor: str
    values: tuple[float, ...]


def read_sensor(sensor: str) -> Any:
    """A dataclass holding a tuple: it comes back as itself, not as JSON."""
    return Reading(sensor, (1.5, 2.5))


def put_and_return(value: int) -> Any:
    """An object reference inside the result: only Ray's serializer may carry it (the driver
    then borrows the object, and can read it after the actor forgets it)."""
    return {"ref": ray.put(value), "value": value}


def local_class() -> Any:
    """An instance of a class defined here: only cloudpickle (Ray's serializer) can pickle it."""

    class Local:
        def __init__(self) -> None:
            self.answer = 42

    return Local()
