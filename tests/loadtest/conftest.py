from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from kvserve.loadtest.client import Endpoint
from kvserve.loadtest.datasets import BenchRequest
from kvserve.loadtest.records import RunResult
from kvserve.loadtest.runner import LoadConfig, run_load

from .fake_openai_server import MODEL, Behaviour, FakeOpenAIServer

BehaviourFn = Callable[[int, dict[str, Any]], Behaviour]


@pytest.fixture
def fake_server() -> Callable[..., Any]:
    """`with fake_server(behaviour) as server:` runs a fake OpenAI server on 127.0.0.1."""

    @contextmanager
    def start(behaviour: BehaviourFn = lambda i, body: Behaviour()) -> Iterator[FakeOpenAIServer]:
        with FakeOpenAIServer(behaviour) as server:
            yield server

    return start


def endpoint_for(server: FakeOpenAIServer, **overrides: Any) -> Endpoint:
    options: dict[str, Any] = {"base_url": server.base_url, "model": MODEL, "request_timeout_s": 30.0}
    options.update(overrides)
    return Endpoint(**options)


def run(endpoint: Endpoint, requests: Sequence[BenchRequest], **load: Any) -> RunResult:
    load.setdefault("num_warmups", 0)
    load.setdefault("show_progress", False)
    return asyncio.run(run_load(endpoint, requests, LoadConfig(**load)))
