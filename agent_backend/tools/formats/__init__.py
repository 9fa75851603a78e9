"""Tool calls written as text by open models: one parser and one renderer per format family.

=============  ==================================================================
``hermes``     Hermes, Qwen2.5, Qwen3: ``<tool_call>{json}</tool_call>``
``llama3``     Llama 3.x: ``{"name": ..., "parameters": ...}``, ``<|python_tag|>``, ``;``
``mistral``    ``[TOOL_CALLS][{...}]`` and ``[TOOL_CALLS]name[ARGS]{json}``
``deepseek``   DeepSeek V3/R1 and V3.1: a ``tool_calls_begin`` section (fullwidth bars)
``glm45``      GLM-4.5/4.6/4.7: ``<tool_call>name<arg_key>..<arg_value>..``
``kimi_k2``    Kimi K2: ``<|tool_calls_section_begin|>...``
``qwen3_coder`` Qwen3-Coder: ``<tool_call><function=name><parameter=k>v...``
``harmony``    gpt-oss: ``<|channel|>commentary to=functions.name ...<|call|>``
=============  ==================================================================

:func:`from_text` reads ``(prose, calls)`` in a named format,
:func:`render_tool_calls` writes calls back as the family's chat template
puts them in history, and :func:`detect_call_format` names the family of a
tokenizer's chat template. Parsing never raises on model output: what
cannot be read becomes a call with ``error`` set. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, get_args

from agent_backend.errors import SchemaError
from agent_backend.schema import resolve_local_refs
from agent_backend.tools.formats import (
    deepseek,
    glm45,
    harmony,
    hermes,
    kimi_k2,
    llama3,
    mistral,
    qwen3_coder,
)
from agent_backend.tools.formats._base import (
    MAX_CALLS,
    CallFormat,
    TextFormat,
    ToolCall,
    ToolSchemas,
)

__all__ = [
    "MAX_CALLS",
    "TEXT_FORMATS",
    "CallFormat",
    "TextFormat",
    "ToolCall",
    "ToolSchemas",
    "detect_call_format",
    "from_text",
    "render_tool_calls",
]

#: Every text format's name, in the order :func:`detect_call_format` tells them apart.
TEXT_FORMATS: tuple[TextFormat, ...] = get_args(TextFormat)

_Parser = Callable[[str, "ToolSchemas | None"], tuple[str, list[ToolCall]]]

_PARSERS: dict[str, _Parser] = {
    "hermes": lambda text, _tools: hermes.parse(text),
    "llama3": lambda text, _tools: llama3.parse(text),
    "mistral": lambda text, _tools: mistral.parse(text),
    "deepseek": lambda text, _tools: deepseek.parse(text),
    "glm45": glm45.parse,
    "kimi_k2": lambda text, _tools: kimi_k2.parse(text),
    "qwen3_coder": qwen3_coder.parse,
    "harmony": lambda text, _tools: harmony.parse(text),
}
# The formats whose argument values are bare text, typed by the tools' schemas.
_TYPED = frozenset({"glm45", "qwen3_coder"})


def _check_format(format: object) -> str:
    if format not in _PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}: one of {', '.join(TEXT_FORMATS)}")
    assert isinstance(format, str)
    return format


def _has_ref(node: object) -> bool:
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if "$ref" in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def tool_schemas(tools: object) -> dict[str, Mapping[str, Any]]:
    """``{name: parameters schema}`` from any way of listing tools.

    Accepts that mapping itself, or a sequence of :class:`~agent_backend.tools.Tool`
    objects, OpenAI tool definitions (``{"type": "function", "function": {...}}``),
    or ``{"name", "parameters" | "input_schema" | "inputSchema"}`` dicts (Anthropic, MCP).
    Local ``$ref``\\ s are resolved, so a referenced parameter's type is seen.
    """
    schemas: dict[str, Mapping[str, Any]] = {}
    if isinstance(tools, Mapping):
        items: Iterable[tuple[object, object]] = tools.items()
    elif isinstance(tools, Iterable) and not isinstance(tools, (str, bytes)):
        items = (_named_schema(tool) for tool in tools)
    else:
        raise TypeError(f"tools must be a mapping or a list of tools, not {type(tools).__name__}")
    for name, schema in items:
        if not isinstance(name, str) or not isinstance(schema, Mapping):
            raise TypeError(f"a tool needs a name and a parameters schema, got {name!r}")
        if _has_ref(schema):
            try:
                resolved: object = resolve_local_refs(schema)
            except SchemaError:
                resolved = schema  # the schema layer reports it where the tool is loaded
            if isinstance(resolved, Mapping):
                schema = resolved
        schemas[name] = schema
    return schemas


def _named_schema(tool: object) -> tuple[object, object]:
    if isinstance(tool, Mapping):
        function = tool.get("function")
        if isinstance(function, Mapping):
            tool = function
        assert isinstance(tool, Mapping)
        for key in ("parameters", "input_schema", "inputSchema"):
            if key in tool:
                return tool.get("name"), tool[key]
        return tool.get("name"), {}
    return getattr(tool, "name", None), getattr(tool, "parameters", None)


def from_text(text: str, *, format: TextFormat, tools: object = None) -> tuple[str, list[ToolCall]]:
    """``(prose, calls)`` of model output ``text`` in the tool-call ``format`` named.

    ``prose`` is the text outside the calls (for ``harmony``, the final
    channel). ``tools`` (see :func:`tool_schemas`) is used by ``glm45`` and
    ``qwen3_coder`` only, to tell which bare-text values are strings. Never
    raises on what the model wrote; raises ``ValueError`` for an unknown format.
    """
    name = _check_format(format)
    if not isinstance(text, str):
        raise TypeError(f"from_text reads text, not {type(text).__name__}")
    schemas = tool_schemas(tools) if tools is not None and name in _TYPED else None
    return _PARSERS[name](text, schemas)


def render_tool_calls(
    calls: Sequence[ToolCall],
    *,
    format: TextFormat,
    content: str = "",
    style: str | None = None,
) -> str:
    """The text of an assistant turn with ``content`` and ``calls``, as the format's template writes it.

    That is the text between the generation prompt and the end-of-turn token
    (for ``harmony``, whose calls are messages of their own, each message
    with its ``<|start|>assistant`` header), so a token-in/token-out rollout
    can append a call to history exactly as the model would have sampled it.
    ``style`` picks a template generation where a family has two:
    ``deepseek`` ``"v3"`` (default) or ``"v3.1"``; ``mistral`` ``"args"``
    (default) or ``"list"``. Raises ``ValueError`` for a call with ``error``
    set or with arguments that are not a JSON object.
    """
    name = _check_format(format)
    if name == "deepseek":
        return deepseek.render(calls, content, style=style or "v3")
    if name == "mistral":
        return mistral.render(calls, content, style=style or "args")
    if style is not None:
        raise ValueError(f"the {name} format has no styles")
    renderers: dict[str, Callable[[Sequence[ToolCall], str], str]] = {
        "hermes": hermes.render,
        "llama3": llama3.render,
        "glm45": glm45.render,
        "kimi_k2": kimi_k2.render,
        "qwen3_coder": qwen3_coder.render,
        "harmony": harmony.render,
    }
    return renderers[name](calls, content)


# What marks each family in a chat template (or a tokenizer's vocabulary).
_MARKERS: dict[str, Callable[[str], bool]] = {
    "harmony": lambda t: "<|channel|>" in t and ("<|call|>" in t or "<|constrain|>" in t),
    "kimi_k2": lambda t: "<|tool_calls_section_begin|>" in t,
    "deepseek": lambda t: deepseek.CALLS_BEGIN in t,
    "mistral": lambda t: mistral.TOOL_CALLS in t,
    "glm45": lambda t: "<arg_key>" in t and "<tool_call>" in t,
    "qwen3_coder": lambda t: "<function=" in t and "<parameter=" in t and "<tool_call>" in t,
    "hermes": lambda t: "<tool_call>" in t and "<arg_key>" not in t and "<parameter=" not in t,
    "llama3": lambda t: (
        llama3.PYTHON_TAG in t or ("<|start_header_id|>" in t and '"parameters"' in t)
    ),
}


def detect_call_format(template_or_tokenizer: object) -> TextFormat | None:
    """The tool-call format a chat template (or a tokenizer's) writes, or None.

    Decided by the markers each family's template uses to put calls in
    history; None when no family's markers are there, or when several
    families' are (an ambiguous template is never guessed at).
    """
    template = template_or_tokenizer
    if not isinstance(template, str):
        template = getattr(template_or_tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: the tool-use one, else the default
        template = template.get("tool_use") or template.get("default")
    if isinstance(template, list):  # [{"name": ..., "template": ...}] as in tokenizer_config.json
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("tool_use") or named.get("default")
    if not isinstance(template, str):
        return None
    found = [name for name, marks in _MARKERS.items() if marks(template)]
    if len(found) != 1:
        return None
    detected: TextFormat = found[0]  # type: ignore[assignment]
    return detected
