"""The Llama family in one class: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.layers.linear import Linear, QuantizedLinear, rms_norm_linear, silu_and_mul_linear
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.quantization import QuantizationConfig
from asyncllm.layers.rotary import RotaryEmbedding
from asyncllm.models.causal_lm import PieceShapes

# checkpoint name piece -> (fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _linear(
    input_size: int,
    output_sizes: list[int],
    bias: bool,
    quant_config: QuantizationConfig | None,
    prefix: str,
) -> nn.Module:
    """A plain Linear (with its fused CUDA GEMVs) unless the model is quantized."""
    if quant_config is None:
        return Linear(input_size, sum(output_sizes), bias=bias)
    return QuantizedLinear(
        input_size, output_sizes, bias, quant_config, prefix, torch.get_default_dtype()
    )


class Attention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        qk_norm: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = _linear(
            config.hidden_size, self.shard_sizes(), bias, quant_config, f"{prefix}.qkv_proj"
        )
        self.o_proj = _linear(
            self.q_size, [config.hidden_size], False, quant_config, f"{prefix}.o_proj"
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            getattr(config, "rope_theta", None)
            or _rope_parameters(config).get("rope_theta", 10000.0),
            _rope_scaling(config),
        )
        self.backend = backend

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def prepare_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The query; keys and values go to the KV cache."""
        return self.backend.prepare_qkv(
            qkv, positions, self.rotary, self.q_norm, self.k_norm, kv_cache, meta
        )

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.backend.attend(query, kv_cache, meta, self.scale, out)


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = _linear(
            hidden_size, self.shard_sizes(), False, quant_config, f"{prefix}.gate_up_proj"
        )
        self.down_proj = _linear(
            intermediate_size, [hidden_size], False, quant_config, f"{prefix}.down_proj"
        )

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_linear(self.down_proj, gate_up)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        qk_norm: bool,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, qk_norm, quant_config, f"{prefix}.self_attn")
        self.mlp = MLP(config.hidden_size, config.intermediate_size, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

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
        gate_up, residual = rms_norm_linear(
            self.post_attention_layernorm, self.mlp.gate_up_proj, x, residual
        )
        return self.mlp.down(gate_up), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        qk_norm = config.model_type == "qwen3"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, qk_norm, quant_config, f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.final_norm(x, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens them only when it needs to."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (self.tie_word_embeddings and name.startswith("lm_head")):
                continue
            target, shard = _fused_target(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            owner = self.get_submodule(target.rpartition(".")[0])
            if isinstance(owner, QuantizedLinear):
                owner.weight_loader(params[target], tensor, _shard_id(target, shard))
            else:
                _copy_shard(self, params[target], target, shard, tensor)
            loaded.add(target)
        return loaded

    @property
    def piece_shapes(self) -> PieceShapes:
        attn = self.layers[0].self_attn
        heads = (attn.num_heads, attn.head_dim)
        return PieceShapes(self.config.hidden_size, query=heads, attn_out=heads)

    @property
    def layer_geometry(self) -> tuple[int, int, int]:
        attn = self.layers[0].self_attn
        return len(self.layers), attn.num_kv_heads, attn.head_dim


def _shard_id(target: str, shard: int | None) -> str | int | None:
    """The linear contract's shard id: 'q' | 'k' | 'v' for qkv_proj, 0 | 1 for gate_up_proj."""
    return "qkv"[shard] if shard is not None and ".qkv_proj." in target else shard


def _fused_target(name: str) -> tuple[str, int | None]:
    for piece, (fused, shard) in _STACKED.items():
        if f".{piece}." in name:
            return name.replace(piece, fused), shard
    return name, None


def _copy_shard(
    model: nn.Module, param: nn.Parameter, name: str, shard: int | None, tensor: torch.Tensor
) -> None:
    if shard is None:
        param.data.copy_(tensor)
        return
    owner = model.get_submodule(name.rsplit(".", 2)[0])
    sizes = owner.shard_sizes()
    start = sum(sizes[:shard])
    param.data[start : start + sizes[shard]].copy_(tensor)


def _rope_parameters(config: PretrainedConfig) -> dict:
    return getattr(config, "rope_parameters", None) or {}


def _rope_scaling(config: PretrainedConfig) -> dict | None:
    scaling = getattr(config, "rope_scaling", None) or _rope_parameters(config)
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling
