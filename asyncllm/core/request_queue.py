"""Waiting queues: first come first served, or by priority (lower value first)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from asyncllm.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Puts a preempted request back where it is served next among its peers."""

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: set[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In the order the requests would be popped."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: set[Request]) -> None:
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lower priority value first, then earlier arrival, then insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[-1]

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][-1]

    def prepend(self, request: Request) -> None:
        # a preempted request keeps its (priority, arrival_time), which already ranks it first
        self.add(request)

    def remove(self, request: Request) -> None:
        if all(e[-1] is not request for e in self._heap):
            raise ValueError(f"request {request.request_id} is not in the queue")
        self.remove_requests({request})

    def remove_requests(self, requests: set[Request]) -> None:
        self._heap = [e for e in self._heap if e[-1] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'.")
