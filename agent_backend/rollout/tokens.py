"""Token-in/token-out episodes: the exact ids the server sampled, never a re-rendered history.

A chat endpoint re-renders the whole conversation every turn; a template
that differs from the sampled tokens by one newline, strips earlier
reasoning (Qwen3) or re-renders tool calls changes the prompt ids, and the
trajectory splits into segments. :class:`TokenPolicy` never
re-renders: turn N+1's prompt is turn N's prompt + its completion + the
tokens of the messages that came back (tool results, a user message),
rendered **alone** by the model's :class:`~agent_backend.rollout.chat_template.ChatTemplate`.
The server gets token ids and answers token ids; tool calls are read from the
decoded text by the tool-call layer. An episode run with it has one record,
always.

* :class:`TokenSampler` is what samples a completion from token ids: a
  protocol with one method. :class:`VLLMTokenSampler` is vLLM's
  ``/v1/completions`` with a token-id prompt; trainer adapters provide
  samplers over their own engines (verl's server manager, SkyRL's inference
  client), so that the trainer's weight sync applies.
* :class:`TokenPolicy` joins a sampler and a template into a
  :class:`~agent_backend.rollout.policy.Policy` for
  :func:`~agent_backend.rollout.episode.run_episode` and
  :class:`~agent_backend.rollout.pool.RolloutPool`, which ask it for one
  stateful policy per episode (:meth:`TokenPolicy.for_episode`).

Non-finite logprobs are handled where they arrive (later, a NaN crashes
tensor creation), with the
policy's :data:`~agent_backend.rollout.logprobs.NonFinitePolicy`, as for
chat completions. This module must never re-tokenize a token the server
sampled, and never send a prompt that does not start with the previous one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import anyio
import anyio.lowlevel
import anyio.to_thread

from agent_backend.errors import PolicyError
from agent_backend.rollout import defaults
from agent_backend.rollout.chat_template import ChatTemplate
from agent_backend.rollout.logprobs import NonFiniteCounters, NonFinitePolicy, check_logprobs
from agent_backend.rollout.policy import (
    AssistantTurn,
    Messages,
    OpenAICompatiblePolicy,
    Policy,
    ToolSpecs,
)
from agent_backend.rollout.server_client import PolicyServerClient, token_ids
from agent_backend.rollout.servers import Sticky

__all__ = [
    "SampledTokens",
    "TokenPolicy",
    "TokenSampler",
    "VLLMTokenSampler",
    "open_policy",
]


@dataclasses.dataclass(frozen=True, slots=True)
class SampledTokens:
    """One completion as a sampler returns it."""

    token_ids: list[int]
    """The ids sampled, the end-of-turn token included when the server sampled it."""
    logprobs: list[float | None]
    """The sampler's logprob of each id (None or NaN where it had none: policy-handled)."""
    finish_reason: str
    """``stop`` (end of turn or a stop sequence), ``length`` ..."""
    versions: tuple[int, int] | None = None
    """The policy versions when it was sent and answered (None: the sampler does not know)."""


@runtime_checkable
class TokenSampler(Protocol):
    """Samples one completion of ``prompt_ids`` (at most ``max_tokens`` ids; None: no bound here).

    Failures raise :class:`~agent_backend.errors.PolicyError`.
    """

    async def sample(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> SampledTokens: ...


class TokenPolicy:
    """A :class:`~agent_backend.rollout.policy.Policy` that extends token streams (module docstring).

    ``run_episode`` and ``RolloutPool`` call :meth:`for_episode` once per
    episode; the per-episode policy remembers the ids sent and sampled so far.
    """

    def __init__(
        self,
        sampler: TokenSampler,
        template: ChatTemplate,
        *,
        non_finite: NonFinitePolicy = defaults.NON_FINITE,
        counters: NonFiniteCounters | None = None,
    ) -> None:
        if not isinstance(sampler, TokenSampler):
            raise TypeError(
                f"{type(sampler).__name__} has no async sample(prompt_ids, max_tokens=)"
            )
        self.sampler = sampler
        self.template = template
        self.non_finite: NonFinitePolicy = non_finite
        self.counters = counters if counters is not None else NonFiniteCounters()

    def __repr__(self) -> str:
        return f"<TokenPolicy {self.sampler!r} {self.template!r}>"

    def for_episode(self) -> EpisodeTokens:
        """A fresh policy for one episode (it must not be shared between episodes)."""
        return EpisodeTokens(self)

    async def generate(
        self, messages: Messages, tools: ToolSpecs, *, max_tokens: int | None = None
    ) -> AssistantTurn:
        """One turn of a conversation with no past turns of this policy (a one-turn episode)."""
        return await self.for_episode().generate(messages, tools, max_tokens=max_tokens)


class EpisodeTokens:
    """The token stream of one episode: what :meth:`TokenPolicy.for_episode` returns."""

    def __init__(self, policy: TokenPolicy) -> None:
        self._policy = policy
        self._context: list[int] = []
        self._seen = 0
        self._last: dict[str, Any] | None = None
        self._last_ids: list[int] = []
        self._sticky = Sticky()

    def __repr__(self) -> str:
        return f"<EpisodeTokens context={len(self._context)} tokens>"

    def _prompt(self, messages: Messages, tools: ToolSpecs) -> list[int]:
        template = self._policy.template
        if self._last is None:
            return template.prompt_ids(messages, tools)
        if len(messages) <= self._seen or messages[self._seen] is not self._last:
            raise PolicyError(
                "token-in/token-out: the conversation must keep this policy's last assistant "
                "message and only append after it (use one TokenPolicy.for_episode() per episode)"
            )
        new = messages[self._seen + 1 :]
        if not new:
            raise PolicyError("token-in/token-out: no new message since the last turn")
        return self._context + template.continuation_ids(new, tools, after=self._last_ids)

    async def generate(
        self, messages: Messages, tools: ToolSpecs, *, max_tokens: int | None = None
    ) -> AssistantTurn:
        policy = self._policy
        prompt = self._prompt(messages, tools)
        if self._last is None:
            # An episode's first request goes out after one trip through the event loop:
            # the episodes a RolloutPool starts together render their prompts first, then
            # send together, and the server prefills them in one step. Sent as each one is
            # ready, 16 went out ~1 ms apart beside a busy vLLM server, were prefilled over
            # several steps and stayed apart for the rest of the episode.
            await anyio.lowlevel.checkpoint()
        sampler = policy.sampler
        if isinstance(sampler, VLLMTokenSampler):  # ours: the episode stays on one server
            sampled = await sampler.sample(prompt, max_tokens=max_tokens, sticky=self._sticky)
        else:
            sampled = await sampler.sample(prompt, max_tokens=max_tokens)
        ids = [int(t) for t in sampled.token_ids]
        if len(sampled.logprobs) != len(ids):
            raise PolicyError(
                f"the sampler returned {len(ids)} token ids but {len(sampled.logprobs)} "
                "logprobs; they must align one to one"
            )
        check = check_logprobs(
            list(sampled.logprobs), policy=policy.non_finite, counters=policy.counters
        )
        message, prose, calls = policy.template.assistant_message(ids, tools)
        self._context = prompt + ids
        self._seen = len(messages)
        self._last = message
        self._last_ids = ids
        return AssistantTurn.sampled(
            message, prose, calls, prompt, ids, check, sampled.finish_reason, sampled.versions
        )


def _logprob(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


class VLLMTokenSampler(PolicyServerClient):
    """vLLM's ``/v1/completions`` with a token-id prompt: token ids and logprobs back.

    Each request asks for the sampled token's logprob (``logprobs``) and the
    completion's ids (``return_token_ids``), with special tokens kept in the
    text; a response without them raises :class:`PolicyError` (never a
    silently zeroed mask that stops training making progress). Its arguments
    and retries are :class:`~agent_backend.rollout.server_client.PolicyServerClient`'s:
    ``max_tokens`` is required here or per call (an OpenAI completions endpoint
    samples 16 tokens without it); ``top_logprobs`` may be 0 (the sampled
    token's own logprob always comes first); ``extra_body`` may hold
    ``structured_outputs`` for guided decoding, ``repetition_penalty``, ``seed`` ...
    """

    _endpoint = "completions"

    def request_body(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> dict[str, Any]:
        """The JSON body of one completions request."""
        body = self._sampling(
            {
                "prompt": [int(t) for t in prompt_ids],
                "logprobs": self.top_logprobs,
                "return_token_ids": True,
                "skip_special_tokens": False,
                "stream": False,
                "n": 1,
            },
            max_tokens,
        )
        if "max_tokens" not in body:
            # Without it an OpenAI completions endpoint samples 16 tokens: a silent cut.
            raise PolicyError(
                "VLLMTokenSampler needs max_tokens (the sampler's, or EpisodeConfig's "
                "max_tokens_per_turn): the completions endpoint samples 16 tokens without it",
                url=self.url,
                retryable=False,
            )
        return body

    async def sample(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None = None,
        sticky: Sticky | None = None,
    ) -> SampledTokens:
        """Sample one completion; :class:`PolicyError` when the server fails or answers unusably.
        ``sticky`` keeps the turns of one episode on one server."""
        return await self._request(
            functools.partial(self.request_body, prompt_ids, max_tokens=max_tokens),
            self._sampled,
            sticky,
        )

    def _sampled(self, data: Any, versions: tuple[int, int]) -> SampledTokens:
        choice = self._first_choice(data)
        ids = token_ids(choice.get("token_ids"))
        if ids is None:
            raise self._no_completion_ids()
        values = self._logprobs(choice, "token_logprobs", f"logprobs: {self.top_logprobs}")
        if len(values) != len(ids):
            raise self._misaligned(len(ids), len(values))
        finish = choice.get("finish_reason")
        return SampledTokens(
            token_ids=ids,
            logprobs=[_logprob(v) for v in values],
            finish_reason=str(finish) if finish else "stop",
            versions=versions,
        )


@contextlib.asynccontextmanager
async def open_policy(
    options: Mapping[str, Any], *, counters: NonFiniteCounters | None = None
) -> AsyncIterator[Policy]:
    """The policy that ``options`` describe, open for the duration of the ``async with``.

    ``options`` are :class:`~agent_backend.rollout.policy.OpenAICompatiblePolicy`'s
    keyword arguments (``url``, ``model``, ``temperature`` ...): chat completions.
    With ``tokenizer`` (a local folder or an installed model name, loaded with
    transformers) they describe a token-in/token-out :class:`TokenPolicy` over
    :class:`VLLMTokenSampler` instead; ``chat_template_kwargs`` and ``call_format`` then
    go to the template (without ``call_format``, the one its chat template writes). What
    ``agent-backend rollout --tokenizer`` and Ray rollout workers use.
    """
    given = dict(options)
    tokenizer = given.pop("tokenizer", None)
    if tokenizer is None:
        async with OpenAICompatiblePolicy(**given, counters=counters) as chat:
            yield chat
        return
    non_finite: NonFinitePolicy = given.pop("non_finite", defaults.NON_FINITE)
    template_kwargs = given.pop("chat_template_kwargs", None)
    call_format = given.pop("call_format", None)  # None: the template's own (detected)
    template = await anyio.to_thread.run_sync(
        functools.partial(
            ChatTemplate.from_pretrained,
            str(tokenizer),
            chat_template_kwargs=template_kwargs,
            call_format=call_format,
        )
    )
    async with VLLMTokenSampler(**given) as sampler:
        yield TokenPolicy(sampler, template, non_finite=non_finite, counters=counters)
