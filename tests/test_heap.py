"""Freed heap memory goes back to the OS when the engine goes idle."""

import asyncio
import os
import queue
import threading

import pytest
from test_reliability_support import rss_kib

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.engine import core_client, core_process
from asyncllm.engine.core_process import CoreLoop, Shutdown
from asyncllm.engine.heap import _malloc_trim, release_freed_memory


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_release_gives_back_the_pages_of_freed_heap_blocks() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(2048)]  # 128 MiB on malloc's heap
    del blocks[::2]  # 64 MiB of holes between live blocks: free() keeps them resident
    before = rss_kib(os.getpid())
    release_freed_memory()
    after = rss_kib(os.getpid())
    assert before - after >= 32 * 1024, (before, after)
    assert len(blocks) == 1024


async def test_the_engine_releases_memory_each_time_it_goes_idle(tiny_model_dir, monkeypatch):
    releases = []
    monkeypatch.setattr(core_client, "release_freed_memory", lambda: releases.append(1))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=512))
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        for round_ in range(1, 3):
            async for _ in engine.generate("hello", params, f"r{round_}"):
                pass
            await asyncio.sleep(0.05)  # the engine task reaches its idle wait
            assert len(releases) == round_
    finally:
        await engine.shutdown()


class IdleCore:
    def has_work(self) -> bool:
        return False


@pytest.mark.parametrize("message_waiting", [False, True])
def test_the_core_process_releases_memory_only_when_it_waits(monkeypatch, message_waiting):
    releases = []
    monkeypatch.setattr(core_process, "release_freed_memory", lambda: releases.append(1))
    messages: queue.Queue = queue.Queue()
    if message_waiting:
        messages.put(Shutdown())
    else:
        threading.Timer(0.05, messages.put, [Shutdown()]).start()
    CoreLoop(IdleCore(), outbox=None).run(messages)
    assert len(releases) == (0 if message_waiting else 1)
