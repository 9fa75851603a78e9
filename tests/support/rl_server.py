"""A scripted vLLM stand-in for weight-update fault injection: completions plus vLLM's RL API.

The real server's side is tests/test_vllm_weights.py (vLLM on CPU, dev mode); this one lets a
test hold a request in flight, kill a server and bring it back on the same port, or refuse a
checkpoint, which a real server does not do on cue. It is a real HTTP server (aiohttp, on a
free port of 127.0.0.1, on the test's event loop), and answers the endpoints vLLM 0.32 has:

* ``POST /v1/completions``: one token, the id of the loaded weights (``weights``: 0 for the
  original, then the number in the checkpoint's folder name ``.../ckpt-<n>``), and a logprob;
  ``held`` requests wait until :meth:`RLServer.release` (or an abort);
* ``POST /pause?mode=abort|wait|keep``, ``POST /resume``: ``abort`` answers the held
  requests at once with ``finish_reason: "abort"``; ``wait`` waits for them; ``keep``
  freezes them, held or not (they finish after ``/resume``, on the weights loaded meanwhile);
* ``POST /collective_rpc`` ``reload_weights(weights_path=...)``: loads a checkpoint (HTTP
  500 when the folder does not exist or is named ``ckpt-bad``, as vLLM answers a failed load);
* ``POST /update_weight_version``, ``POST /reset_prefix_cache``, ``GET /health``.

This module must never listen on anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
from aiohttp import web

__all__ = ["RLServer", "fake_checkpoint", "rl_server"]

_CKPT = re.compile(r"ckpt-(\d+)$")


class RLServer:
    """One scripted server; ``url`` once started. ``hold = True`` holds the next requests."""

    def __init__(self) -> None:
        self.url = ""
        self.port = 0
        self.weights = 0
        self.version_label = "0"
        self.hold = False
        self.paused: str | None = None
        self.requests: list[dict[str, Any]] = []
        self.answered_weights: list[int] = []
        self.calls: list[str] = []
        self.in_flight = 0
        self._release = anyio.Event()
        self._resumed = anyio.Event()
        self._resumed.set()
        self._abort = anyio.Event()
        self._idle = anyio.Event()
        self._idle.set()
        self._runner: web.AppRunner | None = None

    def release(self) -> None:
        """Let the held requests finish."""
        self._release.set()
        self._release = anyio.Event()

    async def wait_in_flight(self, count: int) -> None:
        """Wait until ``count`` requests are being held (bounded by the test's timeout)."""
        while self.in_flight < count:  # noqa: ASYNC110 (a state of another task's request)
            await anyio.sleep(0.005)

    # -- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_post("/collective_rpc", self._rpc)
        app.router.add_post("/update_weight_version", self._label)
        app.router.add_post("/reset_prefix_cache", self._reset)
        # SGLang's names for the same (its documented API; no SGLang runs on this CPU).
        app.router.add_post("/pause_generation", self._sglang_pause)
        app.router.add_post("/continue_generation", self._resume)
        app.router.add_post("/update_weights_from_disk", self._sglang_update)
        return app

    async def _sglang_pause(self, request: web.Request) -> web.Response:
        mode = (await request.json()).get("mode", "abort")
        self.calls.append(f"pause_generation:{mode}")
        self.paused = mode
        self._resumed = anyio.Event()
        if mode == "abort":
            self._abort.set()
            self._abort = anyio.Event()
        else:  # in_place, retract: frozen until /continue_generation
            self.release()
        return web.json_response({"success": True})

    async def _sglang_update(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = str(body.get("model_path", ""))
        self.calls.append(
            f"update_weights_from_disk:{Path(path).name}:{body.get('weight_version')}"
            f":flush={body.get('flush_cache')}"
        )
        if not Path(path).is_dir():  # noqa: ASYNC240
            return web.json_response({"success": False, "message": f"no such path {path}"})
        found = _CKPT.search(path)
        self.weights = int(found.group(1)) if found else 0
        self.version_label = str(body.get("weight_version"))
        return web.json_response({"success": True, "message": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "scripted"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self._idle = anyio.Event()
        try:
            aborted = False
            if self.hold:
                release, abort = self._release, self._abort
                async with anyio.create_task_group() as group:

                    async def wait_for(event: anyio.Event) -> None:
                        await event.wait()
                        group.cancel_scope.cancel()

                    group.start_soon(wait_for, release)
                    group.start_soon(wait_for, abort)
                aborted = abort.is_set()
            await self._resumed.wait()  # frozen by pause(mode=keep) until /resume
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
        weights = self.weights
        self.answered_weights.append(weights)
        choice = {
            "index": 0,
            "text": "x",
            "token_ids": [] if aborted else [weights],
            "logprobs": {"token_logprobs": [] if aborted else [-0.5 - weights]},
            "finish_reason": "abort" if aborted else "length",
        }
        return web.json_response({"choices": [choice]})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        self.calls.append(f"pause:{mode}")
        self.paused = mode
        self._resumed = anyio.Event()
        if mode == "abort":
            self._abort.set()
            self._abort = anyio.Event()
        elif mode == "keep":
            self.release()  # held requests stop being held, and are frozen until /resume
        elif mode == "wait":
            self._resumed.set()  # requests in flight finish; wait for them
            await self._idle.wait()
            self._resumed = anyio.Event()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.calls.append("resume")
        self.paused = None
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = str(body.get("kwargs", {}).get("weights_path", ""))
        self.calls.append(f"reload:{Path(path).name}")
        bad = not Path(path).is_dir() or Path(path).name == "ckpt-bad"  # noqa: ASYNC240
        if body.get("method") != "reload_weights" or bad:
            return web.json_response({"error": f"no such checkpoint: {path}"}, status=500)
        found = _CKPT.search(path)
        self.weights = int(found.group(1)) if found else 0
        return web.json_response({"results": [None]})

    async def _label(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.version_label = str(body["new_version"])
        self.calls.append(f"version:{self.version_label}")
        return web.json_response({"success": True})

    async def _reset(self, request: web.Request) -> web.Response:
        self.calls.append("reset_prefix_cache")
        return web.json_response({"success": True})

    # -- life ---------------------------------------------------------------------------------

    async def start(self, port: int = 0) -> None:
        self._runner = web.AppRunner(self.app(), shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop listening (what a killed server looks like: connections refused)."""
        if self._runner is not None:
            self._abort.set()  # held requests end with the server
            self._release.set()
            self._resumed.set()
            await self._runner.cleanup()
            self._runner = None
            self._abort = anyio.Event()
            self._release = anyio.Event()


@contextlib.asynccontextmanager
async def rl_server() -> AsyncIterator[RLServer]:
    server = RLServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def fake_checkpoint(root: Path, n: int | str, *, tied: bool = False, head: bool = False) -> Path:
    """``root/ckpt-<n>`` as save_pretrained writes one, for the scripted server (which reads
    ``n``) and for ``check_checkpoint``: config.json and a safetensors file holding the input
    embeddings (and ``lm_head.weight`` with ``head``), one float32 each."""
    path = root / f"ckpt-{n}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied}))
    names = ["model.embed_tokens.weight", *(["lm_head.weight"] if head else [])]
    header = {
        name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i, name in enumerate(names)
    }
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + struct.pack(f"<{len(names)}f", *[0.0] * len(names))
    (path / "model.safetensors").write_bytes(data)
    return path
