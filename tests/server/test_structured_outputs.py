"""Structured outputs over HTTP (issue 13): every spelling OpenAI and vLLM clients use constrains
the real engine's output (the tiny random model, so only the grammar makes the output valid),
streamed or not, on both endpoints; a constraint the grammar engine cannot compile is a 400
naming the field; unconstrained requests in the same batch are untouched."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest

from tests.server.sse import parse_sse
from tests.server.tiny_server import MODEL, TinyServer, tiny_server

PERSON = {
    "type": "object",
    "properties": {
        # Patterns rather than maxLength: the random byte-level model would otherwise fill strings
        # with stray bytes (xgrammar bounds characters, the detokenizer sees broken UTF-8).
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "active": {"type": "boolean"}},
                    "required": ["zip", "active"], "additionalProperties": False},
    },
    "required": ["name", "role", "tags", "address"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Give me a person."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyServer]:
    with tiny_server(tmp_path_factory.mktemp("structured")) as running:
        yield running


def post(server: TinyServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 300, **body}, timeout=120)


# xgrammar's JSON strings admit raw control characters, which a random model happily picks; the
# JSON stays well-formed apart from that, so it is parsed with strict=False.


def chat_text(server: TinyServer, body: dict) -> str:
    response = post(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chat_json_schema_outputs_validate(server, seed):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    text = chat_text(server, {"response_format": response_format, "temperature": 1.0, "seed": seed})
    jsonschema.validate(json.loads(text, strict=False), PERSON)


def test_json_object_gives_an_object(server):
    text = chat_text(server, {"response_format": {"type": "json_object"}, "temperature": 0.7, "seed": 3,
                              "max_tokens": 400})
    assert isinstance(json.loads(text, strict=False), dict)


@pytest.mark.parametrize(("field", "value", "check"), [
    ("guided_regex", r"[a-z]{3}-\d{2}", lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    ("guided_choice", ["red", "green", "blue \"sky\""], lambda t: t in ("red", "green", "blue \"sky\"")),
    ("guided_json", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 4},
     lambda t: 2 <= len(json.loads(t, strict=False)) <= 4 and all(0 <= v <= 9 for v in json.loads(t, strict=False))),
    ("guided_grammar", 'root ::= "yes" | "no" | "maybe"', lambda t: t in ("yes", "no", "maybe")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ("structured_outputs", {"regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
], ids=["guided_regex", "guided_choice", "guided_json", "guided_grammar", "so_choice", "so_regex"])
def test_vllm_spellings_on_completions(server, field, value, check):
    response = post(server, "/v1/completions", {"prompt": "Answer:", field: value, "temperature": 1.0, "seed": 5})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_streamed_json_schema_assembles_to_a_valid_object(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "stream": True, "seed": 4, "temperature": 1.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    chunks = parse_sse(response.text)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text, strict=False), PERSON)


def test_constrained_and_free_rows_share_a_batch(server):
    """n=3 completions with a choice constraint next to a free request at the same time: the
    free one is what it is alone (greedy), the constrained ones obey."""
    free = {"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = post(server, "/v1/completions", free).json()["choices"][0]["text"]
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(post, server, "/v1/completions",
                                  {"prompt": "Pick:", "n": 3, "guided_choice": ["alpha", "beta"], "seed": 9})
        together = pool.submit(post, server, "/v1/completions", free)
        assert together.result().json()["choices"][0]["text"] == alone
        assert {c["text"] for c in constrained.result().json()["choices"]} <= {"alpha", "beta"}


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
], ids=["bad schema", "bad regex", "bad grammar", "schema missing", "empty choice", "json text", "two constraints"])
def test_uncompilable_constraints_are_400_naming_the_field(server, body, param):
    response = post(server, "/v1/completions", {"prompt": "x", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    streamed = post(server, "/v1/completions", {"prompt": "x", "stream": True, **body})
    assert streamed.status_code == 400
