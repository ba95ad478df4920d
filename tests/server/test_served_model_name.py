"""A model given as a path is served under its file stem (a folder under its name), so clients of
a container that mounts `/models/x.gguf` ask for "x"; --served-model-name still wins."""

from __future__ import annotations

import httpx
import pytest

from kvserve.engine.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine


@pytest.mark.parametrize("model,name", [
    ("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ("/models/llama-3-8b.Q4_K_M.gguf", "llama-3-8b.Q4_K_M"),
    ("models/Qwen2-0.5B/", "Qwen2-0.5B"),
])
def test_default_served_name(model: str, name: str) -> None:
    assert EngineConfig(model=model).model_name == name
    assert EngineConfig(model=model, served_model_name="mine").model_name == "mine"


@pytest.mark.anyio
async def test_a_mounted_model_is_listed_and_served_under_its_stem() -> None:
    app = build_app(FakeEngine(model="/models/tiny-llama.gguf"), ServerSettings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        listed = (await client.get("/v1/models")).json()["data"][0]
        answer = await client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "a", "max_tokens": 1})
    assert listed["id"] == "tiny-llama" and listed["root"] == "/models/tiny-llama.gguf"
    assert answer.status_code == 200 and answer.json()["model"] == "tiny-llama"
