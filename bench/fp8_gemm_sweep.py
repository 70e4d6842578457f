"""FP8 (per-channel e4m3 weights) GEMMs on the Llama-3.1-8B projections against bf16 in the
same run, replayed in CUDA graphs with the weights rotated past the L2 (as decode and the
offline run meet them):

  gemv  one row (batch-1 decode): kernels.gemv over e4m3 as it runs (FP8_GEMV_BY_SHAPE,
        else choose_gemv_config's 4 rows a program) and over a sweep of GemvConfig, as weight
        bytes per second against the copy bandwidth, and bf16's kernels.gemv; the fastest per
        projection is written with --gemv-winner for ASYNCLLM_FP8_GEMV.
  gemm  32-2,048 rows (the offline run's decode batches, a prompt chunk): where an FP8
        layer's time goes, per part: kernels.quantize_fp8 alone, torch._scaled_mm alone
        (row-wise scales), both (the layer as it runs), _scaled_mm with its operands swapped
        (W x^T, so that cuBLAS tiles the weights' rows; alone and with the transposed output
        made contiguous) and with fast (FP8-precision) accumulation, and
        kernels.fp8_rowwise_gemm over a sweep of tiles, against bf16's cuBLAS matmul.
        --gemm-winner writes the Fp8GemmConfig (with max_rows, the most rows up to which a
        tile beats _scaled_mm at every row count swept) for ASYNCLLM_FP8_GEMM, per
        projection; a projection where it never wins stays on _scaled_mm.

Every output is checked against the dequantized operands.

    python bench/fp8_gemm_sweep.py --out bench/results/fp8_gemm_sweep_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import kernels  # noqa: E402
from asyncllm.layers.quantization.fp8 import quantize_per_row  # noqa: E402
from bench.int4_gemv_sweep import PROJECTIONS, run_header, time_ms  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from kernels.fp8_gemm import Fp8GemmConfig  # noqa: E402
from kernels.gemv_kernels import FP8_GEMV_BY_SHAPE, GemvConfig, choose_gemv_config  # noqa: E402

ROWS = (32, 64, 128, 256, 512, 2048)
# around choose_gemv_config's 4 rows of e4m3 a program, 4096 of K a tile, 8 warps; and programs
# taking row blocks in turn (x read once, the next block loading), 1-3 a SM (95 registers at 4
# rows of 4096, 169 at 8, 219 at 2 of 16384 for the 14336-wide down_proj; ptxas for sm_90)
GEMV_CONFIGS = [
    GemvConfig(block_n=bn, block_k=bk, num_warps=w, programs_per_sm=p)
    for bn, bk, w, p in (
        (2, 4096, 8, 0), (4, 4096, 8, 0), (8, 4096, 8, 0), (4, 2048, 4, 0), (8, 4096, 16, 0),
        (4, 4096, 8, 2), (2, 4096, 8, 3), (8, 4096, 8, 1), (2, 16384, 8, 1),
    )
]  # fmt: skip
# 64-row tiles fill the GPU at 256 rows of a 4096-wide output (4 x 32 = 128 programs) where
# 128 x 128 makes 64; a wider one for the 28672-wide gate_up
GEMM_CONFIGS = [
    Fp8GemmConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4),
    Fp8GemmConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3),
    Fp8GemmConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    Fp8GemmConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=5),
    # weight-bound at 128-256 rows: every row in one tile (the weights read once), narrower
    # columns for more programs (128 x 128 tiles make 48 of 6,144 outputs on 132 SMs)
    Fp8GemmConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=4),
    Fp8GemmConfig(block_m=128, block_n=32, block_k=128, num_warps=4, num_stages=4),
    Fp8GemmConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=6),
]
ROTATE_BYTES = 256 << 20


def copies_of(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """Enough copies of tensors that cycling through them reads past the 50 MB L2."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return [tuple(t.clone() for t in tensors) for _ in range(-(-ROTATE_BYTES // nbytes))]


def fp8_weights(n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5
    wq, w_scale = quantize_per_row(w)
    return w, wq, w_scale.view(1, -1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def sweep_gemv(n: int, k: int, copy_bps: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w, wq, w_scale = fp8_weights(n, k, gen)
    x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = x.float() @ (wq.float() * w_scale.view(-1, 1)).t()
    fp8 = copies_of((wq, w_scale))
    w16 = copies_of((w,))
    bf16_ms = time_ms(lambda i: kernels.gemv(x, w16[i][0]), len(w16))
    default = FP8_GEMV_BY_SHAPE.get((n, k)) or choose_gemv_config(n, k, block_n=4)
    rows = []
    for config in [default, *(c for c in GEMV_CONFIGS if c != default)]:

        def fn(i, c=config):
            return kernels.gemv(x, fp8[i][0], None, config=c, scale=fp8[i][1])

        err = relative_error(fn(0), ref)
        ms = time_ms(fn, len(fp8))
        rows.append({
            "config": dataclasses.asdict(config), "default": config == default, "ms": ms,
            "max_rel_err": err, "of_copy_bandwidth": n * k / (ms * 1e-3) / copy_bps,
            "speedup_over_bf16_gemv": bf16_ms / ms,
        })  # fmt: skip
    ok = [r for r in rows if r["max_rel_err"] < 2e-2]
    return {
        "n": n, "k": k, "bf16_gemv_ms": bf16_ms, "floor_ms": n * k / copy_bps * 1e3,
        "bf16_of_copy_bandwidth": 2 * n * k / (bf16_ms * 1e-3) / copy_bps,
        "best": min(ok, key=lambda r: r["ms"], default=None),
        "default": rows[0], "rows": rows,
    }  # fmt: skip


def sweep_gemm(n: int, k: int, m: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(m)
    w, wq, w_scale = fp8_weights(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    xq, x_scale = kernels.quantize_fp8(x)
    ref = (xq.float() * x_scale) @ (wq.float() * w_scale.view(-1, 1)).t()
    fp8 = copies_of((wq, w_scale))
    w16 = copies_of((w,))

    def scaled_mm(i, xq=xq, x_scale=x_scale):
        return torch._scaled_mm(xq, fp8[i][0].t(), x_scale, fp8[i][1], out_dtype=torch.bfloat16)

    def layer(i):
        return scaled_mm(i, *kernels.quantize_fp8(x))

    def swapped(i):  # W x^T: cuBLAS tiles the weights' N where it tiled the few rows
        wq_i, w_scale_i = fp8[i]
        return torch._scaled_mm(
            wq_i, xq.t(), w_scale_i.view(-1, 1), x_scale.view(1, -1), out_dtype=torch.bfloat16
        ).t()

    def fast_accum(i):
        return torch._scaled_mm(
            xq, fp8[i][0].t(), x_scale, fp8[i][1], out_dtype=torch.bfloat16, use_fast_accum=True
        )

    parts = {
        "bf16_matmul": time_ms(lambda i: x @ w16[i][0].t(), len(w16)),
        "quantize_fp8": time_ms(lambda i: kernels.quantize_fp8(x), 1),
        "scaled_mm": time_ms(scaled_mm, len(fp8)),
        "quantize_and_scaled_mm": time_ms(layer, len(fp8)),
        "scaled_mm_swapped": time_ms(swapped, len(fp8)),
        "scaled_mm_swapped_contiguous": time_ms(lambda i: swapped(i).contiguous(), len(fp8)),
        "scaled_mm_fast_accum": time_ms(fast_accum, len(fp8)),
    }
    errors = {
        "scaled_mm": relative_error(scaled_mm(0), ref),
        "scaled_mm_swapped": relative_error(swapped(0), ref),
        "scaled_mm_fast_accum": relative_error(fast_accum(0), ref),
    }
    tiles = []
    for config in GEMM_CONFIGS:

        def fn(i, c=config):
            return kernels.fp8_rowwise_gemm(
                xq, x_scale, fp8[i][0], fp8[i][1], torch.bfloat16, config=c
            )

        try:
            err = relative_error(fn(0), ref)
        except Exception as error:  # a tile past the shared-memory or register limit
            tiles.append({"config": dataclasses.asdict(config), "ms": float("inf"),
                          "max_rel_err": float("inf"), "error": str(error)[:200]})  # fmt: skip
            continue
        tiles.append({"config": dataclasses.asdict(config), "ms": time_ms(fn, len(fp8)),
                      "max_rel_err": err})  # fmt: skip
    return {"n": n, "k": k, "rows": m, "parts_ms": parts, "errors": errors, "triton": tiles}


def gemv_winner(shapes: list[dict]) -> dict | None:
    """The GemvConfig fastest over the projections together, correct on all."""
    totals: dict[str, float] = {}
    for shape in shapes:
        for row in shape["rows"]:
            key = json.dumps(row["config"], sort_keys=True)
            good = row["max_rel_err"] < 2e-2
            totals[key] = totals.get(key, 0.0) + (row["ms"] if good else float("inf"))
    key = min(totals, key=totals.get, default=None)
    if key is None or totals[key] == float("inf"):
        return None
    bf16 = sum(shape["bf16_gemv_ms"] for shape in shapes)
    default = sum(shape["default"]["ms"] for shape in shapes)
    return {"config": json.loads(key), "ms": totals[key], "default_ms": default,
            "speedup_over_bf16_gemv": bf16 / totals[key]}  # fmt: skip


def gemm_winners(cases: list[dict]) -> dict[str, dict]:
    """Per projection {"NxK": Fp8GemmConfig's fields}: the most rows up to which some tile
    beats the layer's _scaled_mm at every row count swept, and the tile fastest over those;
    shapes where no tile wins at the fewest rows are left to _scaled_mm."""
    winners = {}
    for n, k in sorted({(c["n"], c["k"]) for c in cases}):
        at = sorted((c for c in cases if (c["n"], c["k"]) == (n, k)), key=lambda c: c["rows"])
        won = []
        for case in at:
            times = [t["ms"] if t["max_rel_err"] < 2e-2 else float("inf") for t in case["triton"]]
            if min(times) >= case["parts_ms"]["scaled_mm"]:
                break
            won.append((case["rows"], times))
        if won:
            best = min(range(len(GEMM_CONFIGS)), key=lambda i: sum(t[i] for _, t in won))
            config = dataclasses.replace(GEMM_CONFIGS[best], max_rows=won[-1][0])
            winners[f"{n}x{k}"] = dataclasses.asdict(config)
    return winners


def report_gemm(case: dict) -> None:
    parts = case["parts_ms"]
    best = min(case["triton"], key=lambda r: r["ms"])
    print(f"{case['n']}x{case['k']} rows {case['rows']}: bf16 {parts['bf16_matmul'] * 1e3:.1f} us,"
          f" fp8 layer {parts['quantize_and_scaled_mm'] * 1e3:.1f} (quantize "
          f"{parts['quantize_fp8'] * 1e3:.1f}, _scaled_mm {parts['scaled_mm'] * 1e3:.1f}, "
          f"swapped {parts['scaled_mm_swapped'] * 1e3:.1f} / contiguous "
          f"{parts['scaled_mm_swapped_contiguous'] * 1e3:.1f}, fast accumulation "
          f"{parts['scaled_mm_fast_accum'] * 1e3:.1f}), "
          f"triton best {best['ms'] * 1e3:.1f} {best['config']}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="gemv,gemm")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gemv-winner", type=Path)
    parser.add_argument("--gemm-winner", type=Path)
    args = parser.parse_args()
    copy_bps = copy_bandwidth(torch.device("cuda"))
    result = run_header("fp8_gemm_sweep", copy_bps)
    parts = args.parts.split(",")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if "gemv" in parts:
        shapes = [sweep_gemv(n, k, copy_bps) for n, k in PROJECTIONS]
        for shape in shapes:
            for name in ("default", "best"):
                row = shape[name]
                print(f"gemv {shape['n']}x{shape['k']} {name}: {row['ms'] * 1e3:.1f} us (floor "
                      f"{shape['floor_ms'] * 1e3:.1f}, bf16 {shape['bf16_gemv_ms'] * 1e3:.1f}), "
                      f"{row['of_copy_bandwidth']:.0%} of copy {row['config']}")  # fmt: skip
        by_shape = {f"{s['n']}x{s['k']}": s["best"]["config"] for s in shapes if s["best"]}
        result["gemv"] = {"shapes": shapes, "best_overall": gemv_winner(shapes),
                          "best_by_shape": by_shape}  # fmt: skip
        winner = result["gemv"]["best_overall"]
        if winner:
            print(f"gemv fastest over all four: {winner['ms'] * 1e3:.1f} us (default "
                  f"{winner['default_ms'] * 1e3:.1f}), {winner['speedup_over_bf16_gemv']:.2f}x "
                  f"bf16 gemv: {winner['config']}")  # fmt: skip
        print(f"gemv FP8_GEMV_BY_SHAPE: {json.dumps(by_shape)}")
        if args.gemv_winner:
            args.gemv_winner.write_text(json.dumps(by_shape))
        args.out.write_text(json.dumps(result, indent=1))
    if "gemm" in parts:
        cases = []
        for m in ROWS:  # the files rewritten after each row count: a run cut short keeps them
            for n, k in PROJECTIONS:
                cases.append(sweep_gemm(n, k, m))
                report_gemm(cases[-1])
            result["gemm"] = {"cases": cases, "winners": gemm_winners(cases)}
            args.out.write_text(json.dumps(result, indent=1))
            if args.gemm_winner:
                args.gemm_winner.write_text(json.dumps(result["gemm"]["winners"]))
        print(f"gemm: {json.dumps(result['gemm']['winners'])}")


if __name__ == "__main__":
    main()
