"""Schema-driven fuzzing: schemathesis generates requests (valid and invalid) from the app's own
/openapi.json and sends them to the real app over a fake engine. Every answer must be a non-5xx;
every 4xx must carry OpenAI's error body (Anthropic's on /v1/messages); afterwards the server is healthy and holds nothing."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine

ENGINE = FakeEngine(max_model_len=256, max_num_seqs=8)
METRICS = ServerMetrics(MODEL, {"model": MODEL})
APP = build_app(ENGINE, ServerSettings(), metrics=METRICS)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# Bounded: ~12 operations x this many examples each (positive and negative) keeps it under a minute.
MAX_EXAMPLES = 60


@pytest.mark.slow  # ~45 s on a loaded 2-core machine
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_and_openai_error_bodies(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        error = body["error"]
        # Anthropic's API answers in Anthropic's error shape; a wrong method (405) is the router's, app-wide.
        if case.path.startswith("/v1/messages") and response.status_code != 405:
            assert body.get("type") == "error" and set(error) == {"type", "message"}, response.text
        else:
            assert set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and error["message"]


@pytest.mark.anyio
async def test_after_fuzzing_the_server_is_healthy_and_holds_nothing() -> None:
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzzed") as client:
        assert (await client.get("/health")).status_code == 200
        metrics = (await client.get("/metrics")).text
        ok = await client.post("/v1/completions", json={"prompt": "still works", "max_tokens": 3})
    assert ok.status_code == 200
    assert ENGINE.active == set() and ENGINE.load.kv_blocks_used == 0
    assert f'kvserve_kv_cache_blocks{{model_name="{MODEL}",state="used"}} 0.0' in metrics
    assert f'kvserve_num_requests_running{{model_name="{MODEL}"}} 0.0' in metrics
    assert APP.state.serving.in_flight_requests == 0


@pytest.mark.anyio
async def test_unknown_field_names_outside_latin1_are_escaped_in_the_header() -> None:
    # Found by the fuzzer: a non-Latin-1 (or CR/LF) field name made the X-Ignored-Fields header unsendable.
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzzed") as client:
        response = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "Ā\r\nX-Evil": 1})
    assert response.status_code == 200
    assert response.headers["x-ignored-fields"] == "\\u0100\\u000d\\u000aX-Evil"
    assert "x-evil" not in response.headers


@pytest.mark.anyio
async def test_min_tokens_above_the_room_the_prompt_leaves_is_a_400() -> None:
    # Found by the fuzzer: max_tokens resolved from the context made SamplingParams raise (a 500).
    transport = httpx.ASGITransport(app=APP)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzzed") as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "min_tokens": 255})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "min_tokens"
