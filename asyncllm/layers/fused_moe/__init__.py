from asyncllm.layers.fused_moe.layer import EXPERT_SHARDS, FusedMoE
from asyncllm.layers.fused_moe.routing import RoutingConfig, select_experts

__all__ = ["EXPERT_SHARDS", "FusedMoE", "RoutingConfig", "select_experts"]
