"""Waiting queues: first come first served, by priority (lower value first, then arrival), or
shortest first (fewest tokens left to compute first, with a bound on how long one waits)."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator

from engine.core.request import Request


class RequestQueue:
    """The interface both policies share."""

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """Puts a preempted request where it is taken next (within its priority)."""
        raise NotImplementedError

    def peek(self) -> Request:
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        raise NotImplementedError


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue(RequestQueue):
    """Orders by (priority, arrival time, insertion order); a preempted request goes first
    among requests of its priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._front = itertools.count(-1, -1)

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.times.arrival_time,
                                    next(self._counter), request))

    def prepend(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, float("-inf"), next(self._front), request))

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


class ShortestFirstQueue(RequestQueue):
    """Fewest tokens left to compute first (then arrival): on a compute-bound prefill worker,
    serving short prompts before long ones lowers mean TTFT and lets more requests meet a TTFT
    SLO. A request that has waited `max_wait_s` since arrival goes ahead of every younger one
    (oldest first), so long prompts are delayed, never starved. Preempted requests go first.
    A linear scan per peek: waiting queues hold at most a few hundred requests. `pop()` removes
    the request the last `peek()` returned (a request may age between the two calls: the
    scheduler allocates for the one it peeked)."""

    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._front: deque[Request] = deque()
        self._items: list[Request] = []
        self._peeked: Request | None = None  # what peek() last returned from _items

    def is_aged(self, request: Request, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        return now - request.times.arrival_time >= self.max_wait_s

    def _key(self, request: Request, now: float) -> tuple[int, float, float]:
        if self.is_aged(request, now):
            return (0, request.times.arrival_time, 0.0)
        return (1, tokens_left(request), request.times.arrival_time)

    def add(self, request: Request) -> None:
        self._items.append(request)
        self._peeked = None

    def prepend(self, request: Request) -> None:
        self._front.appendleft(request)
        self._peeked = None

    def peek(self) -> Request:
        if self._front:
            return self._front[0]
        now = self._clock()
        self._peeked = min(self._items, key=lambda r: self._key(r, now))
        return self._peeked

    def pop(self) -> Request:
        if self._front:
            return self._front.popleft()
        request = self._peeked if self._peeked is not None else self.peek()
        self._peeked = None
        self._items.remove(request)
        return request

    def remove(self, request: Request) -> None:
        self._peeked = None
        if request in self._front:
            self._front.remove(request)
        else:
            self._items.remove(request)

    def __len__(self) -> int:
        return len(self._front) + len(self._items)

    def __iter__(self) -> Iterator[Request]:
        now = self._clock()
        return iter([*self._front, *sorted(self._items, key=lambda r: self._key(r, now))])


def make_queue(policy: str, max_wait_s: float = 10.0) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "sjf":
        return ShortestFirstQueue(max_wait_s)
    raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or 'sjf', got {policy!r}")
