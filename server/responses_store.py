"""Finished /v1/responses kept in memory, for `previous_response_id` and GET/DELETE
/v1/responses/{id}: each entry is the Response object and the conversation it ended (the chat
messages up to and including its output), so a follow-up continues it without resending it.

Bounded in count and in bytes (each entry's JSON size): past either cap the least recently used
entries go first, so a busy server's memory stays flat. One entry larger than the byte cap is
not kept. The store lives in this process: replicas behind a load balancer do not share it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as returned
    conversation: list[dict[str, Any]]  # chat messages, without the request's instructions
    size: int


class ResponsesStore:
    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Keeps the response; False when it alone is over the byte cap (then it is not kept)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        self.delete(response["id"])
        if size > self.max_bytes:
            return False
        self._entries[response["id"]] = StoredResponse(response, conversation, size)
        self._bytes += size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
