"""Text tool-call parsers: ours against vLLM's for each family, on the same ~10 KB reply with 8 calls.

    .venv/bin/python bench/parser_bench.py [--rounds N] [--seconds S]

For each family, one assistant reply of about 10 KB (some prose, then eight
calls whose arguments hold a path, a block of code, numbers and a nested
object), written with :func:`~agent_backend.tools.render_tool_calls` as the
family's chat template writes it. Ours (:func:`~agent_backend.tools.from_text`)
runs in this process; vLLM's parser for the same family (vLLM in
``.venv-vllm``, with a tokenizer built offline: the tiny test model's BPE
plus the family's tool-call tokens, special or not as in the family's own
tokenizer) runs in a worker subprocess, set up as vLLM's OpenAI server sets
it up for a non-streaming chat completion with ``--enable-auto-tool-choice
--tool-call-parser NAME``: the parser class the server composes, built with
the request's tools and chat-template arguments, the request passed through
its ``adjust_request`` first, the reply as the detokenizer would hand it
(special tokens dropped unless ``adjust_request`` turned
``skip_special_tokens`` off), and the worker's startup heap frozen for the
garbage collector, as the server freezes its own before serving. Both get
the tools' schemas. The two are timed in turns, round after round (each side
parsing the reply again and again for at least ``--seconds``), and each
side's best round is kept. Before timing, both parsers' calls are compared
(names and decoded arguments). vLLM parses gpt-oss replies from token ids
(``openai_harmony``), so for ``harmony`` it is given the reply's token ids,
encoded before timing.

Printed per family: ours and vLLM's MB/s and calls/s, the ratio (ours /
vLLM's throughput), and PASS when the ratio is at least 1.0. Not a test:
the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TARGET = 1.0
CALLS = 8

# Our format -> vLLM's parser name for the same family.
VLLM_PARSER = {
    "hermes": "hermes",
    "llama3": "llama3_json",
    "mistral": "mistral",
    "deepseek": "deepseek_v3",
    "glm45": "glm45",
    "kimi_k2": "kimi_k2",
    "qwen3_coder": "qwen3_coder",
    "harmony": "openai",
}
# Tool-call tokens the family's tokenizer marks special: vLLM's detokenizer drops them from
# the text unless the parser's adjust_request sets skip_special_tokens=False.
SPECIAL_TOKENS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "llama3": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
    "deepseek": [],
    "glm45": [
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        "<|tool_call_argument_begin|>",
    ],
    "qwen3_coder": ["<tool_call>", "</tool_call>"],
    "harmony": [],
}
# Tool-call tokens the family's tokenizer adds as plain (not special) tokens: DeepSeek-V3's,
# which its parser reads from text while skip_special_tokens stays on.
PLAIN_TOKENS = {
    "deepseek": [
        "<\uff5ctool\u2581calls\u2581begin\uff5c>",
        "<\uff5ctool\u2581calls\u2581end\uff5c>",
        "<\uff5ctool\u2581call\u2581begin\uff5c>",
        "<\uff5ctool\u2581call\u2581end\uff5c>",
        "<\uff5ctool\u2581sep\uff5c>",
    ],
}

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "content": {"type": "string"},
        "line": {"type": "integer"},
        "options": {
            "type": "object",
            "properties": {"mode": {"type": "string"}, "retries": {"type": "integer"}},
        },
    },
    "required": ["path", "content"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "write_file", "description": "", "parameters": SCHEMA},
    }
]


def _code(i: int) -> str:
    lines = [f"def handler_{i}_{n}(request, retries=3):" for n in range(6)]
    body = "\n".join(
        f"{line}\n    for attempt in range(retries):\n        result = fetch(request, attempt)\n"
        f"        if result.ok:\n            return result.json()  # step {i}\n    raise RuntimeError('gave up')\n"
        for line in lines
    )
    return body[:1000]


def reply(fmt: str) -> str:
    """The ~10 KB reply of eight calls, as the family's template writes it."""
    from agent_backend.tools import ToolCall, render_tool_calls

    calls = [
        ToolCall(
            f"call_{i}",
            "write_file",
            {
                "path": f"src/service/handlers_{i}.py",
                "content": _code(i),
                "line": 10 * i + 1,
                "options": {"mode": "overwrite", "retries": i},
            },
            "openai",
        )
        for i in range(CALLS)
    ]
    prose = "I'll write the eight handler modules now, one file each, then run the tests. " * 8
    if fmt == "harmony":  # gpt-oss: reasoning, then the calls as the model samples them
        text = "<|channel|>analysis<|message|>" + prose + "<|end|>"
        return text + render_tool_calls(calls, format="harmony")
    return render_tool_calls(calls, format=fmt, content=prose)  # type: ignore[arg-type]


def _timed(run: Any, at_least: float) -> tuple[int, float]:
    """Run ``run()`` until ``at_least`` seconds have passed (at least once): (runs, seconds)."""
    iterations = 0
    started = time.perf_counter()
    while True:
        run()
        iterations += 1
        elapsed = time.perf_counter() - started
        if elapsed >= at_least:
            return iterations, elapsed


# -- the vLLM side (runs in .venv-vllm) -------------------------------------------------------------


def _worker() -> None:
    import contextlib
    import copy
    import gc
    import io
    import logging

    logging.disable(logging.WARNING)
    with contextlib.redirect_stderr(io.StringIO()):
        from support.tiny_model import _train_tokenizer
        from transformers import PreTrainedTokenizerFast
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser import ParserManager
        from vllm.utils.gc_utils import freeze_gc_heap

    base = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    state: dict[str, Any] = {}
    for line in sys.stdin:
        message = json.loads(line)
        if message["cmd"] == "setup":
            fmt, text = message["format"], message["text"]
            tokenizer = copy.deepcopy(base)
            if PLAIN_TOKENS.get(fmt):
                tokenizer.add_tokens(PLAIN_TOKENS[fmt])
            if SPECIAL_TOKENS[fmt]:
                tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[fmt]})
            request = ChatCompletionRequest(
                model="bench", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
            )
            # As the server: the parser class it composes for --tool-call-parser NAME
            # --enable-auto-tool-choice (gpt-oss: HarmonyParser), built per request with the
            # request's tools and chat-template arguments; adjust_request runs on the request
            # (from a parser of its own) before generation.
            parser_cls = ParserManager.get_parser(
                tool_parser_name=VLLM_PARSER[fmt],
                enable_auto_tools=True,
                is_harmony=fmt == "harmony",
                tokenizer=tokenizer,
            )
            assert parser_cls is not None
            chat_kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
            parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_kwargs).adjust_request(
                request
            )
            parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=chat_kwargs)
            if fmt == "harmony":
                run = _harmony_runner(parser, request, text)
            else:
                # The text the detokenizer hands the parser: without the special tokens,
                # unless adjust_request turned skip_special_tokens off.
                if request.skip_special_tokens:
                    for token in tokenizer.all_special_tokens:
                        text = text.replace(token, "")

                def run(parser: Any = parser, request: Any = request, text: str = text) -> Any:
                    # What the server's parse() calls for auto tool choice.
                    info = parser.extract_tool_calls(text, request)
                    return [(c.function.name, c.function.arguments) for c in info.tool_calls]

            state[fmt] = run
            answer: dict[str, Any] = {"calls": run()}
            freeze_gc_heap()  # as the server does after startup (its lifespan hook)
        else:
            iterations, seconds = _timed(state[message["format"]], message["seconds"])
            answer = {"iterations": iterations, "seconds": seconds}
        print(json.dumps(answer), flush=True)
    gc.unfreeze()  # let the interpreter's shutdown free the frozen heap (else nanobind warns)


def _harmony_runner(parser: Any, request: Any, text: str) -> Any:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    ids = encoding.encode(text, allowed_special="all")  # before timing: vLLM gets token ids

    def run() -> Any:
        # As the server calls it; parse() ends with flush(), which resets the stream's state.
        _, _, calls = parser.parse("", request, enable_auto_tools=True, model_output_token_ids=ids)
        return [(c.name, c.arguments) for c in calls or []]

    return run


# -- the comparison -------------------------------------------------------------------------------


class VLLMWorker:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [str(VLLM_PYTHON), str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def ask(self, **message: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the vLLM worker exited (see its stderr above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _same_calls(ours: list[Any], theirs: list[Any]) -> bool:
    def normal(arguments: Any) -> Any:
        return json.loads(arguments) if isinstance(arguments, str) else arguments

    return [(n, normal(a)) for n, a in ours] == [(n, normal(a)) for n, a in theirs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="per side per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker()
        return 0

    from agent_backend.tools import from_text

    if not VLLM_PYTHON.exists():
        print("no vLLM environment at .venv-vllm: nothing to compare with", file=sys.stderr)
        return 1
    schemas = {"write_file": SCHEMA}
    texts = {fmt: reply(fmt) for fmt in VLLM_PARSER}
    worker = VLLMWorker()
    status = 0
    try:
        checked: dict[str, str] = {}
        for fmt, text in texts.items():
            _, calls = from_text(text, format=fmt, tools=schemas)  # type: ignore[arg-type]
            ours = [(c.name, c.arguments) for c in calls if c.error is None]
            theirs = worker.ask(cmd="setup", format=fmt, text=text)["calls"]
            checked[fmt] = (
                "same calls"
                if _same_calls(ours, theirs) and len(ours) == CALLS
                else f"DIFFERENT calls (ours {len(ours)}, vLLM {len(theirs)})"
            )
        # Best throughput (parses per second) of each side over the rounds.
        best_ours = dict.fromkeys(texts, 0.0)
        best_vllm = dict.fromkeys(texts, 0.0)
        for _ in range(args.rounds):
            for fmt, text in texts.items():

                def ours(fmt: str = fmt, text: str = text) -> None:
                    from_text(text, format=fmt, tools=schemas)  # type: ignore[arg-type]

                runs, seconds = _timed(ours, args.seconds)
                best_ours[fmt] = max(best_ours[fmt], runs / seconds)
                answer = worker.ask(cmd="time", format=fmt, seconds=args.seconds)
                best_vllm[fmt] = max(best_vllm[fmt], answer["iterations"] / answer["seconds"])
    finally:
        worker.close()

    print(
        f"parser_bench: {CALLS} calls per reply, best of {args.rounds} interleaved rounds of "
        f">= {args.seconds} s per side; ratio = ours / vLLM 0.32 throughput, target >= {TARGET}"
    )
    for fmt, text in texts.items():
        size = len(text.encode())
        ratio = best_ours[fmt] / best_vllm[fmt]
        verdict = "PASS" if ratio >= TARGET and checked[fmt] == "same calls" else "FAIL"
        if verdict == "FAIL":
            status = 1
        print(
            f"  {fmt:<12} {size / 1000:5.1f} KB  ours {size * best_ours[fmt] / 1e6:8.2f} MB/s "
            f"{CALLS * best_ours[fmt]:9.0f} calls/s | vLLM {VLLM_PARSER[fmt]:<12} "
            f"{size * best_vllm[fmt] / 1e6:8.2f} MB/s {CALLS * best_vllm[fmt]:9.0f} calls/s"
            f" | ratio {ratio:8.2f}  {verdict}  ({checked[fmt]})"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
