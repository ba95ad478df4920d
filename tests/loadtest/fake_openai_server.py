"""A small OpenAI-compatible streaming server for the load-test client's tests.

It streams `max_tokens` tokens with injected, known delays, and can fail on purpose (an HTTP
status, a dropped connection, a hang) as a per-request `Behaviour` chosen by the test. It runs
uvicorn in a thread on a socket bound to 127.0.0.1 port 0, so it needs no free-port guessing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass(frozen=True)
class Behaviour:
    ttft_s: float = 0.0  # delay before the first token
    itl_s: float = 0.0  # delay before each later token
    status: int = 200  # >= 400: answer with this status and no stream
    disconnect_after: int | None = None  # drop the connection after this many tokens
    tokens_per_chunk: int = 1  # >1: several usage tokens per streamed chunk
    send_usage: bool = True


class _Dropped(Exception):
    """Raised inside the stream so uvicorn aborts the response mid-body."""


class FakeOpenAIServer:
    def __init__(self, behaviour: Callable[[int, dict[str, Any]], Behaviour] = lambda i, body: Behaviour()) -> None:
        self.behaviour = behaviour
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        async def generate(request: Request, is_chat: bool) -> Any:
            body = await request.json()
            index = len(self.bodies)
            self.bodies.append(body)
            plan = self.behaviour(index, body)
            if plan.status >= 400:
                return JSONResponse({"error": {"message": "injected failure"}}, status_code=plan.status)
            return StreamingResponse(self._stream(body, plan, is_chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            return await generate(request, is_chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await generate(request, is_chat=True)

        return app

    async def _stream(self, body: dict[str, Any], plan: Behaviour, is_chat: bool) -> AsyncIterator[str]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            prompt = body["messages"][-1]["content"] if is_chat else body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            max_tokens = int(body["max_tokens"])
            sent = 0
            while sent < max_tokens:
                if plan.disconnect_after is not None and sent >= plan.disconnect_after:
                    raise _Dropped()
                await asyncio.sleep(plan.ttft_s if sent == 0 else plan.itl_s)
                n = min(plan.tokens_per_chunk, max_tokens - sent)
                sent += n
                text = " tok" * n
                choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            if plan.send_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1

    def __enter__(self) -> FakeOpenAIServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake OpenAI server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(timeout=10)
