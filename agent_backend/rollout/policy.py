"""Policies: what samples the assistant turns of an episode.

:class:`Policy` is the protocol the episode loop needs: given the
conversation and the tools, one assistant turn (:class:`AssistantTurn`)
with its text, its tool calls, the token ids of the prompt the server
rendered and of the completion it sampled, the sampler's logprobs, and the
finish reason.

:class:`OpenAICompatiblePolicy` is that protocol over HTTP, for vLLM and
SGLang servers (``/v1/chat/completions`` with ``tools``). It asks for what a
trainer needs in every request and refuses an answer without it:

* ``logprobs: true`` **and** ``top_logprobs`` (engines that get the first
  without the second answer no logprobs, and a trainer silently trained on
  a zeroed mask and stopped making progress);
* ``return_token_ids: true``: vLLM (since vllm-project/vllm#22587, 2025)
  answers the prompt's ids as ``prompt_token_ids`` on the response and the
  completion's as ``choices[0].token_ids``; SGLang (sgl-project/sglang#30917)
  answers them per choice
  (``choices[0].prompt_token_ids``/``token_ids``) or, for
  ``return_input_ids``/``return_output_ids`` (sent with ``extra_body``), in
  ``sglext.input_ids``/``sglext.output_ids``. All three places are read. As a
  last resort for the completion, logprob tokens in vLLM's
  ``return_tokens_as_token_ids`` form (``"token_id:123"``) are read as ids.

A response without logprobs or token ids, or whose logprobs do not line up
with its completion ids, raises :class:`~agent_backend.errors.PolicyError`
(never a silently zeroed mask). Non-finite logprobs (NaN, infinities,
``null``) are handled here, where they arrive, with the configured
:data:`~agent_backend.rollout.logprobs.NonFinitePolicy` (a NaN let through
becomes ``None`` and crashes tensor creation); the
JSON is parsed with a parser that accepts ``NaN`` literals so that they are
seen, not mistaken for a broken response.

HTTP 5xx, 408, 429, connection errors and timeouts are retried with
exponential backoff and jitter, a bounded number of times; other 4xx are
not. Each attempt is bounded by a client-side timeout.

Tool calls are located by the project's tool-call layer
(:func:`~agent_backend.tools.parse_tool_calls`): structured ``tool_calls``
from a server with a tool parser, or, from one without (or a reply its parser
left as text), the calls written in the text in the model family's own format
(``call_format``: Hermes ``<tool_call>`` blocks unless told otherwise).

This module must never return a turn whose logprobs are not finite or do not
align with its completion ids, and never hide a missing field behind a default.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, Unpack, get_args, runtime_checkable

from agent_backend.rollout import defaults
from agent_backend.rollout.logprobs import (
    LogprobCheck,
    NonFiniteCounters,
    NonFinitePolicy,
    check_logprobs,
)
from agent_backend.rollout.server_client import (
    PolicyServerClient,
    PolicyStatistics,
    ServerOptions,
    token_ids,
    v1_url,
)
from agent_backend.rollout.servers import Sticky
from agent_backend.tools import TextFormat, ToolCall, from_hermes, from_text, parse_tool_calls

__all__ = [
    "AssistantTurn",
    "EpisodeChat",
    "Messages",
    "OpenAICompatiblePolicy",
    "Policy",
    "PolicyStatistics",
    "ToolSpecs",
    "chat_completions_url",
]

Messages: TypeAlias = Sequence[Mapping[str, Any]]
"""A conversation in OpenAI chat format."""
ToolSpecs: TypeAlias = Sequence[Mapping[str, Any]]
"""Tools in OpenAI function format (``ToolRegistry.to_openai()``)."""

_TOKEN_ID_PREFIX = "token_id:"


@dataclasses.dataclass(frozen=True, slots=True)
class AssistantTurn:
    """One sampled assistant turn, with everything a trainer needs of it.

    ``logprobs`` are aligned with ``completion_ids`` and finite; ``mask`` is 1
    on every sampled token except those a non-finite logprob policy masked
    (their logprob is 0.0). ``drop_error`` is set when the ``drop`` policy
    asks the whole rollout to be dropped.
    """

    message: dict[str, Any]
    """The assistant message to append to the conversation (OpenAI chat format)."""
    text: str
    """The prose of the turn (the tool calls written in its text cut out)."""
    tool_calls: tuple[ToolCall, ...]
    """The calls located in the turn, arguments raw (checked when dispatched)."""
    prompt_ids: list[int]
    """Token ids of the prompt the server rendered for this turn."""
    completion_ids: list[int]
    """Token ids the policy sampled."""
    logprobs: list[float]
    """The sampler's logprob of each completion token (0.0 where ``mask`` is 0)."""
    mask: list[int]
    """1 per completion token, 0 where a non-finite logprob was masked."""
    finish_reason: str
    """``stop``, ``length``, ``tool_calls``... as the server said."""
    non_finite: int = 0
    """How many logprobs of this turn were NaN, infinite or missing."""
    drop_error: str | None = None
    """Set when the rollout must be dropped (non-finite logprobs under the ``drop`` policy)."""
    versions: tuple[int, int] | None = None
    """The policy versions when the turn was sent and when it was answered (equal unless a
    ``continue`` weight update crossed it); None when the policy does not know them."""

    @classmethod
    def sampled(
        cls,
        message: dict[str, Any],
        text: str,
        calls: Sequence[ToolCall],
        prompt_ids: list[int],
        completion_ids: list[int],
        check: LogprobCheck,
        finish_reason: object,
        versions: tuple[int, int] | None = None,
    ) -> AssistantTurn:
        """The turn of one sampled completion whose logprobs ``check`` made safe to keep
        (a missing ``finish_reason`` is ``stop``)."""
        return cls(
            message=message,
            text=text,
            tool_calls=tuple(calls),
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            logprobs=check.logprobs,
            mask=check.mask,
            finish_reason=str(finish_reason) if finish_reason else "stop",
            non_finite=check.count,
            drop_error=check.error,
            versions=versions,
        )


@runtime_checkable
class Policy(Protocol):
    """Samples one assistant turn: ``await policy.generate(messages, tools)``.

    ``messages`` is the conversation in OpenAI chat format, ``tools`` the
    tools in OpenAI function format (``ToolRegistry.to_openai()``),
    ``max_tokens`` the most tokens this turn may sample (None: the policy's
    own limit). Failures of the policy raise
    :class:`~agent_backend.errors.PolicyError` (the episode records them).
    """

    async def generate(
        self, messages: Messages, tools: ToolSpecs, *, max_tokens: int | None = None
    ) -> AssistantTurn: ...


def chat_completions_url(url: str) -> str:
    """The chat-completions endpoint of a server URL.

    ``http://h:8000`` and ``http://h:8000/v1`` both give
    ``http://h:8000/v1/chat/completions``; a URL already ending in
    ``/chat/completions`` is kept.
    """
    return v1_url(url, "chat/completions")


class OpenAICompatiblePolicy(PolicyServerClient):
    """A policy served by vLLM or SGLang behind ``/v1/chat/completions``.

    ``async with OpenAICompatiblePolicy(url, model=...) as policy``; or use it
    without ``async with`` and call :meth:`aclose`. See the module docstring
    for what is requested and required.
    """

    _endpoint = "chat/completions"

    def __init__(
        self,
        url: str,
        *,
        non_finite: NonFinitePolicy = defaults.NON_FINITE,
        counters: NonFiniteCounters | None = None,
        call_format: TextFormat | None = None,
        **options: Unpack[ServerOptions],
    ) -> None:
        """
        Args:
            url: the server (``http://host:8000``, ``.../v1`` or the full endpoint).
            non_finite: what to do with a NaN/inf/null logprob: mask, drop or fail.
            counters: where non-finite logprobs are counted (shared with a pool).
            call_format: the text format the model writes tool calls in
                (:data:`~agent_backend.tools.TextFormat`), read from a reply without
                structured ``tool_calls`` (a server without a tool parser for the model's
                family); default ``"hermes"``. Given, requests also ask for
                ``skip_special_tokens: false``: many families' call markers are special
                tokens, which a server drops from the text otherwise.
            options: as :class:`~agent_backend.rollout.server_client.PolicyServerClient`
                (``model``, ``temperature``, ``max_tokens``, ``timeout``, ``max_retries`` ...);
                ``top_logprobs`` must be at least 1 (some engines answer no logprobs at all
                without it), and ``extra_body`` may hold e.g. ``{"return_input_ids": true}``
                for SGLang's sglext, ``chat_template_kwargs``, ``repetition_penalty``.
        """
        super().__init__(url, **options)
        if self.top_logprobs < 1:
            raise ValueError(
                "top_logprobs must be at least 1 (without it engines answer no logprobs)"
            )
        self.non_finite: NonFinitePolicy = non_finite
        self.counters = counters if counters is not None else NonFiniteCounters()
        if call_format is not None and call_format not in get_args(TextFormat):
            raise ValueError(f"unknown call_format {call_format!r}: one of {get_args(TextFormat)}")
        self.call_format: TextFormat = call_format or "hermes"
        self._keep_special_tokens = call_format is not None

    # -- requests ---------------------------------------------------------------------------------

    def request_body(
        self, messages: Messages, tools: ToolSpecs, *, max_tokens: int | None = None
    ) -> dict[str, Any]:
        """The JSON body of one chat-completions request (shown in docs/rollouts.md)."""
        body: dict[str, Any] = {
            "messages": list(messages),
            "logprobs": True,
            "top_logprobs": self.top_logprobs,
            "return_token_ids": True,
            "stream": False,
            "n": 1,
        }
        if tools:
            body["tools"] = list(tools)
        if self._keep_special_tokens:  # the call's markers, to read them in call_format
            body["skip_special_tokens"] = False
        return self._sampling(body, max_tokens)

    async def generate(
        self,
        messages: Messages,
        tools: ToolSpecs,
        *,
        max_tokens: int | None = None,
        sticky: Sticky | None = None,
    ) -> AssistantTurn:
        """Sample one turn; :class:`PolicyError` when the server fails or answers unusably.
        ``sticky`` keeps the turns of one episode on one server (:meth:`for_episode`)."""
        return await self._request(
            functools.partial(self.request_body, messages, tools, max_tokens=max_tokens),
            functools.partial(self._turn, tools=tools),
            sticky,
        )

    def for_episode(self) -> EpisodeChat:
        """This policy for one episode: its turns stay on one server while it is up."""
        return EpisodeChat(self)

    def _turn(
        self, data: Any, versions: tuple[int, int], *, tools: ToolSpecs = ()
    ) -> AssistantTurn:
        if not isinstance(data, dict):
            raise self._unusable("a JSON object")
        choice = self._first_choice(data)
        raw_message = choice.get("message")
        if not isinstance(raw_message, dict):
            raise self._unusable("a message")
        content = raw_message.get("content")
        if content is not None and not isinstance(content, str):
            raise self._unusable("text content", "Multimodal content is not supported")
        entries = self._logprobs(
            choice, "content", f"logprobs: true, top_logprobs: {self.top_logprobs}"
        )
        prompt_ids = self._prompt_ids(data, choice)
        completion_ids = self._completion_ids(data, choice, entries)
        if len(completion_ids) != len(entries):
            raise self._misaligned(len(completion_ids), len(entries))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        raw_calls = raw_message.get("tool_calls")
        if raw_calls:
            message["tool_calls"] = raw_calls
        elif content is None:
            message["content"] = ""
        calls: list[ToolCall]
        if raw_calls or self.call_format == "hermes":
            text = from_hermes(content)[0] if content and "<tool_call>" in content else content
            calls = parse_tool_calls(message)
        else:
            # The message goes back as the server returned it (the template renders the text
            # as it was sampled); the calls are read from the text in the model's format.
            text, calls = from_text(content or "", format=self.call_format, tools=tools or None)
            if not calls and self.call_format != "harmony":
                text = content  # nothing was cut out (harmony's prose is its final channel)
        check = check_logprobs(
            [entry.get("logprob") if isinstance(entry, dict) else None for entry in entries],
            policy=self.non_finite,
            counters=self.counters,
        )
        return AssistantTurn.sampled(
            message,
            text or "",
            calls,
            prompt_ids,
            completion_ids,
            check,
            choice.get("finish_reason"),
            versions,
        )

    def _prompt_ids(self, data: dict[str, Any], choice: dict[str, Any]) -> list[int]:
        sglext = data.get("sglext")
        for candidate in (
            data.get("prompt_token_ids"),  # vLLM
            choice.get("prompt_token_ids"),  # SGLang return_token_ids
            sglext.get("input_ids") if isinstance(sglext, dict) else None,  # SGLang sglext
        ):
            ids = token_ids(candidate)
            if ids is not None:
                return ids
        raise self._unusable(
            "the prompt's token ids",
            "The request asked for them (return_token_ids: true): upgrade a vLLM older than "
            "that field (vllm-project/vllm#22587); "
            "SGLang needs return_token_ids support, or extra_body={'return_input_ids': True, "
            "'return_output_ids': True}",
        )

    def _completion_ids(
        self, data: dict[str, Any], choice: dict[str, Any], entries: list[Any]
    ) -> list[int]:
        ids = token_ids(choice.get("token_ids"))
        if ids is not None:
            return ids
        sglext = data.get("sglext")
        if isinstance(sglext, dict):
            output = sglext.get("output_ids")
            index = choice.get("index", 0)
            if isinstance(output, list) and isinstance(index, int) and 0 <= index < len(output):
                ids = token_ids(output[index])
                if ids is not None:
                    return ids
        # vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:123".
        parsed: list[int] = []
        for entry in entries:
            token = entry.get("token") if isinstance(entry, dict) else None
            if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
                break
            digits = token[len(_TOKEN_ID_PREFIX) :]
            if not digits.isdigit():
                break
            parsed.append(int(digits))
        else:
            if entries:
                return parsed
        raise self._no_completion_ids()


class EpisodeChat:
    """One episode's view of an :class:`OpenAICompatiblePolicy`: what ``for_episode()`` returns."""

    def __init__(self, policy: OpenAICompatiblePolicy) -> None:
        self.policy = policy
        self._sticky = Sticky()

    def __repr__(self) -> str:
        return f"<EpisodeChat {self.policy!r}>"

    async def generate(
        self, messages: Messages, tools: ToolSpecs, *, max_tokens: int | None = None
    ) -> AssistantTurn:
        return await self.policy.generate(
            messages, tools, max_tokens=max_tokens, sticky=self._sticky
        )
