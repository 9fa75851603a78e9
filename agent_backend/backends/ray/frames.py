"""A call's request and its outcome as bytes the pool and its actors pickle themselves.

Ray hands a ``bytes`` argument or return value on nearly as it is, while any
other value goes through its serializer (msgpack, then cloudpickle with
out-of-band buffers): measured 0.5 us against 10-12 us for the small tuple of
one call, paid for the request and for the outcome, on both sides. So the pool
pickles a request (tool name and arguments, which the pool already prepared:
JSON values) and the actor its outcome with the standard C pickler, and Ray
carries bytes.

Ray's serializer also registers object references found inside a value (the
owner must learn who borrows an object, or it frees it); the standard pickler
pickles an ``ObjectRef`` silently without doing so. This pickler refuses
Ray's handles (object references, their generators, actor handles), and
:func:`encode` then answers ``None``: such a value, like one only cloudpickle
can pickle (a lambda, a class defined in a function), goes to Ray as before.
"""

from __future__ import annotations

import io
import pickle
import threading
from typing import Any, Final

import ray
import ray._raylet
import ray.actor

__all__ = ["decode", "encode"]


class _Refused(Exception):
    """A value holds something only Ray's serializer may carry."""


def _ray_handles() -> tuple[type, ...]:
    names = ("ObjectRef", "ObjectRefGenerator", "DynamicObjectRefGenerator")
    found = [getattr(ray._raylet, name, None) for name in names]
    found.append(ray.actor.ActorHandle)
    return tuple(kind for kind in found if isinstance(kind, type))


_RAY_HANDLES: Final = _ray_handles()


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        # Not called for None, bools and exact int, float, bytes, str, dict, set, frozenset,
        # list and tuple: the check costs plain data nothing.
        if isinstance(obj, _RAY_HANDLES):
            raise _Refused(type(obj).__name__)
        return NotImplemented


class _Encoder(threading.local):
    """One pickler and buffer per thread, reused: making them costs more than pickling
    a call's few values."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()
        self.pickler = _Pickler(self.buffer, protocol=5)


_encoder = _Encoder()


def encode(value: Any) -> bytes | None:
    """``value`` pickled, or ``None`` when it must go through Ray's serializer instead
    (it holds a Ray handle, or the standard pickler cannot pickle it)."""
    encoder = _encoder
    buffer = encoder.buffer
    buffer.seek(0)
    buffer.truncate()
    try:
        encoder.pickler.dump(value)
    except Exception:  # _Refused, PicklingError, or whatever a __reduce__ raised
        return None
    finally:
        encoder.pickler.clear_memo()  # it holds what it pickled until then
    return buffer.getvalue()


def decode(data: bytes) -> Any:
    """What :func:`encode` pickled (raises what unpickling raises)."""
    return pickle.loads(data)
