"""One request against scripted HTTP responses (a raw server on 127.0.0.1): parsing, counting, error kinds."""

import asyncio
import json
import socket

import pytest

from kvserve.loadtest.client import Endpoint, EndpointError, send_request
from kvserve.loadtest.datasets import BenchRequest
from kvserve.loadtest.http_stream import StreamClient
from kvserve.loadtest.records import ErrorKind, RequestRecord

from .raw_http_server import Answer, RawHttpServer, chunked, sized, sse

TEXT = BenchRequest(prompt="one two three", prompt_len=3, output_len=3)


def text_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text}]}


def send(answer: Answer, request: BenchRequest = TEXT, **endpoint: object) -> tuple[RequestRecord, RawHttpServer]:
    async def go() -> tuple[RequestRecord, RawHttpServer]:
        async with RawHttpServer(answer) as server, StreamClient() as http:
            options = {"base_url": server.base_url, "model": "m", "request_timeout_s": 5, **endpoint}
            return await send_request(http, Endpoint(**options), request), server

    return asyncio.run(go())


def stream_of(body: bytes, piece: int = 7) -> Answer:
    """A 200 event stream cut into `piece`-byte chunks, so events arrive split across reads."""
    return lambda i, request: chunked(200, *(body[at:at + piece] for at in range(0, len(body), piece)))


def test_counts_chunks_and_prefers_server_usage() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    body = sse(text_chunk("a"), text_chunk(""), text_chunk("b"), text_chunk("c"), usage, "[DONE]")
    record, _ = send(stream_of(body))
    assert record.success
    assert (record.prompt_len, record.output_tokens, record.content_chunks) == (4, 3, 3)
    assert len(record.itl_s) == 2 and record.generated_text == "abc"
    assert not record.usage_mismatch
    assert 0 <= record.ttft_s <= record.e2e_s


def test_crlf_lines_and_non_ascii_text_split_mid_character() -> None:
    body = sse(text_chunk("é€"), text_chunk("ok"), "[DONE]").replace(b"\n", b"\r\n")
    for piece in (1, 3, 5, len(body)):
        record, _ = send(stream_of(body, piece))
        assert record.success and record.generated_text == "é€ok" and record.output_tokens == 2


def test_without_usage_the_chunk_count_and_dataset_estimate_are_used() -> None:
    record, _ = send(stream_of(sse(text_chunk("a"), text_chunk("b"), "[DONE]")))
    assert (record.prompt_len, record.output_tokens, record.usage_completion_tokens) == (3, 2, None)


def test_usage_that_disagrees_with_the_stream_is_flagged() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    record, _ = send(stream_of(sse(text_chunk("ab"), text_chunk("cd"), usage, "[DONE]")))
    assert record.success and record.usage_mismatch and record.output_tokens == 4


@pytest.mark.parametrize(
    "body, kind",
    [
        (sse(text_chunk("a")), ErrorKind.DISCONNECT),  # no [DONE]
        (sse("{oops", "[DONE]"), ErrorKind.BAD_RESPONSE),
        (b"data: \xff\xfe\n\n" + sse("[DONE]"), ErrorKind.BAD_RESPONSE),  # not UTF-8
        (sse("[1, 2]", "[DONE]"), ErrorKind.BAD_RESPONSE),
        (sse(text_chunk("a"), {"error": {"message": "boom"}}, "[DONE]"), ErrorKind.STREAM_ERROR),
        (sse("[DONE]"), ErrorKind.EMPTY_OUTPUT),
    ],
)
def test_malformed_streams_are_classified(body: bytes, kind: ErrorKind) -> None:
    record, _ = send(stream_of(body))
    assert not record.success and record.error is kind and record.error_type == kind.value


def test_http_errors_are_labelled_by_status() -> None:
    record, _ = send(lambda i, body: sized(429, b'{"error": "slow down"}'))
    assert record.error_type == "http_429" and "slow down" in record.error_message


def test_an_unreachable_server_is_a_connect_error() -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> RequestRecord:
        async with StreamClient() as http:
            endpoint = Endpoint(base_url=f"http://127.0.0.1:{port}", model="m", request_timeout_s=5)
            return await send_request(http, endpoint, TEXT)

    record = asyncio.run(go())
    assert record.error is ErrorKind.CONNECT and str(port) in record.error_message


@pytest.mark.parametrize(
    "answer",
    [
        lambda i, body: None,  # closed without a byte
        lambda i, body: chunked(200, sse(text_chunk("a")))[:2],  # closed mid-body
        lambda i, body: [b"HTTP/1.1 200 X\r\ncontent-length: 100\r\n\r\n", b"data: {}"],  # short body
        lambda i, body: [b"SSH-2.0-OpenSSH\r\n\r\n"],  # not HTTP
    ],
)
def test_dropped_and_garbled_connections_are_disconnects(answer: Answer) -> None:
    record, _ = send(answer)
    assert record.error is ErrorKind.DISCONNECT and record.error_message


def test_a_server_that_never_answers_is_a_timeout_not_a_hang() -> None:
    def answer(i: int, body: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 X\r\ntransfer-encoding: chunked\r\n\r\n"]  # then silence, connection open

    async def go() -> RequestRecord:
        async with RawHttpServer(answer, keep_alive=True) as server, StreamClient() as http:
            endpoint = Endpoint(base_url=server.base_url, model="m", request_timeout_s=0.3)
            return await send_request(http, endpoint, TEXT)

    record = asyncio.run(go())
    assert record.error is ErrorKind.TIMEOUT


def test_chat_requests_send_messages_and_read_deltas() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    record, server = send(stream_of(sse(chunk, chunk, "[DONE]")), path="/v1/chat/completions",
                          ignore_eos=True, api_key="k", extra_body={"top_k": 1})
    assert record.output_tokens == 2 and record.generated_text == "hihi"
    head, raw_body = server.requests[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in head and f"Host: 127.0.0.1:{server.port}".encode() in head
    body = json.loads(raw_body)
    assert body["messages"] == [{"role": "user", "content": "one two three"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 3 and body["max_tokens"] == 3
    assert body["top_k"] == 1
    endpoint = Endpoint(base_url="http://127.0.0.1:1/v1", model="m", path="/v1/chat/completions", api_key="k")
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
