"""Which JSON Schema draft a schema is written in.

Pure: no I/O. The draft decides two things this package cares about: whether
keywords beside a ``$ref`` apply (2019-09 and later) or are ignored (draft 7
and earlier), and which keyword holds definitions (``$defs`` or
``definitions``). A schema that names no ``$schema`` is read as 2020-12, the
dialect of OpenAI, Anthropic and MCP tool schemas.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Dialect", "detect_dialect"]


class Dialect(enum.Enum):
    DRAFT4 = "draft4"
    DRAFT6 = "draft6"
    DRAFT7 = "draft7"
    DRAFT2019_09 = "2019-09"
    DRAFT2020_12 = "2020-12"

    @property
    def ref_siblings_apply(self) -> bool:
        """True when keywords next to ``$ref`` are evaluated too (2019-09 and later)."""
        return self in (Dialect.DRAFT2019_09, Dialect.DRAFT2020_12)

    @property
    def defs_keyword(self) -> str:
        """Where this draft keeps reusable subschemas."""
        return "$defs" if self.ref_siblings_apply else "definitions"

    @property
    def id_keyword(self) -> str:
        return "id" if self is Dialect.DRAFT4 else "$id"

    @property
    def meta_schema_uri(self) -> str:
        return _META[self]


_META = {
    Dialect.DRAFT4: "http://json-schema.org/draft-04/schema#",
    Dialect.DRAFT6: "http://json-schema.org/draft-06/schema#",
    Dialect.DRAFT7: "http://json-schema.org/draft-07/schema#",
    Dialect.DRAFT2019_09: "https://json-schema.org/draft/2019-09/schema",
    Dialect.DRAFT2020_12: "https://json-schema.org/draft/2020-12/schema",
}

_BY_MARKER = (
    ("draft-04", Dialect.DRAFT4),
    ("draft-06", Dialect.DRAFT6),
    ("draft-07", Dialect.DRAFT7),
    ("2019-09", Dialect.DRAFT2019_09),
    ("2020-12", Dialect.DRAFT2020_12),
)


def detect_dialect(schema: Any, default: Dialect = Dialect.DRAFT2020_12) -> Dialect:
    """The draft named by the root ``$schema``, or ``default`` when absent or unknown."""
    if isinstance(schema, dict):
        uri = schema.get("$schema")
        if isinstance(uri, str):
            for marker, dialect in _BY_MARKER:
                if marker in uri:
                    return dialect
    return default
