"""One policy server over HTTP: the retries, model discovery and counters every client of it shares.

:class:`PolicyServerClient` is the base of
:class:`~agent_backend.rollout.policy.OpenAICompatiblePolicy` (chat completions)
and :class:`~agent_backend.rollout.tokens.VLLMTokenSampler` (completions with
token-id prompts). It posts JSON to one endpoint: HTTP 5xx, 408, 425, 429,
connection errors and timeouts are retried a bounded number of times, after
the server's ``Retry-After`` on a 429 or 503 (capped by ``max_backoff``), else
after exponential backoff with jitter (:func:`agent_backend.retry.retry_delay`,
shared with the daemon's client); other 4xx are not. Each attempt is bounded by a client-side timeout. Bodies are
parsed with the standard parser, which reads ``NaN`` literals, so that a
non-finite logprob is seen where it arrives and handled (let through, it
becomes ``None`` and crashes tensor creation in the trainer).

The HTTP client is aiohttp (the project's client library). Measured side by
side through the real vLLM CPU server (bench/rollout_vllm_bench.py), httpx
reusing keep-alive connections against vLLM's uvicorn spread 64 concurrent
requests over seconds and made the engine run many small batches (3-5x its CPU
per episode); aiohttp sends them as they come. Idle connections are kept for
less than uvicorn's 5 s keep-alive, so a request never lands on one the
server is closing. The session is created on first use, on the event loop
that uses it (asyncio: aiohttp's own), and closed by :meth:`aclose`.

This module must never retry a request the server refused for its content,
and never hide a failure behind a default.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypedDict, TypeVar

import aiohttp
import anyio
import orjson

from agent_backend.errors import PolicyError, clip
from agent_backend.lifecycle import AsyncResource
from agent_backend.retry import retry_delay
from agent_backend.rollout import defaults
from agent_backend.rollout.servers import PolicyServers, Sticky

__all__ = ["PolicyServerClient", "PolicyStatistics", "ServerOptions", "token_ids", "v1_url"]

_T = TypeVar("_T")

# HTTP statuses worth another attempt: the server is overloaded, restarting or timed out.
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_BODY_SHOWN = 300
# Below uvicorn's default keep-alive (5 s): an idle connection is dropped here first.
_KEEPALIVE = 4.0
# Resends of one request aborted by weight updates (each update aborts it at most once).
_MAX_RESENDS = 100


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyStatistics:
    requests: int
    """HTTP requests sent (attempts, retries included)."""
    turns: int
    """Turns answered."""
    retries: int
    """Attempts beyond the first."""
    failures: int
    """Calls that raised a :class:`PolicyError`."""
    seconds: float
    """Wall time spent in calls, summed."""


def v1_url(url: str, endpoint: str) -> str:
    """``endpoint`` (``chat/completions``, ``completions``) under a server's ``/v1``.

    ``http://h:8000`` and ``http://h:8000/v1`` both give
    ``http://h:8000/v1/<endpoint>``; a URL already ending in ``/<endpoint>`` is kept.
    """
    base = url.rstrip("/")
    if base.endswith("/" + endpoint):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/{endpoint}"


def _aborted(data: Any) -> bool:
    """True when an answer's first choice says the server aborted it."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return choices[0].get("finish_reason") == "abort"


def token_ids(value: object) -> list[int] | None:
    """``value`` as a list of token ids (non-negative ints), or None when it is not one."""
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        return value
    return None


class ServerOptions(TypedDict, total=False):
    """:class:`PolicyServerClient`'s keyword arguments (documented there), for a subclass that
    adds its own and passes these on: mypy checks them against that signature."""

    model: str | None
    api_key: str | None
    temperature: float
    top_p: float | None
    max_tokens: int | None
    top_logprobs: int
    timeout: float
    max_retries: int
    backoff: float
    max_backoff: float
    extra_body: Mapping[str, Any] | None
    client: aiohttp.ClientSession | None


class PolicyServerClient(AsyncResource):
    """Posts to one endpoint of a policy server, with bounded retries (module docstring).

    A subclass names its endpoint (``_endpoint``), builds request bodies and reads answers;
    :meth:`_request` does the rest of every call.
    """

    _endpoint: ClassVar[str]
    """The endpoint under the server's ``/v1`` (``chat/completions``, ``completions``)."""

    def __init__(
        self,
        url: str | Sequence[str] | PolicyServers,
        *,
        model: str | None = None,
        api_key: str | None = None,
        temperature: float = defaults.TEMPERATURE,
        top_p: float | None = None,
        max_tokens: int | None = None,
        top_logprobs: int = defaults.TOP_LOGPROBS,
        timeout: float = defaults.REQUEST_TIMEOUT,
        max_retries: int = defaults.MAX_RETRIES,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        extra_body: Mapping[str, Any] | None = None,
        client: aiohttp.ClientSession | None = None,
    ) -> None:
        """
        Args:
            url: the server (``http://host:8000``, ``.../v1`` or the full endpoint), several
                replicas of it, or a :class:`~agent_backend.rollout.servers.PolicyServers`
                (shared with other clients and with the pool's weight updates; not closed
                here). Requests are spread over the replicas, an episode kept on one.
            model: the served model name; None: the first of ``GET /v1/models``.
            api_key: sent as ``Authorization: Bearer``.
            temperature, top_p: sampling parameters (RL samples at temperature 1).
            max_tokens: the most tokens one turn may sample (``max_tokens``), unless the
                call is given a smaller bound.
            top_logprobs: alternatives per token to ask for, beside the sampled token's own
                logprob.
            timeout: seconds one HTTP attempt may take, end to end.
            max_retries: attempts after the first, on 5xx/408/425/429, connection errors
                and timeouts.
            backoff, max_backoff: the first retry's delay, doubled per retry up to
                ``max_backoff``, with jitter (or the server's ``Retry-After``).
            extra_body: more request fields, sent with every request (they win over ours).
            client: an aiohttp session to use (not closed here); default: our own, made on
                first use.
        """
        if not timeout > 0:
            raise ValueError("timeout must be positive")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        self._owns_servers = not isinstance(url, PolicyServers)
        self.servers = url if isinstance(url, PolicyServers) else PolicyServers(url, weights=None)
        self.url = v1_url(self.servers.servers[0].url, self._endpoint)
        """The endpoint on the first server (the one named in messages about the client)."""
        self.top_logprobs = top_logprobs
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._headers = headers
        self._owns_client = client is None
        self._client = client
        self._closed = False
        self._requests = 0
        self._turns = 0
        self._retries = 0
        self._failures = 0
        self._seconds = 0.0
        self._model_lock = anyio.Lock()
        self._random = random.Random()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<{type(self).__name__} {self.url} model={self.model!r}"
            f" [turns: {self._turns} | retries: {self._retries} | failures: {self._failures}]{state}>"
        )

    def _sampling(self, body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
        """``body`` with the model, the sampling parameters and ``extra_body`` (which wins)."""
        body["temperature"] = self.temperature
        if self.model is not None:
            body["model"] = self.model
        if self.top_p is not None:
            body["top_p"] = self.top_p
        limits = [m for m in (max_tokens, self.max_tokens) if m is not None]
        if limits:
            body["max_tokens"] = min(limits)
        body.update(self.extra_body)
        return body

    def statistics(self) -> PolicyStatistics:
        return PolicyStatistics(
            requests=self._requests,
            turns=self._turns,
            retries=self._retries,
            failures=self._failures,
            seconds=self._seconds,
        )

    async def aclose(self) -> None:
        """Close the HTTP client (when it is ours); idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._owns_client and self._client is not None:
                await self._client.close()
            if self._owns_servers:
                await self.servers.aclose()

    def _session(self) -> aiohttp.ClientSession:
        """The HTTP session: the caller's, or ours, created on first use (on this loop)."""
        if self._client is None:
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE),
                timeout=aiohttp.ClientTimeout(total=None),  # each attempt: anyio.fail_after
            )
        return self._client

    def _check_open(self) -> None:
        if self._closed:
            raise PolicyError("the policy client is closed", url=self.url)

    async def _discover_model(self) -> None:
        async with self._model_lock:
            if self.model is not None:
                return
            models_url = f"{self.servers.servers[0].url}/v1/models"
            try:
                with anyio.fail_after(self.timeout):
                    async with self._session().get(models_url, headers=self._headers) as response:
                        data = json.loads(await response.read())
                self.model = str(data["data"][0]["id"])
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
                raise PolicyError(
                    f"no model name given and {models_url} did not name one; pass model=",
                    url=models_url,
                    retryable=False,
                ) from None

    def _delay(
        self, retry: int, status: int | None = None, retry_after: str | None = None
    ) -> float:
        """Seconds before retry ``retry``: the last answer's ``Retry-After``, else backoff."""
        return retry_delay(
            retry,
            first=self.backoff,
            ceiling=self.max_backoff,
            status=status,
            retry_after=retry_after,
            rng=self._random,
        )

    async def _request(
        self,
        body: Callable[[], dict[str, Any]],
        answer: Callable[[Any, tuple[int, int]], _T],
        sticky: Sticky | None = None,
    ) -> _T:
        """One call: ``body()`` (built once the model is known) posted with retries, the JSON
        answer read by ``answer`` with the ``(sent, answered)`` policy versions; counted and
        timed. ``sticky`` keeps an episode on one server. Failures raise :class:`PolicyError`."""
        self._check_open()
        started = time.perf_counter()
        try:
            if self.model is None:
                await self._discover_model()
            data, versions = await self._post(orjson.dumps(body()), sticky)
            result = answer(data, versions)
        except PolicyError:
            self._failures += 1
            raise
        finally:
            self._seconds += time.perf_counter() - started
        self._turns += 1
        return result

    async def _post(self, payload: bytes, sticky: Sticky | None) -> tuple[Any, tuple[int, int]]:
        last: PolicyError | None = None
        retry_after: str | None = None
        resend_now = False
        attempt = 0
        resends = 0
        while attempt <= self.max_retries:
            if attempt:
                self._retries += 1
                if not resend_now:
                    refused = last.status if last is not None else None
                    await anyio.sleep(self._delay(attempt, refused, retry_after))
            attempt += 1
            retry_after = None
            try:
                async with self.servers.lease(sticky) as lease:
                    url = lease.endpoint(self._endpoint)
                    self._requests += 1
                    status, body, retry_after = await self._send(url, payload)
            except PolicyError as exc:  # no server is up (retryable), or they are closed
                if not exc.retryable:
                    raise
                last, resend_now = exc, False
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                connect_failed = isinstance(exc, aiohttp.ClientConnectorError)
                broken = isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(
                    exc, TimeoutError
                )
                what = (
                    "timed out"
                    if isinstance(exc, TimeoutError)
                    else (f"failed: {type(exc).__name__}: {clip(str(exc), 200)}")
                )
                last = PolicyError(f"the policy server at {url} {what}", url=url, retryable=True)
                if connect_failed:
                    # Nothing listens there (killed, restarting): out of rotation, and the
                    # request goes to another server at once.
                    self.servers.failed(lease.server, last.message)
                    resend_now = self.servers.up_count() > 0
                else:
                    # The connection failed (closed before the answer, reset while writing):
                    # most often a kept-alive one the server had just timed out (its clock runs
                    # ahead of ours under load). A sampling request may be sent again (it
                    # changes nothing on the server), so the first such failure is resent at
                    # once, on a new connection; the next ones back off.
                    resend_now = broken and not resend_now
                continue
            if self.servers.interrupted(lease):
                # An abort-mode weight update began while this request was out: its answer is
                # aborted or sampled on the old weights. Sent again on the new ones, not counted.
                resends += 1
                if resends > _MAX_RESENDS:
                    raise PolicyError(
                        f"the request to {url} was aborted by {resends} weight updates in a row",
                        url=url,
                        retryable=True,
                    )
                attempt -= 1
                resend_now = True
                continue
            resend_now = False
            if status == 200:
                data = self._json(url, status, body)
                if not _aborted(data):
                    return data, lease.versions
                # Aborted on the server's side (someone paused it with mode=abort): nothing
                # was wrong with the request, and it changes nothing there: sent again.
                last = PolicyError(
                    f"the policy server at {url} aborted the request", url=url, retryable=True
                )
                continue
            detail = clip(body.decode("utf-8", "replace"), _BODY_SHOWN)
            last = PolicyError(
                f"the policy server at {url} answered HTTP {status}: {detail}",
                status=status,
                url=url,
                retryable=status in _RETRY_STATUSES,
            )
            if not last.retryable:
                raise last
        assert last is not None
        if self.max_retries:
            last = PolicyError(
                f"{last.message} (gave up after {self.max_retries + 1} attempts)",
                status=last.status,
                url=last.url,
                retryable=True,
            )
        raise last

    async def _send(self, url: str, payload: bytes) -> tuple[int, bytes, str | None]:
        with anyio.fail_after(self.timeout):
            async with self._session().post(url, data=payload, headers=self._headers) as response:
                return response.status, await response.read(), response.headers.get("Retry-After")

    def _json(self, url: str, status: int, body: bytes) -> Any:
        try:
            # The standard parser, not orjson: it reads NaN/Infinity literals, which a
            # server may send as logprobs; they must be seen and handled, not refused.
            return json.loads(body)
        except ValueError as exc:
            raise PolicyError(
                f"the policy server at {url} answered with invalid JSON ({exc}): "
                f"{clip(body.decode('utf-8', 'replace'), _BODY_SHOWN)}",
                status=status,
                url=url,
            ) from None

    def _first_choice(self, data: Any) -> dict[str, Any]:
        """The first of an answer's ``choices``."""
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._unusable("choices")
        return choices[0]

    def _logprobs(self, choice: dict[str, Any], key: str, asked: str) -> list[Any]:
        """``choice["logprobs"][key]``: the logprobs the request asked for with ``asked``."""
        logprobs = choice.get("logprobs")
        values = logprobs.get(key) if isinstance(logprobs, dict) else None
        if not isinstance(values, list):
            raise self._unusable(
                "logprobs",
                f"The request asked for them ({asked}); check that the server supports "
                f"logprobs on this endpoint (vLLM: --max-logprobs must be >= {self.top_logprobs})",
            )
        return values

    def _misaligned(self, ids: int, logprobs: int) -> PolicyError:
        return PolicyError(
            f"the policy server at {self.url} answered {ids} completion token ids "
            f"but {logprobs} logprobs; they must align one to one",
            status=200,
            url=self.url,
        )

    def _no_completion_ids(self) -> PolicyError:
        return self._unusable(
            "the completion's token ids",
            "The request asked for them (return_token_ids: true): upgrade a vLLM older than "
            "that field (vllm-project/vllm#22587)",
        )

    def _unusable(self, problem: str, fix: str = "") -> PolicyError:
        return PolicyError(
            f"the policy server at {self.url} answered without {problem}; a trainer cannot use "
            f"this turn{'. ' + fix if fix else ''}",
            status=200,
            url=self.url,
        )
