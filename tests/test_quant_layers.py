"""Each quantization method's layer computes what its dequantized weights compute.

Checkpoint tensors are written here from the formats' documentation (GPTQ: AutoGPTQ's
qweight/qzeros/g_idx; AWQ: AutoAWQ's GEMM packing; FP8: vLLM's fp8 method), independently of
the packing code under test, loaded shard by shard through the layer's weight_loader the way
a model's loader does, and the layer's output compared with x @ dequantized W on CPU.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from asyncllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    rms_norm_linear,
    silu_and_mul_linear,
)
from asyncllm.layers.norm import RMSNorm
from asyncllm.layers.quantization import get_quantization_config
from asyncllm.layers.quantization.awq import AWQConfig
from asyncllm.layers.quantization.cpu_int8 import check_supported
from asyncllm.layers.quantization.fp8 import FP8, MIN_SCALE, Fp8Config, Fp8LinearMethod
from asyncllm.layers.quantization.gptq import GPTQConfig
from asyncllm.layers.quantization.int4 import pack_int4, unpack_int4
from bench.gptq_checkpoint import as_int32, gptq_int4, gptq_pack_cols, gptq_pack_rows, rtn_int4

# a merged q/k/v-like layer: shards of different widths, all multiples of 8
SHARDS = {"q": 48, "k": 16, "v": 24}


def make_layer(
    config, in_features: int, sizes: list[int], dtype=torch.float32, bias=False
) -> ColumnParallelLinear:
    """A merged layer of the shards sizes (loaded by shard index), or a plain one of one."""
    prefix = "model.layers.0.self_attn.qkv_proj"
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if len(sizes) == 1:
            return ColumnParallelLinear(in_features, sizes[0], bias, False, config, prefix)
        return MergedColumnParallelLinear(in_features, sizes, bias, False, config, prefix)
    finally:
        torch.set_default_dtype(saved)


def awq_pack_cols(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: of each 8 columns, column order_map[i] goes to nibble i with
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for col in range(q.shape[1] // 8):
        for i in range(8):
            out[:, col] |= q[:, col * 8 + order_map[i]].long() << (i * 4)
    return as_int32(out)


def load_shards(layer: ColumnParallelLinear, tensors: dict[str, list[torch.Tensor]]) -> None:
    for name, shards in tensors.items():
        for shard_id, tensor in enumerate(shards):
            layer.weight_loader(getattr(layer, name), tensor, shard_id)
    assert layer.unloaded() == []
    layer.quant_method.process_weights_after_loading(layer)


def split_out(t: torch.Tensor, dim: int, factor: int = 1) -> list[torch.Tensor]:
    return list(t.split([s // factor for s in SHARDS.values()], dim=dim))


def test_pack_and_unpack_are_inverse_in_both_orders() -> None:
    q = torch.randint(0, 16, (16, 24), dtype=torch.int32)
    for order in [(0, 1, 2, 3, 4, 5, 6, 7), (0, 2, 4, 6, 1, 3, 5, 7)]:
        for dim in (0, 1):
            assert torch.equal(unpack_int4(pack_int4(q, dim, order), dim, order), q)
    assert torch.equal(pack_int4(q, 0), gptq_pack_rows(q))
    assert torch.equal(pack_int4(q, 1, (0, 2, 4, 6, 1, 3, 5, 7)), awq_pack_cols(q))


def test_gptq_rounding_beats_round_to_nearest_on_its_inputs() -> None:
    """bench/gptq_checkpoint.py's GPTQ: on the inputs its Hessian comes from (correlated, as
    a layer's are) its 4-bit W gives a smaller output error than rounding each weight to
    nearest, with every value and zero point on the 4-bit grid."""
    gen = torch.Generator().manual_seed(0)
    k, n, group = 128, 48, 32
    x = torch.randn(512, k, generator=gen) @ torch.randn(k, k, generator=gen)
    w = torch.randn(k, n, generator=gen)
    errors = {}
    for name, (q, scales, zeros) in {
        "rtn": rtn_int4(w, group, symmetric=False),
        "gptq": gptq_int4(w, x.t() @ x, group),
    }.items():
        assert q.min() >= 0 and q.max() <= 15 and zeros.min() >= 0 and zeros.max() <= 15
        rows = torch.arange(k) // group
        dequantized = (q - zeros[rows]).float() * scales[rows]
        errors[name] = (x @ (dequantized - w)).norm() / (x @ w).norm()
    assert errors["gptq"] < 0.8 * errors["rtn"]


@pytest.mark.parametrize("group", [32, -1])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_layer_equals_dequantized_weights(
    group: int, symmetric: bool, act_order: bool
) -> None:
    torch.manual_seed(0)
    k, n = 96, sum(SHARDS.values())
    gs = k if group == -1 else group
    w = torch.randn(k, n)
    # act-order: GPTQ quantizes rows in a permuted order, the i-th one into group i // gs
    perm = torch.randperm(k) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // gs
    q_perm, scales, zeros = rtn_int4(w[perm], gs, symmetric)
    q = torch.empty_like(q_perm)
    q[perm] = q_perm
    reference = (q.float() - zeros[g_idx.long()].float()) * scales[g_idx.long()]
    config = GPTQConfig.from_config(
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": symmetric,
        }
    )
    layer = make_layer(config, k, list(SHARDS.values()))
    load_shards(
        layer,
        {
            "qweight": split_out(gptq_pack_rows(q), 1),
            "qzeros": split_out(gptq_pack_cols(zeros - 1), 1, 8),  # the v1 format's zero - 1
            "scales": split_out(scales, 1),
            "g_idx": [g_idx] * 3,
        },
    )
    x = torch.randn(5, k)
    torch.testing.assert_close(layer(x), x @ reference, rtol=1e-5, atol=1e-4)


def test_awq_layer_equals_dequantized_weights() -> None:
    torch.manual_seed(1)
    k, n, gs = 64, sum(SHARDS.values()), 16
    q, scales, zeros = rtn_int4(torch.randn(k, n), gs, symmetric=False)
    groups = torch.arange(k) // gs
    reference = (q.float() - zeros[groups].float()) * scales[groups]
    config = AWQConfig.from_config(
        {
            "quant_method": "awq",
            "w_bit": 4,
            "q_group_size": gs,
            "zero_point": True,
            "version": "gemm",
        }
    )
    layer = make_layer(config, k, list(SHARDS.values()), bias=True)
    bias = torch.randn(n)
    load_shards(
        layer,
        {
            "qweight": split_out(awq_pack_cols(q), 1, 8),
            "qzeros": split_out(awq_pack_cols(zeros), 1, 8),
            "scales": split_out(scales, 1),
            "bias": split_out(bias, 0),
        },
    )
    x = torch.randn(3, 2, k)
    torch.testing.assert_close(layer(x), x @ reference + bias, rtol=1e-5, atol=1e-4)


def quantize_fp8(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448, 448).to(FP8)


def per_token_fp8(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 GEMM sees it: each row scaled to e4m3's range, rounded, scaled back."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 448
    return (x / scale).to(FP8).float() * scale


def test_fp8_per_tensor_scales_of_merged_shards() -> None:
    torch.manual_seed(2)
    k = 64
    shards = [torch.randn(s, k) * (i + 1) for i, s in enumerate(SHARDS.values())]
    scales = [w.abs().max() / 448 for w in shards]
    weights = [quantize_fp8(w, s) for w, s in zip(shards, scales)]
    reference = torch.cat([w.float() * s for w, s in zip(weights, scales)])
    layer = make_layer(
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"}),
        k,
        list(SHARDS.values()),
    )
    load_shards(layer, {"weight": weights, "weight_scale": [s.reshape(()) for s in scales]})
    x = torch.randn(7, k)
    torch.testing.assert_close(layer(x), per_token_fp8(x) @ reference.t(), rtol=1e-5, atol=1e-4)


def test_fp8_static_activation_scale_takes_the_largest_shard_scale() -> None:
    torch.manual_seed(3)
    k = 32
    shards = [torch.randn(s, k) for s in SHARDS.values()]
    w_scales = [w.abs().max() / 448 for w in shards]
    x = torch.randn(4, k)
    x_scales = [torch.tensor(1e-3), torch.tensor(2e-3), x.abs().max() / 448]
    layer = make_layer(
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"}),
        k,
        list(SHARDS.values()),
    )
    weights = [quantize_fp8(w, s) for w, s in zip(shards, w_scales)]
    load_shards(layer, {"weight": weights, "weight_scale": w_scales, "input_scale": x_scales})
    reference = torch.cat([w.float() * s for w, s in zip(weights, w_scales)])
    x_seen = (x / x_scales[2]).to(FP8).float() * x_scales[2]
    torch.testing.assert_close(layer(x), x_seen @ reference.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("n", "k", "block"), [(48, 64, (16, 32)), (40, 100, (16, 32)), (130, 256, (128, 128))]
)
def test_fp8_block_scales_equal_dequantized_weights(n: int, k: int, block: tuple[int, int]) -> None:
    """Partial blocks at the edges of N and K, as DeepSeek-V3 checkpoints have them."""
    torch.manual_seed(4)
    bn, bk = block
    w = torch.randn(n, k)
    nb, kb = -(-n // bn), -(-k // bk)
    scale = torch.rand(nb, kb) * 0.01 + 1e-3
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    wq = quantize_fp8(w, full)
    config = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    )
    layer = make_layer(config, k, [n])
    layer.weight_loader(layer.weight, wq)
    layer.weight_loader(layer.weight_scale_inv, scale)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, k)
    x_seen = torch.cat([per_token_fp8(part) for part in x.split(bk, dim=1)], dim=1)
    torch.testing.assert_close(layer(x), x_seen @ (wq.float() * full).t(), rtol=1e-5, atol=1e-4)


def test_fp8_at_load_quantizes_each_output_channel() -> None:
    torch.manual_seed(5)
    k = 64
    w = torch.randn(sum(SHARDS.values()), k)
    layer = make_layer(get_quantization_config(None, "fp8"), k, list(SHARDS.values()))
    load_shards(layer, {"weight": split_out(w, 0)})
    assert layer.weight.dtype == FP8
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    x = torch.randn(6, k)
    expected = per_token_fp8(x) @ (quantize_fp8(w, scale).float() * scale).t()
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    assert (layer(x) - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


def test_wrong_shape_scale_fails_at_load_naming_the_tensor() -> None:
    layer = make_layer(
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [16, 16]}), 64, [48]
    )
    with pytest.raises(ValueError, match=r"qkv_proj\.weight_scale_inv.*\(3, 3\).*\(3, 4\)"):
        layer.weight_loader(layer.weight_scale_inv, torch.ones(3, 3))


def test_a_missing_shard_is_reported() -> None:
    layer = make_layer(Fp8Config.from_config({"quant_method": "fp8"}), 32, list(SHARDS.values()))
    for shard_id, size in enumerate(SHARDS.values()):
        layer.weight_loader(layer.weight, torch.zeros(size, 32, dtype=FP8), shard_id)
    layer.weight_loader(layer.weight_scale, torch.tensor(1.0), 0)
    assert layer.unloaded() == [
        "model.layers.0.self_attn.qkv_proj.weight_scale[1]",
        "model.layers.0.self_attn.qkv_proj.weight_scale[2]",
    ]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_cuda_fp8_and_int4_layers_equal_their_dequantized_weights(rows: int) -> None:
    """FP8 through torch._scaled_mm (kernels.gemv at one row), GPTQ act-order through
    kernels.int4_gemm, in bf16 on the GPU."""
    torch.manual_seed(6)
    k, sizes = 256, [256, 128, 128]
    w = torch.randn(sum(sizes), k)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
    with torch.device("cuda"):
        fp8 = make_layer(get_quantization_config(None, "fp8"), k, sizes, torch.bfloat16)
    for shard_id, shard in enumerate(w.bfloat16().cuda().split(sizes)):
        fp8.weight_loader(fp8.weight, shard, shard_id)
    fp8.quant_method.process_weights_after_loading(fp8)
    dequantized = fp8.weight.float() * fp8.weight_scale.view(-1, 1)
    seen = x.float() if rows == 1 else per_token_fp8(x.float())  # one row: 16-bit x (GEMV)
    assert relative(fp8(x).float(), seen @ dequantized.t()) < 1e-2

    perm = torch.randperm(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // 64
    q_perm, scales, zeros = rtn_int4(w.t()[perm], 64, symmetric=False)
    q = torch.empty_like(q_perm)
    q[perm] = q_perm
    reference = (q.float() - zeros[g_idx.long()].float()) * scales[g_idx.long()]
    config = GPTQConfig.from_config(
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    )
    with torch.device("cuda"):
        int4 = make_layer(config, k, [sum(sizes)], torch.bfloat16)
    tensors = {
        "qweight": gptq_pack_rows(q),
        "qzeros": gptq_pack_cols(zeros - 1),
        "scales": scales,
        "g_idx": g_idx,
    }
    for name, tensor in tensors.items():
        param = getattr(int4, name)
        int4.weight_loader(param, tensor.to(param.device, param.dtype))
    int4.quant_method.process_weights_after_loading(int4)
    assert relative(int4(x).float(), x.float() @ reference.cuda()) < 1e-2


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def int8_layer(w: torch.Tensor, bias: torch.Tensor | None = None) -> ColumnParallelLinear:
    """A merged layer of SHARDS with --quantization int8, loaded with W [out, in] (and bias)."""
    layer = make_layer(
        get_quantization_config(None, "int8"),
        w.shape[1],
        list(SHARDS.values()),
        bias=bias is not None,
    )
    tensors = {"weight": split_out(w, 0)}
    if bias is not None:
        tensors["bias"] = split_out(bias, 0)
    load_shards(layer, tensors)
    return layer


def int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return (w / scale).round(), scale


def test_int8_at_load_stores_each_output_channel_rounded_to_its_scale() -> None:
    torch.manual_seed(6)
    w = torch.randn(sum(SHARDS.values()), 64)
    packed, _ = int8_layer(w).int8_packed.unpack()
    q, scale = int8_per_channel(w)
    assert torch.equal(packed.int_repr().float(), q)
    torch.testing.assert_close(packed.q_per_channel_scales().float(), scale.view(-1))


def test_int8_linear_is_exact_on_the_activation_grid() -> None:
    """Rows of integers 0..127, each reaching 127: fbgemm's 7-bit activation grid holds them
    exactly, so only the weights' rounding is left."""
    torch.manual_seed(7)
    w, bias = torch.randn(sum(SHARDS.values()), 64), torch.randn(sum(SHARDS.values()))
    x = torch.randint(0, 128, (5, 64)).float()
    x[:, 0], x[:, 1] = 0, 127
    q, scale = int8_per_channel(w)
    expected = x @ (q * scale).t() + bias
    torch.testing.assert_close(int8_layer(w, bias)(x), expected, rtol=1e-5, atol=1e-4)


def test_int8_linear_stays_within_the_activations_rounding() -> None:
    """Each row's error under half its activation step times the row of |dequantized W|; one
    row 100x the others does not widen the others' steps (each row is scaled to one max)."""
    torch.manual_seed(8)
    w = torch.randn(sum(SHARDS.values()), 96)
    x = torch.randn(7, 96)
    x[3] *= 100
    q, scale = int8_per_channel(w)
    dequantized = q * scale
    normalized = x / x.abs().amax(dim=1, keepdim=True)
    span = normalized.amax().clamp(min=0) - normalized.amin().clamp(max=0)
    step = span / 127 * x.abs().amax(dim=1, keepdim=True)
    bound = 0.5 * step * dequantized.abs().sum(dim=1)
    error = (int8_layer(w)(x) - x @ dequantized.t()).abs()
    assert (error <= 1.01 * bound + 1e-4).all()
    assert error.max() > 0  # the activations were rounded: the bound is what is tested


def test_int8_is_refused_off_cpu() -> None:
    with pytest.raises(ValueError, match="--quantization fp8"):
        check_supported(torch.device("cuda"))


@pytest.mark.parametrize("with_residual", [False, True])
def test_fp8_layer_takes_rows_quantized_by_the_norm_and_silu_kernels(
    with_residual: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past one GPU row an FP8 layer's activations are quantized by the kernel before it
    (kernels.rms_norm_fp8, silu_and_mul_fp8): on the GPU bit for bit what the layer gives when
    it quantizes the norm's or the SiLU-and-mul's rows itself, with the same residual. On CPU,
    where the interpreter's casts to e4m3 round otherwise than torch's, the method is told it
    takes the rows and the outputs are checked against the kernels' rows through apply_fp8."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(3)
    k, rows = 96, 7
    with torch.device(device):
        layer = make_layer(get_quantization_config(None, "fp8"), k, [64, 64], torch.bfloat16)
        norm = RMSNorm(k, 1e-6)
    for shard_id, shard in enumerate(torch.randn(128, k, device=device).split(64)):
        layer.weight_loader(layer.weight, shard.bfloat16(), shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    residual = torch.randn(rows, k, device=device, dtype=torch.bfloat16) if with_residual else None
    gate_up = torch.randn(rows, 2 * 128, device=device, dtype=torch.bfloat16)[:, : 2 * k]
    gate_up = gate_up.contiguous()

    def fused_and_unfused(takes: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(Fp8LinearMethod, "takes_fp8_rows", lambda self, x: takes)
        res = None if residual is None else residual.clone()
        out, res = rms_norm_linear(norm, layer, x.clone(), res)
        return [out, res, silu_and_mul_linear(layer, gate_up)]

    assert layer.quant_method.takes_fp8_rows(x) == cuda
    fused = fused_and_unfused(True)
    if cuda:
        expected = fused_and_unfused(False)
    else:
        res = None if residual is None else residual.clone()
        normed = kernels.rms_norm_fp8(x, res, norm.weight, norm.eps, MIN_SCALE)
        acts = kernels.silu_and_mul_fp8(gate_up, MIN_SCALE)
        expected = [layer.forward_fp8(*normed, x.dtype), x if res is None else res]
        expected.append(layer.forward_fp8(*acts, x.dtype))
    for out, want in zip(fused, expected):
        assert out.shape == want.shape and torch.equal(out, want)
