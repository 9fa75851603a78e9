"""A model's chat template, used to extend a token stream without ever re-rendering its past.

Token-in/token-out episodes (:class:`~agent_backend.rollout.tokens.TokenPolicy`)
keep the exact ids the server sampled. Only three things are ever rendered:

* the first prompt (:meth:`ChatTemplate.prompt_ids`): the conversation so far
  with the generation prompt;
* after a turn, the messages that came back (tool results, a user message)
  **alone** (:meth:`ChatTemplate.continuation_ids`): the template's glue after
  the assistant's end-of-turn token, the new messages, and the generation
  prompt. It is computed as the difference between a fixed short conversation
  rendered with and without the new messages, so whatever the template puts
  around a message (roles, ``<tool_response>`` wrappers, a default system
  prompt) comes out exactly as it would in a full render, and the past is
  never tokenized again;
* the decoded text of a completion (:meth:`ChatTemplate.assistant_message`),
  from which the tool-call layer reads the calls.

A template that cannot be extended this way (its rendering of a conversation
does not start with its rendering of that conversation's beginning) raises
:class:`~agent_backend.errors.PolicyError` with what differed; it is never
papered over.

``ChatTemplate`` takes any Hugging Face tokenizer (``apply_chat_template``,
``encode``, ``decode``): a trainer's own (TRL's ``processing_class``, verl's
and SkyRL's ``tokenizer``) or :meth:`ChatTemplate.from_pretrained` (transformers,
an optional dependency imported only there). This module must never do I/O
outside ``from_pretrained``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from agent_backend.errors import PolicyError, clip
from agent_backend.tools import TextFormat, ToolCall, detect_call_format, from_text

__all__ = ["ChatTemplate"]

# A short conversation that ends with a finished assistant turn: what new messages are
# rendered after, to learn the template's glue and wrappers without the real history.
_BASE: tuple[dict[str, Any], ...] = (
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "ok"},
)


class ChatTemplate:
    """Renders prompts and continuations with a tokenizer's chat template (module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        end_of_turn: str | None = None,
        call_format: TextFormat | None = None,
    ) -> None:
        """
        Args:
            tokenizer: a Hugging Face tokenizer with a chat template.
            chat_template_kwargs: passed to every ``apply_chat_template`` call
                (e.g. ``{"enable_thinking": False}``).
            end_of_turn: the text of the token that ends an assistant turn
                (default: the tokenizer's eos token, ``<|im_end|>`` for ChatML models).
            call_format: the text format the model writes tool calls in
                (:data:`~agent_backend.tools.TextFormat`); default: the one its chat
                template uses (:func:`~agent_backend.tools.detect_call_format`), else
                ``"hermes"``.
        """
        for method in ("apply_chat_template", "encode", "decode"):
            if not callable(getattr(tokenizer, method, None)):
                raise TypeError(f"ChatTemplate needs a tokenizer with {method}()")
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        eot = end_of_turn if end_of_turn is not None else getattr(tokenizer, "eos_token", None)
        if not isinstance(eot, str) or not eot:
            raise ValueError("the tokenizer has no eos token: pass end_of_turn=")
        self.end_of_turn = eot
        ids = self.encode(eot)
        if len(ids) != 1:
            raise ValueError(f"end_of_turn {eot!r} is {len(ids)} tokens, not one")
        self.end_of_turn_id: int = ids[0]
        self._bases: dict[str, tuple[str, str]] = {}
        if call_format is not None and call_format not in get_args(TextFormat):
            raise ValueError(f"unknown call_format {call_format!r}: one of {get_args(TextFormat)}")
        self.call_format: TextFormat = call_format or detect_call_format(tokenizer) or "hermes"

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> ChatTemplate:
        """The chat template of a model: a local folder or an installed model name (transformers)."""
        template_kwargs = kwargs.pop("chat_template_kwargs", None)
        end_of_turn = kwargs.pop("end_of_turn", None)
        call_format = kwargs.pop("call_format", None)
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                "ChatTemplate.from_pretrained needs transformers: pip install 'agent-backend[tokens]'"
            ) from exc
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
        return cls(
            tokenizer,
            chat_template_kwargs=template_kwargs,
            end_of_turn=end_of_turn,
            call_format=call_format,
        )

    def __repr__(self) -> str:
        name = getattr(self.tokenizer, "name_or_path", type(self.tokenizer).__name__)
        return (
            f"<ChatTemplate {name!s} end_of_turn={self.end_of_turn!r} "
            f"call_format={self.call_format!r}>"
        )

    # -- tokens -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without the special tokens a tokenizer may add around it."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
    ) -> str:
        """The template's text for ``messages`` (what a chat endpoint would tokenize)."""
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tools=[dict(t) for t in tools] or None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.kwargs,
            )
        except Exception as exc:  # jinja2's errors, a template that raises on purpose
            raise PolicyError(
                f"the chat template failed: {type(exc).__name__}: {clip(str(exc), 300)}"
            ) from exc
        if not isinstance(text, str):
            raise PolicyError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def prompt_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """The first prompt of an episode: ``messages`` rendered with the generation prompt."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=True))

    def continuation_ids(
        self,
        new_messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        *,
        after: Sequence[int],
    ) -> list[int]:
        """The ids that follow a finished assistant turn ``after`` when ``new_messages`` come back.

        The end-of-turn token when the completion lacks it (a stop string or
        a server that strips it), the template's glue after it, the new
        messages as the template wraps them, and the generation prompt.
        """
        glue, rendered = self._continuation(new_messages, tools)
        closed = bool(after) and after[-1] == self.end_of_turn_id
        return self.encode(("" if closed else self.end_of_turn) + glue + rendered)

    def _continuation(
        self, new_messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
    ) -> tuple[str, str]:
        base, glue = self._base(tools)
        full = self.render_text([*_BASE, *new_messages], tools, add_generation_prompt=True)
        if not full.startswith(base):
            at = next(
                (i for i, (a, b) in enumerate(zip(base, full, strict=False)) if a != b),
                min(len(base), len(full)),
            )
            raise PolicyError(
                "the chat template rewrites a conversation's beginning when messages are "
                f"added (first difference at character {at}: {clip(base[at:], 60)!r} became "
                f"{clip(full[at:], 60)!r}); token-in/token-out cannot extend it"
            )
        return glue, full[len(base) :]

    def _base(self, tools: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """The fixed conversation rendered with ``tools``, and the glue after its end of turn.

        Rendered once per tool list (an episode offers the same tools every turn);
        only the new messages are rendered each turn.
        """
        key = json.dumps([dict(t) for t in tools], sort_keys=True, default=str)
        cached = self._bases.get(key)
        if cached is not None:
            return cached
        base = self.render_text(_BASE, tools, add_generation_prompt=False)
        end = base.rfind(self.end_of_turn)
        if end < 0:
            raise PolicyError(
                f"the chat template does not end an assistant turn with {self.end_of_turn!r}; "
                "pass ChatTemplate(end_of_turn=...)"
            )
        value = (base, base[end + len(self.end_of_turn) :])
        if len(self._bases) < 64:
            self._bases[key] = value
        return value

    # -- completions ------------------------------------------------------------------------------

    def assistant_message(
        self, completion_ids: Sequence[int], tools: object = None
    ) -> tuple[dict[str, Any], str, list[ToolCall]]:
        """``(message, prose, calls)`` of a sampled completion.

        The text is decoded with special tokens kept (``<tool_call>`` is often
        one), the end-of-turn token cut off; calls are located by the tool-call
        layer in :attr:`call_format`. ``tools`` (the turn's, any form
        :func:`~agent_backend.tools.tool_schemas` reads) types the bare-text values
        of the formats that write them so (``glm45``, ``qwen3_coder``): ``007``
        stays a string where the parameter is one. The message carries the prose and
        the calls in OpenAI form, so the recorded conversation reads like a chat
        endpoint's (the tokens, not the message, are what was sampled).
        """
        text = str(self.tokenizer.decode(list(completion_ids), skip_special_tokens=False))
        if text.endswith(self.end_of_turn):
            text = text[: -len(self.end_of_turn)]
        prose, calls = from_text(text, format=self.call_format, tools=tools or None)
        if not calls and self.call_format != "harmony":
            prose = text  # nothing was cut out (harmony's prose is its final channel)
        # As a chat endpoint with a tool parser answers: the prose, and the calls apart.
        message: dict[str, Any] = {"role": "assistant", "content": prose}
        if calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": call.arguments
                        if isinstance(call.arguments, str)
                        else json.dumps(call.arguments),
                    },
                }
                for call in calls
            ]
        return message, prose, calls
