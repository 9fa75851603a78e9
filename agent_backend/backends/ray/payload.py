"""Results by reference: what stays in the Ray object store, and the handle a caller gets for it.

A tool result at or above a pool's ``inline_limit`` (bytes, NumPy arrays,
torch tensors when torch is already imported, and lists, tuples and dicts of
them) is not sent back to the driver. The actor returns it as the second
return object of the call, so Ray stores it in the object store of the
actor's node **owned by the driver** (the caller of a task owns its return
objects), and the driver gets a :class:`PayloadRef`: the ``ObjectRef``, the
size, dtype and shape where known, and a CRC-32 of the bytes. The driver can
pass that handle as an argument to another tool call, or to any Ray actor or
task, and the receiver resolves it from the object store: zero-copy on the
same node, node to node otherwise. The bytes never pass through the driver.

Lifetime (see ``docs/ray.md``): an object lives while any reference to it
does. The driver's reference is dropped by :meth:`PayloadRef.release`, by
leaving an ``async with`` / ``with`` block over the handle, by the pool's
``aclose()``, or when the handle is garbage-collected; a receiver that
deserialized a copy of the handle is a *borrower* and keeps the object alive
until it drops its copy. Because the driver owns it, the object outlives the
producing call and the producing actor (killed, evicted, replaced): it is
lost only when the driver process exits or the node holding it dies.

In call arguments, payloads (a :class:`PayloadRef`, or raw bytes, arrays and
tensors the driver passes itself) are swapped for small JSON stand-ins while
the arguments are checked against the tool's schema, then put back
(:func:`split_payloads`, :func:`restore_payloads`).

This module must never fetch a payload's bytes into the driver: only
:meth:`PayloadRef.resolve` and :meth:`PayloadRef.get` read them, and those
are meant for the receiving side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import zlib
from collections.abc import Iterator, Mapping
from typing import Any, Final

import ray
import ray.exceptions

from agent_backend.errors import PayloadLost
from agent_backend.lifecycle import AsyncResource, SyncResource

__all__ = [
    "PayloadInfo",
    "PayloadRef",
    "checksum",
    "contains_payloads",
    "describe_payload",
    "payload_size",
    "restore_payloads",
    "split_payloads",
]

#: Containers are walked this deep for sizes and checksums; deeper levels count as opaque.
_MAX_DEPTH: Final = 32

#: The key of the stand-in that replaces a :class:`PayloadRef` while arguments are validated.
_MARKER: Final = "$agent_backend.payload"


def _torch_tensor_type() -> type[Any] | None:
    # Only when the tool's process already imported torch: never import it here.
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return tensor if isinstance(tensor, type) else None


def _numpy_array_type() -> type[Any] | None:
    numpy = sys.modules.get("numpy")
    array = getattr(numpy, "ndarray", None)
    return array if isinstance(array, type) else None


def _buffers(value: Any, depth: int = 0) -> Iterator[memoryview | bytes]:
    """The raw byte buffers in ``value``, in a fixed order (what size and checksum cover)."""
    if isinstance(value, (bytes, bytearray)):
        yield memoryview(value)
        return
    if isinstance(value, memoryview):
        yield value.cast("B") if value.c_contiguous else memoryview(value.tobytes())
        return
    if isinstance(value, str):
        yield value.encode("utf-8", errors="surrogatepass")
        return
    ndarray = _numpy_array_type()
    if ndarray is not None and isinstance(value, ndarray):
        if value.dtype.hasobject or value.nbytes == 0:
            return  # object arrays hold pointers, not data; nothing to cover
        if not value.flags.c_contiguous:
            value = value.copy(order="C")
        yield memoryview(value.reshape(-1).view("u1"))
        return
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(value, tensor):
        host = value.detach().to("cpu").contiguous()
        if host.numel():
            yield memoryview(host.reshape(-1).view(_torch_uint8()).numpy())
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for item in value.values():
            yield from _buffers(item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _buffers(item, depth + 1)


def _torch_uint8() -> Any:
    return sys.modules["torch"].uint8


_SCALARS: Final = frozenset({int, float, bool, type(None)})


def payload_size(value: Any, depth: int = 0) -> int:
    """Bytes of array, tensor, bytes and string data in ``value`` (containers summed).

    Cheap: sizes come from ``nbytes``/``len`` without touching the data. Any
    other object counts as 0 and is returned inline.
    """
    if type(value) in _SCALARS:  # the common small result: no type lookups
        return 0
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value.nbytes if isinstance(value, memoryview) else len(value)
    if isinstance(value, str):
        return len(value)
    ndarray = _numpy_array_type()
    if ndarray is not None and isinstance(value, ndarray):
        return int(value.nbytes)
    tensor = _torch_tensor_type()
    if tensor is not None and isinstance(value, tensor):
        return int(value.element_size() * value.numel())
    if depth >= _MAX_DEPTH:
        return 0
    if isinstance(value, Mapping):
        return sum(payload_size(item, depth + 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_size(item, depth + 1) for item in value)
    return 0


def checksum(value: Any) -> str:
    """``crc32:<8 hex digits>`` over the data buffers of ``value`` (see :func:`payload_size`).

    The same function on both sides of a hand-off tells whether the consumer
    got the producer's bytes. CRC-32 runs at memory speed (about 2 GB/s here).
    """
    crc = 0
    for buffer in _buffers(value):
        crc = zlib.crc32(buffer, crc)
    return f"crc32:{crc:08x}"


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadInfo:
    """What is known about a payload without reading it."""

    size: int
    """Bytes of data (``nbytes`` of an array, ``len`` of bytes; containers summed)."""
    type: str
    """The result's type: ``numpy.ndarray``, ``torch.Tensor``, ``bytes``, ``dict``..."""
    dtype: str | None = None
    """The element type of an array or tensor result; None for others."""
    shape: tuple[int, ...] | None = None
    """The shape of an array or tensor result; None for others."""
    checksum: str | None = None
    """``crc32:...`` of the data, computed by the producer (:func:`checksum`)."""


def describe_payload(
    value: Any, *, size: int | None = None, with_checksum: bool = True
) -> PayloadInfo:
    """The :class:`PayloadInfo` of ``value`` (the checksum reads the data once)."""
    kind = type(value)
    dtype = shape = None
    ndarray = _numpy_array_type()
    tensor = _torch_tensor_type()
    if (ndarray is not None and isinstance(value, ndarray)) or (
        tensor is not None and isinstance(value, tensor)
    ):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = tuple(int(n) for n in value.shape)
    module = kind.__module__
    return PayloadInfo(
        size=payload_size(value) if size is None else size,
        type=kind.__qualname__
        if module == "builtins"
        else f"{module.split('.')[0]}.{kind.__qualname__}",
        dtype=dtype,
        shape=shape,
        checksum=checksum(value) if with_checksum else None,
    )


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)
class PayloadRef(SyncResource, AsyncResource):
    """A tool result kept in the Ray object store; pass it on instead of its bytes.

    Pass it as (part of) an argument of another tool call on a Ray pool, or
    to any Ray actor or task; there, :meth:`resolve` (async) or :meth:`get`
    reads the value. ``release()`` drops this handle's reference (see the
    module docstring for who keeps the object alive); ``async with ref:`` or
    ``with ref:`` releases at the end of the block.
    """

    _ref: Any
    """The ``ray.ObjectRef`` (owned by the driver that made the call); None once released."""
    info: PayloadInfo
    producer: str = ""
    """The actor that produced it (``pool-0.0``)."""
    tool: str = ""
    """The tool whose result it is."""

    @property
    def object_ref(self) -> Any:
        """The underlying ``ray.ObjectRef``; :class:`PayloadLost` once released."""
        if self._ref is None:
            raise PayloadLost(
                f"payload from {self.tool or 'a tool'} on {self.producer or 'an actor'} "
                "was released",
                payload=None,
                cause="released",
                backend="ray",
            )
        return self._ref

    @property
    def id(self) -> str | None:
        """The object's id (hex), None once released."""
        return None if self._ref is None else str(self._ref.hex())

    @property
    def size(self) -> int:
        return self.info.size

    @property
    def dtype(self) -> str | None:
        return self.info.dtype

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.info.shape

    @property
    def checksum(self) -> str | None:
        return self.info.checksum

    def is_released(self) -> bool:
        return self._ref is None

    def release(self) -> None:
        """Drop this handle's reference; idempotent. Borrowers that hold a copy keep theirs."""
        self._ref = None

    def close(self) -> None:
        """:meth:`release`, as ``with ref:`` calls it at the end of the block."""
        self.release()

    async def aclose(self) -> None:
        """:meth:`release`, as ``async with ref:`` calls it at the end of the block."""
        self.release()

    def __repr__(self) -> str:
        info = self.info
        what = info.type
        if info.dtype is not None and info.shape is not None:
            what = f"{info.dtype}{list(info.shape)}"
        state = "released" if self._ref is None else self._ref.hex()[:16]
        return (
            f"<PayloadRef {what} {info.size} bytes {info.checksum or ''} "
            f"from {self.producer or '?'} [{state}]>"
        )

    async def resolve(self, *, verify: bool = False) -> Any:
        """The value, read from the object store (on the receiving side, not the driver).

        ``verify`` recomputes the checksum and raises :class:`PayloadLost` on a mismatch.
        Ray's object errors (owner died, object lost) become :class:`PayloadLost`.
        """
        ref = self.object_ref
        with _map_object_errors(self):
            value = await ref
        return self._verified(value) if verify else value

    def get(self, *, timeout: float | None = None, verify: bool = False) -> Any:
        """:meth:`resolve` for synchronous code (a plain Ray task or a threaded actor)."""
        ref = self.object_ref
        with _map_object_errors(self):
            value = ray.get(ref, timeout=timeout)
        return self._verified(value) if verify else value

    def _verified(self, value: Any) -> Any:
        if self.info.checksum is not None:
            got = checksum(value)
            if got != self.info.checksum:
                raise PayloadLost(
                    f"payload {self.id} is corrupt: checksum {got}, expected {self.info.checksum}",
                    payload=self.id,
                    cause="checksum mismatch",
                    backend="ray",
                )
        return value


@contextlib.contextmanager
def _map_object_errors(payload: PayloadRef) -> Iterator[None]:
    """Ray's object errors (owner died, object lost or freed), as :class:`PayloadLost`."""
    try:
        yield
    except _OBJECT_ERRORS as exc:
        cause = type(exc).__name__
        raise PayloadLost(
            f"payload {payload.id} from {payload.producer or '?'} is gone ({cause})",
            payload=payload.id,
            cause=cause,
            backend="ray",
        ) from None


_OBJECT_ERRORS: Final = (
    ray.exceptions.ObjectLostError,  # OwnerDiedError, ObjectFreedError, ... subclass it
    ray.exceptions.ObjectFetchTimedOutError,
    ray.exceptions.ReferenceCountingAssertionError,
    ray.exceptions.ObjectReconstructionFailedError,
)


# -- payloads inside call arguments --------------------------------------------------------------
#
# Arguments are checked against the tool's JSON Schema, which only knows JSON
# values. Payloads (a PayloadRef, or raw data: bytes, arrays, tensors) are
# swapped for small JSON stand-ins for that check and put back afterwards, so
# a parameter annotated ``Any`` takes them wherever they appear.


def _is_data(value: Any) -> bool:
    if isinstance(value, (PayloadRef, bytes, bytearray, memoryview)):
        return True
    ndarray = _numpy_array_type()
    if ndarray is not None and isinstance(value, ndarray):
        return True
    tensor = _torch_tensor_type()
    return tensor is not None and isinstance(value, tensor)


def contains_payloads(value: Any, depth: int = 0) -> bool:
    """True when ``value`` (arguments) holds a :class:`PayloadRef` or raw data (bytes, arrays).

    Raises :class:`PayloadLost` for a released :class:`PayloadRef`, before anything is sent.
    """
    if isinstance(value, PayloadRef):
        _ = value.object_ref
        return True
    if _is_data(value):
        return True
    if depth >= _MAX_DEPTH:
        return False
    items = value.values() if isinstance(value, Mapping) else value
    if not isinstance(value, (Mapping, list, tuple)):
        return False
    found = False
    for item in items:
        found = contains_payloads(item, depth + 1) or found
    return found


def _swap(value: Any, swap: Any, depth: int = 0) -> Any:
    replaced = swap(value)
    if replaced is not value:
        return replaced
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {key: _swap(item, swap, depth + 1) for key, item in value.items()}
    if isinstance(value, list):
        return [_swap(item, swap, depth + 1) for item in value]
    if isinstance(value, tuple):
        return tuple(_swap(item, swap, depth + 1) for item in value)
    return value


def split_payloads(arguments: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """``arguments`` with each payload swapped for a JSON stand-in, and the payloads in order.

    The stand-in is an object with the payload's size, type, dtype, shape and
    checksum (None for raw data), so the check reads no payload.
    :func:`restore_payloads` puts the values back in its place.
    """
    payloads: list[Any] = []

    def to_marker(value: Any) -> Any:
        if not _is_data(value):
            return value
        info = (
            value.info
            if isinstance(value, PayloadRef)
            else describe_payload(value, with_checksum=False)
        )
        payloads.append(value)
        return {
            _MARKER: len(payloads) - 1,
            "size": info.size,
            "type": info.type,
            "dtype": info.dtype,
            "shape": list(info.shape) if info.shape is not None else None,
            "checksum": info.checksum,
        }

    jsonable: dict[str, Any] = _swap(dict(arguments), to_marker)
    return jsonable, payloads


async def restore_payloads(prepared: dict[str, Any], payloads: list[Any]) -> dict[str, Any]:
    """``prepared`` with each stand-in replaced by its value (a PayloadRef read here, the receiver)."""
    values = [
        await payload.resolve() if isinstance(payload, PayloadRef) else payload
        for payload in payloads
    ]

    def from_marker(value: Any) -> Any:
        if isinstance(value, Mapping) and type(value.get(_MARKER)) is int:
            index = value[_MARKER]
            if 0 <= index < len(values):
                return values[index]
        return value

    restored: dict[str, Any] = _swap(prepared, from_marker)
    return restored
