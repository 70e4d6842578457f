"""Draft tokens in the scheduler: lookahead slots, rollback of rejected positions, and a prefix
cache that never hashes a rejected draft."""

from asyncllm.config import SchedulerConfig
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput, VerifiedTokens
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(prompt: list[int], max_tokens: int = 32, request_id: str = "r") -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, max_tokens=max_tokens)


def make_scheduler(num_blocks: int = 64, **config) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    config.setdefault("num_lookahead_tokens", 4)
    return Scheduler(SchedulerConfig(**config), kv), kv


def verified(output: SchedulerOutput, tokens: list[int]) -> ModelRunnerOutput:
    """The one scheduled request produced these tokens from its drafts."""
    (scheduled,) = output.scheduled
    result = ModelRunnerOutput([tokens[0]])
    result.verified = VerifiedTokens([list(tokens)], [len(scheduled.spec_token_ids)])
    return result


def prefill(scheduler: Scheduler, request: Request, token: int) -> None:
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput([token]))


def test_drafts_follow_the_last_token_with_a_slot_each():
    scheduler, kv = make_scheduler()
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7]
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.num_new_tokens == 4
    assert scheduled.token_ids == [4, 5, 6, 7]
    assert scheduled.spec_token_ids == [5, 6, 7]
    # positions 0..6 hold KV: two blocks of four
    assert len(scheduled.block_ids) == 2
    assert request.spec_token_ids == []


def test_rejected_drafts_roll_back_the_computed_tokens():
    scheduler, _ = make_scheduler()
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7]
    output = scheduler.schedule()
    # the first draft accepted, the second rejected: the target sampled 9 there
    scheduler.update_from_output(output, verified(output, [5, 9]))
    assert request.output_token_ids == [4, 5, 9]
    assert request.num_computed_tokens == 5  # 1, 2, 3, 4, 5; 9 is not computed yet
    (scheduled,) = scheduler.schedule().scheduled
    assert (scheduled.num_computed_tokens, scheduled.token_ids) == (5, [9])


def test_a_rejected_draft_is_never_hashed_into_the_prefix_cache():
    scheduler, kv = make_scheduler()
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    output = scheduler.schedule()
    # positions 4..7 (the second block) were computed with drafts 5, 6, 7; all rejected
    scheduler.update_from_output(output, verified(output, [9]))
    assert kv._tables["r"].num_cached == 1
    assert len(request.block_hashes) == 1
    other = make_request([1, 2, 3, 4, 5, 6, 7, 8, 0], request_id="other")
    assert kv.get_computed_blocks(other)[1] == BLOCK_SIZE


def test_accepted_drafts_fill_blocks_that_are_cached():
    scheduler, kv = make_scheduler()
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    output = scheduler.schedule()
    scheduler.update_from_output(output, verified(output, [5, 6, 7, 8, 9]))
    assert request.num_computed_tokens == 8
    assert kv._tables["r"].num_cached == 2


def test_drafts_are_cut_to_the_tokens_left_and_the_budget():
    scheduler, _ = make_scheduler(max_num_batched_tokens=3)
    request = make_request([1, 2, 3], max_tokens=4)
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.spec_token_ids == [5, 6]  # budget 3: the last token and two drafts


def test_drafts_stop_at_max_tokens():
    scheduler, _ = make_scheduler()
    request = make_request([1, 2, 3], max_tokens=3)
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.spec_token_ids == [5]  # two more outputs: one draft and the bonus


def test_a_stop_inside_the_accepted_tokens_drops_the_rest():
    scheduler, _ = make_scheduler()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=32), frozenset({6}), 32)
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7]
    output = scheduler.schedule()
    result = verified(output, [5, 6, 7, 8])
    (finished,) = scheduler.update_from_output(output, result)
    assert finished.output_token_ids == [4, 5, 6]
    assert result.verified.token_ids == [[5, 6]]


def test_with_speculation_a_request_is_not_scheduled_ahead_of_its_tokens():
    scheduler, _ = make_scheduler()
    request = make_request([1, 2, 3])
    scheduler.add_request(request)
    scheduler.schedule()
    assert scheduler.schedule().is_empty  # its drafts will follow the token in flight


def test_a_request_with_drafts_in_flight_waits_for_their_verdict():
    scheduler, _ = make_scheduler()
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6]
    first = scheduler.schedule()
    assert scheduler.schedule().is_empty  # how far it gets is not known yet
    scheduler.update_from_output(first, verified(first, [5, 6, 1]))
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.token_ids == [1]


def test_drafts_without_room_are_dropped_instead_of_preempting():
    scheduler, kv = make_scheduler(num_blocks=3)
    request = make_request([1, 2, 3])
    other = make_request([1, 9, 9, 9, 9], request_id="other")
    scheduler.add_request(request)
    scheduler.add_request(other)
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput([4, 5]))
    assert kv.num_free_blocks == 0
    request.spec_token_ids = [5, 6]  # positions 4 and 5 would need another block
    output = scheduler.schedule()
    assert [s.spec_token_ids for s in output.scheduled] == [[], []]
    assert not output.preempted_req_ids


def test_with_drafts_on_the_device_a_request_runs_ahead_counting_its_drafts_accepted():
    scheduler, _ = make_scheduler(drafts_on_device=True)
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    first = scheduler.schedule()  # computes positions 3..7: the last token and four drafts
    (ahead,) = scheduler.schedule().scheduled
    # its input token and drafts come from the device; it starts as if all four were accepted
    assert ahead.drafts_on_device and ahead.token_ids == []
    assert (ahead.num_computed_tokens, ahead.num_new_tokens) == (8, 5)
    assert len(ahead.block_ids) == 4  # up to position 12: room however many are accepted
    scheduler.update_from_output(first, verified(first, [5, 9]))  # three drafts rejected
    assert request.all_token_ids == [1, 2, 3, 4, 5, 9]
    # the step in flight really starts at position 5 (the runner moves it back on the device)
    assert request.num_computed_tokens == 5 + 5
    scheduler.update_from_output(
        SchedulerOutput([ahead]), verified(SchedulerOutput([ahead]), [10, 11, 12])
    )
    assert request.all_token_ids == [1, 2, 3, 4, 5, 9, 10, 11, 12]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_a_step_run_ahead_hashes_no_block_past_its_computed_tokens():
    scheduler, kv = make_scheduler(drafts_on_device=True)
    request = make_request([1, 2, 3])
    prefill(scheduler, request, 4)
    request.spec_token_ids = [5, 6, 7, 8]
    first = scheduler.schedule()
    ahead = SchedulerOutput(scheduler.schedule().scheduled)
    scheduler.update_from_output(first, verified(first, [5, 6, 9]))
    scheduler.update_from_output(ahead, verified(ahead, [10]))  # its four drafts rejected
    # 1 2 3 4 | 5 6 9 10: the KV of 10 is not computed, so the second block is not cached
    # (the step's scheduled start, 8, would say nine tokens computed)
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6, 9, 10]
    assert (
        kv.get_computed_blocks(make_request([1, 2, 3, 4, 5, 6, 9, 10, 11], request_id="x"))[1] == 4
    )


def test_requests_that_count_their_tokens_do_not_run_ahead():
    scheduler, _ = make_scheduler(drafts_on_device=True)
    seeded = Request("s", [1, 2, 3], SamplingParams(max_tokens=32, seed=1), max_tokens=32)
    prefill(scheduler, seeded, 4)
    seeded.spec_token_ids = [5, 6]
    scheduler.schedule()
    assert scheduler.schedule().is_empty
