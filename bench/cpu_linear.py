"""The default model's CPU GEMMs and decode attention, one thread, timed in thread CPU time.

On a shared, loaded machine wall-clock timings of one op spread by 5x; the CPU time of the
calling thread (one OpenMP thread, so the op runs in it) spreads by about 20%, the rest of the
noise being other processes' use of the shared L3 and memory bandwidth. Each figure is the
minimum over interleaved rounds of every variant.

Variants per projection of SmolLM2-135M (x [rows, in] @ W.T): the engine's fp32 GEMM on
panels (kernels/cpu_gemm.cpp, where this CPU has AVX-512 or AVX2), the oneDNN-packed fp32
weight (the engine's where it has neither), F.linear (MKL), fbgemm's dynamically quantized int8
linear (per-channel int8 weights, activations quantized per call), bf16 F.linear, and, where
oneDNN has bf16 GEMMs, the engine's `--dtype bfloat16` on CPU: the oneDNN-packed bf16 weight,
fp32 activations cast to bf16 and the output back to fp32. Also the square fp32 matmul rate
the CPU floor of bench/throughput.py uses, and the C++ paged decode attention on one layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.layers.quantization.base import packed_linear
from bench.throughput import cpu_description
from kernels.cpu_decode_attention import cpu_decode_attention_available, paged_decode_attention_cpu
from kernels.cpu_gemm import cpu_gemm, cpu_gemm_available, pack_cpu_gemm_weight

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536, vocabulary 49,152
PROJECTIONS = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def cpu_seconds(fn, repeats: int = 5, inner: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - start) / inner)
    return best


def int8_weight(weight: torch.Tensor) -> object:
    """fbgemm's packed weight: symmetric int8 per output channel."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-8).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    quantized = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(quantized, None)


def linear_variants(weight: torch.Tensor, x: torch.Tensor) -> dict:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    int8 = int8_weight(weight)
    weight_bf16, x_bf16 = weight.bfloat16(), x.bfloat16()
    variants = {}
    if cpu_gemm_available():
        panels = pack_cpu_gemm_weight(weight)
        variants["cpu_gemm_fp32"] = lambda: cpu_gemm(x, panels, None)
    variants |= {
        "onednn_fp32": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "mkl_fp32": lambda: F.linear(x, weight),
        "fbgemm_int8_dynamic": lambda: torch.ops.quantized.linear_dynamic(x, int8, True),
        "bf16": lambda: F.linear(x_bf16, weight_bf16),
    }
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN packs bf16 only with AVX-512
        packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, 32)
        variants["onednn_bf16_fp32_io"] = lambda: packed_linear(x, packed_bf16, None, torch.float32)
    return variants


def time_linears(rows: list[int], rounds: int) -> list[dict]:
    results = []
    for name, (n, k) in PROJECTIONS.items():
        weight = torch.randn(n, k) * 0.02
        for m in rows:
            variants = linear_variants(weight, torch.randn(m, k))
            best = {label: float("inf") for label in variants}
            for _ in range(rounds):
                for label, fn in variants.items():
                    best[label] = min(best[label], cpu_seconds(fn))
            flops = 2 * m * n * k
            results.append(
                {
                    "projection": name,
                    "rows": m,
                    "gflops_per_s": {label: flops / s / 1e9 for label, s in best.items()},
                }
            )
            print(name, m, {label: round(flops / s / 1e9, 1) for label, s in best.items()})
    return results


def time_decode_attention(requests: int, context: int) -> dict:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks = -(-context // block_size)
    kv_cache = torch.randn(2, requests * blocks, block_size, kv_heads, head_dim)
    tables = torch.arange(requests * blocks, dtype=torch.int32).view(requests, blocks)
    lens = torch.full((requests,), context, dtype=torch.int32)
    query = torch.randn(requests, heads, head_dim)
    out = torch.empty_like(query)
    seconds = cpu_seconds(
        lambda: paged_decode_attention_cpu(query, kv_cache, tables, lens, 0.125, out)
    )
    flops = 4 * requests * heads * head_dim * context
    kv_bytes = 2 * requests * context * kv_heads * head_dim * 4
    return {
        "requests": requests,
        "context": context,
        "ms_per_layer": seconds * 1e3,
        "gflops_per_s": flops / seconds / 1e9,
        "kv_gb_per_s": kv_bytes / seconds / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,16,32,256", help="comma-separated row counts")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per shape")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    a = torch.randn(1024, 1024)
    result = {
        "benchmark": "cpu_linear",
        "command": " ".join(["python", *sys.argv]),
        "cpu": cpu_description(),
        "torch": torch.__version__,
        "timing": "thread CPU time, 1 thread, min of interleaved rounds",
        "square_matmul_fp32_gflops_per_s": 2 * 1024**3 / cpu_seconds(lambda: a @ a) / 1e9,
        "linears": time_linears([int(r) for r in args.rows.split(",")], args.rounds),
    }
    if cpu_decode_attention_available():
        result["decode_attention"] = [time_decode_attention(32, c) for c in (100, 300, 500)]
    print(json.dumps({k: v for k, v in result.items() if k != "linears"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
