"""Decode attention over an FP8 (e4m3) KV cache against a bf16 one: the cache bytes read per
second against the copy bandwidth of the same run, over a grid of tile shapes and of the ways
the kernel widens e4m3 (`Fp8CacheRead`), every output checked against a float32 reference.

Cases: the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128, 16-token
blocks scattered over the pool); 256 sequences of 1,024 tokens as bench/quant.py's kernels part
times it (the issue asks FP8 >= 70% of the copy bandwidth there), where the whole grid runs;
64 of 4,096 and 8 of 8,192 (split-K) with the defaults and the first case's best. The bytes
counted are the cache's, each read once; the query and output are under 0.1% of them.

    python bench/fp8_kv_attention_sweep.py --out bench/results/fp8_kv_attention_sweep_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.throughput import copy_bandwidth  # noqa: E402
from kernels._common import AttentionConfig  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    Fp8CacheRead,
    default_decode_config,
    paged_decode_attention,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.5, 0.25
FP8 = torch.float8_e4m3fn
CASES = [(256, 1024), (64, 4096), (8, 8192)]  # (sequences, tokens of context each)
READS = {
    "bf16-dots,bytes": Fp8CacheRead(fp16_dots=False, value_pairs=False),  # the kernel before
    "fp16-dots,bytes": Fp8CacheRead(fp16_dots=True, value_pairs=False),
    "bf16-dots,pairs": Fp8CacheRead(fp16_dots=False, value_pairs=True),
    "fp16-dots,pairs,shifts": Fp8CacheRead(prmt_pairs=False),
    "fp16-dots,pairs": Fp8CacheRead(fp16_dots=True, value_pairs=True, prmt_pairs=True),
}
MAX_ERROR = 1e-2  # bf16 output: its rounding alone is up to 2^-9 of each value


def grid() -> list[tuple[str, AttentionConfig]]:
    """(read, config) pairs of the first case: every tile shape for the new read, the tile
    of the defaults and twice it for the others (21 timings with bf16's two)."""
    pairs = [
        ("fp16-dots,pairs", AttentionConfig(0, tile, warps, stages))
        for tile, warps, stages in itertools.product((64, 128, 256), (4, 8), (2, 3))
    ]
    others = [
        (read, AttentionConfig(0, tile, 4, 3))
        for read in ("bf16-dots,bytes", "fp16-dots,bytes", "fp16-dots,pairs,shifts")
        for tile in (128, 256)
    ]
    return pairs + others + [("bf16-dots,pairs", AttentionConfig(0, 256, 4, 3))]


def make_case(seqs: int, context: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seqs)
    blocks = seqs * context // BLOCK
    tables = torch.randperm(blocks, device="cuda", generator=gen, dtype=torch.int32)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    return {
        "tables": tables.view(seqs, -1),
        "seq_lens": torch.full((seqs,), context, device="cuda", dtype=torch.int32),
        "query": torch.randn(seqs, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16(),
        "caches": {torch.bfloat16: cache.bfloat16(), FP8: cache.to(FP8)},
    }


def reference(case: dict, cache: torch.Tensor, scales: dict) -> torch.Tensor:
    """float32 attention over the widened cache (times its scales), all sequences at once."""
    seqs = case["query"].shape[0]
    k, v = (c.float()[case["tables"]].flatten(1, 2) for c in cache)  # [seqs, ctx, kv, d]
    k, v = k * scales.get("k_scale", 1.0), v * scales.get("v_scale", 1.0)
    q = case["query"].float().view(seqs, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    p = (torch.einsum("skgd,sckd->skgc", q, k) * HEAD_DIM**-0.5).softmax(-1)
    return torch.einsum("skgc,sckd->skgd", p, v).reshape(seqs, HEADS, HEAD_DIM)


def time_one(case: dict, dtype: torch.dtype, read: str | None, config, ref, copy_bps) -> dict:
    """One configuration: its output (into a NaN-poisoned buffer) checked, then timed."""
    cache = case["caches"][dtype]
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE} if dtype == FP8 else {}
    extra = {"fp8_read": READS[read]} if read else {}
    context = int(case["seq_lens"][0])
    config = config or default_decode_config(torch.bfloat16, case["query"].shape[0], dtype)
    out = torch.full_like(case["query"], float("nan"))

    def run():
        return paged_decode_attention(
            case["query"], cache, case["tables"], case["seq_lens"], HEAD_DIM**-0.5, out,
            max_seq_len=context, config=config, **scales, **extra,
        )  # fmt: skip

    row = {"cache": str(dtype).removeprefix("torch."), "read": read, "block_n": config.block_n,
           "num_warps": config.num_warps, "num_stages": config.num_stages}  # fmt: skip
    try:
        run()
    except Exception as error:  # past the shared-memory or register limit
        return {**row, "error": str(error)[:200]}
    error = ((out.float() - ref).norm() / ref.norm()).item()  # NaN where a row went unwritten
    ms = triton.testing.do_bench_cudagraph(run, rep=100, return_mode="median")
    cache_bytes = cache.numel() * cache.element_size()
    return {
        **row,
        "ms": ms,
        "rel_error": error,
        "ok": error < MAX_ERROR,
        "cache_bytes_per_s": cache_bytes / ms * 1e3,
        "of_copy_bandwidth": cache_bytes / ms * 1e3 / copy_bps,
    }


def sweep_case(seqs: int, context: int, configs, copy_bps: float) -> dict:
    case = make_case(seqs, context)
    refs = {
        dtype: reference(case, cache, {"k_scale": K_SCALE, "v_scale": V_SCALE} if dtype == FP8 else {})
        for dtype, cache in case["caches"].items()
    }  # fmt: skip
    rows = [time_one(case, torch.bfloat16, None, None, refs[torch.bfloat16], copy_bps)]
    rows += [time_one(case, FP8, read, c, refs[FP8], copy_bps) for read, c in configs]
    # bf16 again last: its spread against the first is the run's noise
    rows.append(time_one(case, torch.bfloat16, None, None, refs[torch.bfloat16], copy_bps))
    fp8 = [r for r in rows if r["cache"] != "bfloat16" and r.get("ok")]
    return {
        "seqs": seqs,
        "context": context,
        "best_fp8": min(fp8, key=lambda r: r["ms"], default=None),
        "rows": rows,
    }


def print_table(cases: list[dict]) -> None:
    print(f"{'case':>10} {'cache':>14} {'read':>16} tile warps stages {'us':>7}  of copy  error")
    for case in cases:
        for r in case["rows"]:
            name = f"{case['seqs']}x{case['context']}"
            head = f"{name:>10} {r['cache']:>14} {r['read'] or '-':>16} {r['block_n']:>4}"
            if "error" in r:
                print(f"{head} {r['num_warps']:>5} {r['num_stages']:>6}  {r['error'][:60]}")
                continue
            print(f"{head} {r['num_warps']:>5} {r['num_stages']:>6} {r['ms'] * 1e3:7.1f} "
                  f"{r['of_copy_bandwidth']:8.0%}  {r['rel_error']:.1e}{'' if r['ok'] else ' BAD'}")  # fmt: skip
    best = cases[0]["best_fp8"]
    if best:
        print(
            f"best FP8 at {cases[0]['seqs']}x{cases[0]['context']}: {best['of_copy_bandwidth']:.0%} "
            f"of copy. To adopt it: Fp8CacheRead's defaults as READS[{best['read']!r}], and "
            f"default_decode_config for a 1-byte cache (16-bit query) returns AttentionConfig("
            f"0, {best['block_n']}, {best['num_warps']}, {best['num_stages']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    copy_bps = copy_bandwidth(torch.device("cuda"))
    cases = [sweep_case(*CASES[0], grid(), copy_bps)]
    best = cases[0]["best_fp8"]
    follow = [("bf16-dots,bytes", None), ("fp16-dots,pairs", None)]
    if best:
        follow.append((best["read"], AttentionConfig(0, best["block_n"], best["num_warps"],
                                                     best["num_stages"])))  # fmt: skip
    cases += [sweep_case(seqs, context, follow, copy_bps) for seqs, context in CASES[1:]]
    result = {
        "benchmark": "fp8_kv_attention_sweep",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
        "kv_scales": {"k": K_SCALE, "v": V_SCALE},
        "copy_bytes_per_s": copy_bps,
        "wall_s": time.perf_counter() - start,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(cases)


if __name__ == "__main__":
    main()
