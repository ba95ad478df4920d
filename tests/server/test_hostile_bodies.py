"""Hostile bodies at every POST route, over one real keep-alive HTTP connection to a real uvicorn
server with the real engine (tiny checkpoint: real tokenizer, chat template, grammar engine).

Each body is a valid one with one field replaced by something hostile (nesting past the parser's
own recursion limit, integers past Python's conversion limit, lone surrogates, NaN, ...), or a
whole body in an odd encoding. The server must answer every one below 500, with OpenAI's error
body for a 4xx, keep the same TCP connection open and usable, count no 5xx in /metrics, and stay
healthy. The routes are read from the app's own OpenAPI document, so a new POST route is fuzzed
without being listed here.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.config import EngineConfig
from kvserve.server.app import build_app
from kvserve.server.bounded_json import MAX_DEPTH
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from tests.server.fake_engine import FakeEngine
from tests.server.live_server import live_server
from tests.server.tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.slow

MODEL = "tiny"
BEYOND_RECURSION = 5000  # deeper than Python's json decoder can go (RecursionError near 1,000)
USER = [{"role": "user", "content": "hi"}]
# A valid body per known route; a route added later starts from the generic one, which has the
# fields most generation APIs share (its mutations still reach parsing and validation).
BASES: dict[str, dict] = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2, "stop": ["x"], "seed": 1},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2, "cache_salt": "tenant"},
    "/tokenize": {"prompt": "hello"},
    "/detokenize": {"tokens": [10, 11]},
}
GENERIC_BASE = {"model": MODEL, "prompt": "hello", "input": "hello", "messages": USER, "max_tokens": 2}
# Every POST route the app serves, from its own OpenAPI document.
POST_ROUTES = [path for path, operations in build_app(FakeEngine(), ServerSettings()).openapi()["paths"].items()
               if "post" in operations]


def _nested(depth: int, opener: str, closer: str, core: str = "") -> str:
    return opener * depth + core + closer * depth


# Raw JSON text put where a field's value goes (json.dumps cannot write most of these).
HOSTILE_VALUES: dict[str, str] = {
    "array nested past recursion": _nested(BEYOND_RECURSION, "[", "]"),
    "object nested past recursion": _nested(BEYOND_RECURSION, '{"a":', "}", "1"),
    "array just past the depth limit": _nested(MAX_DEPTH + 1, "[", "]"),
    "array at the depth limit": _nested(MAX_DEPTH - 2, "[", "]", '"a"'),
    "objects at the depth limit": _nested(MAX_DEPTH - 2, '{"type":', "}", '"string"'),
    "integer past Python's digit limit": "9" * 5000,
    "negative integer past the limit": "-" + "9" * 5000,
    "integer 10**30": str(10**30),
    "integer 2**64": str(2**64),
    "integer -2**63-1": str(-(2**63) - 1),
    "float 1e308": "1e308",
    "float overflowing to inf": "1e999",
    "float underflowing to 0": "1e-999",
    "negative zero": "-0.0",
    "a thousand-digit float": "0." + "1" * 1000,
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
    "lone high surrogate": '"a\\ud800b"',
    "lone low surrogate": '"\\udfff"',
    "reversed surrogate pair": '"\\udc00\\ud800"',
    "escaped emoji": '"\\ud83d\\ude00"',
    "NUL character": '"a\\u0000b"',
    "BOM and bidi overrides": '"\\ufeff\\u202e\\u2066x"',
    "combining marks": '"a' + "\\u0301" * 2000 + '"',
    "long string": json.dumps("x" * 200_000),
    "many long strings": json.dumps(["stop" * 64] * 2000),
    "many token ids": json.dumps(list(range(20_000))),
    "huge token ids": json.dumps([2**63, -(2**63), 10**40]),
    "list of lists": json.dumps([[1, 2]] * 1000),
    "true": "true",
    "null": "null",
    "empty object": "{}",
    "empty array": "[]",
    "object with an empty key": '{"": ""}',
    "object with 5000 keys": json.dumps({f"k{i}": i for i in range(5000)}),
}


def _whole_bodies(base: dict) -> dict[str, tuple[bytes, str]]:
    """(raw body, content type) for encodings and shapes of the whole body."""
    text = json.dumps(base)
    json_type = "application/json"
    return {
        "UTF-16 with BOM": (text.encode("utf-16"), json_type),
        "UTF-16-BE without BOM": (text.encode("utf-16-be"), json_type),
        "UTF-32": (text.encode("utf-32"), json_type),
        "UTF-8 BOM": (b"\xef\xbb\xbf" + text.encode(), json_type),
        "Latin-1 bytes": (text[:-1].encode() + ', "x": "caf\xe9"}'.encode("latin-1"), json_type),
        "invalid UTF-8": (text[:-1].encode() + b', "x": "\xff\xfe"}', json_type),
        "overlong UTF-8": (text[:-1].encode() + b', "x": "\xc0\xaf"}', json_type),
        "UTF-8-encoded surrogate (CESU-8)": (text[:-1].encode() + b', "x": "\xed\xa0\x80"}', json_type),
        "raw control character in a string": (text[:-1].encode() + b', "x": "a\x01b"}', json_type),
        "truncated": (text[: len(text) // 2].encode(), json_type),
        "empty": (b"", json_type),
        "null": (b"null", json_type),
        "a number": (b"12345", json_type),
        "a string": (b'"text"', json_type),
        "an array": (json.dumps([base]).encode(), json_type),
        "nested past recursion at the top": (_nested(BEYOND_RECURSION, "[", "]").encode(), json_type),
        "duplicate keys": (text[:-1].encode() + b", " + text[1:].encode(), json_type),
        "10000 unknown fields": (json.dumps({**base, **{f"unknown_{i}": i for i in range(10_000)}}).encode(),
                                 json_type),
        "unknown fields with CR LF and non-ASCII names": (
            json.dumps({**base, "a\r\nSet-Cookie: x": 1, "\u4e2d\u6587": 2, "\u0000": 3}).encode(), json_type),
        "charset latin-1 declared": (text.encode(), "application/json; charset=latin-1"),
        "text/plain": (text.encode(), "text/plain"),
        "no content type": (text.encode(), ""),
    }


@dataclass(frozen=True)
class Case:
    name: str
    body: bytes
    content_type: str = "application/json"


def cases_for(path: str) -> Iterator[Case]:
    base = BASES.get(path, GENERIC_BASE)
    for field in base:
        for value_name, fragment in HOSTILE_VALUES.items():
            text = json.dumps({**base, field: "__HOSTILE__"}).replace('"__HOSTILE__"', fragment)
            yield Case(f"{field} = {value_name}", text.encode("utf-8"))
    for name, (body, content_type) in _whole_bodies(base).items():
        yield Case(name, body, content_type)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("hostile") / "tiny")
    config = EngineConfig(model=str(checkpoint), served_model_name=MODEL, dtype="float32", device="cpu",
                          num_kv_blocks=64, max_model_len=256, enforce_eager=True)
    metrics = ServerMetrics(MODEL, {})
    engine = AsyncEngine.from_config(config, [metrics])
    engine.start()
    try:
        with live_server(build_app(engine, ServerSettings(), metrics=metrics)) as url:
            yield url
    finally:
        engine.shutdown()


def test_the_known_routes_are_among_those_fuzzed() -> None:
    assert set(BASES) <= set(POST_ROUTES), POST_ROUTES


def _exchange(connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
              content_type: str = "") -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": content_type} if content_type else {}
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()


@pytest.mark.parametrize("path", POST_ROUTES)
def test_hostile_bodies_get_4xx_on_one_usable_keep_alive_connection(server: str, path: str) -> None:
    url = server
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
    connection.connect()
    first_socket = connection.sock
    problems: list[str] = []
    statuses: dict[int, int] = {}
    for case in cases_for(path):
        try:
            status, headers, raw = _exchange(connection, "POST", path, case.body, case.content_type)
        except (OSError, http.client.HTTPException) as error:
            problems.append(f"{case.name}: the connection broke: {error!r}")
            connection.close()
            connection.connect()
            first_socket = connection.sock
            continue
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500:
            problems.append(f"{case.name}: {status} {raw[:200]!r}")
        elif status >= 400:
            body = json.loads(raw)
            error = body.get("error", {})
            if path.startswith("/v1/messages"):  # Anthropic's API, Anthropic's error shape
                if body.get("type") != "error" or set(error) != {"type", "message"}:
                    problems.append(f"{case.name}: {status} without Anthropic's error body: {raw[:200]!r}")
            elif set(error) != {"message", "type", "param", "code"}:
                problems.append(f"{case.name}: {status} without OpenAI's error body: {raw[:200]!r}")
        if headers.get("connection", "").lower() == "close" or connection.sock is not first_socket:
            problems.append(f"{case.name}: the server closed the keep-alive connection")
            connection.close()
            connection.connect()
            first_socket = connection.sock
        health, _, _ = _exchange(connection, "GET", "/health")  # the same connection still serves
        if health != 200:
            problems.append(f"{case.name}: /health then answered {health}")
    connection.close()
    assert problems == [], "\n".join(problems)
    assert statuses.get(400, 0) > len(HOSTILE_VALUES), statuses  # the battery did reach the checks


def test_no_5xx_was_counted_and_the_engine_is_healthy(server: str) -> None:
    url = server
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    for path in BASES:  # a normal request still works after the battery
        status, _, raw = _exchange(connection, "POST", path, json.dumps(BASES[path]).encode(), "application/json")
        assert status == 200, (path, raw[:300])
    _, _, text = _exchange(connection, "GET", "/metrics")
    server_errors = {sample.labels["code"]: sample.value
                     for family in text_string_to_metric_families(text.decode())
                     for sample in family.samples
                     if sample.name == "kvserve_request_errors_total" and sample.labels["code"].startswith("5")}
    assert server_errors == {}
    assert _exchange(connection, "GET", "/health")[0] == 200
