"""Repair the small type mistakes models make in tool arguments, guided by a resolved schema.

Pure: no I/O. The rules (docs/tool-calls.md has an example of each):

* a numeric string becomes an integer or a number, never lossily (``"1.5"``
  is not an integer; NaN and infinities are refused);
* ``"true"``/``"false"`` become booleans, ``"null"`` becomes null;
* a JSON-encoded string becomes the object or array the schema wants;
* a lone value becomes a one-element array where an array is wanted;
* ``enum``/``const`` members are matched after the same conversions;
* null for an optional property whose schema refuses null leaves the property
  out, and a list of ``{"name", "value"}`` pairs becomes the object where a map
  is wanted: what a call written against the strict variant of a schema sends
  (``strict.py``).

What already validates is kept as it is (converting it would corrupt valid
data): a container that a subschema accepts is not entered, a scalar whose
type the schema allows is never converted (``"007"`` stays a string for
``["string", "integer"]``, a JSON-looking string stays a string for
``string | null``), and a union branch that already accepts the value wins
over any conversion. Branches are tried in declared order. Input is never
mutated: changed containers are copied on write. This module never validates
the final result: the caller does that against the original schema.

Each schema node is compiled once, on the first repair, into one function
``fix(value, depth, check)`` that does only what that node asks for: a node
with nothing to repair compiles to :func:`keep` and its parent skips it, a
``type: integer`` node checks the type and converts a string, an object node
holds a key -> child-function table. ``$ref`` (kept only for recursive
schemas) is compiled lazily on first use, so a recursive schema never
recurses at compile time, and compiling walks the schema without recursion.
The value-level rules live in ``coerce_rules.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Final

import orjson

from agent_backend.schema.coerce_nodes import (
    Accepts,
    AcceptsOf,
    Fix,
    IsValid,
    Parse,
    Step,
    array_fix,
    container_fix,
    json_parse,
    keep,
    member_fix,
    null_left_out,
    object_descend,
    object_fix,
    properties_descend,
    type_fix,
    union_fix,
)
from agent_backend.schema.coerce_rules import (
    CONVERSION_ORDER,
    FAIL,
    PYTHON_TYPES,
    TEXT_RULES,
    TYPE_ONLY_KEYS,
    compile_patterns,
    from_pairs,
    is_map,
    member_test,
    type_allowed,
    type_plan,
)
from agent_backend.schema.parse import (
    BIG_FLOAT,
    check_depth,
    json_type_name,
    load_json_value,
)
from agent_backend.schema.plain import big_float

__all__ = ["Coercer"]

_KNOWN_TYPES: Final = frozenset(PYTHON_TYPES)
#: A node with only these keys is its ``$ref`` target, as far as validity and repair go.
_BARE_REF_KEYS: Final = (TYPE_ONLY_KEYS - {"type"}) | {"$ref"}
_CONTAINERS: Final = (dict, list)
_OPENERS: Final = (("object", "{", dict), ("array", "[", list))
_OBJECT_KEYWORDS: Final = frozenset(("properties", "patternProperties", "additionalProperties"))


class Coercer:
    """Repair for one resolved schema; built once and reused (nodes are compiled on first use)."""

    def __init__(
        self,
        root: dict[str, Any] | bool,
        *,
        is_valid: IsValid,
        max_depth: int,
        inject_defaults: bool = False,
        accepts_of: AcceptsOf | None = None,
    ) -> None:
        """``accepts_of(node)``, when given, is ``is_valid`` for one node, as a faster
        function of the value alone (a node's own validator); asked once per node."""
        self._root = root
        self._is_valid = is_valid
        self._accepts_of: AcceptsOf = accepts_of or (lambda node: functools.partial(is_valid, node))
        self._max_depth = max_depth
        self._inject_defaults = inject_defaults
        # Whether children first keep what their subschema accepts (never when injecting
        # defaults: a valid object may still lack a default).
        self._check = not inject_defaults
        # id(node) -> (node, its function). Holding the node keeps its id from being reused.
        self._compiled: dict[int, tuple[Any, Fix]] = {}
        self._fix: Fix | None = None
        self._parse_fn: Parse | None = None

    def coerce(self, value: Any, *, known_invalid: bool = False) -> Any:
        """``value`` with what fails repaired; ``known_invalid`` skips re-checking the whole value."""
        fix = self._fix
        if fix is None:
            fix = self._fix = self._compile(self._root)
        return fix(value, 1, self._check and not known_invalid)

    # -- compiling ---------------------------------------------------------------------

    def _compile(self, top: Any) -> Fix:
        """Compile ``top`` and every node below it (not through ``$ref``), children first."""
        compiled = self._compiled
        opened: set[int] = set()  # nodes whose children are on the stack above them
        stack = [top]
        while stack:
            node = stack[-1]
            key = id(node)
            if key in compiled or not isinstance(node, dict):
                stack.pop()
            elif key in opened:
                stack.pop()
                compiled[key] = (node, self._build(node))
            else:
                opened.add(key)
                # A node inside itself (opened, not yet built) is reached lazily (_fix_of).
                stack.extend(
                    child
                    for child in _children(node)
                    if isinstance(child, dict) and id(child) not in opened
                )
        return self._fix_of(top)

    @property
    def _parse(self) -> Parse:
        """:meth:`_parse_text`, in C where built; chosen on the first use (when nodes compile)."""
        parse = self._parse_fn
        if parse is None:
            parse = self._parse_fn = json_parse(self._max_depth, self._parse_text)
        return parse

    def _fix_of(self, node: Any) -> Fix:
        if not isinstance(node, dict):
            return keep
        entry = self._compiled.get(id(node))
        return entry[1] if entry is not None else self._lazy(node)

    def _lazy(self, node: dict[str, Any]) -> Fix:
        """``node``'s function, compiled on its first call (``$ref`` targets: recursion)."""
        done: list[Fix] = []

        def fix(value: Any, depth: int, check: bool) -> Any:
            if not done:
                done.append(self._compile(node))
            return done[0](value, depth, check)

        return fix

    def _build(self, node: dict[str, Any]) -> Fix:
        """One node's function; its children (but not its ``$ref`` target) are compiled already."""
        if node.keys() <= TYPE_ONLY_KEYS:  # a leaf, the most common node: only ``type`` matters
            types = _declared_types(node)
            convert = self._types_step(types) if types is not None else None
            if types is None or convert is None:
                return keep
            return type_fix(types, convert, self._parse)
        types = _declared_types(node)
        if types is not None and len(types) > 1 and "$ref" not in node:
            return self._types_union(node, types)
        ref = node.get("$ref")
        target = self._lookup(ref) if isinstance(ref, str) else None
        via_ref: Fix | None = None
        if isinstance(target, dict):
            via_ref = self._fix_of(target)
            if node.keys() <= _BARE_REF_KEYS:
                return via_ref
            if via_ref is keep:
                via_ref = None
        members: list[Any] | None = None
        if "const" in node:
            members = [node["const"]]
        elif isinstance(node.get("enum"), list):
            members = node["enum"]
        if members is not None:
            convert = self._members_step(members)
        else:
            convert = self._types_step(types) if types is not None else None
            if is_map(node):
                convert = _pairs_step(convert)
        unions = tuple(
            step
            for step in (self._union_step(node.get("anyOf")), self._union_step(node.get("oneOf")))
            if step is not None
        )
        all_of = node.get("allOf")
        every = tuple(
            fix
            for fix in map(self._fix_of, all_of if isinstance(all_of, list) else ())
            if fix is not keep
        )
        objects, plain = self._object_step(node)
        arrays, each = self._array_step(node)
        nothing_else = via_ref is None and not every and not unions
        if nothing_else and objects is None and arrays is None and convert is None:
            return keep
        accepts = self._acceptor(node)
        generic = self._generic(accepts, via_ref, convert, unions, every, objects, arrays)
        # The common shapes get a function that short-cuts ``generic`` for the values they
        # see most, giving the same result; every other value still goes through ``generic``.
        if via_ref is not None or every:
            return generic
        if unions:
            if len(unions) == 1 and convert is None and objects is None and arrays is None:
                return union_fix(accepts, unions[0])
            return generic
        if objects is None and arrays is None:
            if members is None and types is not None and convert is not None and ref is None:
                # Then ``generic`` is ``convert``: a container the node accepts is of an
                # allowed type, which ``convert`` keeps as it is.
                return type_fix(types, convert, self._parse)
            if members is not None and convert is not None:
                return member_fix(members, self._member_rules(members), convert)
            return generic
        for kind, name, descend in ((dict, "object", objects), (list, "array", arrays)):
            # An enum or const never converts a container, and neither does a type that allows it.
            if descend is not None and (members is not None or types is None or name in types):
                alone = members is None and types == (name,)
                parse = self._parse if alone else None
                if plain is not None and kind is dict:
                    return object_fix(node, plain, parse, generic, self._accepts_of, self._check)
                if each is not None and kind is list:
                    return array_fix(node, each, parse, generic, self._accepts_of, self._check)
                return container_fix(node, kind, descend, parse, generic, self._is_valid)
        return generic

    def _generic(
        self,
        accepts: Accepts,
        via_ref: Fix | None,
        convert: Step | None,
        unions: tuple[Step, ...],
        every: tuple[Fix, ...],
        objects: Step | None,
        arrays: Step | None,
    ) -> Fix:
        """Every step a node may take, in order: ref, own type/enum, unions, allOf, children."""
        check_children = self._check

        def fix(value: Any, depth: int, check: bool) -> Any:
            if check and isinstance(value, _CONTAINERS) and accepts(value):
                return value
            if via_ref is not None:
                value = via_ref(value, depth, check_children)
            if convert is not None:
                value = convert(value, depth)
            for choose in unions:
                value = choose(value, depth)
            for branch in every:
                value = branch(value, depth, check_children)
            if isinstance(value, dict):
                return value if objects is None else objects(value, depth)
            if isinstance(value, list) and arrays is not None:
                return arrays(value, depth)
            return value

        return fix

    def _acceptor(self, node: Any) -> Accepts:
        """``is_valid(node, value)``, answered without the validator where ``type`` decides."""
        is_valid = self._is_valid
        if isinstance(node, bool):
            return _always if node else _never
        types = _declared_types(node) if isinstance(node, dict) else None
        if (
            not types or not _KNOWN_TYPES.issuperset(types) or "$ref" in node
        ):  # draft 7: $ref hides type
            return lambda value: is_valid(node, value)
        allowed, refused, _, _ = type_plan(types)
        if node.keys() <= TYPE_ONLY_KEYS:

            def accepts_type(value: Any) -> bool:
                kind = type(value)
                if kind in allowed:
                    return True
                return kind not in refused and is_valid(node, value)

            return accepts_type

        def accepts(value: Any) -> bool:
            return type(value) not in refused and is_valid(node, value)

        return accepts

    # -- a node's own value: type, enum, const -----------------------------------------

    def _types_union(self, node: dict[str, Any], types: tuple[str, ...]) -> Fix:
        """A type list beside other keywords, repaired as the ``anyOf`` it means.

        ``{"type": [A, B], **rest}`` accepts what ``{"anyOf": [{"type": A, **rest},
        {"type": B, **rest}]}`` accepts, so it is repaired as that union: one branch per
        listed type, in the order listed, each with every sibling keyword. A string kept
        because ``string`` is listed would fail a ``pattern`` the integer it spells
        satisfies; as a union, the string branch refuses it and the integer branch converts it.
        """
        branches = [{**node, "type": name} for name in types]
        for branch in branches:  # children are compiled already; only the branch itself is new
            self._compile(branch)
        choose = self._union_step(branches)
        return keep if choose is None else union_fix(self._acceptor(node), choose)

    def _types_step(self, types: tuple[str, ...]) -> Step | None:
        allowed, refused, rules, openers = type_plan(types)
        wrap = "array" in types
        if not rules and not openers:
            return None  # nothing converts to a string: such a node only descends
        parse = self._parse

        def convert(value: Any, depth: int) -> Any:
            kind = type(value)
            if kind in allowed or (kind not in refused and type_allowed(value, types)):
                return value
            if isinstance(value, str):
                text = value.strip()
                for rule in rules:
                    candidate = rule(text)
                    if candidate is not FAIL:
                        return candidate
                for opener, wanted in openers:
                    candidate = parse(text, opener, wanted, depth)
                    if candidate is not FAIL:
                        return candidate
            if wrap and not isinstance(value, list):
                return [value]
            return value

        return convert

    def _members_step(self, members: list[Any]) -> Step | None:
        kinds = self._member_kinds(members)
        if not kinds:
            return None  # only strings (or nothing a string converts to) are allowed
        convert_to = self._convert_to
        is_member = member_test(members)

        def convert(value: Any, depth: int) -> Any:
            if is_member(value):
                return value
            for kind in kinds:
                candidate = convert_to(value, kind, depth)
                if candidate is not FAIL and is_member(candidate):
                    return candidate
            return value

        return convert

    @staticmethod
    def _member_kinds(members: list[Any]) -> tuple[str, ...]:
        """The kinds a string may convert to on its way to a member, in conversion order."""
        return tuple(
            kind
            for kind in dict.fromkeys(json_type_name(member) for member in members)
            if kind in CONVERSION_ORDER
        )

    def _member_rules(self, members: list[Any]) -> tuple[Any, ...]:
        """The text rules of :meth:`_members_step`'s kinds; none if one is a container's."""
        kinds = self._member_kinds(members)
        if not all(kind in TEXT_RULES for kind in kinds):
            return ()
        return tuple(TEXT_RULES[kind] for kind in kinds)

    def _convert_to(self, value: Any, kind: str, depth: int) -> Any:
        """``value`` (a string, for every rule) as a ``kind``, or ``FAIL``."""
        if not isinstance(value, str):
            return FAIL
        text = value.strip()
        rule = TEXT_RULES.get(kind)
        if rule is not None:
            return rule(text)
        for name, opener, wanted in _OPENERS:
            if name == kind:
                return self._parse(text, opener, wanted, depth)
        return FAIL

    def _parse_text(self, text: str, opener: str, wanted: type, depth: int) -> Any:
        """A JSON-encoded object or array at ``depth``, within the depth bound, or ``FAIL``.

        orjson reads it; a float that may be an integer orjson could not hold
        exactly, and text orjson refuses, are read again by :func:`load_json_value`.
        Text of ``n`` levels has at least ``n`` opening brackets and ``2 * n``
        characters, so short text, or text with few brackets, cannot nest past the
        bound (as ``prepare``'s fast path reasons) and only floats are looked for;
        other text is walked by :func:`_scan`, which bounds the depth as well.
        """
        if not text.startswith(opener):
            return FAIL
        try:
            parsed = orjson.loads(text)
        except ValueError:
            return self._parse_exactly(text, wanted, depth)
        levels = self._max_depth - depth + 1  # how many levels may nest from ``depth``
        if len(text) < 2 * levels + 2 or text.count("{") + text.count("[") <= levels:
            if big_float(parsed):
                return self._parse_exactly(text, wanted, depth)
        else:
            verdict = _scan(parsed, depth, self._max_depth)
            if verdict is _TOO_DEEP:
                return FAIL
            if verdict is _BIG_FLOAT:
                return self._parse_exactly(text, wanted, depth)
        return parsed if isinstance(parsed, wanted) else FAIL

    def _parse_exactly(self, text: str, wanted: type, depth: int) -> Any:
        """:meth:`_parse` of text orjson refuses or cannot read exactly: the slow, exact reader."""
        try:
            parsed = load_json_value(text)
            check_depth(parsed, self._max_depth, start=depth)
        except ValueError:
            return FAIL
        return parsed if isinstance(parsed, wanted) else FAIL

    # -- unions ------------------------------------------------------------------------

    def _union_step(self, branches: Any) -> Step | None:
        """A value some branch accepts is kept; else the first branch its repair satisfies."""
        if not isinstance(branches, list) or not branches:
            return None
        acceptors = tuple(self._acceptor(branch) for branch in branches)
        repairs = tuple(
            (fix, accepts)
            for fix, accepts in zip(map(self._fix_of, branches), acceptors, strict=True)
            if fix is not keep
        )
        if not repairs:
            return None
        # A value of a type some branch allows whatever else it is: that branch accepts it.
        accepted = frozenset(
            python
            for branch in branches
            if isinstance(branch, dict) and branch.keys() <= TYPE_ONLY_KEYS
            for python in _plain_types(branch)
        )

        def choose(value: Any, depth: int) -> Any:
            if type(value) in accepted:
                return value
            for accepts in acceptors:
                if accepts(value):
                    return value
            wrapped = None
            for fix, accepts in repairs:
                # No branch accepts the value, so none needs to check it again.
                candidate = fix(value, depth, False)
                if candidate is not value and accepts(candidate):
                    if type(candidate) is list and _wraps(value):
                        # A lone value put in an array: only if no other branch converts it,
                        # as in a type list (``"5"`` for an array or an integer is ``5``).
                        if wrapped is None:
                            wrapped = candidate
                        continue
                    return candidate
            return value if wrapped is None else wrapped

        return choose

    # -- children ----------------------------------------------------------------------

    def _object_step(self, node: dict[str, Any]) -> tuple[Step | None, dict[str, Fix] | None]:
        """How an object's children are repaired, and the child table if only ``properties``
        matters (then the node's own function runs the loop itself: one call less per object)."""
        if not _OBJECT_KEYWORDS & node.keys():
            return None, None
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = node.get("required")
        required = frozenset(required) if isinstance(required, list) else frozenset()
        fixes = {
            key: self._property_fix(schema, optional=key not in required)
            for key, schema in properties.items()
            if schema is not None
        }
        active = {key: fix for key, fix in fixes.items() if fix is not keep}
        patterns = node.get("patternProperties")
        additional = node.get("additionalProperties")
        extra = self._fix_of(additional) if isinstance(additional, dict) else keep
        by_pattern = [
            (pattern, self._fix_of(schema))
            for pattern, schema in (
                compile_patterns(patterns) if isinstance(patterns, dict) else ()
            )
        ]
        if extra is keep:  # then which keys a pattern matches does not matter, only its repair
            by_pattern = [(pattern, fix) for pattern, fix in by_pattern if fix is not keep]
        defaults: tuple[tuple[str, Any], ...] = ()
        if self._inject_defaults:
            defaults = tuple(
                (key, schema["default"])
                for key, schema in properties.items()
                if isinstance(schema, dict) and "default" in schema
            )
        if not by_pattern and extra is keep and not defaults:
            return (properties_descend(active, self._check), active) if active else (None, None)
        return object_descend(fixes, by_pattern, extra, defaults, self._check), None

    def _property_fix(self, schema: Any, *, optional: bool) -> Fix:
        """A property's function; null for an optional one whose schema refuses null leaves
        it out (what strict clients send for a property they do not mean to give)."""
        fix = self._fix_of(schema)
        if optional and not self._acceptor(schema)(None):
            return null_left_out(fix)
        return fix

    def _array_step(self, node: dict[str, Any]) -> tuple[Step | None, Fix | None]:
        """How an array's items are repaired, and the items' function if one repairs them all
        (then the node's own function runs the loop itself, as for objects)."""
        if "items" not in node and "prefixItems" not in node:
            return None, None
        items = node.get("items")
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # draft 7 and earlier: positional items
            prefix, rest = items, node.get("additionalItems")
        else:
            rest = items
        by_index = [self._fix_of(schema) for schema in prefix] if isinstance(prefix, list) else []
        others = self._fix_of(rest) if isinstance(rest, dict) else keep
        if others is keep and all(fix is keep for fix in by_index):
            return None, None
        check = self._check
        if not by_index:

            def each_item(value: list[Any], depth: int) -> Any:
                result = value
                depth += 1
                for index, child in enumerate(value):
                    new = others(child, depth, check)
                    if new is not child:
                        if result is value:
                            result = list(value)
                        result[index] = new
                return result

            return each_item, others
        count = len(by_index)

        def by_position(value: list[Any], depth: int) -> Any:
            result = value
            depth += 1
            for index, child in enumerate(value):
                new = (by_index[index] if index < count else others)(child, depth, check)
                if new is not child:
                    if result is value:
                        result = list(value)
                    result[index] = new
            return result

        return by_position, None

    def _lookup(self, ref: str) -> Any:
        """A ``#/...`` pointer into the resolved root (retained recursive defs); else ``None``."""
        if not (ref.startswith("#/") or ref == "#"):
            return None
        target: Any = self._root
        for token in ref[2:].split("/") if ref != "#" else []:
            token = token.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                return None
        return target


_TOO_DEEP: Final = "too deep"
_BIG_FLOAT: Final = "big float"


def _scan(value: Any, depth: int, max_depth: int) -> str | None:
    """Why ``value`` as orjson read it (placed at ``depth``) cannot be kept, or ``None``.

    Iterative, as :func:`check_depth` and :func:`has_big_float` are, in one walk.
    """
    if type(value) is not dict and type(value) is not list:
        return _BIG_FLOAT if type(value) is float and abs(value) >= BIG_FLOAT else None
    if depth > max_depth:
        return _TOO_DEEP
    stack = [(value, depth)]
    while stack:
        node, level = stack.pop()
        for child in node.values() if type(node) is dict else node:
            kind = type(child)
            if kind is dict or kind is list:
                if level >= max_depth:
                    return _TOO_DEEP
                stack.append((child, level + 1))
            elif kind is float and abs(child) >= BIG_FLOAT:
                return _BIG_FLOAT
    return None


def _pairs_step(convert: Step | None) -> Step:
    """A map's own step: a list of ``{"name", "value"}`` pairs becomes the object it spells."""

    def from_pairs_or_convert(value: Any, depth: int) -> Any:
        if type(value) is list:
            mapping = from_pairs(value)
            if mapping is not FAIL:
                return mapping
        return value if convert is None else convert(value, depth)

    return from_pairs_or_convert


def _always(value: Any) -> bool:
    return True


def _never(value: Any) -> bool:
    return False


def _plain_types(node: dict[str, Any]) -> frozenset[type]:
    """The plain Python types whose every value ``node``'s ``type`` allows (none if untyped)."""
    types = _declared_types(node)
    if not types or not _KNOWN_TYPES.issuperset(types):
        return frozenset()
    return type_plan(types).allowed


def _declared_types(node: dict[str, Any]) -> tuple[str, ...] | None:
    """The node's ``type`` names in the order listed (repair tries them in that order)."""
    declared = node.get("type")
    if isinstance(declared, str):
        return (declared,)
    if isinstance(declared, list):
        return tuple(dict.fromkeys(name for name in declared if isinstance(name, str)))
    return None


def _wraps(value: Any) -> bool:
    """Whether an array made from ``value`` wraps it rather than reads it: ``value`` is
    neither an array nor text that starts like one (JSON text of an array is converted)."""
    if type(value) is list:
        return False
    return type(value) is not str or not value.lstrip().startswith("[")


def _children(node: dict[str, Any]) -> Iterator[Any]:
    """The subschemas repair applies (``$ref`` targets are compiled lazily, apart)."""
    if node.keys() <= TYPE_ONLY_KEYS:
        return
    for key in ("properties", "patternProperties"):
        group = node.get(key)
        if isinstance(group, dict):
            yield from group.values()
    for key in ("additionalProperties", "items", "additionalItems"):
        child = node.get(key)
        if isinstance(child, list):
            yield from child
        else:
            yield child
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        group = node.get(key)
        if isinstance(group, list):
            yield from group
