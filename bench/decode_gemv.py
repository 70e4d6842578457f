"""Batch-1 decode's projections on one GPU, timed as the decode step runs them: every layer's
weights (distinct tensors, so nothing stays in L2) in one CUDA graph, replayed.

    python bench/decode_gemv.py --out bench/results/decode_gemv_h200.json
    python bench/decode_gemv.py --shape llama-3.1-8b --out bench/results/decode_gemv_llama8b_h200.json

Sections: each GEMM shape alone for a sweep of GEMV tile configs, against cuBLAS (F.linear),
and those that follow a norm as rms_norm_gemv runs them (the norm in each program); then one
layer's chain of projections with the norms and activation between them, unfused
(separate norm, GEMM and activation launches; cuBLAS or GEMV GEMMs) against the fused GEMV
kernels.
GB/s counts the weight bytes read, against the bytes read + written per second by a copy in the
same run (the convention of bench/throughput.py's floor: weights read once at copy bandwidth).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow kernels
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncllm.models.shapes import SHAPES  # noqa: E402
from kernels import (  # noqa: E402
    fused_add_rms_norm,
    gemv,
    rms_norm_gemv,
    silu_and_mul,
    silu_and_mul_gemv,
)
from kernels.gemv_kernels import GemvConfig, choose_gemv_config, gemv_config  # noqa: E402

DTYPE = torch.bfloat16
SWEEP = [
    GemvConfig(block_n, block_k, warps)
    for block_n, block_k, warps in itertools.product(
        (1, 2, 4, 8, 16), (256, 512, 1024, 2048, 4096, 8192), (4, 8)
    )
    if 1024 <= block_n * block_k <= 16384
]
NORM_FIRST = ("qkv_proj", "gate_up_proj")  # rms_norm_gemv's in a decode layer


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    q_size: int
    qkv_size: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        q_size = config["num_attention_heads"] * head_dim
        kv_size = config["num_key_value_heads"] * head_dim
        return cls(
            config["num_hidden_layers"],
            config["hidden_size"],
            q_size,
            q_size + 2 * kv_size,
            config["intermediate_size"],
            config["vocab_size"],
        )

    def gemms(self) -> dict[str, tuple[int, int]]:
        """GEMM: (N, K) of one layer."""
        return {
            "qkv_proj": (self.qkv_size, self.hidden),
            "o_proj": (self.hidden, self.q_size),
            "gate_up_proj": (2 * self.intermediate, self.hidden),
            "down_proj": (self.hidden, self.intermediate),
        }


def graph_us(fn: Callable[[], object], replays: int = 50) -> float:
    """Microseconds per replay of a CUDA graph of fn (captured after a warm-up run)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def copy_gbps(copies: int = 20) -> float:
    """Bytes read + written per second by eager device-to-device copies, as bench/throughput.py
    measures the floor's bandwidth (captured in a graph, the copy becomes a memcpy node that
    ran at two thirds of that)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(copies):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * copies / start.elapsed_time(end) / 1e6


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE) * 0.02


def sweep_gemm(
    name: str, n: int, k: int, copies: int, copy: float, norm_first: bool = False
) -> dict:
    """The GEMV's tiles on its own, or (norm_first) as rms_norm_gemv runs them in a layer, each
    program first taking the residual add and the RMSNorm of x."""
    weights = [rand(n, k) for _ in range(copies)]
    x, residual, norm_weight = rand(1, k), rand(1, k), rand(k) + 1

    def run(w: torch.Tensor, config: GemvConfig) -> object:
        if norm_first:
            return rms_norm_gemv(x, residual, norm_weight, 1e-6, w, config=config)
        return gemv(x, w, config=config)

    def per_gemm_us(gemm: Callable[[torch.Tensor], object]) -> float:
        return graph_us(lambda: [gemm(w) for w in weights]) / copies

    rows = []
    for config in SWEEP:
        us = per_gemm_us(lambda w, c=config: run(w, c))
        rows.append({"config": vars(config), "us": us, "gbps": n * k * 2 / us / 1e3})
    best = min(rows, key=lambda r: r["us"])
    chosen = gemv_config(n, k, norm_first=norm_first)
    chosen_us = per_gemm_us(lambda w: run(w, chosen))
    cublas_us = per_gemm_us(lambda w: F.linear(x, w))
    return {
        "gemm": name + (" after its rms_norm" if norm_first else ""),
        "n": n,
        "k": k,
        "chosen": {
            "config": vars(chosen),
            "us": chosen_us,
            "pct_of_copy": pct(n, k, chosen_us, copy),
        },
        "best": dict(best, pct_of_copy=pct(n, k, best["us"], copy)),
        "cublas_us": cublas_us,
        "sweep": rows,
    }


def pct(n: int, k: int, us: float, copy: float) -> float:
    return 100 * n * k * 2 / us / 1e3 / copy


def layer_chain(shape: Shape) -> dict:
    """One decode layer's projections with what runs between them, for all layers."""
    layers = [
        {name: rand(n, k) for name, (n, k) in shape.gemms().items()}
        | {"norm1": rand(shape.hidden) + 1, "norm2": rand(shape.hidden) + 1}
        for _ in range(shape.layers)
    ]
    x0, attn = rand(1, shape.hidden), rand(1, shape.q_size)

    def unfused(linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        x, residual = x0.clone(), x0.clone()
        for w in layers:
            x, residual = fused_add_rms_norm(x, residual, w["norm1"], 1e-6)
            linear(x, w["qkv_proj"])
            x, residual = fused_add_rms_norm(linear(attn, w["o_proj"]), residual, w["norm2"], 1e-6)
            x = linear(silu_and_mul(linear(x, w["gate_up_proj"])), w["down_proj"])

    def fused(prologue_block_n: int | None = None) -> None:
        """The kernels' own configs, or prologue_block_n rows per program where a norm or
        activation comes first (each program recomputes it, so more rows share that cost)."""

        def config(name: str) -> GemvConfig | None:
            n, k = shape.gemms()[name]
            return prologue_block_n and choose_gemv_config(n, k, block_n=prologue_block_n)

        x, residual = x0, x0
        for w in layers:
            qkv = w["qkv_proj"]
            rms_norm_gemv(x, residual, w["norm1"], 1e-6, qkv, config=config("qkv_proj"))
            gate_up, residual = rms_norm_gemv(
                gemv(attn, w["o_proj"]),
                residual,
                w["norm2"],
                1e-6,
                w["gate_up_proj"],
                config=config("gate_up_proj"),
            )
            x = silu_and_mul_gemv(gate_up, w["down_proj"], config=config("down_proj"))

    weight_bytes = sum(n * k * 2 for n, k in shape.gemms().values())
    per_layer = shape.layers
    return {
        "launches_per_layer": {"unfused": 7, "fused": 4},
        "unfused_cublas_us_per_layer": graph_us(lambda: unfused(F.linear)) / per_layer,
        "unfused_gemv_us_per_layer": graph_us(lambda: unfused(gemv)) / per_layer,
        "fused_gemv_us_per_layer": graph_us(fused) / per_layer,
        "fused_gemv_us_per_layer_by_prologue_block_n": {
            block_n: graph_us(lambda b=block_n: fused(b)) / per_layer for block_n in (2, 4, 8, 16)
        },
        "weight_bytes_per_layer": weight_bytes,
        "floor_us_per_layer_at_copy": None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = Shape.of(SHAPES[args.shape])
    copy = copy_gbps()
    # distinct copies of each weight, as many as layers (lm_head: enough to leave L2 behind)
    gemms = {name: (n, k, shape.layers) for name, (n, k) in shape.gemms().items()}
    gemms["lm_head"] = (shape.vocab, shape.hidden, 4)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy,
        "shape": args.shape,
        "gemms": [sweep_gemm(name, n, k, copies, copy) for name, (n, k, copies) in gemms.items()]
        # the GEMVs that take the layer's norms in their programs, swept that way too
        + [sweep_gemm(name, *gemms[name], copy, norm_first=True) for name in NORM_FIRST],
        "layer_chain": layer_chain(shape),
    }
    chain = result["layer_chain"]
    chain["floor_us_per_layer_at_copy"] = chain["weight_bytes_per_layer"] / copy / 1e3
    for g in result["gemms"]:
        print(
            f"{g['gemm']:13s} chosen {g['chosen']['us']:6.2f} us ({g['chosen']['pct_of_copy']:.0f}%) "
            f"best {g['best']['us']:6.2f} us {g['best']['config']} cuBLAS {g['cublas_us']:6.2f} us"
        )
    print("fused by prologue block_n", chain["fused_gemv_us_per_layer_by_prologue_block_n"])
    print(
        f"layer: unfused cuBLAS {chain['unfused_cublas_us_per_layer']:.1f} us, unfused GEMV "
        f"{chain['unfused_gemv_us_per_layer']:.1f} us, fused "
        f"{chain['fused_gemv_us_per_layer']:.1f} us, floor {chain['floor_us_per_layer_at_copy']:.1f} us"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
