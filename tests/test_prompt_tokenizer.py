"""Prompts are tokenized off the event loop, in batches, to the ids tokenizer.encode gives."""

import asyncio
import time

import pytest
import transformers
from test_event_loop_support import ticking_while

from asyncllm import AsyncLLM, EngineArgs, SamplingParams
from asyncllm.engine.prompt_tokenizer import PromptTokenizer

TEXTS = ["Hello world", "héllo 🌍 wörld", "def f(x):\n    return x", " leading space", "日本語"]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture
async def prompts(tokenizer):
    prompts = PromptTokenizer(tokenizer)
    yield prompts
    prompts.shutdown()


async def test_a_burst_gets_the_ids_of_encode_in_few_batches(tokenizer, prompts, monkeypatch):
    batches: list[int] = []
    encode_batch = prompts._encode

    def counting(texts, add_special_tokens):
        batches.append(len(texts))
        return encode_batch(texts, add_special_tokens)

    monkeypatch.setattr(prompts, "_encode", counting)
    burst = [(text * (i + 1), i % 3 == 0) for i, text in enumerate(TEXTS * 8)]
    ids = await asyncio.gather(*(prompts.encode(text, special) for text, special in burst))
    for (text, special), got in zip(burst, ids, strict=True):
        assert got == tokenizer.encode(text, add_special_tokens=special)
    assert sum(batches) == len(burst)
    assert len(batches) <= 4  # the first prompt alone, then the rest, split by the flag


async def test_a_caller_that_leaves_does_not_disturb_the_others(tokenizer, prompts) -> None:
    leaving = asyncio.ensure_future(prompts.encode("gone " * 1000))
    staying = asyncio.ensure_future(prompts.encode("stays"))
    await asyncio.sleep(0)
    leaving.cancel()
    assert await staying == tokenizer.encode("stays")
    assert await prompts.encode("after") == tokenizer.encode("after")


async def test_a_prompt_the_tokenizer_rejects_fails_alone(tokenizer, prompts) -> None:
    bad = asyncio.ensure_future(prompts.encode(None))  # type: ignore[arg-type]
    good = asyncio.ensure_future(prompts.encode("fine"))
    with pytest.raises(ValueError):
        await bad
    assert await good == tokenizer.encode("fine")


async def test_after_shutdown_a_prompt_fails_instead_of_waiting(tokenizer) -> None:
    prompts = PromptTokenizer(tokenizer)
    prompts.shutdown()
    with pytest.raises(RuntimeError):
        await asyncio.wait_for(prompts.encode("late"), 5)


async def test_the_event_loop_keeps_running_while_a_long_prompt_is_tokenized(prompts) -> None:
    await prompts.encode("warm up")
    text = "a lot of words to tokenize, " * 40_000
    started = time.monotonic()
    token_ids, gaps = await ticking_while(prompts.encode(text), 0.005)
    took = time.monotonic() - started
    assert len(token_ids) > 100_000
    assert took > 0.1  # long enough for the loop to have been held, had it run there
    assert max(gaps) < took / 2


async def test_async_llm_streams_text_prompts_from_the_tokenizer_thread(tiny_model_dir) -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=512))
    try:
        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)

        async def run(prompt, request_id):
            return [out async for out in engine.generate(prompt, params, request_id)][-1]

        text = "the same prompt, as text and as ids"
        ids = engine.tokenizer.encode(text)
        by_text, by_ids = await asyncio.gather(
            run(text, "text"), run({"prompt_token_ids": ids}, "ids")
        )
        assert by_text.prompt_token_ids == ids and by_text.prompt == text
        assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
        assert not engine.collectors
    finally:
        await engine.shutdown()
