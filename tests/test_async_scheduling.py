"""Async scheduling: step N+1 is scheduled and launched while step N runs, its input token taken
from the device. Checked on CPU, where it is off by default, against the serial engine."""

import asyncio

import pytest
import torch
from test_scheduler import fake_run, make_request, make_scheduler

from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.worker.input_batch import DeviceTokens, InputBatch

PROMPTS = ["Tell me a story", "The weather today", "One two three", "A B C D E F G"]


def outputs(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list:
    results = llm.generate(prompts, params, use_tqdm=False)
    core = llm.core_client.core
    assert core.kv_cache_manager.usage == 0 and not core.has_work()
    return [[(c.text, c.token_ids, c.finish_reason) for c in r.outputs] for r in results]


def test_async_scheduling_gives_the_serial_outputs(tiny_model_dir) -> None:
    serial = LLM(model=str(tiny_model_dir), max_model_len=512, async_scheduling=False)
    ahead = LLM(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    assert ahead.config.async_scheduling and not serial.config.async_scheduling
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = [c[0][0] for c in outputs(serial, PROMPTS, [free] * len(PROMPTS))]
    params = [
        SamplingParams(temperature=0, max_tokens=24, stop=[texts[0][6:9]]),  # stop string
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
        # sampling that reads the output so far: from the history kept on the device
        SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=5, bad_words=["the"]),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True),
    ]
    prompts = PROMPTS + ["Two samples"]
    expected = outputs(serial, prompts, params)
    assert outputs(ahead, prompts, params) == expected
    assert expected[0][0][2] == "stop" and len(expected[1][0][1]) == 9


def test_async_scheduling_under_preemption_matches_an_unpressured_run(tiny_model_dir) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [f"{p} and so on and so forth" for p in PROMPTS]
    roomy = LLM(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    tight = LLM(
        model=str(tiny_model_dir), max_model_len=512, async_scheduling=True, num_kv_blocks=12
    )
    assert outputs(tight, prompts, [params] * 4) == outputs(roomy, prompts, [params] * 4)
    assert tight.core_client.core.scheduler.num_preemptions > 0


@pytest.fixture
async def ahead_engine(tiny_model_dir):
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    await engine.shutdown()


async def test_async_scheduling_streams_to_the_end_and_aborts(ahead_engine) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = [o async for o in ahead_engine.generate("hello", params, "r")][-1]
    assert final.finished and len(final.outputs[0].token_ids) == 12
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    async for output in ahead_engine.generate("hello again", long, "long"):
        if len(output.outputs[0].token_ids) >= 3:
            ahead_engine.abort("long")
            break
    core = ahead_engine.core_client.core
    for _ in range(500):
        if not core.has_work():
            break
        await asyncio.sleep(0.01)
    assert not core.has_work() and core.kv_cache_manager.usage == 0


def test_scheduler_runs_ahead_of_the_sampled_token() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 5, max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("pen", 6, max_tokens=2, presence_penalty=0.5))
    first = scheduler.schedule()
    # step 2 is scheduled before step 1's tokens come back: both decode their placeholder
    second = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.token_ids) for s in second.scheduled] == [
        ("a", 1, []),
        ("pen", 1, []),
    ]
    scheduler.update_from_output(first, fake_run(first))
    # "pen" has 1 token and its second and last in flight: only "a" goes on
    third = scheduler.schedule()
    assert [(s.request.request_id, s.token_ids) for s in third.scheduled] == [("a", [])]
    scheduler.update_from_output(second, fake_run(second))
    assert scheduler.get_request("pen") is None
    # "a" has 2 tokens and its third and last in flight
    assert scheduler.schedule().is_empty
    scheduler.update_from_output(third, fake_run(third))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_input_batch_takes_a_token_still_on_the_device() -> None:
    batch = InputBatch(
        max_num_reqs=4,
        max_num_tokens=16,
        max_model_len=64,
        block_size=4,
        device=torch.device("cpu"),
    )
    waiting = make_request("w", 3)
    decoding = make_request("d", 2)
    decoding.num_output_placeholders = 1  # its third token is being sampled
    step = SchedulerOutput(
        [ScheduledRequest(waiting, 3, 0, [5]), ScheduledRequest(decoding, 1, 2, [6])]
    )
    assert step.scheduled[1].token_ids == []
    previous = DeviceTokens(torch.tensor([41, 42]), {"x": 0, "d": 1})
    inputs = batch.prepare(step, previous=previous)
    assert inputs.input_ids.tolist() == [10, 11, 12, 42]
    with pytest.raises(RuntimeError, match="neither on the host"):
        batch.prepare(step, previous=DeviceTokens(torch.tensor([41]), {"x": 0}))


def test_a_failed_step_spares_the_requests_new_in_the_step_behind_it(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), max_model_len=512, async_scheduling=True)
    client = llm.core_client
    runner = client.core.executor.model_runner
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def add(request_id: str, prompt: str) -> None:
        request, _ = llm.make_request(request_id, prompt, params)
        llm.add_request(request, None)

    real_sampler, calls = runner.sampler, []

    def sampler_failing_at_step_4(logits, meta):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected: the sampler fell over")
        return real_sampler(logits, meta)

    runner.sampler = sampler_failing_at_step_4
    add("a", "one two three")
    for _ in range(3):  # steps 1-4 launched (two in flight), 1-3 taken in
        assert all(o.finish_reason is None for o in client.get_output().outputs)
    add("b", "four five six")
    # launches a step with "a" (scheduled ahead) and "b", then takes in the failed step 4
    outputs = client.get_output().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
    b_tokens, finish, step = [], None, None
    while step is None or step.has_work:
        step = client.get_output()
        for o in step.outputs:
            assert o.request_id == "b"
            b_tokens += o.new_token_ids
            finish = o.finish_reason or finish
    assert (len(b_tokens), finish) == (8, "length")
    assert client.core.kv_cache_manager.usage == 0
