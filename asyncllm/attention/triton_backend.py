"""Paged attention through the Triton kernels in `kernels/`; same contract as the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.kv_scales import UNIT_KV_SCALES, KVScales
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding
from kernels import norm_rope_and_cache, paged_decode_attention, paged_prefill_attention
from kernels.prefill_attention import short_query_prefill_config


@dataclass(frozen=True)
class _MixedParts:
    """A mixed step's metadata cut in two: its leading decodes, and the requests from its first
    prompt on."""

    num_decodes: int
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prompt_query_start_loc: torch.Tensor
    prompt_seq_lens: torch.Tensor
    prompt_block_tables: torch.Tensor

    @classmethod
    def of(cls, meta: AttentionMetadata, min_decodes: int) -> _MixedParts:
        """The leading decodes are those requests before the first with more than one query
        (running requests come first in a step); fewer than min_decodes stay with the rest."""
        d = next((i for i, n in enumerate(meta.query_lens_cpu) if n != 1), meta.num_reqs)
        d = d if d >= min_decodes else 0
        return cls(
            d,
            meta.seq_lens[:d],
            meta.block_tables[:d],
            meta.query_start_loc[d:],
            meta.seq_lens[d:],
            meta.block_tables[d:],
        )


def _kernel_scales(kv_scales: KVScales, kv_cache: torch.Tensor) -> dict[str, float]:
    """The kernels' k_scale and v_scale arguments for this cache."""
    kv_scales = kv_scales.for_cache(kv_cache)
    return {"k_scale": kv_scales.k, "v_scale": kv_scales.v}


class TritonAttentionBackend:
    """The decode path does no host sync and no data-dependent allocation: CUDA-graph capturable.

    A step with prompt tokens of at most max_short_step_tokens rows (padding included) runs all
    its requests, decodes too, through the prefill kernel in 16-row tiles: a decode row costs
    there about what it costs in the decode kernel, and the launch reads no host metadata, so
    the runner captures such steps whole in CUDA graphs (`bench/NOTES.md`, change 25). Longer
    prompts compute faster in 128-row tiles; in bigger steps the leading decodes go to the
    decode kernel once there are min_split_decodes of them (below that a launch per layer
    fewer matters more than the tiles they waste; change 22).
    """

    def __init__(self, min_split_decodes: int = 64, max_short_step_tokens: int = 768) -> None:
        self.min_split_decodes = min_split_decodes
        self.max_short_step_tokens = max_short_step_tokens
        self._last_parts: tuple[AttentionMetadata, _MixedParts] | None = None

    def prepare_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        """One launch for the q/k norms, rotary and the KV cache write."""
        args = (qkv, positions, rotary.cos_sin_cache, kv_cache, meta.slot_mapping)
        scales = _kernel_scales(kv_scales, kv_cache)
        if q_norm is None or k_norm is None:
            return norm_rope_and_cache(*args, **scales)
        return norm_rope_and_cache(*args, q_norm.weight, k_norm.weight, q_norm.eps, **scales)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:
        scales = _kernel_scales(kv_scales, kv_cache)
        if meta.is_pure_decode:
            return paged_decode_attention(
                query,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                out,
                max_seq_len=meta.max_seq_len,
                **scales,
            )
        out = torch.empty_like(query) if out is None else out
        if query.shape[0] <= self.max_short_step_tokens:
            return paged_prefill_attention(
                query,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                scale,
                meta.max_query_len,
                out,
                config=short_query_prefill_config(query.dtype),
                **scales,
            )
        # a big step's many decodes go to the decode kernel: in 128-row tiles each would take a
        # whole tile through the matmuls for its one row. Unsplit, and num_seqs not specialised
        # on, it runs the variant the decode graphs compiled: nothing compiles mid-run
        parts = self._mixed_parts(meta)
        if parts.num_decodes:
            paged_decode_attention(
                query[: parts.num_decodes],
                kv_cache,
                parts.decode_block_tables,
                parts.decode_seq_lens,
                scale,
                out[: parts.num_decodes],
                num_splits=1,
                **scales,
            )
        return paged_prefill_attention(
            query,
            kv_cache,
            parts.prompt_query_start_loc,
            parts.prompt_seq_lens,
            parts.prompt_block_tables,
            scale,
            meta.max_query_len,
            out,
            **scales,
        )

    def _mixed_parts(self, meta: AttentionMetadata) -> _MixedParts:
        """The step's metadata cut once, not again in every layer."""
        if self._last_parts is None or self._last_parts[0] is not meta:
            self._last_parts = (meta, _MixedParts.of(meta, self.min_split_decodes))
        return self._last_parts[1]
