"""Per-request block tables over a BlockPool, with prefix caching of full blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.core.block_pool import BlockPool, KVCacheBlock
from asyncllm.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of a full block; deterministic within a process (ints are not salted)."""
    return hash((parent_hash, token_ids))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _BlockTable:
    blocks: list[KVCacheBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # leading blocks already registered in (or found in) the prefix cache
    num_cached: int = 0
    # cache entry that the next block to cache chains on (-1: none yet)
    parent_cache_id: int = -1

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        self.blocks.extend(blocks)
        self.block_ids.extend(b.block_id for b in blocks)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # in tokens, like vLLM: counted once per admission of a request
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._tables: dict[str, _BlockTable] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of full blocks and its length in tokens; changes nothing."""
        # prompt logprobs need logits at every prompt position, so nothing may be skipped
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        # the last token is always recomputed so that there are logits to sample from
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        parent_cache_id = -1
        for i in range(min(max_blocks, len(request.block_hashes))):
            tokens = self._block_tokens(request, i)
            block = self.block_pool.get_cached_block(
                request.block_hashes[i], tokens, parent_cache_id
            )
            if block is None:
                break
            blocks.append(block)
            parent_cache_id = block.cache_id
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Grows the request's table to hold num_new_tokens more tokens after its computed ones
        (and after new_computed_blocks, the prefix hits of a newly admitted request).
        Returns the whole table, or None, changing nothing, when too few blocks are free."""
        computed = new_computed_blocks or []
        table = self._tables.get(request.request_id)
        assert not (computed and table), "prefix hits are only added to a new table"
        num_held = len(table.blocks) if table else 0
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - num_held - len(computed))
        # hit blocks nobody holds sit in the free queue: touching them takes them out of it
        num_evictable = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable > self.block_pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[request.request_id] = _BlockTable()
            self._record_admission(request, len(computed))
        if computed:
            self.block_pool.touch(computed)
            table.extend(computed)
            table.num_cached = len(table.blocks)
            table.parent_cache_id = computed[-1].cache_id
        if num_new_blocks:
            table.extend(self.block_pool.get_new_blocks(num_new_blocks))
        return table.block_ids.copy()

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that are full and computed up to num_computed_tokens."""
        table = self._tables.get(request.request_id)
        if not self.enable_caching or table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table.blocks))
        start = table.num_cached
        if num_full <= start:
            return
        self._update_block_hashes(request)
        table.parent_cache_id = self.block_pool.cache_full_blocks(
            table.blocks[start:num_full],
            request.block_hashes[start:num_full],
            [self._block_tokens(request, i) for i in range(start, num_full)],
            table.parent_cache_id,
        )
        table.num_cached = num_full

    def free(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        if table is not None:
            # blocks are freed in reverse so the tail of a sequence is evicted first
            self.block_pool.free_blocks(reversed(table.blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        table = self._tables.get(request.request_id)
        return table.block_ids.copy() if table else []

    def get_blocks(self, request: Request) -> list[KVCacheBlock]:
        table = self._tables.get(request.request_id)
        return list(table.blocks) if table else []

    def _record_admission(self, request: Request, num_hit_blocks: int) -> None:
        if self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_blocks * self.block_size

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, self._block_tokens(request, i))
            hashes.append(parent)

    def _block_tokens(self, request: Request, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(request.all_token_ids[start : start + self.block_size])
