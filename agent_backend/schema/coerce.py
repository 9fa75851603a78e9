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

The common shapes of node (an ``integer`` leaf, an object whose only
repairing keyword is ``properties``, an array with one ``items`` schema, ...)
get a function of their own that short-cuts the generic path for the values
those nodes see most (a numeric string, an object) and hands every other
value to the generic path, so the result is always the same. These run on
every repair: closure variables, no attribute lookups, no work a node does not
need. Against the generic path alone they make repair about 1.2x faster on
corrupted BFCL calls (1.3x on a nested pydantic schema), which is why they
stay; ``bench/schema_bench.py`` prints repair beside the valid path.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any, Final

import orjson

from agent_backend.schema.coerce_rules import (
    CONVERSION_ORDER,
    FAIL,
    MAX_NUMBER_TEXT,
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
    has_big_float,
    json_type_name,
    load_json_value,
    may_hold_big_integer,
)

__all__ = ["Coercer"]

IsValid = Callable[[Any, Any], bool]
AcceptsOf = Callable[[Any], Callable[[Any], bool]]
"""``accepts_of(node)``: the function that tells whether ``node`` accepts a value (its
validator's ``is_valid``), asked for once per node, on its first check."""
Fix = Callable[[Any, int, bool], Any]
"""A compiled node: ``fix(value, depth, check)`` is ``value`` repaired (the same object if
nothing changed); ``check`` first keeps a container that the node already accepts."""
Step = Callable[[Any, int], Any]
"""One part of a node's repair: ``step(value, depth)``."""
Accepts = Callable[[Any], bool]
Parse = Callable[[str, str, type, int], Any]
"""``parse(text, opener, wanted, depth)``: JSON text as a ``wanted`` container, or ``FAIL``."""

LEAVE_OUT: Final = object()
"""What a property's function returns when the property is to be left out of its object."""

_KNOWN_TYPES: Final = frozenset(PYTHON_TYPES)
#: A node with only these keys is its ``$ref`` target, as far as validity and repair go.
_BARE_REF_KEYS: Final = (TYPE_ONLY_KEYS - {"type"}) | {"$ref"}
_CONTAINERS: Final = (dict, list)
#: Fewer integer digits than this keep ``float()`` finite (the largest double is about 1.8e308).
_FINITE_DIGITS: Final = 300
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
            return type_fix(types, convert)
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
                return type_fix(types, convert)
            if members is not None and convert is not None:
                return member_fix(convert)
            return generic
        for kind, name, descend in ((dict, "object", objects), (list, "array", arrays)):
            # An enum or const never converts a container, and neither does a type that allows it.
            if descend is not None and (members is not None or types is None or name in types):
                alone = members is None and types == (name,)
                parse = self._parse_text if alone else None
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
        parse = self._parse_text

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
                return self._parse_text(text, opener, wanted, depth)
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
            if may_hold_big_integer(text) and has_big_float(parsed):
                return self._parse_exactly(text, wanted, depth)
        else:
            verdict = _scan(parsed, depth, self._max_depth)
            if verdict is _TOO_DEEP:
                return FAIL
            if verdict is _BIG_FLOAT:
                return self._parse_exactly(text, wanted, depth)
        return parsed if isinstance(parsed, wanted) else FAIL

    def _parse_exactly(self, text: str, wanted: type, depth: int) -> Any:
        """:meth:`_parse_text` of text orjson refuses or cannot read exactly: the slow, exact reader."""
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


# -- the shapes of compiled nodes ------------------------------------------------------------
# Each returns one node's ``fix(value, depth, check)``. The common shapes short-cut the
# generic path (``Coercer._generic``) for the values they see most and hand it every other
# value, so the result is always the same.


def keep(value: Any, depth: int, check: bool) -> Any:
    """The compiled form of a node that repairs nothing; parents leave such children out."""
    return value


def null_left_out(fix: Fix) -> Fix:
    """An optional property whose schema refuses null: null means the property is absent.

    Strict clients must send every property, so they send null for the ones they mean to
    leave out (strict.py); the object is repaired by leaving the property out.
    """

    def fix_or_leave_out(value: Any, depth: int, check: bool) -> Any:
        return LEAVE_OUT if value is None else fix(value, depth, check)

    return fix_or_leave_out


def type_fix(types: tuple[str, ...], convert: Step) -> Fix:
    """A node whose only repair is its own ``type`` (``convert``): no children, no unions."""
    allowed, _, rules, _ = type_plan(types)
    if "object" in types or "array" in types:
        # Nothing inside to repair: a container of an allowed type is kept, valid or not.

        def fix_typed(value: Any, depth: int, check: bool) -> Any:
            return value if type(value) in allowed else convert(value, depth)

        return fix_typed
    if len(rules) == 1 and (rules[0] is TEXT_RULES["integer"] or rules[0] is TEXT_RULES["number"]):
        as_number = rules[0] is TEXT_RULES["number"]
        numeric_rule = rules[0]

        def fix_numeric(value: Any, depth: int, check: bool) -> Any:
            kind = type(value)
            if kind in allowed:
                return value
            if kind is not str:
                return convert(value, depth)
            text = value.strip()
            # The numeric rules' common cases, without the call: ``"12"``, and ``"9.5"`` for
            # a number (unsigned digits around one dot: finite within the length bound).
            if len(text) <= MAX_NUMBER_TEXT:
                if text.isdecimal():
                    return int(text)
                if as_number:
                    whole, _, fraction = text.partition(".")
                    if whole.isdecimal() and fraction.isdecimal() and len(whole) < _FINITE_DIGITS:
                        return float(text)
            new = numeric_rule(text)
            return value if new is FAIL else new

        return fix_numeric
    if len(rules) == 1:
        (rule,) = rules

        def fix_one(value: Any, depth: int, check: bool) -> Any:
            kind = type(value)
            if kind in allowed:
                return value
            if kind is str:
                new = rule(value.strip())
                return value if new is FAIL else new
            return convert(value, depth)

        return fix_one

    def fix_scalar(value: Any, depth: int, check: bool) -> Any:
        kind = type(value)
        if kind in allowed:
            return value
        if kind is str:
            text = value.strip()
            for rule in rules:
                new = rule(text)
                if new is not FAIL:
                    return new
            return value
        return convert(value, depth)

    return fix_scalar


def member_fix(convert: Step) -> Fix:
    """An ``enum`` or ``const`` node with nothing else to repair (``convert`` is its members
    step): only a string converts, to a member; every other value is kept as it is."""

    def fix(value: Any, depth: int, check: bool) -> Any:
        return convert(value, depth) if isinstance(value, str) else value

    return fix


def union_fix(accepts: Accepts, choose: Step) -> Fix:
    """A node whose only repairing keyword is one ``anyOf`` or ``oneOf``."""

    def fix(value: Any, depth: int, check: bool) -> Any:
        if check and isinstance(value, _CONTAINERS) and accepts(value):
            return value
        return choose(value, depth)

    return fix


def container_fix(
    node: dict[str, Any],
    kind: type,
    descend: Step,
    parse: Parse | None,
    generic: Fix,
    is_valid: IsValid,
) -> Fix:
    """An object (array) node given an object (array): keep it if valid, else descend.

    With ``parse`` (``type`` is that container alone), a string is read as JSON
    text here; text that is not becomes nothing (object) or is wrapped (array),
    as the generic path would.
    """
    opener = "{" if kind is dict else "["

    def fix(value: Any, depth: int, check: bool) -> Any:
        given = type(value)
        if given is kind:
            if check and is_valid(node, value):
                return value
            return descend(value, depth)
        if given is str and parse is not None:
            parsed = parse(value.strip(), opener, kind, depth)
            if parsed is not FAIL:
                return descend(parsed, depth)
            return value if kind is dict else descend([value], depth)
        return generic(value, depth, check)

    return fix


def object_fix(
    node: dict[str, Any],
    fixes: dict[str, Fix],
    parse: Parse | None,
    generic: Fix,
    accepts_of: AcceptsOf,
    check_children: bool,
) -> Fix:
    """:func:`container_fix` for an object node whose only repairing keyword is ``properties``,
    with :func:`properties_descend` inlined (the most common node of all). The node's
    validator is asked for once, on its first check, and held."""

    fix_of = fixes.get
    accepts: Callable[[Any], bool] | None = None

    def fix(value: Any, depth: int, check: bool) -> Any:
        nonlocal accepts
        if type(value) is not dict:
            if type(value) is not str or parse is None:
                return generic(value, depth, check)
            parsed = parse(value.strip(), "{", dict, depth)
            if parsed is FAIL:
                return value  # as the generic path: no other conversion, nothing to descend
            value = parsed
        elif check:
            if accepts is None:
                accepts = accepts_of(node)
            if accepts(value):
                return value
        result = value
        depth += 1
        for key, child in value.items():
            child_fix = fix_of(key)
            if child_fix is not None:
                new = child_fix(child, depth, check_children)
                if new is not child:
                    if result is value:
                        result = value.copy()
                    if new is LEAVE_OUT:
                        del result[key]
                    else:
                        result[key] = new
        return result

    return fix


def array_fix(
    node: dict[str, Any],
    each: Fix,
    parse: Parse | None,
    generic: Fix,
    accepts_of: AcceptsOf,
    check_items: bool,
) -> Fix:
    """:func:`container_fix` for an array node whose only repairing keyword is one ``items``
    schema for every item, with the loop over the items inlined."""

    accepts: Callable[[Any], bool] | None = None

    def fix(value: Any, depth: int, check: bool) -> Any:
        nonlocal accepts
        given = type(value)
        if given is list:
            if check:
                if accepts is None:
                    accepts = accepts_of(node)
                if accepts(value):
                    return value
        elif given is str and parse is not None:
            parsed = parse(value.strip(), "[", list, depth)
            value = [value] if parsed is FAIL else parsed
        else:
            return generic(value, depth, check)
        result = value
        depth += 1
        for index, child in enumerate(value):
            new = each(child, depth, check_items)
            if new is not child:
                if result is value:
                    result = value.copy()
                result[index] = new
        return result

    return fix


def properties_descend(fixes: dict[str, Fix], check: bool) -> Step:
    """Children of an object whose only repairing keyword is ``properties``."""

    def descend(value: dict[str, Any], depth: int) -> Any:
        result = value
        depth += 1
        for key, child in value.items():
            fix = fixes.get(key)
            if fix is not None:
                new = fix(child, depth, check)
                if new is not child:
                    if result is value:
                        result = dict(value)
                    if new is LEAVE_OUT:
                        del result[key]
                    else:
                        result[key] = new
        return result

    return descend


def object_descend(
    fixes: dict[str, Fix],
    by_pattern: list[tuple[Any, Fix]],
    extra: Fix,
    defaults: tuple[tuple[str, Any], ...],
    check: bool,
) -> Step:
    """Children of an object through ``properties``, ``patternProperties`` and
    ``additionalProperties``; then defaults, when injecting them."""

    def descend(value: dict[str, Any], depth: int) -> Any:
        result = value
        depth += 1
        for key, child in value.items():
            fix = fixes.get(key)
            matched = fix is not None
            new = child if fix is None else fix(child, depth, check)
            if new is LEAVE_OUT:
                if result is value:
                    result = dict(value)
                del result[key]
                continue
            for pattern, pattern_fix in by_pattern:
                if pattern.search(key):
                    new = pattern_fix(new, depth, check)
                    matched = True
            if not matched:
                new = extra(new, depth, check)
            if new is not child:
                if result is value:
                    result = dict(value)
                result[key] = new
        for key, default in defaults:
            if key not in result:
                if result is value:
                    result = dict(value)
                result[key] = copy.deepcopy(default)
        return result

    return descend


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
