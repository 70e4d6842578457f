"""The attention backend contract shared by the torch reference and the Triton kernels.

A step's tokens form one flat batch: request r owns query rows
query_start_loc[r] : query_start_loc[r + 1]. Its context after the step is seq_lens[r] tokens,
the last (query_start_loc[r + 1] - query_start_loc[r]) of which are the new queries, so query
row i of request r sits at position seq_lens[r] - query_len[r] + i and attends causally to every
cached position up to and including its own.

KV cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; token position p of
request r lives in block block_tables[r, p // block_size] at offset p % block_size, i.e. in slot
block_id * block_size + offset. slot_mapping[t] is the slot for new token t (-1: padding, skip).
An FP8 cache holds each layer's keys and values divided by its KVScales.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from asyncllm.attention.kv_scales import UNIT_KV_SCALES, KVScales
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    max_query_len: int
    max_seq_len: int
    # host copies, so that CPU-side logic never syncs on the device
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # what layers derive from the fields above, computed by the first layer that asks (not an
    # __init__ field: dataclasses.replace gives a copy a cache of its own)
    derived: dict[object, object] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    def once(self, key: object, compute: Callable[[], T]) -> T:
        """compute() the first time key is asked of this step, its value again after that: a
        model's layers share the step's metadata, so their per-step launches run in one."""
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]  # type: ignore[return-value]


class AttentionBackend(Protocol):
    # steps with prompt tokens of at most this many rows (padding included) read no host
    # metadata in attend: the worker captures them whole in CUDA graphs (0: none)
    max_short_step_tokens: int

    def prepare_qkv(
        self,
        qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Split qkv into heads, normalise q and k per head (when the norms are given), rotate
        them, and write key/value into kv_cache at meta.slot_mapping; return the query."""
        ...

    def attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor | None = None,  # written in place when given
        kv_scales: KVScales = UNIT_KV_SCALES,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attend over the paged context, which already holds this step's keys and values."""
        ...
