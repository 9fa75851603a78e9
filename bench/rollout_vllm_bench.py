"""Token-in/token-out episodes through the real vLLM CPU server: ours against verl's ToolAgentLoop.

    .venv/bin/python bench/rollout_vllm_bench.py [--quick] [--rounds N (16)] [--waves W (4)]
                                                 [--concurrency 1,16,64] [--peer-http aiohttp|httpx]

One vLLM server (``.venv-vllm``, tests/support/vllm_server.py; the tiny random model of
tests/support/tiny_model.py, ``--max-num-seqs 64`` so that 64 episodes really decode
at once) serves both sides. Each episode has two turns: the first is guided
(``structured_outputs``: one ``exec`` call ``echo WORD``), the second samples
freely; every request carries a seed that is a function of its prompt ids, so
that the same prompt samples the same tokens on either side. The same episodes
run two ways, in alternating rounds so that machine noise hits both alike:

* **ours**: :class:`~agent_backend.rollout.RolloutPool` over a
  :class:`~agent_backend.rollout.TokenPolicy` (a :class:`~agent_backend.rollout.VLLMTokenSampler`
  and the model's :class:`~agent_backend.rollout.ChatTemplate`), the tools on
  the local pool (a workspace per episode, ``exec`` a real process);
* **peer**: verl 0.9.1's own ``ToolAgentLoop`` (its state machine, Continuous
  Token builder and hermes tool parser), built per episode by hydra from verl's
  agent loop registry as verl's ``AgentLoopWorker`` does, over the worker's
  tokenizer and tools (``multi_turn.tool_config_path``). Only two pieces are
  ours, each what a verl user would write: the server manager
  (``generate(request_id, prompt_ids=, sampling_params=)`` posting the same
  token-id request to the same ``/v1/completions``, aiohttp with keep-alive,
  returning verl's ``TokenOutput``) and the tool (a ``BaseTool`` subclass
  running the same command in ``/bin/sh``, a real subprocess).

Figures, at each concurrency C (episodes in flight at once). A round runs
``W x C`` episodes (``--waves``, 4; at least 16) through C slots on either side,
each slot starting the next episode as soon as its last one ends: the rate a
rollout step sustains with C episodes in flight. One wave (``--waves 1``, C
episodes started together, what the bench ran before) measures the slowest of
C episodes instead: on two cores shared with the server, whose engine and
worker processes spin for a second after every step, a round of one wave
lasted 0.5 to 2.7 s on either side, and the median of 30 rounds' ratios moved
from 0.84 to 1.07 between runs of the same code.


* episodes/s ours and peer, and their ratio (the median of the rounds'
  ratios); target: ratio >= 1.0 at every concurrency;
* our rollout-layer overhead per turn: each episode's ``timing`` total minus
  ``policy``, ``tools``, ``env`` (its workspace) and ``reward``, divided by its
  turns, as bench/rollout_bench.py measures it (mean of the rounds' means,
  and the p99 over episodes); target <= 2 ms. The policy and tool time per
  turn are printed beside it, and, for scale, the peer's overhead measured the
  same way (its ``run`` minus the time in the server manager and the tool).

Before the figures, a check that the two sides ran the same episodes: every
episode made its one tool call and two turns, and the prompts the server got
are compared (the first turn's must be identical; the second's may differ where
the two loops render the tool result differently). After them, for the
diagnosis: this process's CPU per episode, the vLLM server's CPU per episode
(its processes, with psutil), with ``--waves 1`` how spread out in time each
side's requests of a round went out (first turns and second turns apart: the
server batches what arrives together), each side's fastest round (noise only adds time; not the
figure), and our sampler's retries.
``--peer-http httpx`` gives the peer's server manager httpx with keep-alive
instead of aiohttp, the client our sampler had before this bench showed what
it cost (3-5x the server's CPU per episode at 16 and 64 concurrent episodes:
docs/dependencies.md, aiohttp): a diagnosis, not a figure.

Needs ``.venv-vllm`` (``make vllm-env``) and verl with its agent loop
(``pip install -e '.[verl,tokens]'``); without either it prints why and fails.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import dataclasses
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.tiny_model import build_tiny_model  # noqa: E402
from support.vllm_server import VLLMServer, VLLMStartError, launched_vllm  # noqa: E402

from agent_backend import DEFAULT_POOL, Dispatcher, ToolRegistry, load_pool  # noqa: E402
from agent_backend.rollout import (  # noqa: E402
    ChatTemplate,
    EpisodeConfig,
    RolloutPool,
    TokenPolicy,
    Trajectory,
    VLLMTokenSampler,
)

with warnings.catch_warnings():
    # verl's imports warn about what a CPU box lacks (torchtitan, ...) and Ray's old state API.
    warnings.simplefilter("ignore")
    try:
        import aiohttp
        import hydra.utils
        import verl
        from hydra import compose, initialize_config_dir
        from omegaconf import DictConfig, OmegaConf
        from verl.experimental.agent_loop.agent_loop import (
            AgentLoopWorker,
            DictConfigWrap,
            ToolListWrap,
            _agent_loop_registry,
        )
        from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
        from verl.tools.base_tool import BaseTool
        from verl.tools.schemas import ToolResponse
        from verl.utils.rollout_trace import rollout_trace_op
        from verl.workers.rollout.replica import TokenOutput

        VERL_MISSING: str | None = None
    except ImportError as exc:  # the bench reports it as a missed figure
        VERL_MISSING = f"verl 0.9 is not importable here ({exc}): pip install -e '.[verl,tokens]'"
        BaseTool = object  # type: ignore[assignment,misc]

        def rollout_trace_op(function: Any) -> Any:  # type: ignore[no-redef]
            return function


TURNS = 2
GUIDED_TOKENS = 160  # guided ids come out about a character at a time: room for the whole call
FREE_TOKENS = 24
CONCURRENCY = (1, 16, 64)
# Per round, at least: at concurrency 1, sixteen episodes one after the other (eight made a
# round of about 2.5 s, whose ratio spread from 0.80 to 1.19 on this shared machine).
MIN_EPISODES = 16
WAVES = 4  # a round: this many times the concurrency in episodes, slots refilled as they free
MAX_NUM_SEQS = 64
# Every prompt prefilled in one step: on CPU a seeded request whose prefill is chunked kills
# the engine ("CPU Generator does not use offset"; see tests/support/vllm_server.py).
BATCHED_TOKENS = 32768
PROMPT_LENGTH = 1024
RESPONSE_LENGTH = 512
OVERHEAD_TARGET_MS = 2.0
EXEC_CALL = (
    r'<tool_call>\{"name": "exec", "arguments": \{"command": "echo [a-z]{2,8}"\}\}</tool_call>'
)
EXEC_SCHEMA: dict[str, Any] = {
    "name": "exec",
    "description": "Run a shell command in the workspace.",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


# -- what both sides share: the prompts and the per-request rule ----------------------------------


def user_prompts(count: int) -> list[str]:
    return [f"print the word number {i} with exec, then explain" for i in range(count)]


@dataclasses.dataclass
class Requests:
    """The prompts each side sent, as (length, crc32), first turns and later turns apart."""

    first: dict[str, list[tuple[int, int]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    later: dict[str, list[tuple[int, int]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    recording: bool = False


REQUESTS = Requests()


@dataclasses.dataclass
class SendTimes:
    """When a round's requests were built (just before each is sent), by side and turn kind:
    how spread out they reach the server decides how well it batches them (a diagnosis)."""

    first: list[float] = dataclasses.field(default_factory=list)
    later: list[float] = dataclasses.field(default_factory=list)

    def spreads_ms(self) -> tuple[float, float]:
        """Milliseconds from the first to the last request, first turns and later turns."""

        def spread(times: list[float]) -> float:
            return (max(times) - min(times)) * 1000 if len(times) > 1 else 0.0

        return spread(self.first), spread(self.later)


SENT: dict[str, SendTimes] = {"ours": SendTimes(), "peer": SendTimes()}


def turn_fields(side: str, prompt_ids: Sequence[int], tool_response_id: int) -> dict[str, Any]:
    """The request fields that depend on the turn: identical for both sides.

    A prompt with no tool response yet is a first turn: guided to one ``exec`` call. The seed
    is the prompt's crc32, so that the same prompt samples the same tokens on either side.
    """
    ids = [int(t) for t in prompt_ids]
    crc = zlib.crc32(array.array("q", ids).tobytes())
    first = tool_response_id not in ids
    (SENT[side].first if first else SENT[side].later).append(time.perf_counter())
    if REQUESTS.recording:
        (REQUESTS.first if first else REQUESTS.later)[side].append((len(ids), crc))
    if first:
        return {
            "seed": crc & 0x7FFFFFFF,
            "max_tokens": GUIDED_TOKENS,
            "structured_outputs": {"regex": EXEC_CALL},
        }
    return {"seed": crc & 0x7FFFFFFF, "max_tokens": FREE_TOKENS}


# -- ours: RolloutPool over TokenPolicy over VLLMTokenSampler ---------------------------------------


class BenchSampler(VLLMTokenSampler):
    """Our sampler, with the shared per-turn rule (guided first turn, seed)."""

    tool_response_id = -1

    def request_body(
        self, prompt_ids: Sequence[int], *, max_tokens: int | None = None
    ) -> dict[str, Any]:
        body = super().request_body(prompt_ids, max_tokens=max_tokens)
        body.update(turn_fields("ours", prompt_ids, self.tool_response_id))
        return body


def overhead_per_turn(record: Trajectory) -> float:
    t = record.timing
    return (t["total"] - t["policy"] - t["tools"] - t["env"] - t["reward"]) / record.num_turns


@dataclasses.dataclass
class OursRound:
    wall: float
    overheads: list[float]
    policy: float
    """Mean seconds per turn in the policy (the HTTP request included)."""
    tools: float
    env: float
    cpu: float
    """CPU seconds of this process (all its threads) in the round."""


async def ours_round(
    policy: TokenPolicy,
    dispatcher: Dispatcher,
    tools: list[dict[str, Any]],
    count: int,
    concurrency: int,
) -> OursRound:
    pool = RolloutPool(
        policy,
        dispatcher,
        tools=tools,
        n=1,
        concurrency=concurrency,
        episode=EpisodeConfig(max_turns=TURNS, timeout=300),
    )
    records: list[Trajectory] = []
    cpu = time.process_time()
    started = time.perf_counter()
    async with pool.stream(
        [{"prompt": p} for p in user_prompts(count)], groups_per_batch=count
    ) as batches:
        async for batch in batches:
            records.extend(batch)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    bad = [
        r
        for r in records
        if r.num_turns != TURNS or r.tool_calls != 1 or r.tool_failures or r.error
    ]
    if len(records) != count or bad:
        detail = bad[0].error or bad[0].stop_reason if bad else f"{len(records)} records"
        raise RuntimeError(
            f"ours: {len(bad)} of {count} episodes did not run as scripted: {detail}"
        )

    def per_turn(key: str) -> float:
        return statistics.fmean(r.timing[key] / r.num_turns for r in records)

    return OursRound(
        wall=wall,
        overheads=[overhead_per_turn(r) for r in records],
        policy=per_turn("policy"),
        tools=per_turn("tools"),
        env=per_turn("env"),
        cpu=cpu,
    )


# -- the peer: verl's ToolAgentLoop, with a server manager and a tool as a verl user writes them ---


@dataclasses.dataclass
class PeerTimes:
    """Seconds the peer spent in our two pieces, per verl request id (one per episode)."""

    generate: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    tool: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    tool_calls: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    def clear(self) -> None:
        self.generate.clear()
        self.tool.clear()
        self.tool_calls.clear()


PEER_TIMES = PeerTimes()


class ShellTool(BaseTool):  # type: ignore[misc]
    """``exec`` as a verl user writes it: the command in ``/bin/sh``, a real subprocess, its output."""

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            str(parameters["command"]),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await process.communicate()
        text = out.decode("utf-8", "replace")
        if process.returncode:
            text += f"\n(exit status {process.returncode})"
        agent_data = kwargs.get("agent_data")
        if agent_data is not None:
            PEER_TIMES.tool[agent_data.request_id] += time.perf_counter() - started
            PEER_TIMES.tool_calls[agent_data.request_id] += 1
        return ToolResponse(text=text), 0.0, {}


class VLLMServerManager:
    """verl's server manager interface over vLLM's ``/v1/completions`` with token-id prompts."""

    def __init__(
        self, server: VLLMServer, post: Callable[[bytes], Awaitable[bytes]], tool_response_id: int
    ) -> None:
        self.model = server.model
        self.post = post
        self.tool_response_id = tool_response_id

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        **kwargs: Any,  # image_data, video_data, audio_data ...: none here
    ) -> TokenOutput:
        started = time.perf_counter()
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            "temperature": sampling_params.get("temperature", 1.0),
            "logprobs": 1 if sampling_params.get("logprobs") else None,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
            "n": 1,
        }
        if sampling_params.get("top_p", 1.0) != 1.0:
            body["top_p"] = sampling_params["top_p"]
        if sampling_params.get("stop_token_ids"):
            body["stop_token_ids"] = sampling_params["stop_token_ids"]
        body.update(turn_fields("peer", prompt_ids, self.tool_response_id))
        payload = await self.post(orjson.dumps(body))
        choice = orjson.loads(payload)["choices"][0]
        logprobs = choice.get("logprobs") or {}
        output = TokenOutput(
            token_ids=choice["token_ids"],
            log_probs=logprobs.get("token_logprobs"),
            stop_reason="completed",
            num_preempted=0,
        )
        PEER_TIMES.generate[request_id] += time.perf_counter() - started
        return output


def verl_config(model_dir: Path, tool_config: Path) -> DictConfig:
    """The trainer config as verl's main composes it (hydra, verl's own ppo_trainer.yaml)."""
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={TURNS}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with (
        warnings.catch_warnings(),
        initialize_config_dir(config_dir=config_dir, version_base=None),
    ):
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return compose(config_name="ppo_trainer", overrides=overrides)


def write_tool_config(path: Path) -> Path:
    """verl's tool config (``multi_turn.tool_config_path``) naming :class:`ShellTool`."""
    tool = {
        "class_name": f"{ShellTool.__module__}.{ShellTool.__qualname__}",
        "config": {"type": "native"},
        "tool_schema": {"type": "function", "function": EXEC_SCHEMA},
    }
    OmegaConf.save(OmegaConf.create({"tools": [tool]}), path)
    return path


@dataclasses.dataclass
class PeerRound:
    wall: float
    overhead: float
    """Mean seconds per turn in ``run`` but not in the server manager nor the tool."""
    policy: float
    """Mean seconds per turn in the server manager (the HTTP request included)."""
    tools: float
    build: float
    """Mean seconds to build one ToolAgentLoop (hydra, as verl's worker does per row)."""
    cpu: float


class Peer:
    """verl's worker-side pieces: its tokenizer, tools and registry entry; one loop per episode."""

    def __init__(self, worker: AgentLoopWorker, manager: VLLMServerManager) -> None:
        self.worker = worker
        self.manager = manager
        self.entry = _agent_loop_registry["tool_agent"]
        config = worker.rollout_config
        # What AgentLoopWorker.generate_sequences passes to every loop.
        self.sampling_params = {
            "temperature": config.temperature,
            "top_p": config.top_p,
            "top_k": config.top_k,
            "repetition_penalty": 1.0,
            "logprobs": config.calculate_log_probs,
        }

    def loop(self) -> ToolAgentLoop:
        """A ToolAgentLoop as ``AgentLoopWorker._run_agent_loop`` instantiates one per row."""
        worker = self.worker
        loop: ToolAgentLoop = hydra.utils.instantiate(
            config=self.entry,
            trainer_config=DictConfigWrap(config=worker.config),
            server_manager=self.manager,
            tokenizer=worker.tokenizer,
            processor=worker.processor,
            hf_model_type=worker.hf_model_type,
            dataset_cls=worker.dataset_cls,
            data_config=DictConfigWrap(worker.config.data),
            tools=ToolListWrap(worker.tools),
        )
        return loop

    async def round(self, count: int, concurrency: int) -> PeerRound:
        PEER_TIMES.clear()
        limit = asyncio.Semaphore(concurrency)
        runs: list[float] = []
        builds: list[float] = []

        async def episode(prompt: str) -> None:
            async with limit:
                started = time.perf_counter()
                loop = self.loop()
                built = time.perf_counter()
                output = await loop.run(
                    dict(self.sampling_params),
                    raw_prompt=[{"role": "user", "content": prompt}],
                    tools_kwargs={},
                    extra_info={},
                )
                runs.append(time.perf_counter() - built)
                builds.append(built - started)
            mask = output.response_mask
            # verl counts the prompt, each assistant turn and each tool round.
            if output.num_turns != 1 + TURNS + 1 or 0 not in mask or 1 not in mask:
                raise RuntimeError(
                    f"peer: an episode did not run as scripted: num_turns {output.num_turns}"
                )

        cpu = time.process_time()
        started = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for prompt in user_prompts(count):
                group.create_task(episode(prompt))
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu
        calls = sorted(PEER_TIMES.tool_calls.values())
        if len(PEER_TIMES.generate) != count or calls != [1] * count:
            raise RuntimeError(
                f"peer: {len(PEER_TIMES.generate)} request ids for {count} episodes, "
                f"tool calls per episode {calls}"
            )
        turns = count * TURNS
        generate = sum(PEER_TIMES.generate.values())
        tool = sum(PEER_TIMES.tool.values())
        return PeerRound(
            wall=wall,
            overhead=(sum(runs) - generate - tool) / turns,
            policy=generate / turns,
            tools=tool / turns,
            build=statistics.fmean(builds),
            cpu=cpu,
        )


def make_worker(model_dir: Path, directory: Path) -> AgentLoopWorker:
    """verl's own AgentLoopWorker: it loads the tokenizer and the tools (our ShellTool)."""
    config = verl_config(model_dir, write_tool_config(directory / "verl_tools.yaml"))
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        # BaseTool.__init__ prints its schema; verl warns about what a CPU box lacks.
        warnings.simplefilter("ignore")
        worker = AgentLoopWorker(config, llm_client=None)
    if [type(t) for t in worker.tools] != [ShellTool]:
        raise RuntimeError(f"verl loaded {worker.tools} from its tool config, not ShellTool")
    return worker


# -- the rounds -------------------------------------------------------------------------------------


def server_cpu() -> float | None:
    """CPU seconds used so far by this process's children (the vLLM server's processes)."""
    try:
        import psutil
    except ImportError:
        return None
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total


@dataclasses.dataclass
class Result:
    concurrency: int
    episodes: int
    ours: list[OursRound]
    peer: list[PeerRound]
    server_cpu: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"ours": [], "peer": []}
    )
    spreads: dict[str, list[tuple[float, float]]] = dataclasses.field(
        default_factory=lambda: {"ours": [], "peer": []}
    )

    @property
    def ours_eps(self) -> float:
        return statistics.median(self.episodes / r.wall for r in self.ours)

    @property
    def peer_eps(self) -> float:
        return statistics.median(self.episodes / r.wall for r in self.peer)

    @property
    def ratio(self) -> float:
        return statistics.median(p.wall / o.wall for o, p in zip(self.ours, self.peer, strict=True))

    @property
    def overhead_ms(self) -> float:
        return statistics.fmean(statistics.fmean(r.overheads) for r in self.ours) * 1000

    @property
    def overhead_p99_ms(self) -> float:
        ordered = sorted(o for r in self.ours for o in r.overheads)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000

    def ours_ms(self, key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in self.ours) * 1000

    def peer_ms(self, key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in self.peer) * 1000


async def measure(
    concurrency: int,
    rounds: int,
    waves: int,
    ours: tuple[TokenPolicy, Dispatcher, list[dict[str, Any]]],
    peer: Peer,
) -> Result:
    count = max(concurrency * waves, MIN_EPISODES)
    result = Result(concurrency, count, [], [])
    # Warm-up: connections, caches, the server's prefix cache for these prompts.
    await ours_round(*ours, count, concurrency)
    await peer.round(count, concurrency)
    for index in range(rounds):
        for which in ("ours", "peer") if index % 2 == 0 else ("peer", "ours"):
            before = server_cpu()
            SENT[which] = SendTimes()
            if which == "ours":
                result.ours.append(await ours_round(*ours, count, concurrency))
            else:
                result.peer.append(await peer.round(count, concurrency))
            result.spreads[which].append(SENT[which].spreads_ms())
            after = server_cpu()
            if before is not None and after is not None:
                result.server_cpu[which].append(after - before)
    return result


def compare_requests() -> list[str]:
    """Did both sides send the server the same prompts? One line per turn kind."""
    lines = []
    for name, table in (("first-turn", REQUESTS.first), ("second-turn", REQUESTS.later)):
        ours, peer = sorted(table["ours"]), sorted(table["peer"])
        same = sum(1 for a, b in zip(ours, peer, strict=False) if a == b)
        lengths = (
            f"prompt tokens ours {statistics.fmean(n for n, _ in ours):.0f}, "
            f"peer {statistics.fmean(n for n, _ in peer):.0f}"
            if ours and peer
            else "no requests"
        )
        lines.append(
            f"{name} prompts identical on both sides: {same}/{max(len(ours), len(peer))} ({lengths})"
        )
    return lines


PEER_ATTEMPTS = 5  # our sampler's default: the first attempt and 4 retries
PEER_RESENDS = [0]


@contextlib.asynccontextmanager
async def peer_post(url: str, client: str) -> AsyncIterator[Callable[[bytes], Awaitable[bytes]]]:
    """POST a JSON body to ``url``, keep-alive: aiohttp (default, as our sampler) or httpx.

    vLLM's server (uvicorn) closes a connection idle for 5 s; aiohttp keeps idle ones for 4 s
    here, and a request that still meets a closed one is sent again at once, up to
    :data:`PEER_ATTEMPTS` times in all, as our sampler's retries would (it is seeded: sending
    it again samples the same tokens). On a client starved of CPU by the server the 4 s can
    run late: one run met two closed connections in a row.
    """
    headers = {"Content-Type": "application/json"}
    if client == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=300.0, limits=limits) as http:

            async def post_httpx(data: bytes) -> bytes:
                for attempt in range(PEER_ATTEMPTS):
                    try:
                        response = await http.post(url, content=data, headers=headers)
                        break
                    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                        if attempt == PEER_ATTEMPTS - 1:
                            raise
                        PEER_RESENDS[0] += 1
                if response.status_code != 200:
                    raise RuntimeError(
                        f"vLLM answered {response.status_code}: {response.text[:500]}"
                    )
                return response.content

            yield post_httpx
        return
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def post_aiohttp(data: bytes) -> bytes:
            for attempt in range(PEER_ATTEMPTS):
                try:
                    async with session.post(url, data=data, headers=headers) as response:
                        payload = await response.read()
                        status = response.status
                    break
                except aiohttp.ClientConnectionError:  # a closed keep-alive connection
                    if attempt == PEER_ATTEMPTS - 1:
                        raise
                    PEER_RESENDS[0] += 1
            if status != 200:
                raise RuntimeError(f"vLLM answered {status}: {payload[:500]!r}")
            return payload

        yield post_aiohttp


async def run_bench(
    server: VLLMServer, worker: AgentLoopWorker, directory: Path, args: argparse.Namespace
) -> int:
    rounds = 2 if args.quick else args.rounds
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    tool_response_id = int(worker.tokenizer.convert_tokens_to_ids("<tool_response>"))
    template = ChatTemplate(worker.tokenizer)
    tools_dir = directory / "tools"
    tools_dir.mkdir()
    (tools_dir / "exec.json").write_text(
        json.dumps({**EXEC_SCHEMA, "x-agent-backend": {"builtin": "exec"}}), encoding="utf-8"
    )
    registry = ToolRegistry()
    registry.load_dir(tools_dir)
    pool_config = DEFAULT_POOL.model_copy(
        update={
            "workspace_root": str(directory / "ws"),
            "max_concurrent_calls": MAX_NUM_SEQS,
            "kill_grace": 0.5,
        }
    )
    print(
        f"{TURNS}-turn episodes (guided exec call, then {FREE_TOKENS} free tokens) through vLLM at "
        f"{server.url}; concurrency {levels}; rounds: {rounds} per side (after a warm-up) of"
        f" {args.waves} x the concurrency in episodes;"
        f" the peer's server manager over {args.peer_http}; our tools behind"
        f" isolation = {pool_config.isolation!r} (the default pool's; the peer's run unsandboxed)"
    )
    results: list[Result] = []
    async with (
        load_pool(pool_config) as backend,
        Dispatcher(registry, backend) as dispatcher,
        BenchSampler(server.url, model=server.model, max_tokens=GUIDED_TOKENS) as sampler,
        peer_post(f"{server.url}/v1/completions", args.peer_http) as post,
    ):
        sampler.tool_response_id = tool_response_id
        policy = TokenPolicy(sampler, template)
        peer = Peer(worker, VLLMServerManager(server, post, tool_response_id))
        tools = registry.to_openai()
        # One round each, recorded: the two sides must send the same first-turn prompts.
        REQUESTS.recording = True
        await ours_round(policy, dispatcher, tools, MIN_EPISODES, MIN_EPISODES)
        await peer.round(MIN_EPISODES, MIN_EPISODES)
        REQUESTS.recording = False
        checks = compare_requests()
        for line in checks:
            print(f"check  {line}")
        for concurrency in levels:
            started = time.perf_counter()
            result = await measure(
                concurrency, rounds, args.waves, (policy, dispatcher, tools), peer
            )
            results.append(result)
            print(
                f"concurrency {concurrency:>3}: {result.episodes} episodes a round,"
                f" {time.perf_counter() - started:.1f} s"
            )
        if dispatcher.statistics().sessions_open:
            raise RuntimeError("ours: sessions left open")
        sampled = sampler.statistics()
    print()
    print(
        f"{'episodes':>8} {'ours':>8} {'peer':>8} {'ratio':>6} {'overhead':>9} {'p99':>7}"
        f" {'policy':>8} {'tools':>7} {'env':>7} {'peer ovh':>9} {'policy':>8} {'tools':>7}"
    )
    print(
        f"{'at once':>8} {'eps/s':>8} {'eps/s':>8} {'':>6} {'ours, ms/turn':>41}"
        f" {'peer, ms/turn':>26}"
    )
    for r in results:
        print(
            f"{r.concurrency:>8} {r.ours_eps:>8.2f} {r.peer_eps:>8.2f} {r.ratio:>6.2f}"
            f" {r.overhead_ms:>9.3f} {r.overhead_p99_ms:>7.3f} {r.ours_ms('policy'):>8.1f}"
            f" {r.ours_ms('tools'):>7.1f} {r.ours_ms('env'):>7.1f}"
            f" {r.peer_ms('overhead'):>9.3f} {r.peer_ms('policy'):>8.1f} {r.peer_ms('tools'):>7.1f}"
        )
    print()
    failed = 0
    if not checks[0].startswith(
        f"first-turn prompts identical on both sides: {MIN_EPISODES}/{MIN_EPISODES}"
    ):
        failed += 1
        print(f"FAIL  the two sides did not run the same episodes: {checks[0]}")
    for r in results:
        label = f"episodes/s through vLLM >= the peer's loop (ratio >= 1.0) at {r.concurrency:>2}"
        ok = r.ratio >= 1.0
        failed += not ok
        print(
            f"{'PASS' if ok else 'FAIL'}  {label:<66} {r.ratio:>6.2f}"
            f"   ({r.ours_eps:.2f} / {r.peer_eps:.2f} episodes/s)"
        )
    for r in results:
        label = (
            f"rollout-layer overhead per turn <= {OVERHEAD_TARGET_MS:g} ms at {r.concurrency:>2}"
        )
        ok = r.overhead_ms <= OVERHEAD_TARGET_MS
        failed += not ok
        print(
            f"{'PASS' if ok else 'FAIL'}  {label:<66} {r.overhead_ms:>6.3f} ms"
            f"   (p99 {r.overhead_p99_ms:.3f} ms)"
        )
    for r in results:
        ratios = ", ".join(f"{p.wall / o.wall:.2f}" for o, p in zip(r.ours, r.peer, strict=True))
        print(f"info  each round's ratio at {r.concurrency} (the figure is their median): {ratios}")
    for r in results:
        # Noise only ever adds time: each side's fastest round is its least disturbed one.
        ours_best = r.episodes / min(o.wall for o in r.ours)
        peer_best = r.episodes / min(p.wall for p in r.peer)
        print(
            f"info  each side's fastest round at {r.concurrency}: ours {ours_best:.2f},"
            f" peer {peer_best:.2f} episodes/s, ratio {ours_best / peer_best:.2f} (not the figure)"
        )
    for r in results:
        ours_cpu = statistics.fmean(o.cpu for o in r.ours) / r.episodes * 1000
        peer_cpu = statistics.fmean(p.cpu for p in r.peer) / r.episodes * 1000
        print(
            f"info  CPU of this process per episode at {r.concurrency}:"
            f" ours {ours_cpu:.1f} ms, peer {peer_cpu:.1f} ms (the server shares the 2 cores)"
        )
    for r in results:
        if r.server_cpu["ours"] and r.server_cpu["peer"]:
            ours_server = statistics.fmean(r.server_cpu["ours"]) / r.episodes * 1000
            peer_server = statistics.fmean(r.server_cpu["peer"]) / r.episodes * 1000
            print(
                f"info  vLLM server CPU per episode at {r.concurrency}:"
                f" ours {ours_server:.1f} ms, peer {peer_server:.1f} ms"
            )
    for r in results:
        if r.concurrency == 1 or args.waves != 1:
            continue  # one episode at a time, or a stream: its requests are never together
        first, later = (
            {side: statistics.median(s[i] for s in r.spreads[side]) for side in ("ours", "peer")}
            for i in (0, 1)
        )
        print(
            f"info  a round's requests at {r.concurrency} went out over (median of rounds):"
            f" first turns ours {first['ours']:.1f} ms, peer {first['peer']:.1f} ms;"
            f" second turns ours {later['ours']:.1f} ms, peer {later['peer']:.1f} ms"
        )
    print(
        f"info  our sampler: {sampled.requests} requests, {sampled.retries} retries,"
        f" {sampled.failures} failures; the peer's server manager: {PEER_RESENDS[0]} resends"
    )
    for r in results:
        print(
            f"info  verl builds one ToolAgentLoop per episode (hydra, as its worker does):"
            f" {r.peer_ms('build'):.2f} ms at {r.concurrency}, counted in the peer's episodes/s"
        )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds per side and concurrency")
    # The shared machine's noise moves one round's ratio by tenths (rounds of one wave: from
    # 0.3 to 3); the figure is the median of the rounds' ratios.
    parser.add_argument("--rounds", type=int, default=16, help="rounds per side and concurrency")
    parser.add_argument(
        "--waves",
        type=int,
        default=WAVES,
        help="episodes per round, in multiples of the concurrency (1: one wave started together)",
    )
    parser.add_argument(
        "--peer-http",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the HTTP client of the peer's server manager (httpx: the diagnosis in the docstring)",
    )
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="comma-separated episodes in flight at once",
    )
    args = parser.parse_args()
    if VERL_MISSING is not None:
        print(f"FAIL  the peer (verl's ToolAgentLoop) cannot run: {VERL_MISSING}")
        return 1
    with tempfile.TemporaryDirectory(prefix="rollout-vllm-bench-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o711)  # the sandboxes' own uids pass through to their workspaces
        model_dir = build_tiny_model(directory / "model")
        worker = make_worker(model_dir, directory)
        # torch, transformers, verl and Ray make a heap of ~500k objects; a full collection of
        # it paused this process for up to ~270 ms, at random on either side. Frozen, the
        # import-time heap is out of the collector's way for both sides alike.
        gc.collect()
        gc.freeze()
        started = time.monotonic()
        try:
            with launched_vllm(
                model_dir, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=BATCHED_TOKENS
            ) as server:
                print(f"vLLM healthy {time.monotonic() - started:.1f} s after launch")
                try:
                    return anyio.run(run_bench, server, worker, directory, args, backend="asyncio")
                except BaseException:
                    tail = server.log_path.read_bytes()[-6000:].decode("utf-8", "replace")
                    print(f"the bench failed; the vLLM server's log ends:\n{tail}", file=sys.stderr)
                    raise
        except VLLMStartError as exc:
            print(f"FAIL  the vLLM server cannot run: {exc}")
            return 1


if __name__ == "__main__":
    sys.exit(main())
