"""The 4-bit GEMV at one row on the Llama-3.1-8B projections: kernels.int4_gemm as it runs, and
its GEMV kernel over a sweep of tile sizes, warps, stages and K splits, each as weight bytes
read per second against the copy bandwidth of the same run and against bf16's kernels.gemv.
(The committed int4_gemv_sweep_h200.json compared the kernel before the tile-sum design, which
its best configuration then became, with that design.)

    python bench/int4_gemv_sweep.py --out bench/results/int4_gemv_sweep_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
from pathlib import Path

import torch
import triton

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import kernels  # noqa: E402
from asyncllm.layers.quantization.int4 import dequantize_int4, pack_int4  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from kernels.int4_kernels import _int4_gemv_kernel  # noqa: E402

PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
GROUP = 128


def run_config(x, qw, s, z, n, k, block_n, block_r, warps, stages, splits):
    """The GEMV kernel at one row with these launch settings (a tile inside one group)."""
    tile_k = 8 * block_r
    k_per_split = triton.cdiv(triton.cdiv(k, splits), tile_k) * tile_k
    splits = triton.cdiv(k, k_per_split)
    dtype = torch.float32 if splits > 1 else x.dtype
    out = torch.zeros(1, n, dtype=dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, qw, s, z, out, 1, n, k, GROUP, k_per_split,
        BLOCK_M=1, BLOCK_N=block_n, BLOCK_R=block_r, SPLIT_K=splits > 1,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def time_ms(fn) -> float:
    """Replayed in a CUDA graph, as the engine's decode runs: no Python launch cost in it."""
    return triton.testing.do_bench_cudagraph(fn, rep=50)


def sweep_shape(n: int, k: int, copy_bps: float) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randint(0, 16, (k, n), device="cuda", generator=gen)
    qw = pack_int4(q, 0)
    s = (torch.rand(k // GROUP, n, device="cuda", generator=gen) * 0.02).bfloat16()
    z = torch.full((k // GROUP, n), 8.0, device="cuda").bfloat16()
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(qw, s, z, GROUP, k)
    weight_bytes = qw.numel() * 4 + s.numel() * 2 + z.numel() * 2
    w16 = torch.randn(n, k, device="cuda", generator=gen).bfloat16()
    bf16_ms = time_ms(lambda: kernels.gemv(x, w16))
    rows = []

    def record(name, config, fn):
        try:
            out = fn().float()
        except Exception as error:  # a config past the register or shared-memory limit
            rows.append({"kernel": name, **config, "error": str(error)[:200]})
            return
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = time_ms(fn)
        rows.append({
            "kernel": name, **config, "ms": ms, "max_rel_err": err,
            "of_copy_bandwidth": weight_bytes / (ms * 1e-3) / copy_bps,
            "speedup_over_bf16_gemv": bf16_ms / ms,
        })  # fmt: skip

    record("int4_gemm", {}, lambda: kernels.int4_gemm(x, qw, s, z, GROUP))
    for block_n, block_r, warps, stages, splits in itertools.product(
        (64, 128, 256), (8, 16), (2, 4, 8), (1, 3), (1, 2, 4)
    ):
        config = dict(block_n=block_n, block_r=block_r, warps=warps, stages=stages, splits=splits)
        args = (x, qw, s, z, n, k, block_n, block_r, warps, stages, splits)
        record("gemv_kernel", config, lambda a=args: run_config(*a))
    ok = [r for r in rows if "ms" in r and r["max_rel_err"] < 2e-2]
    best = {name: min((r for r in ok if r["kernel"] == name), key=lambda r: r["ms"], default=None)
            for name in ("int4_gemm", "gemv_kernel")}  # fmt: skip
    return {"n": n, "k": k, "weight_bytes": weight_bytes, "bf16_gemv_ms": bf16_ms,
            "bf16_of_copy_bandwidth": n * k * 2 / (bf16_ms * 1e-3) / copy_bps,
            "best": best, "rows": rows}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    copy_bps = copy_bandwidth(torch.device("cuda"))
    shapes = []
    for n, k in PROJECTIONS:
        shapes.append(sweep_shape(n, k, copy_bps))
        for name, row in shapes[-1]["best"].items():
            if row:
                print(f"{n}x{k} {name}: {row['ms'] * 1e3:.1f} us, "
                      f"{row['of_copy_bandwidth']:.0%} of copy, {row['speedup_over_bf16_gemv']:.2f}x "
                      f"bf16 gemv {row}")  # fmt: skip
    result = {
        "benchmark": "int4_gemv_sweep",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "copy_bytes_per_s": copy_bps,
        "group_size": GROUP,
        "shapes": shapes,
    }
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
