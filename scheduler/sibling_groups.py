"""Bookkeeping for n > 1: completions of one prompt share the prompt's KV blocks.

The engine adds n Requests with the same `parent_id` and prompt. The first one to arrive (index
0) is the group's leader and is admitted like any request; the others are held here instead of
in the waiting queue, so they neither compute the prompt again nor block the queue. Once the
leader's prompt is computed, the scheduler forks the leader's blocks to each held sibling. If the
leader is preempted or finishes first, its held siblings are released to be admitted normally
(with prefix caching they still reuse the prompt's full blocks).
"""

from __future__ import annotations

from kvserve.scheduler.request import Request


class SiblingGroups:
    def __init__(self) -> None:
        self._leaders: dict[str, Request] = {}  # parent_id -> leader
        self._held: dict[str, list[Request]] = {}  # parent_id -> siblings waiting for the leader

    def hold(self, request: Request) -> bool:
        """Registers `request` with its group. Returns True when it is held for a fork from a
        live leader; False when the caller must queue it (it leads, or there is no one to
        share with)."""
        parent_id = request.parent_id
        if parent_id is None:
            return False
        leader = self._leaders.get(parent_id)
        if leader is None:
            self._leaders[parent_id] = request
            return False
        if leader.prompt_token_ids != request.prompt_token_ids or leader.cache_salt != request.cache_salt:
            raise ValueError(
                f"request {request.request_id!r} has parent_id {parent_id!r} but a different prompt (or "
                f"cache_salt) than {leader.request_id!r}; completions of one parent must share the prompt: "
                "give unrelated requests distinct parent ids"
            )
        self._held.setdefault(parent_id, []).append(request)
        return True

    def is_held(self, request: Request) -> bool:
        return request.parent_id is not None and request in self._held.get(request.parent_id, ())

    def take_held(self, leader: Request) -> list[Request]:
        """The siblings held for `leader` (none if it leads nothing), no longer held."""
        if leader.parent_id is None or self._leaders.get(leader.parent_id) is not leader:
            return []
        return self._held.pop(leader.parent_id, [])

    def has_held(self, leader: Request) -> bool:
        return (
            leader.parent_id is not None
            and self._leaders.get(leader.parent_id) is leader
            and leader.parent_id in self._held
        )

    def discard(self, request: Request) -> list[Request]:
        """Forgets a request that finished or stopped leading (preempted): a held sibling leaves
        its group; a leader stops leading and its held siblings are returned for normal
        admission."""
        parent_id = request.parent_id
        if parent_id is None:
            return []
        if self._leaders.get(parent_id) is request:
            del self._leaders[parent_id]
            return self._held.pop(parent_id, [])
        held = self._held.get(parent_id)
        if held is not None and request in held:
            held.remove(request)
            if not held:
                del self._held[parent_id]
        return []
