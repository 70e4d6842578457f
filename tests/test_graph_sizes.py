"""The sizes CUDA graphs are captured at, and the plan each step gets: every step fits one
size, with bounded padding, and runs in the graphs that hold it."""

from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.step_plan import (
    StepPlan,
    StepPlanner,
    StepRunner,
    batch_size_ladder,
    token_count_ladder,
)

PLANNER = StepPlanner.from_limits(
    max_num_seqs=16, max_num_tokens=2048, max_short_step_tokens=768, graphs=True
)


def test_decode_batch_sizes_cover_every_batch() -> None:
    sizes = batch_size_ladder(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(next(s for s in sizes if s >= n) - n < 8 for n in range(1, 101))


def test_token_counts_cover_steps_up_to_the_cap_with_under_a_quarter_of_padding() -> None:
    for max_tokens in (100, 512, 1000, 2048, 3000, 8192, 20000):
        sizes = token_count_ladder(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_tokens, 16384)
        for n in range(1, sizes[-1] + 1):
            size = next(s for s in sizes if s >= n)
            assert size <= max_tokens
            assert size - n < 64 or (size - n) * 4 < n
    assert token_count_ladder(2000, cap=512)[-1] == 512


def step(*num_new_tokens: int) -> SchedulerOutput:
    """Requests with a 2,000-token prompt, each scheduled at its start."""
    prompt = list(range(10, 2010))
    return SchedulerOutput(
        [
            ScheduledRequest(Request(f"r{i}", prompt, SamplingParams()), n, 0, [0])
            for i, n in enumerate(num_new_tokens)
        ]
    )


def test_decode_graphs_take_one_token_steps_unless_a_prompt_token_is_scored() -> None:
    """A request asking for prompt_logprobs decodes in the graphs once its prompt is done;
    a one-token chunk inside its prompt still needs the hidden states."""

    def plan(computed: int, logprobs: int | None) -> StepPlan:
        request = Request("r", list(range(10, 20)), SamplingParams(prompt_logprobs=logprobs))
        scheduled = SchedulerOutput([ScheduledRequest(request, 1, computed, [0])])
        return PLANNER.plan(scheduled, scores_prompt=logprobs is not None and computed < 9)

    decode = StepPlan(StepRunner.DECODE_GRAPH, 1, 1, pure_decode=True)
    assert plan(10, 2) == decode
    assert plan(9, 2) == decode  # the last prompt token
    assert plan(5, 2) == StepPlan(StepRunner.EAGER, 64, 1)
    assert plan(5, None) == decode


def test_decode_steps_pad_to_the_next_batch_size() -> None:
    assert PLANNER.plan(step(1, 1, 1), False) == StepPlan(StepRunner.DECODE_GRAPH, 4, 4, True)


def test_short_steps_replay_whole_graphs_with_requests_padded_to_the_graphs_count() -> None:
    assert PLANNER.plan(step(1, 1, 100), False) == StepPlan(StepRunner.SHORT_STEP_GRAPH, 128, 16)
    assert PLANNER.plan(step(30), False) == StepPlan(StepRunner.SHORT_STEP_GRAPH, 64, 16)


def test_bigger_steps_replay_piecewise_graphs_and_past_the_ladder_run_eagerly() -> None:
    assert PLANNER.plan(step(1, 900), False) == StepPlan(StepRunner.PIECEWISE_GRAPHS, 1024, 2)
    planner = StepPlanner.from_limits(16, 20000, 768, graphs=True)
    assert planner.plan(step(1, 16999), False) == StepPlan(StepRunner.EAGER, 17000, 2)


def test_without_graphs_steps_pad_as_the_graphs_would_and_run_eagerly() -> None:
    eager = StepPlanner.from_limits(16, 2048, 768, graphs=False)
    assert eager.plan(step(1, 1, 1), False) == StepPlan(StepRunner.EAGER, 4, 4, True)
    assert eager.plan(step(1, 1, 100), False) == StepPlan(StepRunner.EAGER, 128, 3)
    assert all(not eager.graph_plans(runner) for runner in StepRunner)


def test_without_sizes_steps_run_as_scheduled() -> None:
    assert StepPlanner().plan(step(1, 1), False) == StepPlan(StepRunner.EAGER, 2, 2)
    assert StepPlanner().plan(step(5, 1), False) == StepPlan(StepRunner.EAGER, 6, 2)


def test_every_plan_a_step_gets_has_its_graph_captured() -> None:
    """Whole-step graphs are captured at the step's own plan; the piecewise ones at its token
    count, for any number of requests (their pieces read no request metadata)."""
    captured = {runner: PLANNER.graph_plans(runner) for runner in StepRunner}
    assert not captured[StepRunner.EAGER]
    for counts in [(1,) * n for n in range(1, 17)] + [(1, n) for n in range(2, 2048, 7)]:
        plan = PLANNER.plan(step(*counts), False)
        if plan.runner is StepRunner.PIECEWISE_GRAPHS:
            assert plan.num_tokens in {p.num_tokens for p in captured[plan.runner]}
        elif plan.runner is not StepRunner.EAGER:
            assert plan in captured[plan.runner]
