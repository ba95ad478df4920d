"""Parses a server-sent-event body into its JSON chunks, checking the framing on the way."""

from __future__ import annotations

import json
from typing import Any


def parse_sse(body: str) -> list[dict[str, Any]]:
    events = [e.strip("\n") for e in body.split("\n\n") if e.strip("\n")]
    assert events[-1] == "data: [DONE]", f"stream must end with [DONE], got {events[-1]!r}"
    chunks = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        chunks.append(json.loads(event[len("data: "):]))
    return chunks
