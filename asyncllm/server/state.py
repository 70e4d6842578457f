"""What the handlers share: the engine, the metrics, the requests in flight and their admission,
and the keys they leave on an aiohttp request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.model_files.model_path import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from asyncllm.server.args import ServerArgs
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.protocol import ProtocolError, overloaded, timed_out
from asyncllm.server.resumable import StreamRegistry


class Admission:
    """One admitted generation request. `cutoff` resolves to the error that ends it early:
    its own timeout, --max-queue-wait, or a shutdown that ran out of time."""

    def __init__(self, state: ServerState, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self.state = state
        self.engine_ids: list[str] = []  # set once its prompts reach the engine
        self.cutoff: asyncio.Future[ProtocolError] = loop.create_future()
        self._timers: list[asyncio.TimerHandle] = []
        if timeout:
            message = f"the request did not finish within its timeout ({timeout:g} s)."
            self._timers.append(loop.call_later(timeout, self.end, timed_out(message)))
        if state.args.max_queue_wait:
            wait = state.args.max_queue_wait
            self._timers.append(loop.call_later(wait, self._end_if_queued, wait))

    @property
    def queued(self) -> bool:
        """Not yet in the engine, or some of its requests not yet scheduled."""
        return not self.engine_ids or any(map(self.state.engine.is_queued, self.engine_ids))

    def end(self, error: ProtocolError) -> None:
        if not self.cutoff.done():
            self.cutoff.set_result(error)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.cutoff.cancel()

    def _end_if_queued(self, wait: float) -> None:
        if self.queued:
            self.end(overloaded(f"the request waited over {wait:g} s to be scheduled."))


class ServerState:
    """What the handlers share: the engine, the metrics, and the requests in flight."""

    def __init__(self, engine: AsyncLLM, args: ServerArgs) -> None:
        self.engine = engine
        self.args = args
        path = engine.config.model.path
        model = engine.config.args.model
        if model in (None, DEFAULT_MODEL):
            model = DEFAULT_MODEL_NAME
        self.model_root = model  # the --model argument as given
        self.model_name = args.served_model_name or model
        self.model_names = {self.model_name, str(path), path.name}
        self.metrics = ServerMetrics(engine, self.model_name)
        self.started = int(time.time())
        self.draining = False
        self.admissions: set[Admission] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.max_prompt_chars = _max_prompt_chars(engine)
        self.streams = StreamRegistry(args.stream_retention, args.stream_buffer_bytes)

    @property
    def in_flight(self) -> int:
        return len(self.admissions)

    @property
    def healthy(self) -> bool:
        return not self.engine.errored and not self.draining

    @contextmanager
    def admit(self, timeout: float | None = None) -> Iterator[Admission]:
        """Counts one generation request in flight; 503 while draining or with the queue full,
        429 over the concurrency limit (both with Retry-After)."""
        self._check_capacity()
        admission = Admission(self, timeout)
        self.admissions.add(admission)
        self._idle.clear()
        try:
            yield admission
        finally:
            admission.close()
            self.admissions.discard(admission)
            if not self.admissions:
                self._idle.set()

    def _check_capacity(self) -> None:
        if self.draining:
            raise overloaded("the server is shutting down.")
        limit = self.args.max_concurrent_requests
        if limit and self.in_flight >= limit:
            message = f"too many concurrent requests (the limit is {limit}); retry later."
            raise overloaded(message, status=429)
        limit = self.args.max_waiting_requests
        if limit and sum(a.queued for a in self.admissions) >= limit:
            raise overloaded(f"the queue is full ({limit} requests waiting); retry later.")

    def end_all(self, error: ProtocolError) -> None:
        """Ends every request in flight with this error (their streams get it as an event)."""
        for admission in list(self.admissions):
            admission.end(error)

    async def drain(self, timeout: float) -> bool:
        """Refuses new requests and waits for those in flight; False if the timeout hit."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


def _max_prompt_chars(engine: AsyncLLM) -> int | None:
    """No token covers more characters than the longest vocabulary entry, so a text longer
    than max_model_len of those cannot fit: it is refused before it is tokenized."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        return None
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    return engine.config.model.max_model_len * longest


STATE = web.AppKey("state", ServerState)
