"""The 4-bit GEMV at one row on the Llama-3.1-8B projections: kernels.int4_gemm as it runs
(its settings for the shape, GEMV_BY_SHAPE or GEMV_CONFIG) and over a sweep of its launch
settings (Int4GemvConfig: tile columns, packed rows a slice, slices a tile, warps, K splits),
each as weight bytes read per second against the copy bandwidth of the same run and against
bf16's kernels.gemv. Every output is checked against the dequantized weights. The lines
printed name the fastest settings per projection (the entries of GEMV_BY_SHAPE in
kernels/int4_kernels.py that adopt them; `--winner FILE` writes them as the JSON of
ASYNCLLM_INT4_GEMV, which a decode run of the same session takes) and over all four together
(GEMV_CONFIG, for other shapes).

    python bench/int4_gemv_sweep.py --out bench/results/int4_gemv_sweep_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import triton

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import kernels  # noqa: E402
from asyncllm.layers.quantization.int4 import RUNTIME_ORDER, dequantize_int4, pack_int4  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from kernels.int4_kernels import (  # noqa: E402
    GEMV_BY_SHAPE,
    GEMV_CONFIG,
    Int4GemvConfig,
    int4_n_major,
)

PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GROUP = 128
# The depth-by-hand kernel (tiles loaded 1-4 ahead, 21c1a42-3b21767) lost to this one of
# slices at the same tree's best (1.39x against 1.60x the bf16 GEMV over the four projections,
# int4_gemv_sweep_{39c237c,a7a3157}_h200.json, one session): 16 columns, 8 slices, K unsplit,
# 8 warps won three of the four. Its neighbours, and the earlier winners (64 or 32 columns,
# K in 4 parts) as the reference
CONFIGS = [
    Int4GemvConfig(block_n=32, block_r=16, splits=4, num_warps=2),
    Int4GemvConfig(block_n=64, block_r=16, splits=4, num_warps=4),
    *(
        Int4GemvConfig(block_n=bn, block_r=16, slices=sl, splits=1, num_warps=w)
        for bn, sl, w in (
            (8, 8, 2), (8, 16, 4), (16, 4, 4), (16, 8, 4), (16, 8, 8), (16, 8, 16),
            (16, 16, 8), (32, 8, 8), (32, 4, 8),
        )
    ),
    Int4GemvConfig(block_n=16, block_r=16, slices=8, splits=2, num_warps=8),
    # with the weights stored N-major (--n-major) a column's words are one run: few columns
    # a tile, each read 512 B-1 KB at a time
    *(
        Int4GemvConfig(block_n=bn, block_r=16, slices=sl, splits=1, num_warps=w)
        for bn, sl, w in ((2, 8, 2), (2, 16, 4), (4, 8, 4), (4, 16, 8), (8, 4, 4), (8, 8, 8))
    ),
]  # fmt: skip
# weights rotated through copies of at least this many bytes, past the H200's 50 MB L2
ROTATE_BYTES = 256 << 20


def time_ms(fn, copies: int) -> float:
    """fn(i) for each copy i of the weights, replayed in a CUDA graph as the engine's decode
    runs (no Python launch cost in it), per call."""
    return (
        triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=10) / copies
    )


def sweep_shape(n: int, k: int, copy_bps: float, n_major: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=gen)
    qw = pack_int4(q, 0, RUNTIME_ORDER)
    s = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.02 + 0.005).bfloat16()
    z = torch.randint(0, 16, (k // GROUP, n), device="cuda", generator=gen).bfloat16()
    if n_major:
        qw, s, z = (int4_n_major(t) for t in (qw, s, z))
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(qw, s, z, GROUP, k)
    # weights, scales and zero points: the fewest bytes the GEMV must read
    weight_bytes = qw.numel() * 4 + s.numel() * 2 + z.numel() * 2
    copies = -(-ROTATE_BYTES // weight_bytes)
    # clone keeps the strides (a dense tensor's storage order)
    int4 = [(qw.clone(), s.clone(), z.clone()) for _ in range(copies)]
    w16 = torch.randn(n, k, device="cuda", generator=gen).bfloat16()
    w16 = [w16.clone() for _ in range(-(-ROTATE_BYTES // (n * k * 2)))]
    bf16_ms = time_ms(lambda i: kernels.gemv(x, w16[i]), len(w16))
    rows = []
    default = GEMV_BY_SHAPE.get((n, k), GEMV_CONFIG)
    for config in [default, *(c for c in CONFIGS if c != default)]:
        fields = {"config": config.__dict__, "default": config is default}

        def fn(i, c=config):
            return kernels.int4_gemm(x, *int4[i], GROUP, gemv_config=c)

        try:
            out = fn(copies - 1).float()
        except Exception as error:  # a config past the register or shared-memory limit
            rows.append({**fields, "error": str(error)[:200]})
            continue
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = time_ms(fn, copies)
        rows.append({
            **fields, "ms": ms, "max_rel_err": err,
            "of_copy_bandwidth": weight_bytes / (ms * 1e-3) / copy_bps,
            "speedup_over_bf16_gemv": bf16_ms / ms,
        })  # fmt: skip
    ok = [r for r in rows if "ms" in r and r["max_rel_err"] < 2e-2]
    return {"n": n, "k": k, "weight_bytes": weight_bytes, "bf16_gemv_ms": bf16_ms,
            "bf16_of_copy_bandwidth": n * k * 2 / (bf16_ms * 1e-3) / copy_bps,
            "floor_ms": weight_bytes / copy_bps * 1e3,
            "best": min(ok, key=lambda r: r["ms"], default=None),
            "default": next((r for r in rows if r["default"]), None),
            "wrong": [r for r in rows if "ms" in r and r["max_rel_err"] >= 2e-2], "rows": rows}  # fmt: skip


def best_overall(shapes: list[dict]) -> dict | None:
    """The config with the least time summed over the projections, correct on all of them."""
    totals: dict[str, float] = {}
    for shape in shapes:
        for row in shape["rows"]:
            key = json.dumps(row["config"], sort_keys=True)
            good = "ms" in row and row["max_rel_err"] < 2e-2
            totals[key] = totals.get(key, 0.0) + (row["ms"] if good else float("inf"))
    key = min(totals, key=totals.get, default=None)
    if key is None or totals[key] == float("inf"):
        return None
    bf16 = sum(shape["bf16_gemv_ms"] for shape in shapes)
    return {
        "config": json.loads(key),
        "ms": totals[key],
        "speedup_over_bf16_gemv": bf16 / totals[key],
    }


def report_shape(shape: dict) -> None:
    n, k = shape["n"], shape["k"]
    for name in ("default", "best"):
        row = shape[name]
        if row and "ms" in row:
            print(f"{n}x{k} {name}: {row['ms'] * 1e3:.1f} us (floor {shape['floor_ms'] * 1e3:.1f}, "
                  f"bf16 {shape['bf16_gemv_ms'] * 1e3:.1f}), {row['of_copy_bandwidth']:.0%} of copy, "
                  f"{row['speedup_over_bf16_gemv']:.2f}x bf16 gemv, err {row['max_rel_err']:.1e} "
                  f"{row['config']}")  # fmt: skip
    if shape["wrong"]:
        print(f"{n}x{k}: {len(shape['wrong'])} configs WRONG, e.g. {shape['wrong'][0]}")


def run_header(benchmark: str, copy_bps: float) -> dict:
    """What a GPU sweep's result file records of its run."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "copy_bytes_per_s": copy_bps,
    }


def write_results(args: argparse.Namespace, copy_bps: float, shapes: list[dict]) -> dict:
    """The result file and the per-shape winners of the shapes swept so far (rewritten after
    each shape, so a run cut short keeps them)."""
    result = {
        **run_header("int4_gemv_sweep", copy_bps),
        "group_size": GROUP,
        "n_major": args.n_major,
        "best_overall": best_overall(shapes),
        "best_by_shape": {f"{s['n']}x{s['k']}": s["best"]["config"] for s in shapes if s["best"]},
        "shapes": shapes,
    }
    args.out.write_text(json.dumps(result, indent=1))
    if args.winner:
        args.winner.write_text(json.dumps(result["best_by_shape"]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--winner", type=Path, help="write the fastest settings per shape here")
    parser.add_argument(
        "--n-major", action="store_true", help="the weights stored column by column"
    )
    args = parser.parse_args()
    copy_bps = copy_bandwidth(torch.device("cuda"))
    shapes = []
    for n, k in PROJECTIONS:
        shapes.append(sweep_shape(n, k, copy_bps, args.n_major))
        report_shape(shapes[-1])
        result = write_results(args, copy_bps, shapes)
    overall = result["best_overall"]
    if overall:
        print(
            f"fastest over all four: {overall['ms'] * 1e3:.1f} us, "
            f"{overall['speedup_over_bf16_gemv']:.2f}x bf16 gemv"
        )
        print(f"GEMV_CONFIG = Int4GemvConfig(**{overall['config']})")
    print(f"GEMV_BY_SHAPE: {json.dumps(result['best_by_shape'])}")


if __name__ == "__main__":
    main()
