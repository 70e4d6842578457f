"""What the worker needs of a model: the whole forward pass, and its pieces around each
attention, which the piecewise CUDA graphs capture (asyncllm/worker/cuda_graph.py). A model
implementing CausalLM (an MoE or MLA one too) runs under every kind of graph unchanged.

The pieces between two attentions read no request metadata but the KV slots (slot_mapping):
the graphs hold them for any split of the step's tokens into requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.attention.kv_cache_spec import KVCacheSpec


@dataclass(frozen=True)
class PieceShapes:
    """Per token, what passes between the pieces of a layer."""

    hidden_size: int  # the residual stream and each layer's input
    query: tuple[int, ...]  # the attention's input row, e.g. (num_heads, head_dim)
    attn_out: tuple[int, ...]  # the attention's output row
    dtype: torch.dtype  # the activations' (not an FP8 KV cache's)


class DecoderLayerPieces(Protocol):
    def before_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, residual): the layer up to its attention; this step's keys and values go to
        kv_cache. residual is None in the first layer (x is the embedding)."""
        ...

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention's output, written into out when given."""
        ...

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, residual): the layer from its attention's output on."""
        ...


class CausalLM(Protocol):
    layers: Sequence[DecoderLayerPieces]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size]: embed, the layers, final_norm."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @property
    def piece_shapes(self) -> PieceShapes: ...

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """Per layer, what its KV cache holds per token."""
        ...


class PiecewiseDecoderLayer(nn.Module):
    """A decoder layer whose forward pass is its three pieces in order (DecoderLayerPieces):
    eager runs and graph captures go through the same code."""

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        query, residual = self.before_attention(positions, x, residual, kv_cache, meta)
        return self.after_attention(self.attend(query, kv_cache, meta), residual)
