"""One request against scripted responses (httpx.MockTransport): parsing, counting, error kinds."""

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from kvserve.loadtest.client import Endpoint, EndpointError, send_request
from kvserve.loadtest.datasets import BenchRequest
from kvserve.loadtest.records import ErrorKind, RequestRecord

TEXT = BenchRequest(prompt="one two three", prompt_len=3, output_len=3)


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text}]}


def send(handler: Callable[[httpx.Request], httpx.Response], endpoint: Endpoint | None = None,
         request: BenchRequest = TEXT) -> RequestRecord:
    endpoint = endpoint or Endpoint(base_url="http://127.0.0.1:1", model="m", request_timeout_s=5)

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await send_request(http, endpoint, request)

    return asyncio.run(go())


def test_counts_chunks_and_prefers_server_usage() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    body = sse(text_chunk("a"), text_chunk(""), text_chunk("b"), text_chunk("c"), usage, "[DONE]")
    record = send(lambda req: httpx.Response(200, content=body))
    assert record.success
    assert (record.prompt_len, record.output_tokens, record.content_chunks) == (4, 3, 3)
    assert len(record.itl_s) == 2 and record.generated_text == "abc"
    assert not record.usage_mismatch
    assert 0 <= record.ttft_s <= record.e2e_s


def test_without_usage_the_chunk_count_and_dataset_estimate_are_used() -> None:
    record = send(lambda req: httpx.Response(200, content=sse(text_chunk("a"), text_chunk("b"), "[DONE]")))
    assert (record.prompt_len, record.output_tokens, record.usage_completion_tokens) == (3, 2, None)


def test_usage_that_disagrees_with_the_stream_is_flagged() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    record = send(lambda req: httpx.Response(200, content=sse(text_chunk("ab"), text_chunk("cd"), usage, "[DONE]")))
    assert record.success and record.usage_mismatch and record.output_tokens == 4


@pytest.mark.parametrize(
    "body, kind",
    [
        (sse(text_chunk("a")), ErrorKind.DISCONNECT),  # no [DONE]
        (sse("{oops", "[DONE]"), ErrorKind.BAD_RESPONSE),
        (sse(text_chunk("a"), {"error": {"message": "boom"}}, "[DONE]"), ErrorKind.STREAM_ERROR),
        (sse("[DONE]"), ErrorKind.EMPTY_OUTPUT),
    ],
)
def test_malformed_streams_are_classified(body: bytes, kind: ErrorKind) -> None:
    record = send(lambda req: httpx.Response(200, content=body))
    assert not record.success and record.error is kind and record.error_type == kind.value


def test_http_errors_are_labelled_by_status() -> None:
    record = send(lambda req: httpx.Response(429, json={"error": "slow down"}))
    assert record.error_type == "http_429" and "slow down" in record.error_message


def test_transport_failures_are_classified() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    def drop(req: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed")

    assert send(refuse).error is ErrorKind.CONNECT
    assert send(drop).error is ErrorKind.DISCONNECT


def test_chat_requests_send_messages_and_read_deltas() -> None:
    seen: list[dict] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(json.loads(req.content))
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        return httpx.Response(200, content=sse(chunk, chunk, "[DONE]"))

    endpoint = Endpoint(base_url="http://127.0.0.1:1/v1", model="m", path="/v1/chat/completions",
                        ignore_eos=True, api_key="k", extra_body={"top_k": 1})
    record = send(handler, endpoint)
    assert record.output_tokens == 2 and record.generated_text == "hihi"
    body = seen[0]
    assert body["messages"] == [{"role": "user", "content": "one two three"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 3 and body["max_tokens"] == 3
    assert body["top_k"] == 1
    assert endpoint.url == "http://127.0.0.1:1/v1/chat/completions"
    assert endpoint.headers == {"Authorization": "Bearer k"}


def test_completions_send_token_ids_as_a_list() -> None:
    endpoint = Endpoint(base_url="http://h:1", model="m")
    body = endpoint.body(BenchRequest(prompt=(5, 6, 7), prompt_len=3, output_len=2))
    assert body["prompt"] == [5, 6, 7] and "ignore_eos" not in body


def test_incompatible_prompts_and_bad_options_fail_early() -> None:
    chat = Endpoint(base_url="http://h:1", model="m", path="/v1/chat/completions")
    with pytest.raises(EndpointError, match="token-id prompts"):
        chat.check_prompt(BenchRequest(prompt=(1, 2), prompt_len=2, output_len=1))
    with pytest.raises(EndpointError, match="chat/completions"):
        Endpoint(base_url="http://h:1", model="m").check_prompt(
            BenchRequest(prompt=({"role": "user", "content": "x"},), prompt_len=1, output_len=1))
    with pytest.raises(EndpointError, match="--base-url"):
        Endpoint(base_url="h:1", model="m")
    with pytest.raises(EndpointError, match="--endpoint"):
        Endpoint(base_url="http://h:1", model="m", path="/v1/embeddings")
