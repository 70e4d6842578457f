"""Mixtral: the Llama attention with a sparse mixture of experts in place of each MLP. The MoE
block and the expert weight loading here serve Qwen3-MoE and DeepSeek-V2 too."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from asyncllm.attention.backend import AttentionBackend
from asyncllm.layers.fused_moe import EXPERT_SHARDS, FusedMoE, RoutingConfig
from asyncllm.layers.linear import LoadedWeight, QuantizationConfig, ReplicatedLinear, read_all
from asyncllm.models.llama import DecoderLayer, LlamaForCausalLM

# layers.N.mlp.experts.E.w1.weight (one expert), layers.N.mlp.experts.gate_up_proj (stacked),
# layers.N.mlp.shared_experts.gate_proj.weight (DeepSeek's shared MLP)
_ONE_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
_STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)")
_SHARED_EXPERTS = re.compile(r"(.*)\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight")


class SparseMoeBlock(nn.Module):
    """The router and the experts: the routed ones and (DeepSeek) the shared ones every token
    goes to, which FusedMoE stacks after them."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: RoutingConfig,
        prefix: str,
        num_shared_experts: int = 0,
    ) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(
            num_experts, hidden_size, intermediate_size, routing, num_shared=num_shared_experts
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


def mlp_after_attention(
    layer: nn.Module, attn_out: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's after_attention piece when its mlp is a module of its own (an MoE block, or
    DeepSeek's dense MLP): o_proj, the post-attention norm, then the mlp; (output, residual)."""
    x = layer.self_attn.o_proj(attn_out.flatten(1))
    x, residual = layer.post_attention_layernorm(x, residual)
    return layer.mlp(x), residual


class MoeDecoderLayer(DecoderLayer):
    after_attention = mlp_after_attention


def load_expert_weights(
    model: nn.Module, weights: Iterable[tuple[str, LoadedWeight]], loaded: set[str]
) -> Iterator[tuple[str, LoadedWeight]]:
    """Stacks the experts' tensors into their FusedMoE (adding the parameters to loaded) and
    passes every other tensor on; names lose their `model.` prefix. Each rank reads an expert
    tensor whole, then keeps its slice."""
    for name, weight in weights:
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
        if match := _ONE_EXPERT.fullmatch(name):
            module, expert, projection = match.groups()
            target, shard = EXPERT_SHARDS[projection]
            experts = model.get_submodule(module)
            experts.weight_loader(getattr(experts, target), read_all(weight), int(expert), shard)
        elif match := _STACKED_EXPERTS.fullmatch(name):
            module, projection = match.groups()
            model.get_submodule(module).load_stacked(projection, read_all(weight))
            target = "w2_weight" if projection == "down_proj" else "w13_weight"
        elif match := _SHARED_EXPERTS.fullmatch(name):
            block, projection = match.groups()
            model.get_submodule(f"{block}.experts").load_shared(projection, read_all(weight))
            loaded.add(f"{block}.experts.{EXPERT_SHARDS[projection][0]}")
            continue
        else:
            yield name, weight
            continue
        loaded.add(f"{match.group(1)}.{target}")


class MixtralForCausalLM(LlamaForCausalLM):
    def make_layer(
        self,
        config: PretrainedConfig,
        backend: AttentionBackend,
        index: int,
        quant_config: QuantizationConfig | None,
    ) -> nn.Module:
        routing = RoutingConfig(top_k=config.num_experts_per_tok, renormalize=True)
        prefix = f"model.layers.{index}"
        moe = SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.intermediate_size,
            routing,
            f"{prefix}.mlp",
        )
        return MoeDecoderLayer(config, backend, self.rotary, False, quant_config, prefix, mlp=moe)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        loaded: set[str] = set()
        return super().load_weights(load_expert_weights(self, weights, loaded)) | loaded
