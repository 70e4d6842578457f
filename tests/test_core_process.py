"""AsyncLLM with the engine core in its own process (the default on CUDA), here on CPU: the same
outputs as in one process, aborts and stop strings reach the core, and a core that dies ends
the requests in flight instead of hanging them."""

import asyncio
import collections
import os
import signal

import pytest
import pytest_asyncio
import transformers

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from asyncllm.engine.async_llm import EngineDeadError
from asyncllm.engine.core_client import CoreProcessClient, EngineCoreGone, join_steps
from asyncllm.engine.messages import CoreStep, EngineCoreOutput, EngineCoreRequest, EngineStats
from asyncllm.engine.output_processor import OutputProcessor
from asyncllm.outputs import PromptLogprobsChunk, TokenLogprobs

pytestmark = pytest.mark.asyncio(loop_scope="module")


def engine_args(model_dir, **kwargs) -> EngineArgs:
    return EngineArgs(model=str(model_dir), max_model_len=512, **kwargs)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(tiny_model_dir):
    """(core in its own process, core in this process) over the same tiny model."""
    spawned = AsyncLLM.from_engine_args(engine_args(tiny_model_dir, engine_process=True))
    local = AsyncLLM.from_engine_args(engine_args(tiny_model_dir))
    assert isinstance(spawned.core_client, CoreProcessClient)
    assert not isinstance(local.core_client, CoreProcessClient)
    yield spawned, local
    await spawned.shutdown()
    await local.shutdown()
    assert spawned.core_client.process.poll() == 0


async def collect(engine, prompt, params, request_id):
    return [out async for out in engine.generate(prompt, params, request_id)]


async def until(condition, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def final(outputs, params: SamplingParams) -> list:
    """What a stream adds up to (how it is cut into pieces depends on timing)."""
    if params.output_kind != RequestOutputKind.DELTA:
        return outputs[-1].outputs
    pieces = collections.defaultdict(lambda: ("", []))
    for out in outputs:
        for c in out.outputs:
            text, ids = pieces[c.index]
            pieces[c.index] = (text + c.text, ids + c.token_ids)
    return sorted(pieces.items())


def idle(engine: AsyncLLM) -> bool:
    stats = engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0


async def test_outputs_equal_the_in_process_engine(engines) -> None:
    spawned, local = engines
    prompts = ["hello", "a longer prompt about the sea and the sky", "1 2 3", "x" * 40]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(n=2, seed=3, temperature=1.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=7, output_kind=RequestOutputKind.DELTA),
    ]

    jobs = list(enumerate(zip(prompts, params)))
    for i, (prompt, sp) in jobs:  # one at a time: batches of equal shapes, equal bits
        got = await collect(spawned, prompt, sp, f"q{i}")
        want = await collect(local, prompt, sp, f"q{i}")
        assert final(got, sp) == final(want, sp)
    together = await asyncio.gather(*(collect(spawned, p, sp, f"t{i}") for i, (p, sp) in jobs))
    lengths = [[len(c.token_ids) for c in r[-1].outputs] for r in together[:3]]
    assert lengths == [[12], [9], [5, 5]]
    assert len(final(together[3], params[3])[0][1][1]) == 7
    assert idle(spawned)


async def test_the_front_end_learns_when_a_request_is_scheduled(engines) -> None:
    spawned, _ = engines
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = spawned.generate("tell me", params, "timed")
    first = await anext(stream)
    assert not spawned.is_queued("timed")
    metrics = first.metrics
    assert metrics["arrival_time"] <= metrics["first_scheduled_time"]
    assert metrics["first_scheduled_time"] <= metrics["first_token_time"]
    assert spawned.stats().num_running == 1 and spawned.stats().kv_cache_usage > 0
    await stream.aclose()  # leaving the stream aborts the request in the core
    await until(lambda: idle(spawned))


async def test_abort_and_stop_strings_free_the_core_blocks(engines) -> None:
    spawned, local = engines
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    text = (await collect(local, "stop here", greedy, "probe"))[-1].outputs[0].text
    stop = text.strip().split()[2]
    stopping = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[stop])
    stopped = (await collect(spawned, "stop here", stopping, "stopper"))[-1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stop not in stopped.text
    await until(lambda: idle(spawned))

    long = SamplingParams(n=3, max_tokens=400, ignore_eos=True)
    stream = spawned.generate("go on", long, "victim")
    await anext(stream)
    spawned.abort("victim")
    await stream.aclose()
    await until(lambda: idle(spawned))


@pytest.mark.parametrize("engine_process", [True, False])
async def test_a_request_the_kv_cache_could_never_hold_is_refused(
    tiny_model_dir, engine_process: bool
) -> None:
    """As a ValueError (the server's 400), leaving nothing behind; the engine goes on."""
    args = engine_args(tiny_model_dir, engine_process=engine_process, num_kv_blocks=4)
    engine = AsyncLLM.from_engine_args(args)
    too_long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with pytest.raises(ValueError, match="needs up to 7 KV cache blocks, the cache has 4"):
        await collect(engine, "x" * 20, too_long, "big")
    assert not engine.collectors and not engine.output_processor.states
    fits = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert len((await collect(engine, "hi", fits, "small"))[-1].outputs[0].token_ids) == 5
    await engine.shutdown()


async def test_a_core_that_fails_to_start_says_why(tiny_model_dir) -> None:
    with pytest.raises(EngineCoreGone, match="too small to hold two KV blocks"):
        AsyncLLM.from_engine_args(
            engine_args(tiny_model_dir, engine_process=True, kv_cache_memory=1)
        )


async def test_a_dead_core_ends_the_requests_in_flight(tiny_model_dir) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(tiny_model_dir, engine_process=True))
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    stream = engine.generate("doomed", params, "doomed")
    await anext(stream)
    os.kill(engine.core_client.process.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        await collect(engine, "after", params, "after")
    await engine.shutdown()


def test_the_core_process_can_be_read_without_an_event_loop(tiny_model_dir) -> None:
    """CoreProcessClient.get_output blocks this thread, as LLM's loop would."""
    client = CoreProcessClient(engine_args(tiny_model_dir).create_engine_config())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    client.add_request(EngineCoreRequest("r", [5, 6, 7], params, frozenset(), 6, 0.0))
    tokens, finish, step = [], None, None
    while step is None or step.has_work:
        step = client.get_output()
        for out in step.outputs:
            tokens += out.new_token_ids
            finish = out.finish_reason or finish
    assert (len(tokens), finish) == (6, "length")
    assert step.stats.kv_cache_usage == 0
    client.shutdown()
    assert client.process.poll() == 0


def core_output(request_id, tokens, **fields) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, list(tokens), **fields)


def token_logprobs(token_id: int) -> TokenLogprobs:
    return TokenLogprobs(token_id, -0.5, 1, [token_id], [-0.5])


async def test_steps_that_queued_up_join_per_request() -> None:
    prompt_chunk = PromptLogprobsChunk(1, [token_logprobs(9)])
    steps = [
        CoreStep(
            [core_output("a", [1], new_logprobs=[token_logprobs(1)])],
            EngineStats(),
            first_scheduled={"a": 1.0},
            num_scheduled_tokens=[9],
        ),
        CoreStep(
            [
                core_output("b", [5]),
                core_output("a", [2], new_logprobs=[token_logprobs(2)]),
                core_output("c", [], new_prompt_logprobs=prompt_chunk),
            ],
            EngineStats(),
            first_scheduled={"b": 2.0},
            num_scheduled_tokens=[4],
        ),
        CoreStep(
            [
                core_output("a", [3], new_logprobs=[token_logprobs(3)], finish_reason="length"),
                core_output(
                    "c", [7], new_prompt_logprobs=PromptLogprobsChunk(2, [token_logprobs(7)])
                ),
            ],
            stats=EngineStats(num_running=2),
            num_scheduled_tokens=[3, 2],  # itself joined from two steps
        ),
    ]
    joined = join_steps(steps)
    by_id = collections.defaultdict(list)
    for out in joined.outputs:
        by_id[out.request_id].append(out)
    (a,) = by_id["a"]
    assert a.new_token_ids == [1, 2, 3] and a.finish_reason == "length"
    assert [e.token_id for e in a.new_logprobs] == [1, 2, 3]
    assert [o.new_token_ids for o in by_id["b"]] == [[5]]
    # an output with prompt logprobs stays apart, in order
    assert [(o.new_token_ids, o.new_prompt_logprobs.start) for o in by_id["c"]] == [
        ([], 1),
        ([7], 2),
    ]
    assert joined.first_scheduled == {"a": 1.0, "b": 2.0}
    assert joined.stats.num_running == 2
    assert joined.num_scheduled_tokens == [9, 4, 3, 2]  # each step's own count


async def test_a_stop_string_inside_joined_tokens_ends_the_request_at_its_token(
    tiny_model_dir,
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    words = tokenizer.encode(" one two three four five", add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(stop=[" three"], max_tokens=50, logprobs=0)
    request = EngineCoreRequest("s", tokenizer.encode("count:"), params, frozenset(), 50, 0.0)
    processor.add_request(request, "count:")
    logprobs = [token_logprobs(t) for t in words]
    processed = processor.process([core_output("s", words, new_logprobs=logprobs)])
    output = processed.request_outputs[-1]  # one per token taken; the last is the final one
    completion = output.outputs[0]
    assert output.finished
    assert completion.finish_reason == "stop" and completion.text == " one two"
    upto = words[: len(tokenizer.encode(" one two three", add_special_tokens=False))]
    assert completion.token_ids == upto and len(completion.logprobs) == len(upto)
    assert processed.stopped_request_ids == ["s"]
