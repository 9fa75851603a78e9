"""A tiny random Qwen2 model with a real BPE tokenizer and a tool-calling chat template.

The real-engine tests (vLLM on CPU, transformers) need a model directory laid out as on a
hub: ``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and a chat template. :func:`build_tiny_model` writes one, offline
and deterministically (fixed seeds, a tokenizer trained on generated text), in well under
two seconds, with the transformers of either venv (the project's, and ``.venv-vllm``'s).

Two chat templates:

* ``"hermes"``: ChatML with tools the way Qwen2.5 renders them: the tool list in the system
  prompt, assistant tool calls as ``<tool_call>{json}</tool_call>``, ``tool`` messages as
  ``<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>``.
* ``"qwen3"``: the same, plus Qwen3's handling of reasoning: an assistant turn's
  ``<think>...</think>`` (in its content, or as ``reasoning_content``) is dropped from every
  assistant turn before the last real user message, and re-rendered in a normalised form
  (``<think>\\n...\\n</think>\\n\\n``) after it; ``enable_thinking=False`` opens the
  generation prompt with an empty think block. Re-rendering a conversation therefore does
  not reproduce the tokens the model sampled: the drift token-in/token-out avoids.

The weights are random: the model's text is noise, but its logprobs are a real function of
its tokens, which is what comparing engines needs. This module never touches the network.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Literal

__all__ = [
    "SPECIAL_TOKENS",
    "TEMPLATES",
    "TOOL_TOKENS",
    "build_tiny_model",
    "tiny_model_dir_fixture",
]

# Control tokens: skipped when decoding with skip_special_tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added as single tokens but not special (as Qwen does), so they survive decoding and a
# server's tool-call and reasoning parsers see them in the text.
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
SEED = 1234
VOCAB_SIZE = 1024

_SYSTEM_AND_TOOLS = """\
{%- set default_system = 'You are a helpful assistant.' %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = default_system %}
    {%- set rest = messages %}
{%- endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more functions. Their signatures, in <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nCall one with a JSON object in <tool_call></tool_call> tags:\\n' }}
    {{- '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
"""

_TOOL_CALLS = """\
{%- for call in message.tool_calls or [] %}
    {%- set call = call.function if call.function is defined else call %}
    {%- set arguments = call.arguments if call.arguments is string else (call.arguments | tojson) %}
    {{- '<tool_call>{"name": "' + call.name + '", "arguments": ' + arguments + '}</tool_call>' }}
{%- endfor %}
"""

_TOOL_RESPONSE = """\
{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}
    {{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
"""

HERMES_TEMPLATE = (
    _SYSTEM_AND_TOOLS
    + """\
{%- for message in rest %}
    {%- if message.role == 'tool' %}
"""
    + _TOOL_RESPONSE
    + """\
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' + (message.content or '') }}
"""
    + _TOOL_CALLS
    + """\
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

QWEN3_TEMPLATE = (
    _SYSTEM_AND_TOOLS
    + """\
{%- set ns = namespace(last_query=-1) %}
{%- for message in rest %}
    {%- if message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in rest %}
    {%- if message.role == 'tool' %}
"""
    + _TOOL_RESPONSE
    + """\
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- set reasoning = message.reasoning_content or '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
"""
    + _TOOL_CALLS
    + """\
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

TEMPLATES: dict[str, str] = {"hermes": HERMES_TEMPLATE, "qwen3": QWEN3_TEMPLATE}

_TOOL_NAMES = ("echo", "read_file", "write_file", "run_shell", "search", "add", "get_weather")
_WORDS = (
    "the",
    "file",
    "path",
    "text",
    "result",
    "error",
    "value",
    "list",
    "query",
    "count",
    "number",
    "city",
    "name",
    "line",
    "ok",
    "hello",
    "world",
    "assistant",
    "user",
    "system",
    "tool",
    "call",
    "response",
    "think",
    "answer",
    "because",
    "first",
    "then",
)


def _corpus(rng: random.Random) -> list[str]:
    """A few hundred lines of ChatML, JSON tool calls, prose and digits to train BPE on."""
    lines: list[str] = []
    for i in range(400):
        tool = rng.choice(_TOOL_NAMES)
        words = " ".join(rng.choices(_WORDS, k=rng.randint(3, 12)))
        number = rng.randint(0, 10 ** rng.randint(1, 9))
        arguments = {"text": words, "n": number, "path": f"data/f{i}.txt"}
        call = json.dumps({"name": tool, "arguments": arguments})
        lines += [
            f"<|im_start|>user\n{words.capitalize()}? {number}<|im_end|>",
            f"<|im_start|>assistant\n<think>\n{words}\n</think>\n\n<tool_call>{call}</tool_call>",
            f"<tool_response>\n{json.dumps({'result': words, 'count': number})}\n</tool_response>",
            f'{{"type": "function", "function": {{"name": "{tool}", "parameters": {{}}}}}}',
            f"{number} + {i} = {number + i}; {rng.random():.6f}",
        ]
    return lines


def _train_tokenizer() -> object:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def build_tiny_model(path: Path, *, template: Literal["hermes", "qwen3"] | str = "hermes") -> Path:
    """Write a tiny random ``Qwen2ForCausalLM`` with its tokenizer to ``path``; return ``path``.

    Deterministic: the same files (and weights) every time, from fixed seeds.
    """
    import torch
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, not {template!r}")
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATES[template],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(path)

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        # Wide enough that the next-token distribution is far from uniform, so comparing
        # logprobs across engines means something.
        initializer_range=0.2,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(path)
    return path


try:
    import pytest
except ImportError:  # .venv-vllm has no pytest; build_tiny_model works there all the same
    pass
else:

    @pytest.fixture(name="tiny_model_dir", scope="session")
    def tiny_model_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The hermes-template tiny model, built once per test session."""
        return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


if __name__ == "__main__":  # python tests/support/tiny_model.py DIR [hermes|qwen3]
    print(
        build_tiny_model(Path(sys.argv[1]), template=sys.argv[2] if len(sys.argv) > 2 else "hermes")
    )
