"""Requests kept sorted by the scheduling policy: the waiting queue and the running set alike.

One ordering serves both ends of the scheduler. Waiting requests are admitted from the front;
running requests are served from the front and preempted from the back, so under FCFS the newest
request is the one that yields its blocks and the oldest is never preempted by a newer one: no
request starves. A preempted request keeps its original order key, which is older than that of
every request never yet admitted (admission follows the same order), so it lands at the front of
the waiting queue, ahead of new arrivals, and is recomputed first.
"""

from __future__ import annotations

import bisect
from typing import Iterator

from kvserve.scheduler.config import SchedulingPolicy
from kvserve.scheduler.request import Request

# (priority, arrival time, admission sequence number): the sequence number breaks ties between
# equal arrival times, so the order is total and never compares Request objects.
OrderKey = tuple[int, float, int]


def order_key(policy: SchedulingPolicy, request: Request, sequence_number: int) -> OrderKey:
    priority = request.priority if policy is SchedulingPolicy.PRIORITY else 0
    return (priority, request.arrival_time, sequence_number)


class RequestQueue:
    """Requests in ascending order key. Insertion and removal are O(log n) searches plus a list
    shift, which for the few thousand requests a server holds costs microseconds."""

    def __init__(self) -> None:
        self._keys: list[OrderKey] = []
        self._requests: list[Request] = []

    def push(self, request: Request, key: OrderKey) -> None:
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)

    def front(self) -> Request:
        self._require_nonempty("front")
        return self._requests[0]

    def pop_front(self) -> Request:
        self._require_nonempty("pop_front")
        del self._keys[0]
        return self._requests.pop(0)

    def pop_back(self) -> Request:
        self._require_nonempty("pop_back")
        del self._keys[-1]
        return self._requests.pop()

    def remove(self, request: Request, key: OrderKey) -> None:
        index = bisect.bisect_left(self._keys, key)
        if index == len(self._keys) or self._requests[index] is not request:
            raise KeyError(f"request {request.request_id!r} is not in this queue")
        del self._keys[index]
        del self._requests[index]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __bool__(self) -> bool:
        return bool(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def _require_nonempty(self, action: str) -> None:
        if not self._requests:
            raise IndexError(f"cannot {action}: the queue is empty")
