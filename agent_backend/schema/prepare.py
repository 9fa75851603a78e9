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
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jsonschema
import jsonschema.exceptions
import jsonschema_rs
import orjson

from agent_backend.errors import ArgumentIssue, SchemaError, SchemaRefError, ToolArgumentError
from agent_backend.schema.coerce import Coercer
from agent_backend.schema.dialect import Dialect
from agent_backend.schema.keywords import check_json_shape, map_schema
from agent_backend.schema.parse import (
    DEFAULT_LIMITS,
    Limits,
    copy_plain_object,
    has_big_float,
    json_type_name,
    may_hold_big_integer,
    parse_arguments,
    shallow_enough,
)
from agent_backend.schema.refs import resolve_schema
from agent_backend.schema.validate import (
    Validator,
    compile_validator,
    issues_of,
    pointer_of,
    render_value,
)

__all__ = ["CompiledSchema", "compile_schema", "prepare_arguments"]

Arguments = str | bytes | bytearray | Mapping[str, Any]


class CompiledSchema:
    """A tool's argument schema, checked, resolved and compiled once.

    Immutable after construction: it keeps a deep copy of the schema it was
    given, so later changes to the caller's dict are not seen.
    """

    __slots__ = (
        "_coercers",
        "_is_valid",
        "_sub_validators",
        "_validator",
        "_validators_by_text",
        "defs",
        "dialect",
        "limits",
        "prepare",
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
        check_json_shape(schema, source=source)  # before anything recursive walks it
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
        self._is_valid = self._validator.is_valid
        fast_validator = (
            compile_validator(_guard_integers(original), source=source)
            if isinstance(original, dict)
            else self._validator
        )
        self.prepare: PrepareFn = _fast_path(
            self._prepare,
            self._repair,
            fast_validator.is_valid,
            # The dict's copy holds no integer beyond 64 bits: the schema's own validator.
            self._is_valid,
            max_bytes=limits.max_bytes,
            max_depth=limits.max_depth,
        )
        """Arguments the tool may run with, or :class:`ToolArgumentError`; never mutates ``arguments``.

        ``prepare(arguments, tool=None, inject_defaults=False)``: a closure
        built once per schema (the hot path), falling back to the full pipeline.
        """
        self._sub_validators: dict[int, tuple[Any, Callable[[Any], bool]]] = {}
        self._validators_by_text: dict[bytes, Validator] = {}
        self._coercers = tuple(
            Coercer(
                self.resolved,
                is_valid=self._subschema_accepts,
                accepts_of=self._accepts_of,
                max_depth=limits.max_depth,
                inject_defaults=inject,
            )
            for inject in (False, True)
        )

    def __repr__(self) -> str:
        return f"<CompiledSchema {self.source or 'anonymous'} {self.dialect.value}>"

    def is_valid(self, instance: Any) -> bool:
        return bool(self._validator.is_valid(instance))

    def _prepare(
        self,
        arguments: Arguments,
        *,
        tool: str | None = None,
        inject_defaults: bool = False,
        parsed: dict[str, Any] | None = None,
        known_invalid: bool = False,
    ) -> dict[str, Any]:
        """The whole pipeline; :attr:`prepare` is its fast path and falls back to it.

        ``parsed`` is what the fast path already read and bounded; JSON text is
        read again only when it may hold an integer orjson could not keep
        exact (a float that large; a dict's copy never holds one: orjson
        refuses to encode such an integer).
        ``known_invalid``: the fast path's validator already refused ``parsed``
        (it is stricter than the schema at most, so repair is needed or harmless).
        """
        if parsed is None or (
            type(arguments) is not dict
            and may_hold_big_integer(arguments)  # type: ignore[arg-type]
            and has_big_float(parsed)
        ):
            value = parse_arguments(arguments, limits=self.limits, tool=tool)
            valid = self._is_valid(value)
        else:
            value = parsed
            valid = False if known_invalid else self._is_valid(value)
        if valid and not inject_defaults:
            return value
        coercer = self._coercers[inject_defaults]
        return self._checked(coercer.coerce(value, known_invalid=not valid), tool)

    def _checked(self, repaired: Any, tool: str | None) -> dict[str, Any]:
        """Repaired arguments if the schema accepts them as an object; else the refusal."""
        if self._is_valid(repaired):
            if type(repaired) is dict:
                return repaired
            # A top level that wants no object (``"type": "array"``) was met by a repair
            # that wrapped the object: tool arguments are an object, so this is refused.
            message = (
                f"the arguments could only be made valid as {json_type_name(repaired)}, "
                "and tool arguments are a JSON object"
            )
            raise ToolArgumentError(
                message,
                issues=[ArgumentIssue("", message, expected="object")],
                tool=tool,
            )
        issues = issues_of(self._validator, repaired, limit=self.limits.max_issues)
        if not issues:
            # jsonschema-rs's is_valid refused what its iter_errors finds nothing wrong with
            # (a "required" that names a property twice): still a refusal the model can read.
            issues = [
                ArgumentIssue(
                    "",
                    "the arguments do not match the tool's schema",
                    expected="arguments the schema accepts",
                    got=render_value(repaired),
                )
            ]
        count = len(issues)
        noun = "problem" if count == 1 else "problems"
        more = "+" if count >= self.limits.max_issues else ""
        raise ToolArgumentError(
            f"{count}{more} {noun} with the arguments", issues=issues, tool=tool
        )

    def _repair(
        self, arguments: Arguments, tool: str | None, parsed: dict[str, Any]
    ) -> dict[str, Any]:
        """What the fast path read and its validator refused, repaired and validated: the
        pipeline's repair step without its other branches. Text that may hold an integer
        orjson could not keep exact takes the whole pipeline (which reads it again); a
        dict's copy never holds one (orjson refuses to encode such an integer)."""
        if (
            type(arguments) is not dict
            and may_hold_big_integer(arguments)  # type: ignore[arg-type]
            and has_big_float(parsed)
        ):
            return self._prepare(arguments, tool=tool, parsed=parsed, known_invalid=True)
        repaired = self._coercers[0].coerce(parsed, known_invalid=True)
        if type(repaired) is dict and self._is_valid(repaired):
            return repaired
        return self._checked(repaired, tool)  # says why, or refuses a non-object

    def _subschema_accepts(self, node: Any, value: Any) -> bool:
        return self._accepts_of(node)(value)

    def _accepts_of(self, node: Any) -> Callable[[Any], bool]:
        """Whether ``node`` (a subschema of the resolved schema) accepts a value: its validator's
        ``is_valid``, compiled on first use.

        A subschema that cannot be compiled on its own (``"required": ["a", "a"]`` reached
        by a ``$ref`` from a place no meta-schema check looks at, now where one does) is
        taken to accept nothing: repair then leaves it aside, and the schema's own validator
        still decides. A call never raises ``SchemaError`` for a schema that loaded.
        """
        entry = self._sub_validators.get(id(node))
        if entry is None:
            accepts: Callable[[Any], bool]
            try:
                accepts = self._validator_of(node).is_valid
            except SchemaError:
                accepts = _accepts_nothing
            entry = (node, accepts)
            self._sub_validators[id(node)] = entry
        return entry[1]

    def _validator_of(self, node: Any) -> Validator:
        """One validator per distinct subschema text: resolving copies a subschema to every
        place that uses it (1,000 properties that are each ``{"$ref": "#"}`` are 1,000
        nodes), and a validator that holds the root's ``$defs`` takes milliseconds."""
        try:
            text = orjson.dumps(node, option=orjson.OPT_SORT_KEYS)
        except TypeError:  # an integer beyond 64 bits: compiled on its own
            return self._compile_subschema(node)
        validator = self._validators_by_text.get(text)
        if validator is None:
            validator = self._validators_by_text[text] = self._compile_subschema(node)
        return validator

    def _compile_subschema(self, node: Any) -> Validator:
        wrapper: dict[str, Any] = {"$schema": self.dialect.meta_schema_uri, "allOf": [node]}
        if self.defs:
            wrapper[self.dialect.defs_keyword] = self.defs
        return compile_validator(wrapper, source=self.source)


def _accepts_nothing(value: Any) -> bool:
    return False


class PrepareFn(Protocol):
    def __call__(
        self, arguments: Arguments, tool: str | None = None, inject_defaults: bool = False
    ) -> dict[str, Any]: ...


def _fast_path(
    full: Callable[..., dict[str, Any]],
    repair: Callable[[Arguments, str | None, dict[str, Any]], dict[str, Any]],
    text_is_valid: Callable[[Any], bool],
    dict_is_valid: Callable[[Any], bool],
    *,
    max_bytes: int,
    max_depth: int,
) -> PrepareFn:
    """Build the hot path of one schema: a dict, or short JSON text, that is valid as it is.

    A dict is copied by :func:`~agent_backend.schema.parse.copy_plain_object` (a deep
    copy of a plain JSON object within the limits, else ``None``: then the
    full pipeline says what is wrong) and validated.

    Text shorter than 2 * (max_depth + 1) cannot nest deeper than max_depth
    (``[`` and ``]`` per level), nor can text without ``[`` shorter than
    5 * max_depth + 2 (objects only: ``{"":`` and ``}`` per level), so no depth
    walk is needed; longer text counts its brackets first.
    ``text_is_valid`` is the guarded validator (see :func:`_guard_integers`),
    so an integer beyond 64 bits that orjson read as a float fails here and
    the text is read again, exactly, by the full pipeline.

    What the validator refuses goes to ``repair(arguments, tool, value)``; anything else
    goes through ``full``. Closure
    variables instead of attribute lookups, and parameters with positional
    defaults (keyword-only defaults cost a dict lookup each per call): this
    runs on every call.
    """
    loads = orjson.loads
    short = 2 * (max_depth + 1)
    short_objects = 5 * max_depth + 2

    def prepare(
        arguments: Arguments, tool: str | None = None, inject_defaults: bool = False
    ) -> dict[str, Any]:
        # Early returns, few locals: every bytecode here is paid on every call.
        value: dict[str, Any] | None
        kind = type(arguments)
        if kind is dict:
            value = copy_plain_object(arguments, max_depth, max_bytes)
            if value is None:
                return full(arguments, tool=tool, inject_defaults=inject_defaults)
            if inject_defaults:
                return full(arguments, tool=tool, inject_defaults=True, parsed=value)
            if dict_is_valid(value):
                return value
            return repair(arguments, tool, value)
        if kind is str:
            size = len(arguments)
            if size > max_bytes:
                return full(arguments, tool=tool, inject_defaults=inject_defaults)
            try:
                value = loads(arguments)  # type: ignore[arg-type]
            except ValueError:
                return full(arguments, tool=tool, inject_defaults=inject_defaults)
            if type(value) is not dict or (
                size >= short
                and (size >= short_objects or "[" in arguments)
                and not shallow_enough(arguments, value, max_depth)  # type: ignore[arg-type]
            ):
                return full(arguments, tool=tool, inject_defaults=inject_defaults)
            if inject_defaults:
                return full(arguments, tool=tool, inject_defaults=True, parsed=value)
            if text_is_valid(value):
                return value
            return repair(arguments, tool, value)
        return full(arguments, tool=tool, inject_defaults=inject_defaults)

    return prepare


#: The fast path reads JSON with orjson, which turns an integer beyond 64 bits into a
#: float. Bounds at every integer and number position make such a value fail the fast
#: validator, so the full pipeline re-reads the text exactly. Only ever stricter than
#: the schema. (Where the schema leaves a value untyped, a float is what JSON text of
#: that size means to most parsers, and the fast path keeps it.)
_INT_LIMIT = 2**63 - 1


def _guard_integers(schema: dict[str, Any]) -> Any:
    def bound(node: dict[str, Any], pointer: str) -> dict[str, Any]:
        declared = node.get("type")
        types = declared if isinstance(declared, list) else [declared]
        if "integer" in types or "number" in types:
            high, low = node.get("maximum"), node.get("minimum")
            node["maximum"] = min(high, _INT_LIMIT) if _is_number(high) else _INT_LIMIT  # type: ignore[type-var]
            node["minimum"] = max(low, -_INT_LIMIT) if _is_number(low) else -_INT_LIMIT  # type: ignore[type-var]
        return node

    return map_schema(schema, bound)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_against_meta_schema(schema: dict[str, Any] | bool, source: str | None) -> None:
    """A malformed schema fails here, at load, with the pointer of the first problem.

    jsonschema-rs answers in microseconds; the reference implementation, a
    thousand times slower, runs only to name the best-matching problem.
    """
    if isinstance(schema, bool):
        return
    known_invalid = False
    try:
        if jsonschema_rs.meta.is_valid(schema):
            return
        known_invalid = True
    except (ValueError, jsonschema_rs.ReferencingError):
        pass  # an unknown $schema: let the reference implementation judge
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)  # raises the best-matching problem
    except jsonschema.exceptions.SchemaError as exc:
        raise SchemaError(
            f"not a valid JSON Schema: {exc.message[:300]}",
            source=source,
            pointer=pointer_of(exc.absolute_path),
        ) from None
    except RecursionError:
        # The reference implementation recurses several frames per level: about 120
        # levels of a malformed schema exhaust the stack before it names the problem.
        reason = (
            "not a valid JSON Schema"
            if known_invalid
            else "the schema cannot be checked against its meta-schema"
        )
        raise SchemaError(
            f"{reason} (nested too deeply to name the problem)", source=source
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
# id(schema) -> (schema, its compiled prepare). Holding the schema keeps its id from being
# reused.
_cache: dict[int, tuple[object, PrepareFn]] = {}
_cache_lock = threading.Lock()


def _compiled_for(schema: Mapping[str, Any] | bool | CompiledSchema) -> PrepareFn:
    if isinstance(schema, CompiledSchema):
        return schema.prepare
    entry = _cache.get(id(schema))
    if entry is not None and entry[0] is schema:
        return entry[1]
    compiled = CompiledSchema(schema)
    with _cache_lock:
        if len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[id(schema)] = (schema, compiled.prepare)
    return compiled.prepare


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
    entry = _cache.get(id(schema))
    prepare = entry[1] if entry is not None and entry[0] is schema else _compiled_for(schema)
    return prepare(arguments, tool, inject_defaults)
