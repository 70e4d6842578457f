"""The Llama family in one class: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.kv_cache_spec import KVCacheSpec
from asyncllm.attention.kv_scales import UNIT_KV_SCALES, KVScales
from asyncllm.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    QuantizationConfig,
    RowParallelLinear,
    default_weight_loader,
    fuses_silu_and_mul,
    linear_silu_and_mul,
    read_all,
    rms_norm_linear,
    silu_and_mul_linear,
)
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding
from asyncllm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from asyncllm.models.causal_lm import PieceShapes, PiecewiseDecoderLayer
from asyncllm.models.kv_scale_names import KVScaleName, kv_scale_name, kv_scale_value

# checkpoint name piece -> (fused parameter, shard id)
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """This rank's heads: num_heads and num_kv_heads count the heads it holds."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            total_kv_heads,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim,
            config.hidden_size,
            bias=getattr(config, "attention_bias", False),  # Llama's; Qwen2 biases q/k/v only
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = rotary
        self.backend = backend
        # an FP8 KV cache's scales from the checkpoint; None: it has none (scales of 1.0)
        self.kv_scales: KVScales | None = None

    def prepare_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The query; keys and values go to the KV cache."""
        return self.backend.prepare_qkv(
            qkv,
            positions,
            self.rotary,
            self.q_norm,
            self.k_norm,
            kv_cache,
            meta,
            self.kv_scales or UNIT_KV_SCALES,
        )

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scales = self.kv_scales or UNIT_KV_SCALES
        return self.backend.attend(query, kv_cache, meta, self.scale, out, scales)

    def load_kv_scale(self, which: KVScaleName, name: str, loaded: LoadedWeight) -> None:
        """One of the checkpoint's per-tensor KV cache scales: the same number on every rank."""
        value = kv_scale_value(name, read_all(loaded))
        scales = self.kv_scales or UNIT_KV_SCALES
        self.kv_scales = replace(scales, **dict.fromkeys(which.planes, value))


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_rotary(config: PretrainedConfig) -> RotaryEmbedding:
    return RotaryEmbedding(
        head_dim(config),
        config.max_position_embeddings,
        getattr(config, "rope_theta", None) or _rope_parameters(config).get("rope_theta", 10000.0),
        _rope_scaling(config),
    )


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.gate_up_proj.keeps_weight_dtype = True  # silu_and_mul takes bf16 on CPU
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_linear(self.down_proj, gate_up)

    def norm_forward(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(x + residual)), x + residual)"""
        if fuses_silu_and_mul(self.gate_up_proj):
            x, residual = norm(x, residual)
            return self.down_proj(linear_silu_and_mul(self.gate_up_proj, x)), residual
        gate_up, residual = rms_norm_linear(norm, self.gate_up_proj, x, residual)
        return self.down(gate_up), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))


def keeps_bf16_outputs(o_proj: RowParallelLinear, down_proj: RowParallelLinear) -> None:
    """The bf16 CPU mode: a dense layer's o_proj and down_proj outputs stay in their GEMMs'
    bf16, read only by the fused add-norms, whose outputs come back in bf16 for the next GEMM
    (bench/NOTES.md, session 42): the same values without four casts a layer. Not where the
    ranks' outputs are summed: an all-reduce in bf16 would round their sum."""
    for linear in (o_proj, down_proj):
        linear.keeps_weight_dtype = linear.tp_size == 1


class DecoderLayer(PiecewiseDecoderLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        quant_config: QuantizationConfig | None,
        prefix: str,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(
            config, backend, rotary, qk_norm, quant_config, f"{prefix}.self_attn"
        )
        if mlp is None:
            mlp = MLP(config.hidden_size, config.intermediate_size, quant_config, f"{prefix}.mlp")
            keeps_bf16_outputs(self.self_attn.o_proj, mlp.down_proj)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    # the pieces of models.causal_lm.DecoderLayerPieces
    def before_attention(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query, residual)"""
        attn = self.self_attn
        qkv, residual = rms_norm_linear(self.input_layernorm, attn.qkv_proj, x, residual)
        return attn.prepare_qkv(positions, qkv, kv_cache, meta), residual

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.self_attn.attend(query, kv_cache, meta, out)

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual)"""
        x = self.self_attn.o_proj(attn_out.flatten(1))
        return self.mlp.norm_forward(self.post_attention_layernorm, x, residual)


class LlamaForCausalLM(nn.Module):
    """Built for this process's tensor-parallel rank: each holds its share of the heads, of the
    MLP's features and of the vocabulary."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix="model.embed_tokens"
        )
        # one cos/sin cache for every layer: SmolLM2's 30 copies took 60 MiB and 1.6 s to build
        self.rotary = self.make_rotary(config)
        self.layers = nn.ModuleList(
            self.make_layer(config, backend, i, quant_config)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix="lm_head", quant_config=quant_config
        )
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)

    def make_layer(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        index: int,
        quant_config: QuantizationConfig | None,
    ) -> nn.Module:
        qk_norm = config.model_type == "qwen3"
        prefix = f"model.layers.{index}"
        return DecoderLayer(config, backend, self.rotary, qk_norm, quant_config, prefix)

    def make_rotary(self, config: PretrainedConfig) -> RotaryEmbedding:
        return llama_rotary(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.hidden_states(input_ids, positions, kv_caches, meta)[0]

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The final hidden states, and the residual stream entering each of aux_layers
        (EAGLE-3 heads read three of them)."""
        x, residual = self.embed(input_ids), None
        entering = {}
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if index in aux_layers:
                # copies: the fused norms on CUDA add into the residual in place
                entering[index] = x.clone() if residual is None else x + residual
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.final_norm(x, residual), [entering[i] for i in aux_layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # the bf16 CPU mode's last down_proj output is bf16 (keeps_bf16_outputs); the final
        # hidden states stay in the residual's float32, as the drafters read them
        return self.norm(x.to(residual.dtype), residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only when it needs to."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Copy this rank's share of the checkpoint tensors (HF names) into the parameters,
        fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tie_word_embeddings and name.startswith("lm_head")):
                continue
            scale = kv_scale_name(name)
            if scale is not None:
                attention = modules.get(scale.attention)
                if not isinstance(attention, Attention):
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                attention.load_kv_scale(scale, name, tensor)
                continue
            target, shard_id = fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, tensor, shard_id)
            loaded.add(target)
        return loaded

    @property
    def piece_shapes(self) -> PieceShapes:
        attn = self.layers[0].self_attn
        heads = (attn.num_heads, attn.head_dim)
        dtype = self.embed_tokens.weight.dtype
        return PieceShapes(self.config.hidden_size, query=heads, attn_out=heads, dtype=dtype)

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        attn = self.layers[0].self_attn
        return [KVCacheSpec(2, attn.num_kv_heads, attn.head_dim)] * len(self.layers)


def fused_target(name: str) -> tuple[str, str | int | None]:
    """The fused parameter a checkpoint tensor goes into, and its shard there."""
    for piece, (fused, shard) in _STACKED.items():
        if f".{piece}." in name:
            return name.replace(piece, fused), shard
    return name, None


def _rope_parameters(config: PretrainedConfig) -> dict:
    return getattr(config, "rope_parameters", None) or {}


def _rope_scaling(config: PretrainedConfig) -> dict | None:
    scaling = getattr(config, "rope_scaling", None) or _rope_parameters(config)
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling
