"""Paged attention through the Triton kernels in `kernels/`; same contract as the torch backend."""

from __future__ import annotations

import torch

from asyncllm.attention.backend import AttentionMetadata
from kernels import paged_decode_attention, paged_prefill_attention, reshape_and_cache


class TritonAttentionBackend:
    """The decode path does no host sync and no data-dependent allocation: CUDA-graph capturable."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.is_pure_decode:
            return paged_decode_attention(
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                max_seq_len=meta.max_seq_len,
            )
        return paged_prefill_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            meta.max_query_len,
        )
