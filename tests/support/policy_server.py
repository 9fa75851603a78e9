"""A scripted OpenAI-compatible chat-completions server: the only fake of the rollout tests.

No GPU runs a real model here, so this server stands in for vLLM or SGLang.
It is a real HTTP server (Starlette on uvicorn, on a free port of
127.0.0.1, on a thread of the test process), so the policy client's
retries, timeouts and parsing are exercised over real sockets.

What it answers is decided by a *script*, chosen by the request's
``model``: ``server.add("name", script)`` registers ``script(turn) ->
Reply``, where ``turn.index`` is the number of assistant messages already
in the request (the episode's turn). A :class:`Reply` says what the model
"samples" (text, tool calls as OpenAI ``tool_calls`` or as Hermes
``<tool_call>`` text) and which faults to inject: NaN, inf or null
logprobs, missing logprobs or token ids, HTTP 5xx (always, or for the
first attempts of a request), slow replies.

Token ids come from a deterministic byte tokenizer and a fixed chat
template (:func:`render`), so the prompt ids of turn k+1 really extend the
prompt and completion ids of turn k, as with a real template; a script
registered with ``strip_think=True`` renders earlier assistant turns without
their ``<think>`` block, the way some real templates rewrite history, and
then they do not.

As engines do, logprobs come back only when the request says ``logprobs:
true`` *and* ``top_logprobs``, and token ids only with ``return_token_ids``.

This module must never listen on anything but 127.0.0.1.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from agent_backend.dispatch import Dispatcher, builtin_tools
from agent_backend.pool_file import DEFAULT_POOL, load_pool
from agent_backend.tools import ToolRegistry

__all__ = [
    "END",
    "GENERATION_PROMPT",
    "PolicyServer",
    "Reply",
    "Turn",
    "decode",
    "encode",
    "leftover_workspaces",
    "local_dispatcher",
    "policy_server_fixture",
    "render",
    "rollout_registry",
    "serve_policy",
]

HOST = "127.0.0.1"
GENERATION_PROMPT = "<|assistant|>"
END = "<|end|>"
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def encode(text: str) -> list[int]:
    """The byte tokenizer: one id per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def _call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it; arguments that are not JSON text go in as they are."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return (
                f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {arguments}}}</tool_call>'
            )
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _assistant_body(message: Mapping[str, Any], *, strip_think: bool) -> str:
    content = message.get("content") or ""
    if strip_think:
        content = _THINK.sub("", content)
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call["function"]
        content += _call_text(function["name"], function.get("arguments", "{}"))
    return str(content)


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    strip_think: bool = False,
) -> str:
    """The chat template: one ``<|role|>body<|end|>`` line per message, then the generation prompt.

    With ``strip_think``, assistant turns are rendered without their
    ``<think>...</think>`` blocks (a template that rewrites history).
    """
    parts: list[str] = []
    if tools:
        names = ",".join(sorted(str(t.get("function", {}).get("name", "")) for t in tools))
        parts.append(f"<|tools|>{names}{END}\n")
    for message in messages:
        role = str(message.get("role", "user"))
        if role == "assistant":
            body = _assistant_body(message, strip_think=strip_think)
        else:
            content = message.get("content")
            body = content if isinstance(content, str) else json.dumps(content)
        parts.append(f"<|{role}|>{body}{END}\n")
    parts.append(GENERATION_PROMPT)
    return "".join(parts)


@dataclasses.dataclass(frozen=True)
class Reply:
    """What the scripted model answers to one request, faults included."""

    content: str = ""
    tool_calls: Sequence[tuple[str, Any]] = ()
    """(name, arguments) pairs; arguments a dict, or a str sent as is (malformed JSON...)."""
    format: Literal["openai", "hermes"] = "openai"
    """openai: ``message.tool_calls`` (a server with a tool parser); hermes: ``<tool_call>`` text."""
    nan_at: Sequence[int] = ()
    inf_at: Sequence[int] = ()
    null_at: Sequence[int] = ()
    """Completion positions whose logprob is NaN, -Infinity or null."""
    omit: frozenset[str] = frozenset()
    """Any of "logprobs", "token_ids", "prompt_token_ids": left out although requested."""
    status: int = 200
    """An HTTP error status to answer with (every attempt)."""
    fail_first: int = 0
    """Answer 503 to the first N attempts of the same request, then normally."""
    delay: float = 0.0
    """Seconds to wait before answering."""


@dataclasses.dataclass(frozen=True)
class Turn:
    """What a script sees of a request."""

    index: int
    """Assistant messages already in the request: 0 on the first turn."""
    messages: list[dict[str, Any]]
    body: dict[str, Any]
    attempt: int
    """1 for the first time this exact request is seen, 2 for its first retry..."""

    def last_tool_results(self) -> list[str]:
        """The contents of the tool messages after the last assistant message."""
        out: list[str] = []
        for message in reversed(self.messages):
            if message.get("role") != "tool":
                break
            out.append(str(message.get("content", "")))
        return out[::-1]


Script = Callable[[Turn], Reply]
Flavor = Literal["vllm", "sglang", "sglext"]


@dataclasses.dataclass
class _Registered:
    script: Script
    flavor: Flavor
    strip_think: bool


def _logprob(token: int, position: int) -> float:
    """The "sampler" logprob of a token: deterministic, finite, negative."""
    return -0.01 * ((token * 7 + position * 13) % 97 + 1)


def _dumps(obj: Any) -> bytes:
    # allow_nan: a real server that lets NaN through writes NaN / -Infinity literals.
    return json.dumps(obj, allow_nan=True).encode()


class PolicyServer:
    """The scripted server: ``add`` scripts, point a policy at :attr:`url`; requests are kept."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[dict[str, Any]] = []
        self._scripts: dict[str, _Registered] = {}
        self._attempts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    def add(
        self,
        name: str,
        script: Script | Sequence[Reply],
        *,
        flavor: Flavor = "vllm",
        strip_think: bool = False,
    ) -> str:
        """Register ``script`` under the model name ``name`` (returned).

        A sequence of replies is a script too: reply ``k`` on turn ``k``
        (the last one repeats). ``flavor`` says where token ids go: vLLM's
        response-level ``prompt_token_ids`` and ``choices[i].token_ids``,
        SGLang's per-choice ``prompt_token_ids``/``token_ids``, or SGLang's
        ``sglext.input_ids``/``sglext.output_ids``.
        """
        if not callable(script):
            replies = list(script)

            def scripted(turn: Turn) -> Reply:
                return replies[min(turn.index, len(replies) - 1)]

            script = scripted
        with self._lock:
            self._scripts[name] = _Registered(script, flavor, strip_think)
        return name

    def requests_for(self, model: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r.get("model") == model]

    async def _models(self, request: Request) -> Response:
        with self._lock:
            names = list(self._scripts)
        return Response(_dumps({"object": "list", "data": [{"id": n} for n in names]}))

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        model = str(body.get("model", ""))
        key = hashlib.sha256(raw).hexdigest()
        with self._lock:
            self.requests.append(body)
            registered = self._scripts.get(model)
            self._attempts[key] += 1
            attempt = self._attempts[key]
        if registered is None:
            return _error(404, f"the model {model!r} does not exist")
        messages = list(body.get("messages") or [])
        turn = Turn(
            index=sum(1 for m in messages if m.get("role") == "assistant"),
            messages=messages,
            body=body,
            attempt=attempt,
        )
        reply = registered.script(turn)
        if reply.delay:
            await anyio.sleep(reply.delay)
        if reply.status != 200:
            return _error(reply.status, "scripted failure")
        if attempt <= reply.fail_first:
            return _error(503, f"scripted overload (attempt {attempt})")
        return Response(
            _dumps(self._completion(body, messages, reply, registered)),
            media_type="application/json",
        )

    def _completion(
        self,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        reply: Reply,
        registered: _Registered,
    ) -> dict[str, Any]:
        prompt_text = render(messages, body.get("tools"), strip_think=registered.strip_think)
        prompt_ids = encode(prompt_text)
        sampled = reply.content + "".join(_call_text(name, args) for name, args in reply.tool_calls)
        completion_ids = encode(sampled + END)
        finish = "tool_calls" if reply.tool_calls else "stop"
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        truncated = isinstance(limit, int) and len(completion_ids) > limit
        if truncated:
            completion_ids = completion_ids[:limit]
            finish = "length"
        message: dict[str, Any] = {"role": "assistant"}
        if reply.format == "hermes" or truncated:
            message["content"] = decode(completion_ids).removesuffix(END)
        else:
            message["content"] = reply.content or None
            if reply.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": f"chatcmpl-tool-{i}",
                        "type": "function",
                        "function": {
                            "name": name,
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                    for i, (name, args) in enumerate(reply.tool_calls)
                ]
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        wants_logprobs = body.get("logprobs") is True and body.get("top_logprobs") is not None
        if wants_logprobs and "logprobs" not in reply.omit:
            choice["logprobs"] = {
                "content": self._logprobs(completion_ids, reply, body),
            }
        else:
            choice["logprobs"] = None
        response: dict[str, Any] = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt_ids) + len(completion_ids),
            },
        }
        if body.get("return_token_ids") is True:
            give_prompt = "prompt_token_ids" not in reply.omit
            give_completion = "token_ids" not in reply.omit
            if registered.flavor == "vllm":
                response["prompt_token_ids"] = prompt_ids if give_prompt else None
                choice["token_ids"] = completion_ids if give_completion else None
            elif registered.flavor == "sglang":
                if give_prompt:
                    choice["prompt_token_ids"] = prompt_ids
                if give_completion:
                    choice["token_ids"] = completion_ids
            else:
                ext: dict[str, Any] = {}
                if give_prompt:
                    ext["input_ids"] = prompt_ids
                if give_completion:
                    ext["output_ids"] = [completion_ids]
                response["sglext"] = ext
        return response

    @staticmethod
    def _logprobs(ids: list[int], reply: Reply, body: dict[str, Any]) -> list[dict[str, Any]]:
        as_ids = body.get("return_tokens_as_token_ids") is True
        top = int(body.get("top_logprobs") or 0)
        entries: list[dict[str, Any]] = []
        for position, token in enumerate(ids):
            value: float | None = _logprob(token, position)
            if position in reply.nan_at:
                value = float("nan")
            elif position in reply.inf_at:
                value = float("-inf")
            elif position in reply.null_at:
                value = None
            text = f"token_id:{token}" if as_ids or not 32 <= token < 127 else chr(token)
            entry: dict[str, Any] = {"token": text, "logprob": value, "bytes": [token]}
            entry["top_logprobs"] = [
                {"token": text, "logprob": value, "bytes": [token]} for _ in range(top)
            ]
            entries.append(entry)
        return entries


def _error(status: int, message: str) -> Response:
    payload = {"error": {"message": message, "type": "scripted", "code": status}}
    return Response(_dumps(payload), status_code=status, media_type="application/json")


@contextlib.contextmanager
def serve_policy(server: PolicyServer | None = None) -> Iterator[PolicyServer]:
    """Run ``server`` (a new one by default) on uvicorn on a free 127.0.0.1 port, in a thread."""
    server = server or PolicyServer()
    config = uvicorn.Config(
        server.app,
        host=HOST,
        port=0,
        log_level="error",
        lifespan="off",
        access_log=False,
        # A scripted reply still sleeping (a test's slow server) must not hold the stop.
        timeout_graceful_shutdown=1,
    )
    running = uvicorn.Server(config)
    failure: list[BaseException] = []

    def target() -> None:
        try:
            running.run()
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=target, name="scripted policy server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not running.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"the policy server did not start: {failure}")
        if time.monotonic() > deadline:
            running.should_exit = True
            raise TimeoutError("the policy server did not start within 10 s")
        time.sleep(0.005)
    port = running.servers[0].sockets[0].getsockname()[1]
    server.url = f"http://{HOST}:{port}/v1"
    try:
        yield server
    finally:
        running.should_exit = True
        thread.join(10)


@pytest.fixture(name="policy_server", scope="module")
def policy_server_fixture() -> Iterator[PolicyServer]:
    """One scripted server per test module; tests register their own scripts on it."""
    with serve_policy() as server:
        yield server


# -- the tool side of rollout tests: real tools on the real local backend -------------------------


def rollout_registry() -> ToolRegistry:
    """The built-in tools (exec, read_file, write_file, list_dir) and a Python tool ``add``."""
    registry = ToolRegistry(builtin_tools())

    @registry.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: First.
            b: Second.
        """
        return a + b

    return registry


@contextlib.asynccontextmanager
async def local_dispatcher(root: Path, **options: Any) -> AsyncIterator[Dispatcher]:
    """An open dispatcher on the default local pool, its workspaces under ``root``."""
    config = DEFAULT_POOL.model_copy(update={"workspace_root": str(root), "kill_grace": 0.5})
    async with load_pool(config) as pool, Dispatcher(rollout_registry(), pool, **options) as d:
        yield d


def leftover_workspaces(root: Path) -> list[str]:
    """Session workspaces still under ``root`` (there must be none once episodes ended)."""
    if not root.exists():
        return []
    # local: agent-backend-ws-XXXX (mkdtemp); SSH: ws.XXXXXXXXXX (mktemp -d)
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("agent-backend-ws-", "ws.")))


if __name__ == "__main__":  # a standalone server for trying the CLI by hand
    import sys

    def echo(turn: Turn) -> Reply:
        if turn.index == 0:
            return Reply("<think>run it</think>", tool_calls=[("exec", {"command": "echo hi"})])
        return Reply("done: " + " ".join(turn.last_tool_results()).strip())

    with serve_policy() as running_server:
        running_server.add("echo", echo)
        print(running_server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    sys.exit(0)
