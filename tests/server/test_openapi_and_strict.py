"""/openapi.json describes every request body (the pydantic models) and the error body; request
fields are typed strictly, as in OpenAI's API (no bool-as-int, no int-as-bool, no string numbers)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.anyio


async def test_openapi_describes_each_request_body(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    expected = {"/v1/completions": ("CompletionRequest", "prompt"),
                "/v1/chat/completions": ("ChatCompletionRequest", "messages"),
                "/tokenize": ("TokenizeRequest", "prompt"),
                "/detokenize": ("DetokenizeRequest", "tokens")}
    for path, (model, field) in expected.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}"
        assert field in schemas[model]["properties"]
    # nested models resolve inside the document
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["$ref"] == "#/components/schemas/ChatMessage"
    error = document["paths"]["/v1/completions"]["post"]["responses"]["4XX"]
    assert error["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorResponse"
    assert "422" not in document["paths"]["/v1/completions"]["post"]["responses"]


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [False]}, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"prompt": [True, 2]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": 1}, "stream": True}, "stream_options"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 0}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": 0},
     "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": 1}, "logprobs"),
])
async def test_loose_coercions_are_rejected(client: httpx.AsyncClient, path: str, body: dict, param: str) -> None:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param)


async def test_integers_still_pass_for_float_fields(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 1,
                                                         "logit_bias": {"5": 1}})
    assert response.status_code == 200, response.text
