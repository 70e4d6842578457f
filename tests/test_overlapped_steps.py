"""Output processing of step N-1 overlapped with step N (the GPU path), checked on CPU."""

import pytest

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from asyncllm.engine.core import EngineCore

PROMPTS = ["Tell me a story", "The weather today", "One two three"]


def run(model_dir, overlap: bool, monkeypatch) -> list:
    monkeypatch.setattr(EngineCore, "overlap_output_processing", property(lambda self: overlap))
    llm = LLM(model=str(model_dir), max_model_len=512)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[text[6:9]]) for text in texts] + [
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True)
    ]
    outputs = llm.generate(PROMPTS + ["Two samples"], params, use_tqdm=False)
    assert llm.engine.core.kv_cache_manager.usage == 0
    assert not llm.engine.core.has_unfinished_requests()
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def test_overlapped_offline_steps_give_the_same_outputs(tiny_model_dir, monkeypatch) -> None:
    serial = run(tiny_model_dir, False, monkeypatch)
    overlapped = run(tiny_model_dir, True, monkeypatch)
    assert overlapped == serial
    assert all(reason == "stop" for o in serial[:3] for _, _, reason in o)


@pytest.fixture
async def overlapped_engine(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(EngineCore, "overlap_output_processing", property(lambda self: True))
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=512))
    yield engine
    await engine.shutdown()


async def test_overlapped_async_steps_stream_to_the_end(overlapped_engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = [o async for o in overlapped_engine.generate("hello", params, "r")]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 12
    assert overlapped_engine.engine.core.kv_cache_manager.usage == 0
