"""EAGLE draft heads on a Llama-family target, in the layouts the EAGLE authors publish.

Both read, at position t, the embedding of token t+1 and a hidden state of the target at t,
and return (the state their lm_head reads, the state the next chained pass reads):
- EAGLE-1/2 (EagleLlamaHead): fc([embedding; final hidden state]) -> decoder layers, the first
  without its input norm -> hidden + residual, with no final norm.
- EAGLE-3 (Eagle3LlamaHead): fc(three target layers' residual streams) -> one decoder layer
  whose attention reads [norm(embedding); norm(hidden)] -> norm. Its lm_head may cover a vocabulary
  of its own: d2t[i] is target id minus draft id i.
A head without embed_tokens (or lm_head) in its checkpoint uses the target's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.kv_cache_spec import KVCacheSpec
from asyncllm.layers.linear import (
    LoadedWeight,
    QKVParallelLinear,
    ReplicatedLinear,
    default_weight_loader,
)
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding
from asyncllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.models.llama import DecoderLayer, LlamaForCausalLM, fused_target, llama_rotary


class _FirstEagleLayer(DecoderLayer):
    """EAGLE's first layer reads the fc's output with no input norm."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        prefix: str,
    ) -> None:
        super().__init__(config, backend, rotary, False, None, prefix)
        del self.input_layernorm

    def before_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        return attn.prepare_qkv(positions, attn.qkv_proj(x), kv_cache, meta), x


class _Eagle3Layer(DecoderLayer):
    """EAGLE-3's layer: its attention reads the normed embedding and hidden state side by
    side (2H); the residual stream starts from the hidden state."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        prefix: str,
    ) -> None:
        super().__init__(config, backend, rotary, False, None, prefix)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(
            2 * config.hidden_size,
            attn.head_dim,
            config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            bias=getattr(config, "attention_bias", False),
            prefix=f"{prefix}.self_attn.qkv_proj",
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn = self.self_attn
        query = attn.prepare_qkv(positions, attn.qkv_proj(x), kv_cache, meta)
        return self.after_attention(self.attend(query, kv_cache, meta), residual)


class _HeadBase(nn.Module):
    """What both heads share: the embedding and lm_head, their own or the target's, the KV
    cache specs and the checkpoint's names."""

    def __init__(
        self,
        config: PretrainedConfig,
        target: LlamaForCausalLM,
        tensor_names: set[str],
        vocab_size: int,
        draft_vocab_size: int,
    ) -> None:
        super().__init__()
        self.config = config
        own_embedding = "embed_tokens.weight" in tensor_names
        own_lm_head = "lm_head.weight" in tensor_names
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden) if own_embedding else None
        self.lm_head = ParallelLMHead(draft_vocab_size, hidden) if own_lm_head else None
        self._target_embed, self._target_logits = target.embed, target.compute_logits

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self._target_embed if self.embed_tokens is None else self.embed_tokens
        return embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self._target_logits if self.lm_head is None else self.lm_head
        return lm_head(hidden)

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft after each row, as a target id."""
        return self.compute_logits(hidden).argmax(dim=-1)

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        attn = self.decoder_layers[0].self_attn
        return [KVCacheSpec(2, attn.num_kv_heads, attn.head_dim)] * len(self.decoder_layers)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for checkpoint_name, tensor in weights:
            name, shard_id = fused_target(self.param_name(checkpoint_name.removeprefix("model.")))
            if name == "t2d" or "rotary_emb" in name:  # t2d: d2t says the same
                continue
            if name not in params:
                raise ValueError(
                    f"speculative model: tensor {checkpoint_name!r} has no place in the head"
                )
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
            loaded.add(name)
        return loaded

    def param_name(self, name: str) -> str:
        return name


class EagleLlamaHead(_HeadBase):
    aux_layers: tuple[int, ...] = ()  # it reads the target's final hidden states

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        target: LlamaForCausalLM,
        tensor_names: set[str],
    ) -> None:
        super().__init__(config, target, tensor_names, config.vocab_size, config.vocab_size)
        hidden = config.hidden_size
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias="fc.bias" in tensor_names, prefix="fc")
        rotary = llama_rotary(config)
        first = _FirstEagleLayer(config, backend, rotary, "layers.0")
        rest = [
            DecoderLayer(config, backend, rotary, False, None, f"layers.{i}")
            for i in range(1, config.num_hidden_layers)
        ]
        self.layers = nn.ModuleList([first, *rest])
        self.decoder_layers = list(self.layers)

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.fc(torch.cat([self.embed(input_ids), hidden], dim=-1)), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        out = x + residual
        return out, out


class Eagle3LlamaHead(_HeadBase):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        target: LlamaForCausalLM,
        tensor_names: set[str],
        aux_layers: tuple[int, ...],
    ) -> None:
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        super().__init__(config, target, tensor_names, config.vocab_size, draft_vocab)
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False, prefix="fc")
        self.midlayer = _Eagle3Layer(config, backend, llama_rotary(config), "midlayer")
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.decoder_layers = [self.midlayer]
        self.aux_layers = aux_layers  # the target layers whose input states it reads
        own_vocab = "d2t" in tensor_names
        mapping = torch.zeros(draft_vocab, dtype=torch.int64) if own_vocab else None
        self.d2t = None if mapping is None else nn.Parameter(mapping, requires_grad=False)

    def param_name(self, name: str) -> str:
        # vLLM's converted checkpoints name the one layer layers.0
        return name.replace("layers.0.", "midlayer.", 1)

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        draft_ids = super().draft_token_ids(hidden)
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def combine_hidden_states(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target layers' states side by side [T, 3H] -> [T, H]."""
        return self.fc(aux_hidden)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = self.embed(input_ids)
        x, residual = self.midlayer(positions, embeds, hidden, kv_caches[0], meta)
        return self.norm(x, residual)
