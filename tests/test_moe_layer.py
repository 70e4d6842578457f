"""Routing as each model defines it, and the experts' inner dimension split across ranks."""

from __future__ import annotations

import pytest
import torch

from asyncllm.layers.fused_moe import FusedMoE, RoutingConfig, select_experts
from asyncllm.layers.fused_moe.routing import torch_select_experts
from kernels.moe_routing import route_top_k


def test_renormalised_top_k_weights_sum_to_one() -> None:
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = select_experts(logits, RoutingConfig(top_k=3))
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    assert torch.equal(ids.long(), logits.topk(3).indices)


def test_sigmoid_scores_with_routing_scale() -> None:
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    config = RoutingConfig(top_k=2, scoring="sigmoid", renormalize=False, routed_scaling_factor=2.5)
    weights, _ = select_experts(logits, config)
    assert torch.allclose(weights, logits.sigmoid().topk(2).values * 2.5)


def test_grouped_top_k_keeps_experts_of_the_best_groups_only() -> None:
    # 3 groups of 2 experts; the best experts are 0 (group 0) and 5 (group 2), group 1 is second
    logits = torch.tensor([[9.0, -9.0, 5.0, 4.0, -8.0, 8.0]])
    config = RoutingConfig(top_k=3, renormalize=False, num_groups=3, topk_groups=2)
    _, ids = select_experts(logits, config)
    assert set(ids[0].tolist()) == {0, 5, 4}  # not 2 or 3: group 1 lost to group 2's expert 5


def test_ranks_split_the_inner_dimension_and_their_outputs_sum_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(2)
    num_experts, hidden, inner = 4, 16, 12
    gate = torch.randn(num_experts, inner, hidden, generator=gen)
    up = torch.randn(num_experts, inner, hidden, generator=gen)
    down = torch.randn(num_experts, hidden, inner, generator=gen)
    x = torch.randn(5, hidden, generator=gen)
    logits = torch.randn(5, num_experts, generator=gen)

    def layer(rank: int, size: int) -> FusedMoE:
        moe = FusedMoE(num_experts, hidden, inner, RoutingConfig(top_k=2), rank, size)
        for e in range(num_experts):
            moe.weight_loader(moe.w13_weight, gate[e], e, 0)
            moe.weight_loader(moe.w13_weight, up[e], e, 1)
            moe.weight_loader(moe.w2_weight, down[e], e, None)
        return moe

    with torch.no_grad():
        whole = layer(0, 1)(x, logits)
        parts = [layer(rank, 2)(x, logits) for rank in range(2)]
    assert layer(1, 2).w13_weight.shape == (num_experts, inner, hidden)
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_ROUTINGS = {
    "softmax_renormalised": RoutingConfig(top_k=8),
    "softmax_as_is": RoutingConfig(top_k=6, renormalize=False),
    "sigmoid_scaled": RoutingConfig(
        top_k=2, scoring="sigmoid", renormalize=False, routed_scaling_factor=2.5
    ),
    "sigmoid_renormalised": RoutingConfig(top_k=3, scoring="sigmoid"),
}


@pytest.mark.parametrize("name", KERNEL_ROUTINGS)
@pytest.mark.parametrize("num_tokens", [0, 1, 37, 300])
def test_routing_kernel_matches_torch(name: str, num_tokens: int) -> None:
    # 60 experts: not a power of two; 300 tokens: several programs of 64 rows
    config = KERNEL_ROUTINGS[name]
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, 60, generator=gen).to(DEVICE)
    sigmoid = config.scoring == "sigmoid"
    scale = config.routed_scaling_factor
    weights, ids = route_top_k(logits, config.top_k, sigmoid, config.renormalize, scale)
    ref_weights, ref_ids = torch_select_experts(logits, config)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("num_tokens", [1, 37])
def test_shared_experts_follow_the_routed_choices_at_weight_one(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(num_tokens, 60, generator=gen).to(DEVICE)
    config = RoutingConfig(top_k=6, renormalize=False, routed_scaling_factor=2.5)
    routed_weights, routed_ids = torch_select_experts(logits, config)
    for route in (select_experts, torch_select_experts):  # the kernel on a GPU, then torch
        weights, ids = route(logits, config, 2)
        assert torch.equal(ids[:, :6], routed_ids)
        assert ids[:, 6:].tolist() == [[60, 61]] * num_tokens
        torch.testing.assert_close(weights[:, :6], routed_weights)
        assert torch.equal(weights[:, 6:], torch.ones(num_tokens, 2, device=DEVICE))


def test_routing_kernel_appends_shared_experts() -> None:
    logits = torch.randn(37, 60, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    weights, ids = route_top_k(logits, 6, renormalize=False, scale=2.5, num_shared=2)
    ref_weights, ref_ids = torch_select_experts(
        logits, RoutingConfig(top_k=6, renormalize=False, routed_scaling_factor=2.5), 2
    )
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


def test_shared_experts_are_their_mlp_in_inner_slices() -> None:
    """A shared MLP of inner size 2 * I loaded as two experts after the routed ones gives the
    routed experts' output plus the MLP's."""
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inner = 4, 16, 6
    x = torch.randn(5, hidden, generator=gen)
    logits = torch.randn(5, num_experts, generator=gen)
    gate, up = (torch.randn(2 * inner, hidden, generator=gen) for _ in range(2))
    down = torch.randn(hidden, 2 * inner, generator=gen)
    moe = FusedMoE(num_experts, hidden, inner, RoutingConfig(top_k=2), 0, 1, num_shared=2)
    torch.nn.init.normal_(moe.w13_weight, generator=gen)
    torch.nn.init.normal_(moe.w2_weight, generator=gen)
    for name, weight in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
        moe.load_shared(name, weight)
    routed = FusedMoE(num_experts, hidden, inner, RoutingConfig(top_k=2), 0, 1)
    routed.w13_weight.data.copy_(moe.w13_weight.data[:num_experts])
    routed.w2_weight.data.copy_(moe.w2_weight.data[:num_experts])
    with torch.no_grad():
        mlp = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T
        torch.testing.assert_close(moe(x, logits), routed(x, logits) + mlp, rtol=1e-5, atol=1e-5)


def test_routing_kernel_reads_bfloat16_logits() -> None:
    # bf16 scores tie often: the picked experts' logits must match, not their order among equals
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(33, 128, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = route_top_k(logits, 8)
    ref_weights, ref_ids = torch_select_experts(logits, RoutingConfig(top_k=8))
    picked = logits.gather(1, ids.long())
    assert torch.equal(picked, logits.gather(1, ref_ids.long()))
    torch.testing.assert_close(weights, ref_weights)


def test_routing_kernel_keeps_a_nan_row_among_the_experts() -> None:
    # a NaN score equals nothing, not even the row's max: the picked ids must still index weights
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    logits[1] = float("nan")
    _, ids = route_top_k(logits.to(DEVICE), 4)
    assert bool(((ids >= 0) & (ids < 20)).all())
