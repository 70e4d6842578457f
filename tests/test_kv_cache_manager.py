import pytest

from asyncllm.core import kv_cache_manager as kvm
from asyncllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams())


def compute(manager: KVCacheManager, request: Request) -> list[int]:
    """Admits the request with its prefix hits and marks its whole prompt computed and cached."""
    hits, num_hit = manager.get_computed_blocks(request)
    block_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert block_ids is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return block_ids


def test_allocate_slots_grows_the_table_a_block_at_a_time():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(5)))
    assert manager.allocate_slots(request, 5) == [0, 1]
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3) == [0, 1]
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1) == [0, 1, 2]
    assert manager.get_block_ids(request) == [0, 1, 2]


def test_allocate_slots_returns_none_and_changes_nothing_when_blocks_run_out():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(9)))
    assert manager.allocate_slots(request, 9) is None
    assert manager.num_free_blocks == 2
    assert manager.get_block_ids(request) == []
    assert manager.prefix_cache_queries == 0


def test_free_returns_every_block_with_the_tail_evicted_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(12)))
    assert manager.allocate_slots(request, 12) == [0, 1, 2]
    manager.free(request)
    assert manager.num_free_blocks == 4
    assert [b.block_id for b in manager.block_pool.free_block_queue] == [3, 2, 1, 0]


def test_block_hashes_are_chained_over_full_blocks_and_extended_with_new_tokens():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(7)))
    manager.get_computed_blocks(request)
    first = hash_block_tokens(None, (0, 1, 2, 3))
    assert request.block_hashes == [first]
    request.append_output_token(7)
    manager.get_computed_blocks(request)
    assert request.block_hashes == [first, hash_block_tokens(first, (4, 5, 6, 7))]


def test_only_full_computed_blocks_are_cached():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(10)))
    manager.allocate_slots(request, 10)
    manager.cache_blocks(request, 6)
    assert [b.block_hash is not None for b in manager.get_blocks(request)] == [True, False, False]
    manager.cache_blocks(request, 10)
    assert [b.block_hash is not None for b in manager.get_blocks(request)] == [True, True, False]


def test_shared_prefix_hits_the_cached_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    first_ids = compute(manager, first)
    second = make_request("b", list(range(8)) + [50, 51, 52])
    blocks, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    assert [b.block_id for b in blocks] == first_ids[:2]


def test_full_prompt_hit_still_recomputes_the_last_token():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute(manager, make_request("a", list(range(8))))
    blocks, num_hit = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert num_hit == 4
    assert len(blocks) == 1


def test_prefix_hit_counters_count_tokens_once_per_admission():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute(manager, make_request("a", list(range(10))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 0)
    compute(manager, make_request("b", list(range(9))))
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (19, 8)


def test_prefix_hit_blocks_are_shared_by_reference_count():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first_ids = compute(manager, make_request("a", list(range(9))))
    second_ids = compute(manager, make_request("b", list(range(9))))
    assert second_ids[:2] == first_ids[:2]
    assert second_ids[2] != first_ids[2]
    assert [manager.block_pool.blocks[i].ref_cnt for i in second_ids] == [2, 2, 1]


def test_freed_cached_blocks_are_reused_by_a_later_identical_prompt():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    first_ids = compute(manager, first)
    manager.free(first)
    assert manager.usage == 0.0
    second_ids = compute(manager, make_request("b", list(range(9))))
    assert second_ids[:2] == first_ids[:2]
    assert manager.prefix_cache_hits == 8


def test_evicted_blocks_no_longer_hit():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute(manager, first)
    manager.free(first)
    compute(manager, make_request("b", [100 + i for i in range(9)]))
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)


def test_hit_on_free_cached_blocks_counts_them_against_free_blocks():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(9)))
    compute(manager, first)
    manager.free(first)
    # 2 hit blocks leave the free queue and 2 new ones are needed: 4 > 3 free
    second = make_request("b", list(range(16)))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 8
    assert manager.allocate_slots(second, 8, hits) is None
    assert all(b.ref_cnt == 0 for b in hits)
    assert manager.num_free_blocks == 3


def test_hash_collision_never_returns_another_prefix(monkeypatch):
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: 42)
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    compute(manager, make_request("a", [1, 2, 3, 4, 5]))
    # same tokens as the cached block but at another position: its KV belongs to another prefix
    repeated = make_request("b", [1, 2, 3, 4, 1, 2, 3, 4, 9])
    blocks, num_hit = manager.get_computed_blocks(repeated)
    assert num_hit == 4
    assert len(blocks) == 1
    other = make_request("c", [9, 9, 9, 9, 5])
    assert manager.get_computed_blocks(other) == ([], 0)


def test_hash_collision_lets_a_later_prompt_take_over_a_free_entry(monkeypatch):
    monkeypatch.setattr(kvm, "hash_block_tokens", lambda parent, tokens: 42)
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", [1, 2, 3, 4, 5])
    compute(manager, first)
    manager.free(first)
    compute(manager, make_request("b", [6, 7, 8, 9, 5]))
    assert manager.get_computed_blocks(make_request("c", [6, 7, 8, 9, 0]))[1] == 4
    assert manager.get_computed_blocks(make_request("d", [1, 2, 3, 4, 0]))[1] == 0


def test_disabled_caching_never_hits_or_counts():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    compute(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.prefix_cache_queries == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)


def test_usage_counts_blocks_held_by_requests():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request("r", list(range(8)))
    manager.allocate_slots(request, 8)
    assert manager.usage == pytest.approx(0.5)
    manager.free(request)
    assert manager.usage == 0.0
