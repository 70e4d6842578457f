from collections.abc import Callable

import pytest

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from asyncllm.core.scheduler import Scheduler, check_fits
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.request import Request, RequestStatus
from asyncllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
EOS = 2


def make_request(
    request_id: str,
    prompt: list[int] | int,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    prompt_ids = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    return Request(
        request_id,
        prompt_ids,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=arrival_time,
    )


def make_scheduler(num_blocks: int = 64, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BLOCK_SIZE))


def fake_run(output: SchedulerOutput, token: Callable[[Request], int] = lambda r: 7):
    """A token for every scheduled request that reaches the end of its known tokens."""
    sampled = [token(s.request) if s.completes_prompt else None for s in output.scheduled]
    return ModelRunnerOutput(sampled)


def step(scheduler: Scheduler, token: Callable[[Request], int] = lambda r: 7):
    output = scheduler.schedule()
    finished = scheduler.update_from_output(output, fake_run(output, token))
    return output, finished


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        assert len(outputs) < max_steps
        outputs.append(step(scheduler)[0])
    return outputs


def scheduled_tokens(output: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


# request queues


def test_fcfs_queue_pops_in_arrival_order_and_prepend_goes_first():
    queue = FCFSRequestQueue()
    a, b, c = (make_request(i, 1) for i in "abc")
    queue.add(a)
    queue.add(b)
    queue.prepend(c)
    assert list(queue) == [c, a, b]
    assert queue.peek() is c and queue.pop() is c
    queue.remove(a)
    assert list(queue) == [b] and len(queue) == 1 and queue


def test_priority_queue_orders_by_priority_then_arrival():
    queue = PriorityRequestQueue()
    late_urgent = make_request("late_urgent", 1, priority=0, arrival_time=5.0)
    early = make_request("early", 1, priority=1, arrival_time=1.0)
    later = make_request("later", 1, priority=1, arrival_time=2.0)
    for request in (later, early, late_urgent):
        queue.add(request)
    assert list(queue) == [late_urgent, early, later]
    queue.remove_requests({early})
    assert [queue.pop(), queue.pop()] == [late_urgent, later]
    assert not queue


def test_create_request_queue_rejects_unknown_policy():
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")


# budget, batching, order


def test_fcfs_admits_requests_in_arrival_order():
    scheduler = make_scheduler(max_num_seqs=2)
    for request_id in "abc":
        scheduler.add_request(make_request(request_id, 3))
    output = scheduler.schedule()
    assert list(scheduled_tokens(output)) == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_max_num_seqs_is_respected():
    scheduler = make_scheduler(max_num_seqs=3)
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", 3, max_tokens=3))
    for output in run_until_done(scheduler):
        assert len(output.scheduled) <= 3
    assert scheduler.num_running == 0


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("long", 20, max_tokens=2)
    scheduler.add_request(request)
    chunks = [scheduled_tokens(step(scheduler)[0])["long"] for _ in range(4)]
    assert chunks == [8, 8, 4, 1]
    assert request.num_output_tokens == 2


def test_only_the_step_that_completes_the_prompt_samples_a_token():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("long", 12))
    first = scheduler.schedule()
    assert not first.scheduled[0].completes_prompt
    scheduler.update_from_output(first, ModelRunnerOutput([None]))
    second = scheduler.schedule()
    assert second.scheduled[0].completes_prompt
    assert second.scheduled[0].num_computed_tokens == 8


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 6))
    step(scheduler)
    scheduler.add_request(make_request("b", 20))
    assert scheduled_tokens(scheduler.schedule()) == {"a": 1, "b": 9}


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    scheduler = make_scheduler(
        max_num_batched_tokens=10, max_model_len=10, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 8))
    assert scheduled_tokens(scheduler.schedule()) == {"a": 6}
    assert scheduler.num_waiting == 1


def fits(scheduler: Scheduler, request: Request) -> None:
    manager = scheduler.kv_cache_manager
    check_fits(
        request.num_prompt_tokens,
        request.max_tokens,
        scheduler.config,
        manager.num_blocks,
        manager.block_size,
    )


def test_without_chunked_prefill_a_request_longer_than_the_budget_is_rejected():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill"):
        fits(scheduler, make_request("a", 6, max_tokens=4))  # 9 tokens after preemption
    fits(scheduler, make_request("b", 6, max_tokens=3))


def test_long_prefill_token_threshold_caps_a_chunk():
    scheduler = make_scheduler(long_prefill_token_threshold=5)
    scheduler.add_request(make_request("a", 12))
    scheduler.add_request(make_request("b", 3))
    assert scheduled_tokens(scheduler.schedule()) == {"a": 5, "b": 3}


def test_scheduled_request_carries_the_whole_block_table():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.block_ids == [0, 1, 2]
    assert scheduled.request.num_computed_tokens == 9


def test_a_request_never_holds_more_blocks_than_its_tokens_need():
    scheduler = make_scheduler()
    request = make_request("a", 5, max_tokens=8)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        blocks = scheduler.kv_cache_manager.get_block_ids(request)
        assert len(blocks) <= -(-request.num_tokens // BLOCK_SIZE)
        assert len(output.scheduled[0].block_ids) == -(-request.num_computed_tokens // BLOCK_SIZE)


# prefix caching through the scheduler


def test_shared_prefix_is_computed_once():
    scheduler = make_scheduler()
    prefix = list(range(100, 112))
    scheduler.add_request(make_request("a", prefix + [1, 3]))
    step(scheduler)
    scheduler.add_request(make_request("b", prefix + [4, 5, 6]))
    manager = scheduler.kv_cache_manager
    hits_before = manager.prefix_cache_hits
    output, _ = step(scheduler)
    assert scheduled_tokens(output)["b"] == 3
    assert manager.prefix_cache_hits - hits_before == 12
    b = scheduler.get_request("b")
    assert b.num_cached_tokens == 12
    a_blocks = manager.get_block_ids(scheduler.get_request("a"))
    assert manager.get_block_ids(b)[:3] == a_blocks[:3]


def test_finished_request_prefix_is_reused_by_a_later_identical_prompt():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == {"b": 2}
    assert output.scheduled[0].num_computed_tokens == 8


def test_identical_full_prompt_recomputes_only_the_last_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 8, max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(make_request("b", 8, max_tokens=1))
    output, _ = step(scheduler)
    # the last full block cannot be a hit: its last token must run to produce logits
    assert scheduled_tokens(output) == {"b": 4}


def test_prefix_caching_can_be_disabled():
    scheduler = Scheduler(SchedulerConfig(), KVCacheManager(64, BLOCK_SIZE, enable_caching=False))
    scheduler.add_request(make_request("a", 10, max_tokens=1))
    run_until_done(scheduler)
    scheduler.add_request(make_request("b", 10, max_tokens=1))
    assert scheduled_tokens(scheduler.schedule()) == {"b": 10}


# preemption


def test_preemption_frees_the_last_running_request_and_puts_it_first_in_waiting():
    scheduler = make_scheduler(num_blocks=4)
    a, b, c = (make_request(i, 8, max_tokens=6) for i in "abc")
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)  # a and b hold 2 blocks each; c waits (no blocks)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    output, _ = step(scheduler)  # a needs a third block: b is preempted
    assert output.preempted_req_ids == {"b"}
    assert scheduled_tokens(output) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert scheduler.kv_cache_manager.get_block_ids(b) == []
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 1


def test_preempted_requests_still_finish_with_all_their_tokens():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", 5, max_tokens=10) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    run_until_done(scheduler)
    assert scheduler.num_preemptions > 0
    assert [r.num_output_tokens for r in requests] == [10] * 4
    assert all(r.status is RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_a_request_alone_without_room_preempts_itself_and_resumes():
    scheduler = make_scheduler(num_blocks=3)
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    run_until_done(scheduler)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 1


def test_a_request_that_can_never_fit_is_rejected():
    scheduler = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="blocks"):
        fits(scheduler, make_request("a", 4, max_tokens=6))
    fits(scheduler, make_request("b", 4, max_tokens=5))  # 8 tokens computed at most


# priority policy


def test_priority_policy_admits_lower_priority_value_first():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("low", 3, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("high", 3, priority=0, arrival_time=2.0))
    assert list(scheduled_tokens(scheduler.schedule())) == ["high"]


def test_priority_policy_preempts_the_lowest_priority_latest_arrival():
    scheduler = make_scheduler(num_blocks=6, policy="priority")
    first = make_request("first", 8, max_tokens=6, priority=0, arrival_time=1.0)
    old_low = make_request("old_low", 8, max_tokens=6, priority=1, arrival_time=2.0)
    new_low = make_request("new_low", 8, max_tokens=6, priority=1, arrival_time=3.0)
    for request in (first, old_low, new_low):
        scheduler.add_request(request)
    step(scheduler)  # 2 blocks each: the pool is full
    output, _ = step(scheduler)  # each needs a third block
    assert output.preempted_req_ids == {"new_low"}
    assert scheduled_tokens(output) == {"first": 1, "old_low": 1}


def test_priority_victim_already_scheduled_this_step_gives_back_its_tokens():
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    low = make_request("low", 8, max_tokens=6, priority=9, arrival_time=1.0)
    high = make_request("high", 4, max_tokens=6, priority=0, arrival_time=2.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(high)
    step(scheduler)  # low holds 3 blocks, high 1: the pool is full
    # low is scheduled first (its third block has room), then high needs a block and preempts it
    output, _ = step(scheduler)
    assert output.preempted_req_ids == {"low"}
    assert scheduled_tokens(output) == {"high": 1}
    assert output.total_num_scheduled_tokens == 1


def test_priority_waiting_request_preempts_a_lower_priority_running_one():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    low = make_request("low", 3, max_tokens=5, priority=5, arrival_time=1.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(make_request("high", 3, priority=0, arrival_time=2.0))
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == {"high": 3}
    assert output.preempted_req_ids == {"low"}
    assert low.status is RequestStatus.PREEMPTED


def test_fcfs_waiting_request_never_preempts():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 3, max_tokens=5, priority=5))
    step(scheduler)
    scheduler.add_request(make_request("b", 3, priority=0))
    output, _ = step(scheduler)
    assert scheduled_tokens(output) == {"a": 1}
    assert scheduler.num_preemptions == 0


# finishing


def test_finish_requests_frees_blocks_and_reports_the_id_next_step():
    scheduler = make_scheduler(num_blocks=8)
    request = make_request("a", 9, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert request.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_request("a") is None
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert scheduler.schedule().finished_req_ids == set()


def test_finish_requests_removes_a_waiting_request():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("a", 3))
    scheduler.add_request(make_request("b", 3))
    step(scheduler)
    scheduler.finish_requests(["b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_waiting == 0
    assert scheduler.num_running == 1


def test_finish_requests_needs_a_finished_status():
    scheduler = make_scheduler()
    with pytest.raises(ValueError):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_request_aborted_during_a_step_ignores_its_sampled_token():
    scheduler = make_scheduler()
    request = make_request("a", 3)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(output, fake_run(output)) == []
    assert request.output_token_ids == []


# stop conditions


def test_max_tokens_finishes_with_length():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=3)
    scheduler.add_request(request)
    finished = [step(scheduler)[1] for _ in range(3)]
    assert finished[-1] == [request]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.num_output_tokens == 3


def test_eos_finishes_with_stop_and_no_stop_reason():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10)
    scheduler.add_request(request)
    step(scheduler)
    _, finished = step(scheduler, lambda r: EOS)
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason is None
    assert request.output_token_ids == [7, EOS]


def test_stop_token_id_finishes_with_it_as_stop_reason():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10, stop_token_ids=[99])
    scheduler.add_request(request)
    _, finished = step(scheduler, lambda r: 99)
    assert finished == [request]
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 99


def test_ignore_eos_keeps_generating_until_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=4, ignore_eos=True)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        step(scheduler, lambda r: EOS)
    assert request.output_token_ids == [EOS] * 4
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_min_tokens_delays_eos_and_stop_tokens():
    scheduler = make_scheduler()
    request = make_request("a", 3, max_tokens=10, min_tokens=3, stop_token_ids=[99])
    scheduler.add_request(request)
    tokens = iter([EOS, 99, EOS])
    while scheduler.has_unfinished_requests():
        step(scheduler, lambda r: next(tokens))
    assert request.output_token_ids == [EOS, 99, EOS]
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=6)
    request = make_request("a", 4, max_tokens=10)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request.num_tokens == 6
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED


def test_finished_requests_free_their_blocks_and_are_reported_once():
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request("a", 5, max_tokens=1))
    _, finished = step(scheduler)
    assert [r.request_id for r in finished] == ["a"]
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert scheduler.num_running == 0
    assert scheduler.schedule().finished_req_ids == {"a"}
    assert scheduler.schedule().finished_req_ids == set()
