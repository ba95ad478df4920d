"""The app over the real engine and SmolLM2, through real sockets, with httpx and the official
`openai` client. One engine for the module (loading takes a while); a small KV pool."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.serve import metrics_info
from kvserve.server.settings import ServerSettings
from tests.server.live_server import live_server, wait_until
from tests.server.sse import parse_sse

pytestmark = pytest.mark.slow

# Prefix caching on (the default): several tests repeat a prompt, so they also cover prefix hits.
CONFIG = EngineConfig(dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=512, max_num_seqs=32,
                      served_model_name="smol")


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_config(CONFIG)
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine: AsyncEngine) -> Iterator[str]:
    app = build_app(engine, ServerSettings(), metrics=ServerMetrics("smol", metrics_info(CONFIG)))
    with live_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def blocks_in_use(engine: AsyncEngine) -> int:
    return engine.engine.scheduler.kv_cache_manager.stats().blocks_used


def test_httpx_completion_stream_equals_non_stream(url: str) -> None:
    request = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    whole = httpx.post(f"{url}/v1/completions", json=request, timeout=120).json()
    chunks = parse_sse(httpx.post(f"{url}/v1/completions", json={**request, "stream": True}, timeout=120).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 8 and whole["choices"][0]["finish_reason"] == "length"


def test_openai_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(model="smol", prompt="1, 2, 3,", max_tokens=6, temperature=0, n=2,
                                       logprobs=2, echo=False)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.choices[0].text == result.choices[1].text  # greedy: both completions agree
    assert len(result.choices[0].logprobs.tokens) == 6
    assert all(len(top) >= 1 for top in result.choices[0].logprobs.top_logprobs)
    assert result.usage.completion_tokens == 12
    echoed = client.completions.create(model="smol", prompt="Hello", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Hello")


def test_openai_stop_string_is_honoured_and_not_leaked(client: openai.OpenAI) -> None:
    free = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text.strip()[2:4] if len(text.strip()) > 4 else text[-2:]
    stopped = client.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                        stop=[stop])
    assert stop not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == "stop"
    assert text.startswith(stopped.choices[0].text)


def test_openai_chat_stream_and_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert whole.choices[0].message.role == "assistant"
    assert len(whole.choices[0].logprobs.content) == whole.usage.completion_tokens
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_disconnects_leave_no_blocks_in_use(url: str, engine: AsyncEngine) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(3):
            with http.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                              "stream": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
    wait_until(lambda: engine.num_unfinished_requests == 0 and blocks_in_use(engine) == 0, timeout=30)


def test_32_concurrent_greedy_streams_equal_solo_runs(url: str, engine: AsyncEngine) -> None:
    prompts = [f"Item {i}: the number {i} written in words is" for i in range(32)]

    def request(prompt: str) -> dict:
        return {"prompt": prompt, "max_tokens": 6, "temperature": 0}

    solo = [httpx.post(f"{url}/v1/completions", json=request(p), timeout=120).json()["choices"][0]["text"]
            for p in prompts]

    async def run_all() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            async def one(prompt: str) -> str:
                response = await http.post("/v1/completions", json={**request(prompt), "stream": True})
                return "".join(c["choices"][0]["text"] for c in parse_sse(response.text))

            return await asyncio.gather(*(one(p) for p in prompts))

    together = asyncio.run(run_all())
    assert together == solo, [i for i, (a, b) in enumerate(zip(together, solo)) if a != b]
    wait_until(lambda: blocks_in_use(engine) == 0, timeout=30)
