"""DeepSeek-V2 and V2-Lite: multi-head latent attention (asyncllm/attention/mla.py), routed
experts with grouped top-k and a routing scale plus shared experts, YaRN rope on interleaved
pairs, and dense MLPs in the first layers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend, AttentionMetadata
from asyncllm.attention.kv_cache_spec import KVCacheSpec
from asyncllm.attention.mla import MLADims, MLAttention, norm_rope_and_cache
from asyncllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from asyncllm.layers.fused_moe import RoutingConfig
from asyncllm.layers.linear import LoadedWeight, QuantizationConfig, ReplicatedLinear
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.rotary import RotaryEmbedding, yarn_mscale
from asyncllm.models.causal_lm import PieceShapes, PiecewiseDecoderLayer
from asyncllm.models.llama import MLP, LlamaForCausalLM, _rope_parameters, _rope_scaling
from asyncllm.models.mixtral import SparseMoeBlock, load_expert_weights, mlp_after_attention

_LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm keep the default eps


class UpProjection(nn.Module):
    """kv_b_proj's weight [H * (nope + v), kv_lora_rank], read as W_UK and W_UV by the
    attention; not an nn.Linear, so that the CPU packing leaves its layout alone."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLAProjections(nn.Module):
    """kv_b_proj stays unquantized: the attention reads its weight."""

    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        if get_tensor_model_parallel_world_size() > 1:
            raise ValueError(
                "DeepSeek-V2 (latent attention) runs on one rank: tensor_parallel_size 1"
            )
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.dims = mla_dims(config)
        dims = self.dims
        qk_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
        bias = config.attention_bias

        def linear(name: str, input_size: int, output_size: int, bias: bool) -> ReplicatedLinear:
            return ReplicatedLinear(input_size, output_size, bias, quant_config, f"{prefix}.{name}")

        if config.q_lora_rank is None:
            self.q_proj = linear("q_proj", hidden, heads * qk_dim, False)
        else:
            self.q_a_proj = linear("q_a_proj", hidden, config.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = linear("q_b_proj", config.q_lora_rank, heads * qk_dim, False)
        width = dims.kv_lora_rank + dims.qk_rope_head_dim
        self.kv_a_proj_with_mqa = linear("kv_a_proj_with_mqa", hidden, width, bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = UpProjection(
            dims.kv_lora_rank, heads * (dims.qk_nope_head_dim + dims.v_head_dim)
        )
        self.o_proj = linear("o_proj", heads * dims.v_head_dim, hidden, bias)
        self.rotary = rotary
        self.attn = MLAttention(dims, backend.max_short_step_tokens)

    def query(self, h: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(h)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))

    def prepare(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The query [T, H, nope + rope]; each token's latent and rope key go to kv_cache
        (on CUDA three launches: the two projections, then norm, rope and cache write in one)."""
        dims = self.dims
        query = self.query(h).view(h.shape[0], dims.num_heads, -1)
        latent = self.kv_a_proj_with_mqa(h)
        norm_rope_and_cache(
            query,
            latent,
            positions,
            self.rotary,
            self.kv_a_layernorm,
            kv_cache,
            meta.slot_mapping,
        )
        return query


def mla_rotary(config: PretrainedConfig) -> RotaryEmbedding:
    theta = getattr(config, "rope_theta", None) or _rope_parameters(config).get(
        "rope_theta", 10000.0
    )
    return RotaryEmbedding(
        config.qk_rope_head_dim,
        config.max_position_embeddings,
        theta,
        _rope_scaling(config),
        interleaved=True,
    )


def mla_dims(config: PretrainedConfig) -> MLADims:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = _rope_scaling(config)
    if scaling and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return MLADims(
        num_heads=config.num_attention_heads,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        kv_lora_rank=config.kv_lora_rank,
        scale=scale,
    )


class DeepseekV2DecoderLayer(PiecewiseDecoderLayer):
    def __init__(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        rotary: RotaryEmbedding,
        index: int,
        quant_config: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{index}.self_attn"
        self.self_attn = MLAProjections(config, backend, rotary, quant_config, prefix)
        self.mlp = _mlp(config, index)
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
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        return self.self_attn.prepare(positions, h, kv_cache, meta), residual

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.self_attn
        return attn.attn.attend(query, kv_cache, meta, attn.kv_b_proj.weight, out)

    after_attention = mlp_after_attention


def _mlp(config: PretrainedConfig, index: int) -> nn.Module:
    if index < config.first_k_dense_replace or index % getattr(config, "moe_layer_freq", 1):
        return MLP(config.hidden_size, config.intermediate_size, None, f"model.layers.{index}.mlp")
    grouped = config.topk_method == "group_limited_greedy"
    routing = RoutingConfig(
        top_k=config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob),
        num_groups=config.n_group if grouped else 1,
        topk_groups=config.topk_group if grouped else 1,
        routed_scaling_factor=config.routed_scaling_factor,
    )
    return SparseMoeBlock(
        config.hidden_size,
        config.n_routed_experts,
        config.moe_intermediate_size,
        routing,
        f"model.layers.{index}.mlp",
        config.n_shared_experts or 0,
    )


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    def make_layer(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        index: int,
        quant_config: QuantizationConfig | None,
    ) -> nn.Module:
        return DeepseekV2DecoderLayer(config, backend, self.rotary, index, quant_config)

    def make_rotary(self, config: PretrainedConfig) -> RotaryEmbedding:
        return mla_rotary(config)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        loaded: set[str] = set()
        rest = self._load_full_rank_queries(load_expert_weights(self, weights, loaded), loaded)
        return super().load_weights(rest) | loaded

    def _load_full_rank_queries(
        self, weights: Iterable[tuple[str, LoadedWeight]], loaded: set[str]
    ) -> Iterator[tuple[str, LoadedWeight]]:
        """V2-Lite's q_proj (no q_lora_rank) is not the Llama q of a fused qkv."""
        for name, tensor in weights:
            if ".self_attn.q_proj." not in name:
                yield name, tensor
                continue
            param = self.get_parameter(name)
            param.weight_loader(param, tensor)
            loaded.add(name)

    @property
    def piece_shapes(self) -> PieceShapes:
        dims = self.layers[0].self_attn.dims
        query = (dims.num_heads, dims.qk_nope_head_dim + dims.qk_rope_head_dim)
        attn_out = (dims.num_heads, dims.v_head_dim)
        return PieceShapes(self.config.hidden_size, query, attn_out, self.embed_tokens.weight.dtype)

    @property
    def kv_cache_specs(self) -> list[KVCacheSpec]:
        dims = self.layers[0].self_attn.dims
        return [KVCacheSpec(1, 1, dims.kv_lora_rank + dims.qk_rope_head_dim)] * len(self.layers)
