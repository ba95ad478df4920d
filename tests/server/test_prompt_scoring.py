"""Prompt logprobs over HTTP (issue 13), as lm-eval's loglikelihood tasks ask for them: `echo` +
`logprobs` lead the choice's logprobs with the prompt's (the first null), `max_tokens: 0` scores
the prompt only, and vLLM's `prompt_logprobs` gives the per-token maps. Values are compared with
transformers over the same tiny checkpoint in float32."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.server.tiny_server import MODEL, TinyServer, tiny_server

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    # A small token budget: the prompt is scored across several chunked-prefill steps.
    with tiny_server(tmp_path_factory.mktemp("scoring"), max_num_batched_tokens=16) as running:
        yield running


@pytest.fixture(scope="module")
def reference(server: TinyServer) -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' float32 log-softmax over it (row p scores token p + 1)."""
    from transformers import AutoModelForCausalLM

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(str(server.checkpoint), dtype=torch.float32).eval()
    with torch.inference_mode():
        return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def complete(server: TinyServer, **body: object) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_echo_with_logprobs_leads_with_the_prompts(server, reference):
    ids, logprobs = reference
    choice = complete(server, echo=True, logprobs=2, max_tokens=1, temperature=0)["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = [float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp["tokens"][:len(ids)]) == PROMPT
    assert lp["text_offset"][:3] == [0, 1, 2]  # one byte per token in this checkpoint
    for p in range(1, len(ids)):
        top = lp["top_logprobs"][p]
        assert max(top.values()) == pytest.approx(float(logprobs[p - 1].max()), abs=1e-4)
        assert len(top) in (2, 3)  # the top 2, plus the prompt token when it is not among them
    # The generated token's logprob comes from the last prompt position.
    generated = lp["tokens"][-1]
    assert choice["text"] == PROMPT + generated


def test_max_tokens_zero_scores_the_prompt_only(server, reference):
    ids, logprobs = reference
    body = complete(server, echo=True, logprobs=1, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert sum(choice["logprobs"]["token_logprobs"][1:]) == pytest.approx(
        sum(float(logprobs[p - 1, ids[p]]) for p in range(1, len(ids))), abs=1e-3)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)


def test_vllm_prompt_logprobs_maps(server, reference):
    ids, logprobs = reference
    choice = complete(server, prompt_logprobs=3, max_tokens=2)["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for p in range(1, len(ids)):
        entry = scored[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(float(logprobs[p - 1, ids[p]]), abs=1e-4)
        assert entry["rank"] == int((logprobs[p - 1] > logprobs[p - 1, ids[p]]).sum()) + 1
        top_ids = logprobs[p - 1].topk(3).indices.tolist()
        assert set(map(str, top_ids)) <= set(scored[p])
    assert choice["text"] and choice["logprobs"] is None


def test_repeated_prompt_is_scored_again_despite_the_prefix_cache(server):
    first = complete(server, echo=True, logprobs=0, max_tokens=1, temperature=0)["choices"][0]["logprobs"]
    again = complete(server, echo=True, logprobs=0, max_tokens=1, temperature=0)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(first["token_logprobs"], abs=1e-5)


def test_streamed_echo_with_logprobs_sends_the_prompt_with_its_logprobs_first(server, reference):
    ids, _ = reference
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    first = events[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) >= len(ids) + 1
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(ids) + 3
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[len(ids)] == len(PROMPT)


def test_tokenizer_info_as_vllm_serves_it(server):
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] is None
    assert "im_start" in info["chat_template"] and info["model_max_length"] == 512
