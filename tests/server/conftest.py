"""Fixtures for server tests: the app over a fake engine, reached in-process through httpx."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings()


@pytest.fixture
async def client(engine: FakeEngine, settings: ServerSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, settings)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", timeout=10) as http:
        yield http


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
