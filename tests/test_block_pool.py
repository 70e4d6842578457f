import pytest

from asyncllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue]


def test_new_pool_has_every_block_free_in_id_order():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 4
    assert free_ids(pool) == [0, 1, 2, 3]
    assert pool.usage == 0.0


def test_allocation_pops_from_the_head():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert free_ids(pool) == [2, 3]


def test_freed_blocks_are_evicted_in_lru_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert free_ids(pool) == [2, 0, 3, 1]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 0, 3, 1]


def test_touch_removes_a_free_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1
    assert free_ids(pool) == [0, 1, 3]
    assert pool.num_free_blocks == 3


def test_touch_shares_a_block_in_use():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_freeing_a_free_block_fails():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.blocks[0]])


def test_asking_for_more_blocks_than_free_fails():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_usage_is_the_fraction_of_blocks_in_use():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0


def test_freed_cached_block_keeps_its_hash_and_can_be_hit():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [123], [(1, 2)])
    pool.free_blocks([block])
    assert pool.get_cached_block(123, (1, 2)) is block
    assert block.block_hash == 123


def test_allocating_a_cached_free_block_evicts_its_hash():
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [123], [(1, 2)])
    pool.free_blocks([block])
    (again,) = pool.get_new_blocks(1)
    assert again is block
    assert block.block_hash is None
    assert pool.get_cached_block(123, (1, 2)) is None
    assert pool.cached_blocks == {}


def test_cached_block_hit_requires_equal_tokens():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [123], [(1, 2)])
    assert pool.get_cached_block(123, (1, 3)) is None


def test_cached_block_hit_requires_the_same_parent_entry():
    pool = BlockPool(2)
    parent, child = pool.get_new_blocks(2)
    pool.cache_full_blocks([parent, child], [1, 2], [(1, 2), (3, 4)])
    assert pool.get_cached_block(2, (3, 4), parent.cache_id) is child
    assert pool.get_cached_block(2, (3, 4), -1) is None


def test_caching_identical_content_twice_keeps_the_first_block():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [7], [(1, 2)])
    chain = pool.cache_full_blocks([second], [7], [(1, 2)])
    assert chain == first.cache_id
    assert second.block_hash is None
    assert pool.cached_blocks == {7: first}


def test_colliding_hash_with_other_tokens_replaces_a_free_entry():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [7], [(1, 2)])
    pool.free_blocks([first])
    pool.cache_full_blocks([second], [7], [(5, 6)])
    assert first.block_hash is None
    assert pool.get_cached_block(7, (5, 6)) is second
    assert pool.get_cached_block(7, (1, 2)) is None


def test_disabled_caching_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([block], [7], [(1, 2)])
    assert pool.cached_blocks == {}
    assert pool.get_cached_block(7, (1, 2)) is None


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert len(queue) == 4
    assert queue.popleft() is blocks[1]
    assert blocks[1].prev_free is None and blocks[1].next_free is None


def test_popping_an_empty_free_queue_fails():
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(IndexError):
        queue.popleft()


def test_colliding_hash_keeps_an_entry_in_use_and_ends_the_new_chain():
    pool = BlockPool(3)
    first, second, child = pool.get_new_blocks(3)
    pool.cache_full_blocks([first], [7], [(1, 2)])
    chain = pool.cache_full_blocks([second, child], [7, 8], [(5, 6), (3, 4)])
    assert pool.cached_blocks[7] is first
    assert second.block_hash is None
    # the child chains on an id no block holds, so no lookup can reach it
    assert child.parent_cache_id not in {b.cache_id for b in pool.blocks}
    assert chain == child.cache_id
