"""vLLM's per-request `priority` and `cache_salt` on both generation endpoints: checked by the
engine's admission check, then handed to engine.generate with every prompt of the request."""

from __future__ import annotations

import httpx
import pytest

from kvserve.scheduler import SchedulingPolicy
from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio

C, CHAT = "/v1/completions", "/v1/chat/completions"
BODIES = {C: {"prompt": ["one", "two"], "max_tokens": 2},
          CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


async def post(engine: FakeEngine, path: str, **fields: object) -> httpx.Response:
    app = build_app(engine, ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as http:
        return await http.post(path, json={**BODIES[path], **fields})


@pytest.mark.parametrize("path", [C, CHAT])
async def test_priority_and_salt_reach_the_engine_for_every_prompt(path: str) -> None:
    engine = FakeEngine(scheduling_policy=SchedulingPolicy.PRIORITY)
    response = await post(engine, path, priority=-3, cache_salt="tenant-a")
    assert response.status_code == 200, response.text
    assert engine.started and all(engine.scheduling[r] == (-3, "tenant-a") for r in engine.started)


@pytest.mark.parametrize("path", [C, CHAT])
async def test_defaults_are_no_priority_and_no_salt(path: str) -> None:
    engine = FakeEngine()
    assert (await post(engine, path)).status_code == 200
    assert all(engine.scheduling[r] == (0, None) for r in engine.started)


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize(("fields", "param"), [({"priority": 1}, "priority"), ({"cache_salt": ""}, "cache_salt"),
                                               ({"priority": "high"}, "priority"), ({"cache_salt": 7}, "cache_salt")])
async def test_refused_values_name_the_field(path: str, fields: dict, param: str) -> None:
    engine = FakeEngine()  # fcfs: a priority would be ignored, so it is refused (as vLLM does)
    response = await post(engine, path, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.started == []
