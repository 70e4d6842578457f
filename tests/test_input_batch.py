"""The persistent input batch builds the same step inputs as a from-scratch computation."""

import torch

from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.step_plan import StepPlan, StepRunner

BLOCK = 4


def request(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams())


def cpu_batch(max_num_reqs: int, max_tokens: int) -> InputBatch:
    return InputBatch(
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_tokens,
        max_model_len=max_tokens,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )


def scheduled(req: Request, computed: int, new: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req, num_new_tokens=new, num_computed_tokens=computed, block_ids=blocks)


def expected_slots(s: ScheduledRequest) -> list[int]:
    span = range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens)
    return [s.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in span]


def check(batch: InputBatch, out: SchedulerOutput) -> None:
    inputs = batch.prepare(out)
    ids = sum(
        (
            s.request.all_token_ids[
                s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens
            ]
            for s in out.scheduled
        ),
        [],
    )
    positions = sum(
        (
            list(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
            for s in out.scheduled
        ),
        [],
    )
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == positions
    assert inputs.meta.slot_mapping.tolist() == sum((expected_slots(s) for s in out.scheduled), [])
    assert inputs.meta.seq_lens.tolist() == [
        s.num_computed_tokens + s.num_new_tokens for s in out.scheduled
    ]
    assert inputs.meta.query_lens_cpu == [s.num_new_tokens for s in out.scheduled]
    for row, s in enumerate(out.scheduled):
        assert inputs.meta.block_tables[row, : len(s.block_ids)].tolist() == s.block_ids
    sampling = [i for i, s in enumerate(out.scheduled) if s.completes_prompt]
    assert inputs.sampling_rows == sampling
    last_rows = torch.tensor(inputs.meta.query_start_loc[1:].tolist())[sampling] - 1
    rows = torch.arange(inputs.padded_tokens)[inputs.logits_indices]  # a tensor or a slice
    assert rows.tolist() == last_rows.tolist()


def test_prefill_chunks_then_decode_with_growing_tables() -> None:
    batch = cpu_batch(max_num_reqs=4, max_tokens=64)
    a, b = request("a", 10), request("b", 3)
    check(batch, SchedulerOutput([scheduled(a, 0, 6, [7, 2]), scheduled(b, 0, 3, [5])]))
    b.append_output_token(9)
    check(batch, SchedulerOutput([scheduled(a, 6, 4, [7, 2, 9]), scheduled(b, 3, 1, [5])]))
    a.append_output_token(11)
    b.append_output_token(12)
    check(batch, SchedulerOutput([scheduled(a, 10, 1, [7, 2, 9]), scheduled(b, 4, 1, [5, 1])]))


def test_finished_rows_are_reused_with_fresh_tables() -> None:
    batch = cpu_batch(max_num_reqs=1, max_tokens=16)
    a = request("a", 5)
    check(batch, SchedulerOutput([scheduled(a, 0, 5, [3, 4])]))
    c = request("c", 2)
    out = SchedulerOutput([scheduled(c, 0, 2, [6])], finished_req_ids={"a"})
    check(batch, out)
    assert set(batch.rows) == {"c"}


def test_padding_rows_write_nowhere() -> None:
    batch = cpu_batch(max_num_reqs=8, max_tokens=16)
    a = request("a", 3)
    a.append_output_token(1)
    plan = StepPlan(StepRunner.DECODE_GRAPH, num_tokens=4, num_reqs=4, pure_decode=True)
    inputs = batch.prepare(SchedulerOutput([scheduled(a, 3, 1, [2])]), plan)
    assert inputs.padded_tokens == 4
    assert inputs.meta.slot_mapping.tolist() == [2 * BLOCK + 3, -1, -1, -1]
    assert inputs.meta.seq_lens.tolist() == [4, 1, 1, 1]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.meta.max_seq_len == 16  # the decode graphs' value, whatever the lengths


def test_padding_tokens_belong_to_no_request_and_write_nowhere() -> None:
    batch = cpu_batch(max_num_reqs=8, max_tokens=16)
    a, b = request("a", 5), request("b", 3)
    b.append_output_token(7)
    out = SchedulerOutput([scheduled(a, 0, 5, [1, 2]), scheduled(b, 3, 1, [3])])
    inputs = batch.prepare(out, StepPlan(StepRunner.PIECEWISE_GRAPHS, num_tokens=9, num_reqs=2))
    assert inputs.padded_tokens == 9
    assert inputs.input_ids.tolist() == [100, 101, 102, 103, 104, 7, 0, 0, 0]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 3, 0, 0, 0]
    assert inputs.meta.slot_mapping.tolist()[6:] == [-1, -1, -1]
    # the requests' own metadata is untouched: the padding is past query_start_loc[-1]
    assert inputs.meta.query_start_loc.tolist() == [0, 5, 6]
    assert inputs.meta.seq_lens.tolist() == [5, 4]
    assert inputs.logits_indices.tolist() == [4, 5]


def test_whole_step_graph_padding_adds_requests_of_no_tokens() -> None:
    """A whole-step mixed graph takes a fixed number of requests: the step's own, then
    requests that start where the last real query ends, with no tokens and no context."""
    batch = cpu_batch(max_num_reqs=8, max_tokens=16)
    a, b = request("a", 5), request("b", 3)
    b.append_output_token(7)
    out = SchedulerOutput([scheduled(a, 0, 5, [1, 2]), scheduled(b, 3, 1, [3])])
    inputs = batch.prepare(out, StepPlan(StepRunner.SHORT_STEP_GRAPH, num_tokens=9, num_reqs=5))
    assert inputs.padded_tokens == 9
    assert inputs.meta.query_start_loc.tolist() == [0, 5, 6, 6, 6, 6]
    assert inputs.meta.seq_lens.tolist() == [5, 4, 0, 0, 0]
    assert inputs.meta.block_tables.shape[0] == 5
    assert inputs.meta.query_lens_cpu == [5, 1] and inputs.meta.num_reqs == 2
    assert inputs.logits_indices.tolist() == [4, 5]
