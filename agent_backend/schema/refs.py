"""Inline the local ``$ref``s of a JSON Schema, so every subschema says what it means in place.

Tool schemas written by pydantic, zod or by hand hide types behind ``$ref``;
argument coercion that reads a property's ``type`` then sees nothing and
corrupts the arguments (models then send objects as JSON strings, and every
call fails). ``resolve_schema`` returns a new schema that accepts exactly the
same instances as the original, with every reference into the same document
replaced by its target:

* JSON-pointer refs, anchors (``$anchor``, draft 7 ``$id: "#foo"``) and refs to
  embedded resources named by ``$id`` (``id`` in draft 4), resolved against the
  base URI in effect where the ref is written, URNs included.
* Keywords beside a ``$ref`` apply in 2019-09 and later: annotations are merged
  into the target, anything else keeps the target under ``allOf``. Draft 7 and
  earlier ignore them, as the spec says.
* A recursive schema (a tree node that holds nodes) keeps one copy of each
  recursive target in the root's ``$defs``/``definitions`` and refers to it
  from inside itself; the outermost use is still inlined.
* A cycle of refs that never steps into a child instance (``A -> B -> A``) can
  only make a validator loop forever: it raises ``SchemaRefError`` naming the
  cycle, where resolvers and validators elsewhere hit ``RecursionError``. Deep
  or exploding schemas raise ``SchemaError``, never ``RecursionError``.

This module must never do I/O, and above all never fetch anything: a ref to
another document, a remote URL or a meta-schema is left in place (made
absolute, so it means the same after moving) and reported in
``Resolution.external_refs`` (fetching it would be an SSRF hole in a daemon).
It never mutates its input and shares no mutable object with it. ``$dynamicRef`` and
``$recursiveRef`` are rejected: their targets depend on the evaluation path,
so no static rewrite can keep their meaning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urljoin, uses_relative

from agent_backend.errors import SchemaError, SchemaRefError
from agent_backend.schema.dialect import Dialect, detect_dialect
from agent_backend.schema.keywords import MAX_DEPTH, steps_into_child, subschema_shape

__all__ = ["ExternalRef", "Resolution", "resolve_local_refs", "resolve_schema"]

#: Most subschemas the resolved schema may have (refs used twice per level explode).
MAX_NODES = 100_000

_Path = tuple[str, ...]

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$comment",
    }
)
# Dropped from every resolved node: all refs they served are inlined, and a
# moved ``$id`` would change the meaning of what is left.
_DROPPED = frozenset(
    {"$ref", "$schema", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions"}
)
_UNSUPPORTED = ("$dynamicRef", "$recursiveRef")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_INDEX = re.compile(r"0|[1-9][0-9]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True, slots=True)
class ExternalRef:
    """A ``$ref`` left in place because its target is outside this document."""

    pointer: str  # JSON pointer of the $ref's node in the ORIGINAL schema
    ref: str  # the $ref as written
    uri: str  # absolute URI it resolves to (as best known)


@dataclass(frozen=True, slots=True)
class Resolution:
    """A schema with its local refs inlined, and what could not be inlined."""

    schema: dict[str, Any] | bool
    dialect: Dialect
    external_refs: tuple[ExternalRef, ...]
    recursive_defs: tuple[str, ...]


def resolve_schema(schema: Mapping[str, Any] | bool, *, source: str | None = None) -> Resolution:
    """Inline every local ``$ref`` of ``schema``; ``source`` only names it in errors."""
    if isinstance(schema, bool):
        return Resolution(schema, detect_dialect(schema), (), ())
    if not isinstance(schema, Mapping):
        raise SchemaError("a schema must be an object or a boolean", source=source)
    return _Resolver(schema, detect_dialect(dict(schema)), source).run()


def resolve_local_refs(schema: Mapping[str, Any] | bool) -> dict[str, Any] | bool:
    return resolve_schema(schema).schema


def _join(base: str, ref: str) -> str:
    """Resolve ``ref`` against ``base`` (RFC 3986); unlike ``urljoin``, handles URN bases."""
    if not base or _SCHEME.match(ref):
        return ref
    if not ref or ref.startswith("#"):
        return base.partition("#")[0] + ref
    scheme = _SCHEME.match(base)
    if scheme and scheme.group()[:-1].lower() not in uses_relative:
        return ref  # a path relative to a URN has no meaning; keep it as written
    return urljoin(base, ref)


def _pointer(path: _Path) -> str:
    return "".join("/" + seg.replace("~", "~0").replace("/", "~1") for seg in path)


def _copy_json(value: Any) -> Any:
    """Deep copy of JSON data, iterative so that no nesting depth can overflow the stack."""

    def shell(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {}
        return [] if isinstance(v, list | tuple) else None

    top = shell(value)
    if top is None:
        return value
    todo = [(value, top)]
    while todo:
        src, dst = todo.pop()
        for key, item in src.items() if isinstance(src, Mapping) else enumerate(src):
            new = shell(item)
            if isinstance(dst, dict):
                dst[key] = item if new is None else new
            else:
                dst.append(item if new is None else new)
            if new is not None:
                todo.append((item, new))
    return top


def _combine(target: Any, siblings: dict[str, Any]) -> Any:
    """A 2019-09+ node: its ``$ref`` target and its own (resolved) keywords both apply."""
    if not siblings:
        return target
    if siblings.keys() <= _ANNOTATIONS and target is not False:
        return siblings if target is True else {**target, **siblings}
    return {**siblings, "allOf": [target, *siblings.get("allOf", [])]}


class _Index:
    """Where every resource (``$id``) and anchor is, and the base URI of every subschema."""

    def __init__(self, root: Mapping[str, Any], dialect: Dialect, source: str | None) -> None:
        self.dialect = dialect
        self.source = source
        self.resources: dict[str, _Path] = {"": ()}
        self.anchors: dict[tuple[str, str], _Path] = {}
        self.bases: dict[_Path, str] = {}
        self.add(root, (), "")

    def add(self, node: Any, path: _Path, parent_base: str) -> None:
        todo = [(path, node, parent_base, 0)]
        while todo:
            path, node, base, depth = todo.pop()
            if depth > MAX_DEPTH:
                raise SchemaError(
                    f"schema nests deeper than {MAX_DEPTH} levels",
                    source=self.source,
                    pointer=_pointer(path),
                )
            if not isinstance(node, Mapping):
                continue
            base = self.bases[path] = self._identify(node, path, base)
            for key, value in node.items():
                shape = subschema_shape(key, value)
                if shape == "one":
                    todo.append(((*path, key), value, base, depth + 1))
                elif shape == "list":
                    todo.extend(
                        ((*path, key, str(i)), v, base, depth + 1) for i, v in enumerate(value)
                    )
                elif shape == "map":
                    todo.extend(((*path, key, k), v, base, depth + 1) for k, v in value.items())

    def _identify(self, node: Mapping[str, Any], path: _Path, base: str) -> str:
        """Register the resource and anchors ``node`` declares; return the base URI inside it."""
        legacy = not self.dialect.ref_siblings_apply
        declared = node.get(self.dialect.id_keyword)
        # Draft 7 and earlier: "$ref prevents a sibling $id from changing the base uri".
        if isinstance(declared, str) and not (legacy and "$ref" in node):
            uri, _, anchor = declared.partition("#")
            if uri:
                base = _join(base, uri).partition("#")[0]
                self.resources.setdefault(base, path)
            if anchor and legacy and not anchor.startswith("/"):
                self.anchors.setdefault((base, anchor), path)
        if not legacy:
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(name := node.get(key), str):
                    self.anchors.setdefault((base, name), path)
        return base

    def base_of(self, path: _Path, node: Any) -> str:
        """Base URI inside ``node``; indexes it first if no keyword walk reached it (a ref into data)."""
        if path not in self.bases:
            ancestor = next(path[:k] for k in range(len(path), -1, -1) if path[:k] in self.bases)
            self.add(node, path, self.bases[ancestor])
        return self.bases.get(path, "")


@dataclass(slots=True)
class _Frame:
    path: _Path
    steps: int  # how many keywords stepping into a child instance lie above this node
    via: str | None  # the $ref that led here, if any


class _Resolver:
    def __init__(self, root: Mapping[str, Any], dialect: Dialect, source: str | None) -> None:
        self.root = root
        self.dialect = dialect
        self.source = source
        self.index = _Index(root, dialect, source)
        self.dropped = _DROPPED | {dialect.id_keyword}
        self.frames: list[_Frame] = []
        self.active: dict[_Path, int] = {}  # path -> position in frames, for nodes being expanded
        self.names: dict[_Path, str] = {}  # recursive targets -> their retained defs name
        defs = root.get(dialect.defs_keyword)
        self.taken: set[str] = set(defs) if isinstance(defs, Mapping) else set()
        self.retained: dict[str, Any] = {}
        self.external: dict[str, ExternalRef] = {}
        self.nodes = 0

    def run(self) -> Resolution:
        out = self._expand((), self.root, 0, 0, None)
        if self.retained:
            if not isinstance(out, dict):
                out = {"allOf": [out]}
            out[self.dialect.defs_keyword] = self.retained
        if isinstance(out, dict):
            head: dict[str, Any] = {}
            if isinstance(meta := self.root.get("$schema"), str):
                head["$schema"] = meta
            if base := self.index.bases.get((), ""):
                head[self.dialect.id_keyword] = base
            out = {**head, **out}
        return Resolution(out, self.dialect, tuple(self.external.values()), tuple(self.retained))

    def _error(
        self, message: str, path: _Path, ref: str, cycle: tuple[str, ...] = ()
    ) -> SchemaRefError:
        return SchemaRefError(
            message, ref=ref, cycle=cycle, source=self.source, pointer=_pointer(path)
        )

    def _expand(self, path: _Path, node: Any, depth: int, steps: int, via: str | None) -> Any:
        """The resolved form of the subschema ``node`` found at ``path`` of the original."""
        if not isinstance(node, Mapping):
            return _copy_json(node)  # a boolean schema, or data the validator will reject
        if depth > MAX_DEPTH:
            raise SchemaError(
                f"schema nests deeper than {MAX_DEPTH} levels once $refs are inlined",
                source=self.source,
                pointer=_pointer(path),
            )
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SchemaError(
                f"inlining $refs would produce more than {MAX_NODES} subschemas",
                source=self.source,
                pointer=_pointer(path),
            )
        if (position := self.active.get(path)) is not None:
            # Reached again without a $ref: a ref above led into one of its own ancestors.
            return self._reenter(position, steps, via or "#" + _pointer(path), path)
        for keyword in _UNSUPPORTED:
            if keyword in node:
                raise self._error(
                    f"{keyword} is not supported: its target depends on the evaluation path, "
                    "so it cannot be resolved statically",
                    path,
                    str(node[keyword]),
                )
        self.active[path] = len(self.frames)
        self.frames.append(_Frame(path, steps, via))
        try:
            ref = node.get("$ref")
            if ref is None:
                out = self._keywords(path, node, depth, steps)
            elif not isinstance(ref, str):
                raise self._error("$ref must be a string", path, repr(ref))
            elif not self.dialect.ref_siblings_apply:
                out = self._follow(ref, path, node, depth, steps)
            else:
                target = self._follow(ref, path, node, depth, steps)
                out = _combine(target, self._keywords(path, node, depth, steps))
        finally:
            self.frames.pop()
            del self.active[path]
        name = self.names.get(path)
        if name is not None and name not in self.retained:
            self.retained[name] = _copy_json(out)
        return out

    def _keywords(self, path: _Path, node: Mapping[str, Any], depth: int, steps: int) -> Any:
        """``node`` without ``$ref``, its subschemas resolved and everything else copied."""
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in self.dropped:
                continue
            shape = subschema_shape(key, value)
            inner = steps + steps_into_child(key)
            if shape == "one":
                out[key] = self._expand((*path, key), value, depth + 1, inner, None)
            elif shape == "list":
                items: list[Any] = []
                for i, sub in enumerate(value):
                    items.append(self._expand((*path, key, str(i)), sub, depth + 1, inner, None))
                out[key] = items
            elif shape == "map":
                entries: dict[str, Any] = {}
                for name, sub in value.items():
                    entries[name] = self._expand((*path, key, name), sub, depth + 1, inner, None)
                out[key] = entries
            else:
                out[key] = _copy_json(value)
        return out

    def _follow(self, ref: str, path: _Path, node: Any, depth: int, steps: int) -> Any:
        """The resolved target of ``ref``, written in ``node`` at ``path``."""
        uri = _join(self.index.base_of(path, node), ref)
        doc, _, fragment = uri.partition("#")
        if doc not in self.index.resources:
            where = _pointer(path)
            self.external.setdefault(where, ExternalRef(where, ref, uri))
            return {"$ref": uri}
        target_path, target = self._locate(doc, fragment, ref, path)
        if (position := self.active.get(target_path)) is not None:
            return self._reenter(position, steps, ref, path)
        if not isinstance(target, Mapping | bool):
            raise self._error(f"$ref {ref!r} points to a value that is not a schema", path, ref)
        self.index.base_of(target_path, target)
        return self._expand(target_path, target, depth + 1, steps, ref)

    def _locate(self, doc: str, fragment: str, ref: str, path: _Path) -> tuple[_Path, Any]:
        if fragment and not fragment.startswith("/"):
            found: _Path | None = self.index.anchors.get((doc, unquote(fragment)))
        else:
            tokens = unquote(fragment).split("/")[1:] if fragment else []
            segments = tuple(t.replace("~1", "/").replace("~0", "~") for t in tokens)
            found = self.index.resources[doc] + segments
        target = self._node_at(found) if found is not None else None
        if found is None or target is None:
            raise self._error(f"$ref {ref!r} points to nothing in this schema", path, ref)
        return found, target

    def _node_at(self, path: _Path) -> Any:
        node: Any = self.root
        for segment in path:
            if isinstance(node, Mapping) and segment in node:
                node = node[segment]
            elif isinstance(node, list | tuple) and _INDEX.fullmatch(segment):
                if int(segment) >= len(node):
                    return None
                node = node[int(segment)]
            else:
                return None
        return node

    def _reenter(self, position: int, steps: int, ref: str, path: _Path) -> dict[str, Any]:
        """A node already being expanded is reached again: recursion if an instance step lies between."""
        if steps > self.frames[position].steps:
            name = self._name(self.frames[position].path)
            return {"$ref": f"#/{self.dialect.defs_keyword}/{name}"}
        raise self._cycle(position, ref, path)

    def _name(self, path: _Path) -> str:
        """The name under which the recursive target at ``path`` is kept in the root's defs."""
        if path not in self.names:
            last = _UNSAFE.sub("_", path[-1]) if path else "root"
            n = len(self.names) + 1
            while f"_rec_{n}_{last}" in self.taken:
                n += 1
            self.names[path] = f"_rec_{n}_{last}"
            self.taken.add(self.names[path])
        return self.names[path]

    def _cycle(self, position: int, ref: str, path: _Path) -> SchemaRefError:
        first, *rest = self.frames[position:]
        chain = (first.via or "#" + _pointer(first.path), *(f.via for f in rest if f.via), ref)
        return self._error(
            "$ref cycle that never steps into a child instance, so validation could not end: "
            + " -> ".join(chain),
            path,
            ref,
            chain,
        )
