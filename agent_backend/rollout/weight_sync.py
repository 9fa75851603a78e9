"""Loading new weights into a running policy server, through the server's own mechanism.

A :class:`WeightSync` does one server's part of
:meth:`~agent_backend.rollout.servers.PolicyServers.update_weights`: stop
generating the way the in-flight policy asks, load a checkpoint directory
(the Hugging Face layout the server was started from: ``config.json`` and
safetensors), label the weights with the policy version, and go on. What
happens to the requests in flight is chosen by ``in_flight``:

* ``drain``: the caller has already let every request of its own finish;
  the server is paused with ``mode=wait`` (anything else on it finishes too);
* ``abort``: generation is aborted; the caller sends the aborted turns
  again on the new weights;
* ``continue``: in-flight requests are frozen where they are and go on, on
  the new weights, when the server resumes (partial rollouts).

:class:`VLLMWeights` is vLLM's RL API (vLLM >= 0.2x, in the server's dev
mode: start it with ``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait|abort|keep``,
``POST /collective_rpc`` with ``reload_weights(weights_path=...)`` (every
worker reloads in place from disk, CPU included), ``POST
/update_weight_version`` and ``POST /resume``. :class:`SGLangWeights` is
SGLang's ``/pause_generation``, ``/update_weights_from_disk`` (with
``weight_version``) and ``/continue_generation``.

A server is always resumed, also when the load fails or the caller is
cancelled (shielded). An unreachable server raises :class:`ServerUnreachable`
(the caller takes it out of rotation); a server that refuses (a missing
checkpoint, an endpoint the server does not expose) raises
:class:`~agent_backend.errors.PolicyError` with the server's own words.
This module must never leave a server paused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import aiohttp
import anyio

from agent_backend.errors import PolicyError, clip

__all__ = [
    "InFlight",
    "SGLangWeights",
    "ServerUnreachable",
    "VLLMWeights",
    "WeightSync",
    "weight_sync",
]

InFlight = Literal["drain", "abort", "continue"]
"""What a weight update does to the turns being sampled (module docstring)."""

IN_FLIGHT_POLICIES: tuple[InFlight, ...] = ("drain", "abort", "continue")
_SHOWN = 300


def _nothing() -> None:
    pass


class ServerUnreachable(PolicyError):
    """The server did not answer at all (connection refused or reset, timed out)."""


@runtime_checkable
class WeightSync(Protocol):
    """Loads ``checkpoint`` into the server at ``base_url`` and labels it ``version``."""

    async def update(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        in_flight: InFlight,
        *,
        step_timeout: float,
        on_loaded: Callable[[], None] = _nothing,
    ) -> None:
        """``on_loaded`` is called once the weights are loaded, before the server resumes."""
        ...

    async def reload(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        *,
        step_timeout: float,
    ) -> None:
        """Load ``checkpoint`` into a server that serves nothing of ours (one probed back)."""
        ...


async def _post(
    http: aiohttp.ClientSession,
    url: str,
    body: Mapping[str, Any] | None,
    *,
    step_timeout: float,
    hint: str = "",
) -> Any:
    """POST ``body`` as JSON; the JSON answer (None when empty). Errors as module docstring."""
    try:
        with anyio.fail_after(step_timeout):
            async with http.post(url, json=body) as response:
                status, raw = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        what = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        raise ServerUnreachable(
            f"weight update: {url} did not answer ({clip(what, 200)})", url=url, retryable=True
        ) from None
    if status != 200:
        detail = clip(raw.decode("utf-8", "replace"), _SHOWN)
        extra = f" ({hint})" if hint and status in (404, 405) else ""
        raise PolicyError(
            f"weight update: {url} answered HTTP {status}{extra}: {detail}", status=status, url=url
        )
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


class VLLMWeights:
    """vLLM's pause / ``reload_weights`` / version label / resume (module docstring)."""

    _PAUSE_MODES: Mapping[InFlight, str] = {"drain": "wait", "abort": "abort", "continue": "keep"}
    _HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 for its weight-update endpoints"

    def __repr__(self) -> str:
        return "VLLMWeights()"

    async def update(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        in_flight: InFlight,
        *,
        step_timeout: float,
        on_loaded: Callable[[], None] = _nothing,
    ) -> None:
        mode = self._PAUSE_MODES[in_flight]
        await _post(
            http, f"{base_url}/pause?mode={mode}", None, step_timeout=step_timeout, hint=self._HINT
        )
        try:
            await self._load(http, base_url, checkpoint, version, step_timeout=step_timeout)
            on_loaded()
        finally:
            with anyio.CancelScope(shield=True):
                await _post(
                    http, f"{base_url}/resume", None, step_timeout=step_timeout, hint=self._HINT
                )

    async def reload(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        *,
        step_timeout: float,
    ) -> None:
        await self.update(http, base_url, checkpoint, version, "drain", step_timeout=step_timeout)

    async def _load(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        *,
        step_timeout: float,
    ) -> None:
        await _post(
            http,
            f"{base_url}/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": checkpoint}},
            step_timeout=step_timeout,
            hint=self._HINT,
        )
        await _post(
            http,
            f"{base_url}/update_weight_version",
            {"new_version": str(version)},
            step_timeout=step_timeout,
            hint=self._HINT,
        )


class SGLangWeights:
    """SGLang's ``pause_generation`` / ``update_weights_from_disk`` / ``continue_generation``."""

    _PAUSE_MODES: Mapping[InFlight, str] = {
        "drain": "in_place",
        "abort": "abort",
        "continue": "in_place",
    }

    def __repr__(self) -> str:
        return "SGLangWeights()"

    async def update(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        in_flight: InFlight,
        *,
        step_timeout: float,
        on_loaded: Callable[[], None] = _nothing,
    ) -> None:
        await _post(
            http,
            f"{base_url}/pause_generation",
            {"mode": self._PAUSE_MODES[in_flight]},
            step_timeout=step_timeout,
        )
        try:
            answer = await _post(
                http,
                f"{base_url}/update_weights_from_disk",
                {
                    "model_path": checkpoint,
                    "weight_version": str(version),
                    "abort_all_requests": in_flight == "abort",
                    # Cached prefixes hold keys and values of the old weights; a request
                    # frozen in place still uses its own (and SGLang refuses to flush then).
                    "flush_cache": in_flight != "continue",
                },
                step_timeout=step_timeout,
            )
            if isinstance(answer, dict) and answer.get("success") is False:
                raise PolicyError(
                    f"weight update: {base_url} refused {checkpoint}: "
                    f"{clip(str(answer.get('message')), _SHOWN)}",
                    url=base_url,
                )
            on_loaded()
        finally:
            with anyio.CancelScope(shield=True):
                await _post(http, f"{base_url}/continue_generation", {}, step_timeout=step_timeout)

    async def reload(
        self,
        http: aiohttp.ClientSession,
        base_url: str,
        checkpoint: str,
        version: int,
        *,
        step_timeout: float,
    ) -> None:
        await self.update(http, base_url, checkpoint, version, "drain", step_timeout=step_timeout)


def weight_sync(kind: Literal["vllm", "sglang"] | WeightSync) -> WeightSync:
    """The :class:`WeightSync` of a server kind (or ``kind`` itself when it is one)."""
    if kind == "vllm":
        return VLLMWeights()
    if kind == "sglang":
        return SGLangWeights()
    if isinstance(kind, WeightSync):
        return kind
    raise ValueError(f"weights must be 'vllm', 'sglang' or a WeightSync, not {kind!r}")
