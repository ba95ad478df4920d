"""The probes SGLang Model Gateway makes of a worker, answered with the replica's real values."""

from __future__ import annotations

import httpx
import pytest

from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import MODEL, FakeEngine

pytestmark = pytest.mark.anyio


def _client(engine: FakeEngine | None, settings: ServerSettings | None = None) -> httpx.AsyncClient:
    app = build_app(engine, settings or ServerSettings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=10)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
async def test_server_info_names_the_served_model_and_its_limits(path: str) -> None:
    engine = FakeEngine(max_model_len=96, max_num_seqs=3)
    async with _client(engine) as http:
        info = (await http.get(path)).json()
    # The gateway takes the model id it routes by from served_model_name.
    assert info["served_model_name"] == MODEL
    assert info["max_model_len"] == 96
    assert info["block_size"] == info["page_size"] == 16
    assert info["max_total_tokens"] == 64 * 16
    assert info["max_running_requests"] == 3
    # A path here would make the gateway load (or download) a tokenizer of its own.
    assert "model_path" not in info and "tokenizer_path" not in info


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
async def test_model_info_reports_the_architecture(path: str) -> None:
    async with _client(FakeEngine()) as http:
        info = (await http.get(path)).json()
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert info["model_type"] == "llama"
    assert info["is_generation"] is True
    assert (info["num_attention_heads"], info["num_key_value_heads"]) == (4, 2)


async def test_get_load_reports_the_engines_load_in_sglangs_shape() -> None:
    engine = FakeEngine()
    async with _client(engine) as http:
        assert (await http.get("/get_load")).json() == [
            {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        engine.active.update({"a", "b"})  # the fake holds one KV block per active request
        # The gateway sums num_tokens over the list: the tokens this replica's KV cache holds.
        assert (await http.get("/get_load")).json() == [
            {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 2 * 16}]


async def test_probes_answer_503_while_the_model_loads() -> None:
    async with _client(None) as http:
        for path in ("/server_info", "/model_info", "/get_load"):
            response = await http.get(path)
            assert response.status_code == 503, path
            assert "loading" in response.json()["error"]["message"]


async def test_probes_need_the_api_key_like_v1_models() -> None:
    async with _client(FakeEngine(), settings=ServerSettings(api_key="secret")) as http:
        assert (await http.get("/server_info")).status_code == 401
        authorized = await http.get("/server_info", headers={"Authorization": "Bearer secret"})
        assert authorized.status_code == 200
