"""What real clients send (issue 13): unknown top-level fields are ignored, logged once and listed
in a response header, on both endpoints, streamed or not; known fields keep their checks."""

from __future__ import annotations

import logging

import httpx
import pytest

from kvserve.server.ignored_fields import IGNORED_FIELDS_HEADER
from tests.server.sse import parse_sse

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body"), [
    (C, {"prompt": "hello", "max_tokens": 3}),
    (CHAT, {"messages": USER, "max_tokens": 3}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_fields_are_ignored_and_listed(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture,
                                                     path: str, body: dict, stream: bool) -> None:
    plain = await client.post(path, json={**body, "stream": stream})
    # SGLang's router adds no_stop_trim; an arbitrary vendor field stands for the rest.
    with caplog.at_level(logging.WARNING, logger="kvserve.server.ignored_fields"):
        tolerant = await client.post(path, json={**body, "stream": stream, "no_stop_trim": True,
                                                 "vendor_hint": {"x": 1}})
    assert tolerant.status_code == 200, tolerant.text
    assert tolerant.headers[IGNORED_FIELDS_HEADER] == "no_stop_trim, vendor_hint"
    assert IGNORED_FIELDS_HEADER not in plain.headers
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no_stop_trim" in warnings[0].getMessage()
    if not stream:
        # Ignoring changes nothing about the answer itself.
        assert [c.get("text", c.get("message")) for c in tolerant.json()["choices"]] == \
            [c.get("text", c.get("message")) for c in plain.json()["choices"]]


async def test_many_unknown_fields_are_listed_in_bounded_space(client: httpx.AsyncClient) -> None:
    made_up = {f"field_{i:05d}": i for i in range(10_000)} | {"x" * 10_000: 1}
    response = await client.post(C, json={"prompt": "a", "max_tokens": 1, **made_up})
    assert response.status_code == 200
    listed = response.headers[IGNORED_FIELDS_HEADER]
    assert listed.startswith("field_00000, field_00001, ") and listed.endswith(" (and 9985 more)")
    assert len(listed) < 1000


async def test_openai_no_effect_fields_are_not_reported(client: httpx.AsyncClient) -> None:
    response = await client.post(C, json={"prompt": "a", "max_tokens": 1, "store": False, "metadata": {"k": "v"}})
    assert response.status_code == 200
    assert IGNORED_FIELDS_HEADER not in response.headers


@pytest.mark.parametrize(("path", "body"), [
    (C, {"prompt": "hello", "n": 2}),
    (CHAT, {"messages": USER}),
], ids=["completions", "chat"])
async def test_continuous_usage_stats_put_usage_on_every_chunk(client: httpx.AsyncClient, path: str,
                                                               body: dict) -> None:
    """What guidellm sends: usage on each chunk, counting the completion tokens so far."""
    request = {**body, "max_tokens": 4, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = await client.post(path, json=request)
    assert response.status_code == 200, response.text
    chunks = parse_sse(response.text)
    with_choices = [c for c in chunks if c["choices"] and c["choices"][0].get("delta", {}).get("role") is None]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert counts == sorted(counts) and counts[0] >= 1
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in with_choices}
    final = chunks[-1]
    assert final["choices"] == [] and prompt_tokens == {final["usage"]["prompt_tokens"]}
    assert counts[-1] == final["usage"]["completion_tokens"] == 4 * body.get("n", 1)


async def test_usage_stays_on_the_last_chunk_without_continuous_stats(client: httpx.AsyncClient) -> None:
    request = {"prompt": "hello", "max_tokens": 3, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    chunks = parse_sse((await client.post(C, json=request)).text)
    assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


@pytest.mark.parametrize("path,body", [(C, {"prompt": "a"}), (CHAT, {"messages": USER})], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, None])
async def test_stream_options_without_stream_is_rejected(client: httpx.AsyncClient, path: str, body: dict,
                                                         stream: bool | None) -> None:
    request = {**body, "stream_options": {"include_usage": True}}
    if stream is not None:
        request["stream"] = stream
    response = await client.post(path, json=request)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_options"
