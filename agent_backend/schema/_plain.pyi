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
