"""AsyncLLM: streaming iterators, aborts, and an event loop that stays responsive."""

import asyncio
import time

import pytest
from test_event_loop_support import ticking_while

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams


@pytest.fixture
async def engine(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=512))
    yield engine
    await engine.shutdown()


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def test_stream_yields_growing_outputs_then_finishes(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = await collect(engine, "hello", params, "r1")
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 8
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])


async def test_delta_outputs_concatenate_to_the_final_text(engine) -> None:
    cumulative = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = (await collect(engine, "a story", cumulative, "full"))[-1].outputs[0]
    delta = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    pieces = await collect(engine, "a story", delta, "delta")
    assert "".join(p.outputs[0].text for p in pieces) == full.text
    assert sum((p.outputs[0].token_ids for p in pieces), []) == full.token_ids


async def test_concurrent_requests_all_complete(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = await asyncio.gather(
        *(collect(engine, f"prompt {i}", params, f"c{i}") for i in range(10))
    )
    assert all(r[-1].finished and len(r[-1].outputs[0].token_ids) == 6 for r in results)
    assert engine.core_client.core.kv_cache_manager.usage == 0


async def test_abort_frees_blocks(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate("long one", params, "victim")
    await anext(stream)
    assert engine.core_client.core.kv_cache_manager.usage > 0
    engine.abort("victim")
    await stream.aclose()
    await _until(lambda: not engine.core_client.core.scheduler.has_unfinished_requests())
    assert engine.core_client.core.kv_cache_manager.usage == 0


async def test_leaving_the_stream_early_aborts_the_request(engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async for _ in engine.generate("go on", params, "quitter"):
        break
    await _until(lambda: not engine.core_client.core.scheduler.has_unfinished_requests())
    assert engine.core_client.core.kv_cache_manager.usage == 0


async def test_event_loop_stays_responsive_while_the_model_computes(engine, monkeypatch) -> None:
    """Each step takes 300 ms in the runner's thread; a 10 ms ticker must keep ticking."""
    # one request first, so one-time set-up on the loop (tokenizer, decoder) is not measured
    await collect(engine, "warm up", SamplingParams(max_tokens=2, ignore_eos=True), "warm")
    runner = engine.core_client.core.executor.model_runner
    real_execute = runner.execute_model

    def slow_execute(scheduler_output):
        time.sleep(0.3)
        return real_execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", slow_execute)
    slow = collect(engine, "hi", SamplingParams(max_tokens=3, ignore_eos=True), "slow")
    _, gaps = await ticking_while(slow, 0.01)
    assert sum(gaps) >= 0.9  # three steps of 300 ms ran while the ticker was alive
    assert max(gaps) < 0.1


async def test_duplicate_request_id_is_rejected(engine) -> None:
    stream = engine.generate("x", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
    await anext(stream)
    with pytest.raises(ValueError, match="request_id"):
        await anext(engine.generate("y", SamplingParams(max_tokens=2), "dup"))
    await stream.aclose()


async def test_bad_input_raises_and_the_engine_keeps_serving(engine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        await anext(engine.generate("", SamplingParams(), "bad"))
    outputs = await collect(engine, "fine", SamplingParams(max_tokens=2, ignore_eos=True), "good")
    assert outputs[-1].finished


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)
