"""What one layer keeps per token in the paged KV cache, so that the worker sizes and allocates
each layer's cache and GQA and MLA models share one block pool (a block id names the same token
slots in every layer, whatever each layer stores there)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_planes: int  # keys and values: 2; MLA's one latent vector (with its rope part): 1
    num_kv_heads: int
    head_dim: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return self.num_planes * block_size * self.num_kv_heads * self.head_dim * element
