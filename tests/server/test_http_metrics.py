"""The HTTP middleware feeds ServerMetrics with route templates (not raw paths) and error codes."""

from __future__ import annotations

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine

pytestmark = pytest.mark.anyio


async def test_metrics_route_and_labels() -> None:
    metrics = ServerMetrics(MODEL, {"block_size": "16"})
    app = build_app(FakeEngine(), ServerSettings(), metrics=metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200
        assert (await client.post("/v1/completions", json={"prompt": ""})).status_code == 400
        assert (await client.get("/no/such/path/123")).status_code == 404
        response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'route="/v1/completions"' in text
    assert 'route="unmatched"' in text and "/no/such/path/123" not in text
    assert 'status="400"' in text or 'code="400"' in text
