"""Freed heap memory goes back to the OS when the engine goes idle."""

import asyncio
import gc
import os
import queue
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from test_reliability_support import rss_kib

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.engine import core_client, core_process
from asyncllm.engine.core_process import run_core_loop, run_core_process
from asyncllm.engine.heap import _libc, freeze_startup_objects, release_freed_memory
from asyncllm.engine.messages import KVCapacity, Ready, Shutdown


@pytest.mark.skipif(_libc() is None, reason="needs glibc's malloc_trim")
def test_release_gives_back_the_pages_of_freed_heap_blocks() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(2048)]  # 128 MiB on malloc's heap
    del blocks[::2]  # 64 MiB of holes between live blocks: free() keeps them resident
    before = rss_kib(os.getpid())
    release_freed_memory()
    after = rss_kib(os.getpid())
    assert before - after >= 32 * 1024, (before, after)
    assert len(blocks) == 1024


ARENAS_OF_THREADS = """
import ctypes, threading
from asyncllm.engine.heap import use_one_malloc_arena
if {limit}:
    use_one_malloc_arena()
def allocate():
    blocks = [bytearray(100_000) for _ in range(50)]
threads = [threading.Thread(target=allocate) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL("libc.so.6").malloc_stats()
"""


def malloc_arenas(limit: bool) -> int:
    """How many arenas malloc has after four threads allocated (malloc_stats lists them)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    code = ARENAS_OF_THREADS.format(limit=limit)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stderr.count("Arena ")


@pytest.mark.skipif(_libc() is None, reason="needs glibc's mallopt")
def test_the_server_processes_allocate_from_one_malloc_arena() -> None:
    """The other arenas' tops are what malloc_trim cannot give back (heap.py)."""
    assert malloc_arenas(limit=True) == 1
    assert malloc_arenas(limit=False) > 1


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
    run_core_loop(IdleCore(), messages, emit=None)
    assert len(releases) == (0 if message_waiting else 1)


def test_freezing_takes_what_is_alive_out_of_later_collections() -> None:
    try:
        freeze_startup_objects()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # pytest, torch, transformers and this suite's modules
        assert len(gc.get_objects()) < frozen / 10  # what a collection still walks
    finally:
        gc.unfreeze()


class FakePipe:
    def __init__(self, sent: list[str]) -> None:
        self.sent = sent

    def recv(self):
        return SimpleNamespace(create_engine_config=lambda: None)

    def send(self, message) -> None:
        self.sent.append(type(message).__name__)


class FakeCore:
    capacity = KVCapacity(num_blocks=8, block_size=16)

    def __init__(self, config) -> None:
        pass

    def watch_executor(self, post) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_the_core_process_freezes_its_startup_objects_before_it_reports_ready(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(core_process, "EngineCore", FakeCore)
    monkeypatch.setattr(core_process, "freeze_startup_objects", lambda: events.append("freeze"))
    monkeypatch.setattr(core_process, "_receive_in_thread", lambda inbox: queue.Queue())
    monkeypatch.setattr(core_process, "run_core_loop", lambda core, messages, emit: None)
    run_core_process(FakePipe(events), FakePipe(events))
    assert events == ["freeze", Ready.__name__]
