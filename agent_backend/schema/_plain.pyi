from collections.abc import Callable
from typing import Any

def plain_copy(value: Any, max_depth: int, max_bytes: int, /) -> dict[str, Any] | None: ...
def big_float(value: Any, /) -> bool: ...

class DictPrepare:
    def __init__(
        self,
        is_valid: Callable[[Any], bool],
        max_depth: int,
        max_bytes: int,
        slow: Callable[..., dict[str, Any]],
        invalid: Callable[[Any, str | None, dict[str, Any]], dict[str, Any]],
        /,
    ) -> None: ...
    def __call__(
        self, arguments: Any, tool: str | None = None, inject_defaults: bool = False
    ) -> dict[str, Any]: ...

class CachedPrepare:
    def __init__(
        self, cache: dict[int, tuple[Any, ...]], slow: Callable[..., dict[str, Any]], /
    ) -> None: ...
    def __call__(
        self,
        schema: Any,
        arguments: Any,
        *,
        tool: str | None = None,
        inject_defaults: bool = False,
    ) -> dict[str, Any]: ...

# The repair nodes (_repair.c): each stands for the Python function ``slow`` of
# agent_backend/schema/coerce_nodes.py built from the same arguments.
_Fix = Callable[[Any, int, bool], Any]

class NumericFix:
    def __init__(
        self, allowed: tuple[type, ...], as_number: bool, max_text: int, slow: _Fix, /
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class ScalarFix:
    def __init__(
        self, allowed: tuple[type, ...], rules: tuple[Callable[[str], Any], ...], slow: _Fix, /
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class ObjectFix:
    def __init__(
        self,
        node: Any,
        fixes: dict[str, _Fix],
        parse: Callable[[str, str, type, int], Any] | None,
        generic: _Fix,
        accepts_of: Callable[[Any], Callable[[Any], bool]],
        check_children: bool,
        slow: _Fix,
        /,
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class ArrayFix:
    def __init__(
        self,
        node: Any,
        each: _Fix,
        parse: Callable[[str, str, type, int], Any] | None,
        generic: _Fix,
        accepts_of: Callable[[Any], Callable[[Any], bool]],
        check_items: bool,
        slow: _Fix,
        /,
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class NullLeftOut:
    def __init__(self, fix: _Fix, slow: _Fix, /) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

def set_sentinels(leave_out: object, fail: object, /) -> None: ...

class TypedFix:
    def __init__(
        self,
        allowed: tuple[type, ...],
        rules: tuple[Callable[[str], Any], ...],
        openers: tuple[tuple[str, type], ...],
        wrap: bool,
        parse: Callable[[str, str, type, int], Any],
        slow: _Fix,
        /,
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class MemberFix:
    def __init__(
        self,
        strings: frozenset[str],
        numbers: frozenset[int | float],
        flags: frozenset[bool],
        null_ok: bool,
        rules: tuple[Callable[[str], Any], ...],
        slow: _Fix,
        /,
    ) -> None: ...
    def __call__(self, value: Any, depth: int, check: bool, /) -> Any: ...

class JsonParse:
    def __init__(
        self,
        loads: Callable[[str], Any],
        max_depth: int,
        slow: Callable[[str, str, type, int], Any],
        /,
    ) -> None: ...
    def __call__(self, text: str, opener: str, wanted: type, depth: int, /) -> Any: ...

# The quick check of the fast path (_quick.c); quick.py builds the nodes.
class QuickNode:
    def __init__(self, *fields: Any) -> None: ...
    def accepts(self, value: Any, /) -> bool: ...

class QuickValid:
    def __init__(self, root: QuickNode, fallback: Callable[[Any], bool], /) -> None: ...
    def __call__(self, value: Any, /) -> bool: ...
    @property
    def root(self) -> QuickNode: ...
    @property
    def fallback(self) -> Callable[[Any], bool]: ...
