"""A step that fails while other requests still compile their grammar, or wait for a parallel
sample's prompt: the engine fails the step's requests (and the samples waiting for them) and
goes on with the others once their grammars are ready, without hanging."""

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable

import pytest
from test_structured_outputs import COLORS, assert_colors

from asyncllm import LLM, SamplingParams

SLOW = {"regex": "(yes|no)"}  # the grammar that compiles only after the failed step


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(
    params=[{}, {"speculative_config": NGRAM}, {"async_scheduling": False}],
    ids=["async", "async-speculating", "sync"],
)
def llm(tiny_model_dir, request):
    # prompts of more than one step: a parallel sample's siblings wait while it is computed
    kwargs = dict(max_model_len=512, max_num_batched_tokens=16, async_scheduling=True)
    return LLM(model=str(tiny_model_dir), **kwargs | request.param)


def fail_first_sampling(llm: LLM) -> threading.Event:
    """The first step that samples raises; the event is set once it has."""
    runner = llm.core_client.core.executor.model_runner
    real_sampler, failed = runner.sampler, threading.Event()

    def sampler(logits, meta):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("injected: the sampler fell over")
        return real_sampler(logits, meta)

    runner.sampler = sampler
    return failed


def compile_slowly_until(llm: LLM, event: threading.Event, slow: Callable[[int], bool]) -> None:
    """The grammars of the requests whose index among those constrained from now on slow()
    picks are ready only after event is set (and the engine's next few steps)."""
    compiler = llm.core_client.core.grammar_compiler
    real_submit, requests = compiler.submit, itertools.count()

    def submit(params):
        if not slow(next(requests)):
            return real_submit(params)
        compiled = concurrent.futures.Future()

        def compile_late():
            assert event.wait(30)
            time.sleep(0.2)
            compiled.set_result(compiler.compile(params))

        threading.Thread(target=compile_late, name="slow-compile", daemon=True).start()
        return compiled

    compiler.submit = submit


def record_scheduled(core) -> list[str]:
    """The ids of the requests of each step the scheduler makes from now on, in order."""
    scheduled, schedule = [], core.scheduler.schedule

    def recording_schedule():
        output = schedule()
        scheduled.extend(s.request.request_id for s in output.scheduled)
        return output

    core.scheduler.schedule = recording_schedule
    return scheduled


PROMPT = "Answer: " + "one two three " * 12


def run(llm: LLM, requests: dict[str, SamplingParams], limit_s: float = 30) -> dict:
    """Adds the requests and steps the engine to its end: request id -> finished outputs."""
    client = llm.core_client
    for request_id, params in requests.items():
        request, _ = llm.make_request(request_id, PROMPT, params)
        llm.add_request(request, None)
    finished, step, deadline = {}, None, time.monotonic() + limit_s
    while step is None or step.has_work:
        assert time.monotonic() < deadline, f"the engine hangs; finished: {sorted(finished)}"
        step = client.get_output()
        for output in llm.process_step(step):
            finished[output.request_id] = output
    return finished


def test_a_request_compiling_while_a_step_fails_runs_after(llm) -> None:
    failed = fail_first_sampling(llm)
    compile_slowly_until(llm, failed, lambda call: call == 0)  # "b"'s
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    slow = SamplingParams(temperature=0, max_tokens=8, structured_outputs=SLOW)
    finished = run(llm, {"b": slow, "a": free})
    assert finished["a"].error is not None
    assert finished["b"].error is None and finished["b"].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("sibling", ["waiting", "compiling"])
def test_parallel_samples_of_a_failed_step_finish(llm, sibling) -> None:
    """Sample 1's grammar is ready (cached) while sample 0's prompt is computed: it waits for
    that prompt, which the failed step never computes. Without a step behind the failed one
    (no async scheduling, or speculating: no request runs ahead) nothing released it. Or its
    grammar is ready only after the failure: it fails too, instead of running for a parent
    that has failed."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=0, max_tokens=60, structured_outputs={"json": COLORS}
    )
    llm.generate("Answer:", params, use_tqdm=False)  # compiles the grammar
    failed = fail_first_sampling(llm)
    if sibling == "compiling":  # sample 1's grammar is ready only after the failed step
        compile_slowly_until(llm, failed, lambda call: call == 1)
    core = llm.core_client.core
    scheduled = record_scheduled(core)
    finished = run(llm, {"p": params})
    assert finished["p"].error is not None
    assert "0_p" in scheduled and "1_p" not in scheduled  # failed with sample 0, never run
    assert not core.has_work() and not core.scheduler.requests
    (after,) = llm.generate("Answer:", params, use_tqdm=False)
    for completion in after.outputs:
        assert_colors(completion.text)


def test_a_parallel_sample_waits_for_a_sibling_whose_grammar_still_compiles(llm) -> None:
    """Sample 0's grammar is ready after sample 1's: sample 1 still waits for sample 0's
    prompt, instead of taking sample 0 for done because the scheduler has not seen it."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=0, max_tokens=60, structured_outputs={"json": COLORS}
    )
    ready = threading.Event()
    ready.set()
    compile_slowly_until(llm, ready, lambda call: call == 0)  # sample 0's, 0.2 s late
    core = llm.core_client.core
    scheduled = record_scheduled(core)
    finished = run(llm, {"p": params})
    assert finished["p"].error is None
    assert scheduled.index("0_p") < scheduled.index("1_p")
    for completion in finished["p"].outputs:
        assert_colors(completion.text)
