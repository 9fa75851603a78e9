"""What the real vLLM server returns for token-in/token-out sampling, checked on the tiny model.

These pin the wire facts the token sampler is built on: a token-id prompt on
``/v1/completions`` gives back the sampled ids and one logprob per id; those logprobs are
the model's own (transformers, teacher-forced on the same ids, agrees) whatever the
temperature; guided decoding (``structured_outputs``) makes a random model emit a
well-formed tool call, but then the logprobs are those of the masked distribution; and
the chat endpoint returns the prompt's and the completion's ids.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.vllm_server import STARTUP_TIMEOUT, VLLMServer, vllm_server_fixture  # noqa: F401

# The first test to need the server also waits for its start-up.
pytestmark = pytest.mark.timeout(STARTUP_TIMEOUT + 60)

ECHO_CALL = r'<tool_call>\{"name": "echo", "arguments": \{"text": "[a-z]{1,8}"\}\}</tool_call>'
ECHO_TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Print the text back.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["text"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Say hello with the echo tool."}]


@pytest.fixture(scope="module")
def client(vllm_server: VLLMServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def hf(vllm_server: VLLMServer) -> tuple[Any, Any]:
    """The served model and tokenizer, loaded in transformers (float32, eval mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    model = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype="float32").eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def prompt_ids(hf: tuple[Any, Any]) -> list[int]:
    encoded = hf[1].apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def complete(client: httpx.Client, server: VLLMServer, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"model": server.model, **body})
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def teacher_forced(hf: tuple[Any, Any], prompt: list[int], completion: list[int]) -> list[float]:
    """Log p(completion[i] | prompt + completion[:i]) under the transformers model."""
    import torch

    model = hf[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_token_prompt_returns_ids_and_one_logprob_each(
    client: httpx.Client, vllm_server: VLLMServer, prompt_ids: list[int]
) -> None:
    body = {"prompt": prompt_ids, "max_tokens": 12, "logprobs": 1, "return_token_ids": True}
    choice = complete(client, vllm_server, temperature=1.0, seed=11, **body)
    ids, logprobs = choice["token_ids"], choice["logprobs"]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(ids) == 12
    assert len(logprobs["token_logprobs"]) == len(logprobs["tokens"]) == 12
    assert all(
        isinstance(x, float) and math.isfinite(x) and x <= 0 for x in logprobs["token_logprobs"]
    )
    # top_logprobs holds the top-1 and the sampled token: one or two entries per position.
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    # The same seed samples the same tokens.
    assert complete(client, vllm_server, temperature=1.0, seed=11, **body)["token_ids"] == ids
    # return_tokens_as_token_ids names each token by id in logprobs.tokens.
    as_ids = complete(
        client, vllm_server, temperature=1.0, seed=11, return_tokens_as_token_ids=True, **body
    )
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]


def test_stops_keep_their_tokens_in_token_ids(
    client: httpx.Client, vllm_server: VLLMServer, hf: tuple[Any, Any], prompt_ids: list[int]
) -> None:
    body = {"prompt": prompt_ids, "max_tokens": 20, "logprobs": 0, "return_token_ids": True}
    free = complete(client, vllm_server, seed=3, **body)["token_ids"]
    # A stop token id: the last id, named in stop_reason.
    by_id = complete(client, vllm_server, seed=3, stop_token_ids=[free[5]], **body)
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", free[5])
    assert by_id["token_ids"] == free[:6]
    assert len(by_id["logprobs"]["token_logprobs"]) == 6
    # A stop string: the text is cut before it, but token_ids keep every token sampled,
    # the one that completed the string included, so the text is no source of the ids.
    stop = hf[1].decode(free[10:12])
    by_text = complete(client, vllm_server, seed=3, stop=[stop], **body)
    assert (by_text["finish_reason"], by_text["stop_reason"]) == ("stop", stop)
    assert free[: len(by_text["token_ids"])] == by_text["token_ids"]
    assert hf[1].decode(by_text["token_ids"]).startswith(by_text["text"] + stop)
    # The eos: the last id, stop_reason None, not in the text. allowed_token_ids masks after
    # the logprobs are taken, so this one is the model's own, not 0.0.
    eos = hf[1].convert_tokens_to_ids("<|im_end|>")
    at_eos = complete(client, vllm_server, seed=3, allowed_token_ids=[eos], **body)
    assert (at_eos["finish_reason"], at_eos["stop_reason"], at_eos["text"]) == ("stop", None, "")
    assert at_eos["token_ids"] == [eos]
    model = teacher_forced(hf, prompt_ids, [eos])[0]
    assert abs(at_eos["logprobs"]["token_logprobs"][0] - model) < 1e-3
    # max_tokens null (or left out) means 16 tokens, not up to the context length.
    unbounded = complete(
        client, vllm_server, seed=3, prompt=prompt_ids, max_tokens=None, return_token_ids=True
    )
    assert len(unbounded["token_ids"]) == 16


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_are_the_models_own_at_any_temperature(
    client: httpx.Client,
    vllm_server: VLLMServer,
    hf: tuple[Any, Any],
    prompt_ids: list[int],
    temperature: float,
) -> None:
    choice = complete(
        client,
        vllm_server,
        prompt=prompt_ids,
        max_tokens=24,
        logprobs=1,
        return_token_ids=True,
        temperature=temperature,
        seed=5,
    )
    reference = teacher_forced(hf, prompt_ids, choice["token_ids"])
    error = max(
        abs(a - b) for a, b in zip(reference, choice["logprobs"]["token_logprobs"], strict=True)
    )
    print(f"temperature {temperature}: max |vLLM - transformers| logprob = {error:.2e}")
    assert error < 1e-3


def test_guided_decoding_makes_a_random_model_call_a_tool(
    client: httpx.Client, vllm_server: VLLMServer, hf: tuple[Any, Any], prompt_ids: list[int]
) -> None:
    tokenizer = hf[1]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    choice = complete(
        client,
        vllm_server,
        prompt=prompt_ids,
        max_tokens=96,
        logprobs=1,
        return_token_ids=True,
        temperature=1.0,
        seed=3,
        structured_outputs={"regex": ECHO_CALL},
    )
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert re.fullmatch(ECHO_CALL, choice["text"]), choice["text"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    # The eos is the last sampled id, and is not in the text (it is a special token).
    assert ids[-1] == eos
    assert tokenizer.decode(ids[:-1]) == choice["text"]
    assert len(logprobs) == len(ids)
    # The returned logprobs are those of the masked distribution: where the grammar allows
    # one token only (the eos after the call), it is certain.
    assert logprobs[-1] == 0.0
    raw = teacher_forced(hf, prompt_ids, ids)
    print(f"eos logprob: vLLM {logprobs[-1]}, model {raw[-1]:.3f}")
    assert raw[-1] < -0.1
    assert all(masked >= model - 1e-4 for masked, model in zip(logprobs, raw, strict=True))


def test_chat_required_tool_choice_returns_prompt_and_completion_ids(
    client: httpx.Client, vllm_server: VLLMServer, hf: tuple[Any, Any], prompt_ids: list[int]
) -> None:
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": vllm_server.model,
            "messages": MESSAGES,
            "tools": [ECHO_TOOL],
            "tool_choice": "required",
            "max_tokens": 96,
            "logprobs": True,
            "top_logprobs": 1,
            "return_token_ids": True,
            "seed": 1,
            # Otherwise the grammar lets a random model chain calls until max_tokens.
            "parallel_tool_calls": False,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    # Unlike completions, chat puts the prompt's ids on the response, not on the choice.
    prompt = body["prompt_token_ids"]
    # vLLM renders the chat as transformers does, tools included.
    rendered = hf[1].apply_chat_template(
        MESSAGES, tools=[ECHO_TOOL], add_generation_prompt=True, return_dict=True
    )
    assert prompt == list(rendered["input_ids"])
    assert len(prompt) > len(prompt_ids)
    ids = choice["token_ids"]
    assert len(choice["logprobs"]["content"]) == len(ids) > 0
    assert ids[-1] == hf[1].convert_tokens_to_ids("<|im_end|>")
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == ["echo"]
    assert re.fullmatch("[a-z]{1,8}", json.loads(calls[0]["function"]["arguments"])["text"])
