"""Paged attention through the Triton kernels in `kernels/`; same contract as the torch backend."""

from __future__ import annotations

import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.models.layers.norm import RMSNorm
from asyncllm.models.layers.rotary import RotaryEmbedding
from kernels import norm_rope_and_cache, paged_decode_attention, paged_prefill_attention


class TritonAttentionBackend:
    """The decode path does no host sync and no data-dependent allocation: CUDA-graph capturable."""

    def prepare_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One launch for the q/k norms, rotary and the KV cache write."""
        args = (qkv, positions, rotary.cos_sin_cache, kv_cache, meta.slot_mapping)
        if q_norm is None or k_norm is None:
            return norm_rope_and_cache(*args)
        return norm_rope_and_cache(*args, q_norm.weight, k_norm.weight, q_norm.eps)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.is_pure_decode:
            return paged_decode_attention(
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out,
                max_seq_len=meta.max_seq_len,
            )
        # a mixed step's decodes go to the decode kernel: in the prefill kernel each would take
        # a whole query tile through the matmuls for its one row. Unsplit, and num_seqs not
        # specialised on, it runs the variant the decode graphs compiled: nothing compiles
        # mid-run
        out = torch.empty_like(query) if out is None else out
        decodes = meta.num_leading_decodes
        if decodes:
            paged_decode_attention(
                query[:decodes],
                kv_cache,
                meta.block_tables[:decodes],
                meta.seq_lens[:decodes],
                scale,
                out[:decodes],
                num_splits=1,
            )
        return paged_prefill_attention(
            query,
            kv_cache,
            meta.query_start_loc[decodes:],
            meta.seq_lens[decodes:],
            meta.block_tables[decodes:],
            scale,
            meta.max_query_len,
            out,
        )
