"""The fast path's copy of dict arguments: a deep copy of a plain JSON object, or ``None``.

:func:`plain_copy` ``(value, max_depth, max_bytes)`` returns a deep copy of
``value`` when it is a plain JSON object (exact ``dict``/``list`` containers,
exact ``str`` keys, exact ``str``, ``int`` within 64 bits, finite ``float``,
``bool``, ``None``) no deeper than ``max_depth`` levels (the top object is
level 1) and no larger than ``max_bytes`` as compact JSON. Anything else gives
``None`` and the caller takes the checked path, which names what is wrong.

Two implementations give the same answers (``tests/test_schema_plain.py``):
the C extension ``_plain`` (built by ``setup.py`` when a compiler is there;
one pass that copies and checks), and the pure-Python one below (orjson
checks and sizes; several times slower on small objects). :data:`ACCELERATED` says
which one is in use. When built, the C extension also holds the hot path of
``prepare`` itself (``DictPrepare``, ``CachedPrepare``): copy, validate and return a
valid dict without a Python frame, and its quick check (``QuickNode``, ``QuickValid``,
``quick.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from agent_backend.schema.parse import PLAIN_ONLY, has_big_float, has_non_finite, shallow_enough

if TYPE_CHECKING:
    from agent_backend.schema import _plain

__all__ = [
    "ACCELERATED",
    "ArrayFix",
    "CachedPrepare",
    "DictPrepare",
    "NullLeftOut",
    "NumericFix",
    "ObjectFix",
    "QuickNode",
    "QuickValid",
    "ScalarFix",
    "big_float",
    "plain_copy",
    "plain_copy_python",
    "set_sentinels",
]

#: Subclasses of str, int, dict and list go to ``default`` (there is none, so
#: orjson raises): only exact types pass, as in the C implementation.
_EXACT_ONLY = PLAIN_ONLY | orjson.OPT_PASSTHROUGH_SUBCLASS
_SCALAR_TYPES = frozenset((str, int, float, bool, type(None)))


def plain_copy_python(value: Any, max_depth: int, max_bytes: int) -> dict[str, Any] | None:
    """The pure-Python :func:`plain_copy`: orjson checks, sizes and (when nested) copies.

    orjson refuses subclasses of str, int, dict and list here, integers beyond
    64 bits and strings that are not UTF-8. The encoding tells the value's
    shape without a Python-level walk: one ``{`` and no ``[`` means no
    container inside (a bracket in a string only sends it the slower way), so
    once the values' types are plain a shallow copy is a full copy; no
    ``null`` means no NaN or infinity either (orjson writes them as null).
    Anything nested is decoded back (a deep copy) and compared with the
    original: what orjson converts quietly (NaN to null, tuples to lists,
    enums and UUIDs to their values) makes the copy differ, and is refused.
    """
    if type(value) is not dict or max_depth < 1:
        return None
    try:
        encoded = orjson.dumps(value, None, _EXACT_ONLY)  # positional: no keyword parsing
    except TypeError:
        return None
    if len(encoded) > max_bytes:
        return None
    # Int operands: `in` with an int and rfind skip bytes' buffer protocol.
    if 91 not in encoded and encoded.rfind(123) == 0:
        if not _SCALAR_TYPES.issuperset(map(type, value.values())):
            return None  # an enum, a UUID: orjson wrote its value
        if encoded.find(b"null") >= 0 and has_non_finite(value):
            return None
        return {**value}
    copied = orjson.loads(encoded)
    if copied != value or not shallow_enough(encoded, copied, max_depth):
        return None
    return copied  # type: ignore[no-any-return]


plain_copy: Callable[[Any, int, int], dict[str, Any] | None]
#: :func:`~agent_backend.schema.parse.has_big_float`, in C when built.
big_float: Callable[[Any], bool]
#: The hot path of ``prepare`` without a Python frame (``prepare.py`` builds them), or
#: ``None`` when the C extension is not built.
DictPrepare: type[_plain.DictPrepare] | None
CachedPrepare: type[_plain.CachedPrepare] | None
#: The common repair nodes without a Python frame (``coerce_nodes.py`` builds them), or
#: ``None`` when the C extension is not built.
NumericFix: type[_plain.NumericFix] | None
ScalarFix: type[_plain.ScalarFix] | None
ObjectFix: type[_plain.ObjectFix] | None
ArrayFix: type[_plain.ArrayFix] | None
NullLeftOut: type[_plain.NullLeftOut] | None
TypedFix: type[_plain.TypedFix] | None
MemberFix: type[_plain.MemberFix] | None
JsonParse: type[_plain.JsonParse] | None
#: The quick check of the fast path (``quick.py`` builds it), or ``None`` when not built.
QuickNode: type[_plain.QuickNode] | None
QuickValid: type[_plain.QuickValid] | None
set_sentinels: Callable[[object, object], None] | None
try:
    from agent_backend.schema._plain import (
        ArrayFix,
        CachedPrepare,
        DictPrepare,
        JsonParse,
        MemberFix,
        NullLeftOut,
        NumericFix,
        ObjectFix,
        QuickNode,
        QuickValid,
        ScalarFix,
        TypedFix,
        big_float,
        plain_copy,
        set_sentinels,
    )
except ImportError:  # not built (no C compiler at install): same answers, slower
    plain_copy = plain_copy_python
    big_float = has_big_float
    DictPrepare = CachedPrepare = None
    NumericFix = ScalarFix = ObjectFix = ArrayFix = NullLeftOut = set_sentinels = None
    TypedFix = MemberFix = JsonParse = QuickNode = QuickValid = None
    ACCELERATED = False
else:
    ACCELERATED = True
