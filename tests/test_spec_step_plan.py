"""The plans of verify steps: uniform ones (every request a token and k drafts) pad to a batch
size of their own and replay a graph of b x (k + 1) tokens; the others take the ladder."""

import torch

from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.step_plan import StepPlan, StepPlanner, StepRunner, verify_batch_sizes

K = 4
CPU = torch.device("cpu")
PLANNER = StepPlanner.from_limits(
    max_num_seqs=256,
    max_num_tokens=2048,
    max_short_step_tokens=768,
    graphs=True,
    num_speculative_tokens=K,
)


def verify_step(*num_drafts: int) -> SchedulerOutput:
    """Requests of 10 tokens, each verifying its drafts after its last token."""
    scheduled = []
    for i, n in enumerate(num_drafts):
        request = Request(f"r{i}", list(range(10, 20)), SamplingParams())
        drafts = list(range(30, 30 + n))
        scheduled.append(ScheduledRequest(request, n + 1, 9, [0], drafts))
    return SchedulerOutput(scheduled)


def test_a_batch_1_verify_step_runs_a_graph_of_its_own_5_tokens() -> None:
    plan = PLANNER.plan(verify_step(K), scores_prompt=False)
    assert plan == StepPlan(StepRunner.VERIFY_GRAPH, K + 1, 1)


def test_uniform_verify_steps_pad_to_the_next_batch_size_with_empty_requests() -> None:
    assert PLANNER.plan(verify_step(K, K, K), False) == StepPlan(StepRunner.VERIFY_GRAPH, 20, 4)
    assert PLANNER.plan(verify_step(*[K] * 17), False) == StepPlan(
        StepRunner.VERIFY_GRAPH, 24 * (K + 1), 24
    )


def test_verify_steps_with_fewer_drafts_or_too_many_rows_take_the_token_ladder() -> None:
    assert PLANNER.plan(verify_step(K, 2), False).runner is StepRunner.SHORT_STEP_GRAPH
    assert PLANNER.plan(verify_step(*[K] * 160), False) == StepPlan(
        StepRunner.PIECEWISE_GRAPHS, 896, 160
    )
    # a step scoring prompt logprobs needs the hidden states of the ladder's plans
    assert PLANNER.plan(verify_step(K), True).runner is StepRunner.SHORT_STEP_GRAPH


def test_verify_batch_sizes_fit_the_whole_step_graphs() -> None:
    sizes = verify_batch_sizes(256, K + 1, 768)
    assert sizes[:4] == (1, 2, 4, 8) and sizes[-1] == 152
    assert verify_batch_sizes(256, 0, 768) == ()
    assert verify_batch_sizes(2, K + 1, 768) == (1, 2)


def test_without_speculation_no_verify_graphs_are_planned() -> None:
    planner = StepPlanner.from_limits(16, 2048, 768, graphs=True)
    assert not planner.graph_plans(StepRunner.VERIFY_GRAPH)
    assert planner.plan(verify_step(K), False).runner is StepRunner.SHORT_STEP_GRAPH


def test_without_graphs_verify_steps_pad_as_the_graphs_would() -> None:
    eager = StepPlanner.from_limits(16, 2048, 768, graphs=False, num_speculative_tokens=K)
    assert eager.plan(verify_step(K, K, K), False) == StepPlan(StepRunner.EAGER, 20, 4)
    assert not eager.graph_plans(StepRunner.VERIFY_GRAPH)


def test_every_verify_plan_has_its_graph_captured() -> None:
    captured = PLANNER.graph_plans(StepRunner.VERIFY_GRAPH)
    assert len({p.num_tokens for p in captured}) == len(captured)
    for n in range(1, 153):
        assert PLANNER.plan(verify_step(*[K] * n), False) in captured


def test_a_padded_verify_step_scores_every_real_row_and_pads_with_empty_requests() -> None:
    batch = InputBatch(
        max_num_reqs=8, max_num_tokens=64, max_model_len=64, block_size=4, device=CPU
    )
    out = verify_step(K, K, K)
    inputs = batch.prepare(out, PLANNER.plan(out, False))
    assert inputs.padded_tokens == 20
    assert inputs.meta.query_start_loc.tolist() == [0, 5, 10, 15, 15]
    assert inputs.meta.seq_lens.tolist() == [14, 14, 14, 0]
    assert batch.slot_mapping.np[15:20].tolist() == [-1] * 5
    assert inputs.logits_indices.tolist() == list(range(15))
    assert inputs.input_ids[:5].tolist() == [19, 30, 31, 32, 33]
