"""From raw model arguments to arguments a tool may run with: parse, validate, repair, validate.

Pure: no I/O. The pipeline (docs/tool-calls.md):

1. parse exactly one JSON object within the limits (``parse.py``), or fail;
2. validate against the compiled validator of the *original* schema; valid
   arguments are returned as they are (the fast path);
3. otherwise repair what fails, guided by the schema with its local
   ``$ref``s resolved (``refs.py``, ``coerce.py``);
4. validate again against the original schema; anything still wrong raises
   :class:`~agent_backend.errors.ToolArgumentError` with bounded issues.

A schema is compiled once (:func:`compile_schema`); the validator of every
subschema that repair consults is compiled on first use and kept.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Mapping
from typing import Any

import jsonschema
import jsonschema.exceptions

from agent_backend.errors import SchemaError, SchemaRefError, ToolArgumentError
from agent_backend.schema.coerce import Coercer
from agent_backend.schema.dialect import Dialect
from agent_backend.schema.parse import DEFAULT_LIMITS, Limits, fast_parse, parse_arguments
from agent_backend.schema.refs import resolve_schema
from agent_backend.schema.validate import Validator, compile_validator, issues_of, pointer_of

__all__ = ["CompiledSchema", "compile_schema", "prepare_arguments"]

Arguments = str | bytes | bytearray | Mapping[str, Any]


class CompiledSchema:
    """A tool's argument schema, checked, resolved and compiled once.

    Immutable after construction: it keeps a deep copy of the schema it was
    given, so later changes to the caller's dict are not seen.
    """

    __slots__ = (
        "_coercion_refs",
        "_patterns",
        "_sub_validators",
        "_validator",
        "defs",
        "dialect",
        "limits",
        "resolved",
        "schema",
        "source",
    )

    def __init__(
        self,
        schema: Mapping[str, Any] | bool,
        *,
        source: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        if not isinstance(schema, (Mapping, bool)):
            raise SchemaError(
                f"a schema must be an object or a boolean, not {type(schema).__name__}",
                source=source,
            )
        original: dict[str, Any] | bool = (
            schema if isinstance(schema, bool) else copy.deepcopy(dict(schema))
        )
        _check_against_meta_schema(original, source)
        resolution = resolve_schema(original, source=source)
        if resolution.external_refs:
            first = resolution.external_refs[0]
            raise SchemaRefError(
                f"external $ref {first.ref!r} is not fetched; inline it into the schema"
                f" ({len(resolution.external_refs)} external reference(s) in all)",
                ref=first.ref,
                source=source,
                pointer=first.pointer,
            )
        self.schema = original
        self.source = source
        self.limits = limits
        self.dialect: Dialect = resolution.dialect
        self.resolved = resolution.schema
        self.defs: dict[str, Any] = {}
        if isinstance(self.resolved, dict):
            kept = self.resolved.get(self.dialect.defs_keyword)
            if isinstance(kept, dict):
                self.defs = kept
        self._validator: Validator = compile_validator(original, source=source)
        self._sub_validators: dict[int, tuple[Any, Validator]] = {}
        self._coercion_refs: dict[str, Any] = {}
        self._patterns: dict[str, re.Pattern[str] | None] = {}

    def __repr__(self) -> str:
        return f"<CompiledSchema {self.source or 'anonymous'} {self.dialect.value}>"

    def is_valid(self, instance: Any) -> bool:
        return bool(self._validator.is_valid(instance))

    def prepare(
        self,
        arguments: Arguments,
        *,
        tool: str | None = None,
        inject_defaults: bool = False,
    ) -> dict[str, Any]:
        """Arguments the tool may run with, or :class:`ToolArgumentError`. Never mutates ``arguments``."""
        value = fast_parse(arguments, self.limits.max_bytes, self.limits.max_depth)
        if value is None:
            value = parse_arguments(arguments, limits=self.limits, tool=tool)
        if not inject_defaults and self._validator.is_valid(value):
            return value
        coercer = Coercer(
            self.resolved,
            is_valid=self._subschema_accepts,
            max_depth=self.limits.max_depth,
            inject_defaults=inject_defaults,
            ref_cache=self._coercion_refs,
            pattern_cache=self._patterns,
        )
        repaired = coercer.coerce(value)
        if self._validator.is_valid(repaired):
            assert isinstance(repaired, dict)
            return repaired
        issues = issues_of(self._validator, repaired, limit=self.limits.max_issues)
        count = len(issues)
        noun = "problem" if count == 1 else "problems"
        more = "+" if count >= self.limits.max_issues else ""
        raise ToolArgumentError(
            f"{count}{more} {noun} with the arguments", issues=issues, tool=tool
        )

    def _subschema_accepts(self, node: Any, value: Any) -> bool:
        entry = self._sub_validators.get(id(node))
        if entry is None:
            entry = (node, self._compile_subschema(node))
            self._sub_validators[id(node)] = entry
        return bool(entry[1].is_valid(value))

    def _compile_subschema(self, node: Any) -> Validator:
        wrapper: dict[str, Any] = {"$schema": self.dialect.meta_schema_uri, "allOf": [node]}
        if self.defs:
            wrapper[self.dialect.defs_keyword] = self.defs
        return compile_validator(wrapper, source=self.source)


def _check_against_meta_schema(schema: dict[str, Any] | bool, source: str | None) -> None:
    """A malformed schema fails here, at load, with the pointer of the first problem."""
    if isinstance(schema, bool):
        return
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)  # raises the best-matching problem
    except jsonschema.exceptions.SchemaError as exc:
        raise SchemaError(
            f"not a valid JSON Schema: {exc.message[:300]}",
            source=source,
            pointer=pointer_of(exc.absolute_path),
        ) from None


def compile_schema(
    schema: Mapping[str, Any] | bool,
    *,
    source: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> CompiledSchema:
    """Check, resolve and compile ``schema`` once, for many calls of :meth:`CompiledSchema.prepare`."""
    return CompiledSchema(schema, source=source, limits=limits)


_CACHE_SIZE = 512
_cache: dict[int, tuple[object, CompiledSchema]] = {}
_cache_lock = threading.Lock()


def _compiled_for(schema: Mapping[str, Any] | bool | CompiledSchema) -> CompiledSchema:
    if isinstance(schema, CompiledSchema):
        return schema
    entry = _cache.get(id(schema))
    if entry is not None and entry[0] is schema:
        return entry[1]
    compiled = CompiledSchema(schema)
    with _cache_lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[id(schema)] = (schema, compiled)
    return compiled


def prepare_arguments(
    schema: Mapping[str, Any] | bool | CompiledSchema,
    arguments: Arguments,
    *,
    tool: str | None = None,
    inject_defaults: bool = False,
) -> dict[str, Any]:
    """Parse, validate and (only where needed) repair ``arguments`` for ``schema``.

    ``schema`` may be a :class:`CompiledSchema` or a schema dict; a dict is
    compiled on first use and the compiled form kept (keyed by the dict's
    identity, so treat a schema as immutable once used). Raises
    :class:`ToolArgumentError` for anything that cannot be made valid, and
    :class:`SchemaError` for a malformed schema.
    """
    return _compiled_for(schema).prepare(arguments, tool=tool, inject_defaults=inject_defaults)
