"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (q/k norm) with Mixtral's sparse experts; some
layers may keep a dense MLP (mlp_only_layers, decoder_sparse_step)."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend
from asyncllm.layers.fused_moe import RoutingConfig
from asyncllm.layers.linear import QuantizationConfig
from asyncllm.models.llama import DecoderLayer
from asyncllm.models.mixtral import MixtralForCausalLM, MoeDecoderLayer, SparseMoeBlock


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    def make_layer(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        index: int,
        quant_config: QuantizationConfig | None,
    ) -> nn.Module:
        prefix = f"model.layers.{index}"
        if not _is_sparse(config, index):
            return DecoderLayer(config, backend, self.rotary, True, quant_config, prefix)
        routing = RoutingConfig(
            top_k=config.num_experts_per_tok, renormalize=bool(config.norm_topk_prob)
        )
        moe = SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            routing,
            f"{prefix}.mlp",
        )
        return MoeDecoderLayer(config, backend, self.rotary, True, quant_config, prefix, mlp=moe)


def _is_sparse(config: PretrainedConfig, index: int) -> bool:
    return (
        index not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )
