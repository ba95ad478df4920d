"""Send one streaming request to an OpenAI-compatible endpoint and time every chunk.

TTFT is the time from send to the first chunk that carries text; each later text chunk adds one
inter-token gap; e2e ends at `data: [DONE]`. Token counts come from the final usage chunk
(`stream_options.include_usage`), and are checked against the number of text chunks. The stream
goes through http_stream.StreamClient (it says why not httpx); httpx reads /v1/models only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import httpx

from .datasets import BenchRequest
from .http_stream import ConnectFailed, StreamClient, StreamError, StreamResponse
from .records import ErrorKind, RequestRecord

CHAT_SUFFIX = "/chat/completions"


class EndpointError(ValueError):
    """The endpoint options are inconsistent; the message says which flag to change."""


@dataclass(frozen=True)
class Endpoint:
    """Where to send requests and the fixed part of every request body."""

    base_url: str
    model: str
    path: str = "/v1/completions"
    api_key: str | None = None
    ignore_eos: bool = False
    request_timeout_s: float = 300.0
    temperature: float = 0.0
    extra_body: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise EndpointError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if not self.path.startswith("/") or not self.path.endswith(("/completions", CHAT_SUFFIX)):
            raise EndpointError(f"--endpoint must be a /v1/completions or /v1/chat/completions path, got {self.path!r}")
        if not self.model:
            raise EndpointError("--model must name the served model")
        if not self.request_timeout_s > 0:
            raise EndpointError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        object.__setattr__(self, "extra_body", MappingProxyType(dict(self.extra_body)))

    @property
    def is_chat(self) -> bool:
        return self.path.endswith(CHAT_SUFFIX)

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        # Accept both http://host:port and the OpenAI-SDK style http://host:port/v1.
        if base.endswith("/v1") and self.path.startswith("/v1/"):
            base = base[: -len("/v1")]
        return base + self.path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def check_prompt(self, request: BenchRequest) -> None:
        """Fail before the run, not per request, when a prompt cannot go to this endpoint."""
        if self.is_chat and request.is_token_ids:
            raise EndpointError("token-id prompts need /v1/completions; use text prompts for chat endpoints")
        if not self.is_chat and request.is_messages:
            raise EndpointError("chat 'messages' need --endpoint /v1/chat/completions")

    def body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.is_chat:
            if request.is_messages:
                body["messages"] = [dict(m) for m in request.prompt]  # type: ignore[arg-type]
            else:
                body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = list(request.prompt) if request.is_token_ids else request.prompt
        if self.ignore_eos:
            # vLLM's extension (also read by kvserve and SGLang); min_tokens covers servers that
            # only honour that. Servers ignore fields they do not know.
            body["ignore_eos"] = True
            body["min_tokens"] = request.output_len
        body.update(self.extra_body)
        return body


async def _sse_data(response: StreamResponse) -> AsyncIterator[bytes]:
    """The payload of each `data:` line of a server-sent-event stream."""
    async for line in response.lines():
        if line.startswith(b"data:"):
            yield line[len(b"data:"):].strip()


def _chunk_text(chunk: Mapping[str, Any], is_chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if is_chat:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choices[0].get("text") or ""


class _Failure(Exception):
    def __init__(self, kind: ErrorKind, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status_code = status_code


async def send_request(http: StreamClient, endpoint: Endpoint, request: BenchRequest) -> RequestRecord:
    """Send `request` and return its record; failures are recorded, never raised."""
    body = json.dumps(endpoint.body(request)).encode()
    start = time.perf_counter()
    chunk_times: list[float] = []
    text_parts: list[str] = []
    usage: dict[str, Any] = {}

    async def stream() -> None:
        async with http.post(endpoint.url, body, endpoint.headers) as response:
            if response.status_code >= 400:
                detail = (await response.read()).decode("utf-8", "replace")[:300]
                raise _Failure(ErrorKind.HTTP_STATUS, detail, response.status_code)
            async for data in _sse_data(response):
                if data == b"[DONE]":
                    return
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise _Failure(ErrorKind.BAD_RESPONSE, f"chunk is not JSON: {data[:200]!r}") from e
                if not isinstance(chunk, dict):
                    raise _Failure(ErrorKind.BAD_RESPONSE, f"chunk is not an object: {data[:200]!r}")
                if "error" in chunk:
                    raise _Failure(ErrorKind.STREAM_ERROR, json.dumps(chunk["error"])[:300])
                if chunk.get("usage"):
                    usage.update(chunk["usage"])
                if text := _chunk_text(chunk, endpoint.is_chat):
                    chunk_times.append(now)
                    text_parts.append(text)
            raise _Failure(ErrorKind.DISCONNECT, "stream ended without 'data: [DONE]'")

    try:
        await asyncio.wait_for(stream(), timeout=endpoint.request_timeout_s)
    except _Failure as f:
        return _failed(start, request, f.kind, str(f), f.status_code)
    except asyncio.TimeoutError:
        return _failed(start, request, ErrorKind.TIMEOUT, f"no answer within {endpoint.request_timeout_s} s")
    except ConnectFailed as e:
        return _failed(start, request, ErrorKind.CONNECT, f"cannot reach {endpoint.url}: {e}")
    except StreamError as e:  # dropped mid-answer, or not HTTP
        return _failed(start, request, ErrorKind.DISCONNECT, str(e))
    except OSError as e:  # a write to a broken connection, a TLS error mid-stream
        return _failed(start, request, ErrorKind.TRANSPORT, repr(e))
    end = time.perf_counter()

    if not chunk_times:
        return _failed(start, request, ErrorKind.EMPTY_OUTPUT, "the stream carried no generated text")
    usage_tokens = usage.get("completion_tokens")
    usage_tokens = usage_tokens if isinstance(usage_tokens, int) else None
    prompt_tokens = usage.get("prompt_tokens")
    return RequestRecord(
        start_s=start,
        prompt_len=prompt_tokens if isinstance(prompt_tokens, int) else request.prompt_len,
        output_tokens=usage_tokens if usage_tokens is not None else len(chunk_times),
        content_chunks=len(chunk_times),
        usage_completion_tokens=usage_tokens,
        ttft_s=chunk_times[0] - start,
        itl_s=tuple(b - a for a, b in zip(chunk_times, chunk_times[1:])),
        e2e_s=end - start,
        generated_text="".join(text_parts),
    )


def _failed(start: float, request: BenchRequest, kind: ErrorKind, message: str, status: int | None = None) -> RequestRecord:
    return RequestRecord(
        start_s=start,
        prompt_len=request.prompt_len,
        e2e_s=time.perf_counter() - start,
        error=kind,
        status_code=status,
        error_message=message,
    )


async def discover_model(http: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model the server lists at /v1/models, for runs without --model."""
    url = Endpoint(base_url=base_url, model="?").url.removesuffix("/completions") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await http.get(url, headers=headers)
        response.raise_for_status()
        models = response.json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise EndpointError(f"could not read the model name from {url} ({e!r}); pass --model") from e
