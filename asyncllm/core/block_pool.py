"""KV cache blocks, the LRU queue of free blocks and the prefix cache (hash -> block).

Invariants:
- a block is in the free queue exactly when its ref_cnt is 0;
- a block has a block_hash exactly when cached_blocks[block.block_hash] is that block;
- a block held by more than one request is cached (only prefix hits share blocks);
- freed blocks keep their hash (they can still be hit) until allocation takes them from the
  head of the free queue, which evicts them from the prefix cache.

There is no reserved null block: every block id in 0..num_blocks-1 can be handed out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    # A hit must match these too, so a hash collision can never return another prefix's KV:
    # the block's own tokens and the cache entry of the block before it (-1: first block).
    token_ids: tuple[int, ...] = ()
    parent_cache_id: int = -1
    # unique per registration in the prefix cache; -1 while not cached
    cache_id: int = -1
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly-linked list of free blocks in eviction order: pop from the head, append at the tail."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_blocks: dict[int, KVCacheBlock] = {}
        self._next_cache_id = 0

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free), 0..1."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_cached_block(
        self, block_hash: int, token_ids: tuple[int, ...], parent_cache_id: int = -1
    ) -> KVCacheBlock | None:
        block = self.cached_blocks.get(block_hash)
        if (
            block is None
            or block.parent_cache_id != parent_cache_id
            or block.token_ids != token_ids
        ):
            return None
        return block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[int],
        block_token_ids: Sequence[tuple[int, ...]],
        parent_cache_id: int = -1,
    ) -> int:
        """Registers consecutive full blocks of one sequence; returns the cache id to chain on."""
        if not self.enable_caching:
            return -1
        for block, block_hash, token_ids in zip(blocks, block_hashes, block_token_ids, strict=True):
            parent_cache_id = self._cache_block(block, block_hash, token_ids, parent_cache_id)
        return parent_cache_id

    def _cache_block(
        self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...], parent_cache_id: int
    ) -> int:
        existing = self.cached_blocks.get(block_hash)
        if existing is not None:
            if existing.token_ids == token_ids and existing.parent_cache_id == parent_cache_id:
                # the same prefix was computed twice; this block stays an uncached private copy
                return existing.cache_id
            if existing.ref_cnt > 0:
                # a hash collision with a block in use, which stays cached (shared blocks always
                # are); this block is not cached, and an id nobody holds ends the chain
                return self._new_cache_id()
            # a hash collision or an orphan whose parent was evicted: the newer block wins
            self._uncache(existing)
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_cache_id = parent_cache_id
        block.cache_id = self._new_cache_id()
        self.cached_blocks[block_hash] = block
        return block.cache_id

    def _new_cache_id(self) -> int:
        self._next_cache_id += 1
        return self._next_cache_id - 1

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_blocks[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.parent_cache_id = -1
        block.cache_id = -1
