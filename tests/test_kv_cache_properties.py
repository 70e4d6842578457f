"""Random add / step / finish / abort sequences against a small pool, checking invariants."""

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncllm.config import SchedulerConfig
from asyncllm.core import kv_cache_manager as kvm
from asyncllm.core.kv_cache_manager import KVCacheManager, cdiv
from asyncllm.core.scheduler import Scheduler, check_fits
from asyncllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from asyncllm.request import Request, RequestStatus
from asyncllm.sampling_params import SamplingParams

EOS = 0
# a few shared prefixes over a tiny vocabulary, so that prefix hits (and collisions) are common
PREFIXES = [[], [1, 2, 3, 1, 2, 3, 1, 2], [1, 2, 3, 1, 3, 3], [3, 2, 1]]


@dataclass
class FakeRunner:
    """Stands in for the model: each slot remembers the whole prefix its KV was computed from,
    so reading a slot written for another prefix (a wrong prefix hit) is caught."""

    block_size: int
    kv: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput, manager: KVCacheManager) -> ModelRunnerOutput:
        for s in output.scheduled:
            tokens = s.request.all_token_ids
            for pos in range(s.num_computed_tokens):
                assert self.kv[self._slot(s.block_ids, pos)] == tuple(tokens[: pos + 1])
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                block = manager.block_pool.blocks[s.block_ids[pos // self.block_size]]
                assert block.ref_cnt == 1 and block.block_hash is None, "write to a shared block"
                self.kv[self._slot(s.block_ids, pos)] = tuple(tokens[: pos + 1])
        return ModelRunnerOutput([self._sample(s.request) if s.completes_prompt else None
                                  for s in output.scheduled])  # fmt: skip

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _sample(self, request: Request) -> int:
        token = (sum(request.all_token_ids) * 7 + request.num_tokens) % 12
        return token if token < 5 else 1 + token % 4  # EOS about one time in twelve


def check_invariants(scheduler: Scheduler, finished: list[Request]) -> None:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    bs = manager.block_size
    live = list(scheduler.requests.values())
    tables = {r.request_id: manager.get_blocks(r) for r in live}
    assert all(manager.get_blocks(r) == [] for r in finished)

    holders = Counter(b.block_id for table in tables.values() for b in table)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id]

    free_ids = [b.block_id for b in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert pool.num_free_blocks + len(holders) == pool.num_blocks

    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_blocks)

    owners: dict[int, list[tuple[Request, int]]] = defaultdict(list)
    for request in live:
        for index, block in enumerate(tables[request.request_id]):
            owners[block.block_id].append((request, index))
    for block_id, holders_of_block in owners.items():
        if len(holders_of_block) == 1:
            continue
        block = pool.blocks[block_id]
        assert block.block_hash is not None, "a shared block must be a cached full block"
        prefixes = {tuple(r.all_token_ids[: (i + 1) * bs]) for r, i in holders_of_block}
        assert len(prefixes) == 1, "a shared block must hold the same prefix for every holder"
        assert block.token_ids == next(iter(prefixes))[-bs:]

    for request in live:
        table = tables[request.request_id]
        assert len(table) <= cdiv(request.num_tokens, bs)
        if request.status is RequestStatus.RUNNING:
            assert len(table) == cdiv(request.num_computed_tokens, bs)
        else:
            assert table == [] and request.num_computed_tokens == 0


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config = scheduler.config
    ids = [s.request.request_id for s in output.scheduled]
    assert len(ids) == len(set(ids)) <= config.max_num_seqs
    assert 0 < output.total_num_scheduled_tokens <= config.max_num_batched_tokens or not ids
    assert not output.preempted_req_ids & set(ids)


add_op = st.tuples(
    st.just("add"),
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(1, 4), min_size=0, max_size=6),
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # priority
)
step_op = st.tuples(st.just("step"))
finish_op = st.tuples(st.sampled_from(["finish", "abort", "abort_mid_step"]), st.integers(0, 50))
ops_strategy = st.lists(
    st.one_of(add_op, add_op, step_op, step_op, step_op, finish_op), min_size=20, max_size=60
)


def can_never_run(request: Request, config: SchedulerConfig, manager: KVCacheManager) -> bool:
    prompt_len = request.num_prompt_tokens
    final_len = min(prompt_len + request.max_tokens, config.max_model_len)
    most_computed = max(prompt_len, final_len - 1)
    return (
        prompt_len > config.max_model_len
        or cdiv(most_computed, manager.block_size) > manager.num_blocks
        or (not config.enable_chunked_prefill and most_computed > config.max_num_batched_tokens)
    )


configs = st.builds(
    SchedulerConfig,
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(3, 16),
    max_model_len=st.sampled_from([12, 64, 64]),
    policy=st.sampled_from(["fcfs", "priority"]),
    enable_chunked_prefill=st.sampled_from([True, True, False]),
    long_prefill_token_threshold=st.sampled_from([0, 0, 3]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops_strategy,
    config=configs,
    num_blocks=st.integers(4, 10),
    block_size=st.sampled_from([2, 4]),
    enable_caching=st.booleans(),
    weak_hash=st.booleans(),
)
def test_scheduler_and_kv_cache_keep_their_invariants(
    ops, config, num_blocks, block_size, enable_caching, weak_hash
):
    with pytest.MonkeyPatch.context() as monkeypatch:
        if weak_hash:
            # four hash values in all: collisions all the time
            monkeypatch.setattr(kvm, "hash_block_tokens", lambda p, t: hash((p, t)) % 4)
        run_ops(ops, config, KVCacheManager(num_blocks, block_size, enable_caching))


def run_ops(ops, config: SchedulerConfig, manager: KVCacheManager) -> None:
    num_blocks, block_size = manager.num_blocks, manager.block_size
    scheduler = Scheduler(config, manager)
    runner = FakeRunner(block_size)
    finished: list[Request] = []
    counter = 0

    def live_request(index: int) -> str | None:
        ids = sorted(scheduler.requests)
        return ids[index % len(ids)] if ids else None

    def do_step(abort_index: int | None = None) -> None:
        output = scheduler.schedule()
        check_step(scheduler, output)
        result = runner.execute(output, manager)
        if abort_index is not None and (request_id := live_request(abort_index)):
            finished.append(scheduler.get_request(request_id))
            scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        finished.extend(scheduler.update_from_output(output, result))

    for op in ops:
        if op[0] == "add":
            _, prefix, suffix, max_tokens, priority = op
            prompt = PREFIXES[prefix] + suffix or [4]
            request = Request(
                f"r{counter}",
                prompt,
                SamplingParams(max_tokens=max_tokens),
                eos_token_ids=frozenset({EOS}),
                max_tokens=max_tokens,
                priority=priority,
            )
            counter += 1
            try:  # what the front end checks before a request reaches the scheduler
                if len(prompt) > config.max_model_len:
                    raise ValueError("the input processor refuses a prompt over max_model_len")
                check_fits(len(prompt), max_tokens, config, manager.num_blocks, manager.block_size)
                scheduler.add_request(request)
            except ValueError:
                assert can_never_run(request, config, manager)
        elif op[0] == "step":
            do_step()
        elif op[0] == "abort_mid_step":
            do_step(abort_index=op[1])
        elif request_id := live_request(op[1]):
            status = (
                RequestStatus.FINISHED_STOPPED
                if op[0] == "finish"
                else RequestStatus.FINISHED_ABORTED
            )
            finished.append(scheduler.get_request(request_id))
            scheduler.finish_requests(request_id, status)
        check_invariants(scheduler, finished)

    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        do_step()
        check_invariants(scheduler, finished)
    assert not scheduler.has_unfinished_requests()
    assert manager.num_free_blocks == num_blocks
    assert manager.usage == 0.0
    if manager.prefix_cache_hits:
        event("prefix hit")
    if scheduler.num_preemptions:
        event("preempted")
    for request in finished:
        if request.status is RequestStatus.FINISHED_LENGTH_CAPPED:
            assert (
                request.num_output_tokens == request.max_tokens
                or request.num_tokens >= config.max_model_len
            )
