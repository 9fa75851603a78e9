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
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import aiohttp
import anyio
import anyio.to_thread

from agent_backend.errors import PolicyError, clip

__all__ = [
    "InFlight",
    "SGLangWeights",
    "ServerUnreachable",
    "VLLMWeights",
    "WeightSync",
    "check_checkpoint",
    "untie_for_vllm",
    "weight_sync",
]

InFlight = Literal["drain", "abort", "continue"]
"""What a weight update does to the turns being sampled (module docstring)."""

IN_FLIGHT_POLICIES: tuple[InFlight, ...] = ("drain", "abort", "continue")
_SHOWN = 300
_MAX_HEADER = 100_000_000


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


def _safetensors_keys(path: Path) -> set[str]:
    """The tensor names in a safetensors file (its JSON header: 8 bytes of length, then it)."""
    with path.open("rb") as file:
        size = int.from_bytes(file.read(8), "little")
        if not 0 < size <= _MAX_HEADER:
            raise ValueError(f"{path.name} is not a safetensors file")
        header = json.loads(file.read(size))
    return {key for key in header if key != "__metadata__"}


def check_checkpoint(directory: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint a vLLM server would fail on, or load wrongly, before it is sent.

    vLLM dies on a reload that fails (a missing folder, a parameter its model does not
    have: its engine exits), so the folder is checked first: it exists, holds
    ``config.json`` and safetensors weights. And on CPU a model with tied embeddings keeps
    its output layer from start-up unless the checkpoint names ``lm_head.weight``
    explicitly (``save_pretrained`` leaves it out): the logprobs are then silently wrong
    (0.4 nats on the tiny test model); :func:`untie_for_vllm` adds it.
    Raises :class:`PolicyError` saying which.
    """
    path = Path(directory)
    if not path.is_dir():
        raise PolicyError(f"weight update: the checkpoint {path} is not a folder here")
    config_path = path / "config.json"
    files = sorted(path.glob("*.safetensors"))
    if not config_path.is_file() or not files:
        raise PolicyError(
            f"weight update: {path} holds no config.json and *.safetensors "
            "(save it with model.save_pretrained)"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        keys = set().union(*(_safetensors_keys(f) for f in files))
    except (OSError, ValueError) as exc:
        raise PolicyError(f"weight update: cannot read {path}: {exc}") from None
    tied = config.get("tie_word_embeddings", False) or (
        isinstance(config.get("text_config"), dict)
        and config["text_config"].get("tie_word_embeddings", False)
    )
    if tied and not any(k == "lm_head.weight" or k.endswith(".lm_head.weight") for k in keys):
        raise PolicyError(
            f"weight update: {path} ties its embeddings and has no lm_head.weight: vLLM on CPU "
            "would keep its old output layer and sample with wrong logprobs. Call "
            "agent_backend.rollout.weight_sync.untie_for_vllm(path) after save_pretrained"
        )


def untie_for_vllm(directory: str | os.PathLike[str]) -> None:
    """Write ``lm_head.weight`` (a copy of the input embeddings) into a checkpoint saved with
    tied embeddings, so that vLLM reloads its output layer too (:func:`check_checkpoint`).

    Needs ``safetensors`` and torch (the trainer's). A checkpoint that has it already, or
    does not tie its embeddings, is left as it is.
    """
    from safetensors.torch import load_file, save_file  # the trainer's stack, not ours

    path = Path(directory)
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        embed = next((k for k in tensors if k.endswith("embed_tokens.weight")), None)
        if "lm_head.weight" in tensors or embed is None:
            continue
        tensors["lm_head.weight"] = tensors[embed].clone()
        save_file(tensors, str(file), metadata={"format": "pt"})
        return


class VLLMWeights:
    """vLLM's pause / ``reload_weights`` / version label / resume (module docstring).

    ``check`` (default): the checkpoint is checked on this machine first
    (:func:`check_checkpoint`); pass ``check=False`` when the servers read another
    file system (the path is then theirs).
    """

    def __init__(self, *, check: bool = True) -> None:
        self.check = check

    _PAUSE_MODES: Mapping[InFlight, str] = {"drain": "wait", "abort": "abort", "continue": "keep"}
    _HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 for its weight-update endpoints"

    def __repr__(self) -> str:
        return f"VLLMWeights(check={self.check})"

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
        if self.check:
            await anyio.to_thread.run_sync(check_checkpoint, checkpoint)
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


def weight_sync(kind: Literal["vllm", "sglang"] | WeightSync) -> WeightSync:
    """The :class:`WeightSync` of a server kind (or ``kind`` itself when it is one)."""
    if kind == "vllm":
        return VLLMWeights()
    if kind == "sglang":
        return SGLangWeights()
    if isinstance(kind, WeightSync):
        return kind
    raise ValueError(f"weights must be 'vllm', 'sglang' or a WeightSync, not {kind!r}")
