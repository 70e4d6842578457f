"""Tensor-parallel failures: a shape that cannot split is refused at start-up with the reason,
and a worker that dies mid-stream ends the streams with an error and stops the engine; neither
leaves a process behind."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
from test_tensor_parallel import save_random_model

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams


def test_heads_that_cannot_split_are_refused_with_the_reason(tmp_path) -> None:
    path = save_random_model("llama", tmp_path)  # 4 query heads
    with pytest.raises(
        RuntimeError, match=r"attention heads \(4\) cannot be split evenly across 3"
    ):
        LLM(model=str(path), tensor_parallel_size=3, max_model_len=64, max_num_seqs=2)
    assert not multiprocessing.active_children()


async def test_a_worker_that_dies_ends_the_stream_with_an_error(tmp_path) -> None:
    path = save_random_model("llama", tmp_path)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(path), tensor_parallel_size=2, max_model_len=128, max_num_seqs=2)
    )
    executor = engine.core_client.core.executor
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r")
    await anext(stream)
    os.kill(executor.worker_pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(Exception, match="tensor-parallel worker 1"):
        async for _ in stream:
            pass
    assert time.monotonic() - start < 5.0
    assert engine.errored
    await engine.shutdown()
    await asyncio.sleep(0)
    assert not multiprocessing.active_children()
