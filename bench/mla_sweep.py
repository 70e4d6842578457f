"""The paged MLA decode kernel's launch configs on one GPU, DeepSeek-V2-Lite's attention (16
heads, latent 512 + rope 64, bf16, 16-token blocks), at six batch x context decode cases,
against the copy bandwidth measured in the same run.

    python bench/mla_sweep.py --out bench/results/mla_sweep_h200.json

Per case: each candidate (kernels.mla_decode.MLADecodeConfig: tile, warps, stages, programs
per SM, head groups, folded merge, L2 prefetch; the split count that follows from it)
checked against the torch reference, then timed replayed in CUDA graphs over rotating caches
(together four times the L2, so the latents come from device memory, as the engine's layers'
caches do). A folded merge finds its counters zero, left so by the call before, as the engine's
layers do (asyncllm/attention/mla.py: fold_counters, zeroed once a step): the table's choice is
what the engine would run.
Beside the best: the kernel's table as it stands (`table`), the previous sweep's best
(`previous`, from the committed mla_sweep_h200.json), and what the time is made of: the best
config over empty contexts (launches, prologue, merge of nothing) and, for the fastest
two-launch split, its merge launch alone, the best without programmatic dependent launch
(PDL: in this loop the call before lets each launch start early), the best fold with its
counters zeroed on each call (what kernels.paged_mla_decode does when given none: the step's
first layer).
`one_launch_seconds`: a single one-program launch of the kernel, the cost of a kernel in a
graph here. The bytes are the latents read, the query read and the output written;
`floor_seconds` is them at the copy bandwidth.

The cases run the issue's small batches first and the JSON is rewritten after each, so a time
limit keeps what finished. Last it prints the CONFIG_TABLE of the best configs, to paste over
the one in kernels/mla_decode.py. About 90 s, most of it compiling (about 25 kernel variants).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.attention.mla import attend_latent_torch  # noqa: E402
from asyncllm.models.shapes import SHAPES  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from kernels._common import num_sms, uses_pdl  # noqa: E402
from kernels.mla_decode import (  # noqa: E402
    MLADecodeConfig,
    choose_mla_splits,
    head_blocks,
    merge_mla_splits,
    mla_decode_config,
    paged_mla_decode,
)

CASES = [(8, 4096), (32, 2048), (64, 1024), (1, 4096), (128, 1024), (256, 512)]
# Resources at these widths (Triton 3.6, the H200's, for sm_90; cuobjdump): 32-token tiles at 3
# stages 93 KB of shared memory (4 warps 182-186 registers: two programs a SM fit; 8 warps 128),
# 64-token tiles at 3 stages 168 KB (8 warps, 128-146 registers). 64-token tiles at 4 warps and
# 2 stages took 255 registers and a stack (Triton 3.9): left out. L2 prefetches cost 4
# instructions a thread a step (CCTL.E.PF2) and no shared memory; 256 tokens ahead on every SM
# is 39 MB asked of the 50 MB L2, so 128 too. 32-token tiles on 8 warps two a SM lost
# everywhere in the previous sweep, at 146 registers (so one a SM); with the halved latent they
# take 128, and two fit.
GRID = [
    MLADecodeConfig(32, 4, 3, 2),
    MLADecodeConfig(32, 8, 3, 2),
    MLADecodeConfig(64, 8, 3, 1),
    MLADecodeConfig(64, 8, 3, 1, head_groups=2),
    MLADecodeConfig(32, 4, 3, 2, head_groups=2),
    MLADecodeConfig(64, 8, 3, 1, fold_merge=True),
    MLADecodeConfig(32, 4, 3, 2, fold_merge=True),
    MLADecodeConfig(64, 8, 3, 1, prefetch_tokens=128),
    MLADecodeConfig(64, 8, 3, 1, prefetch_tokens=256),
    MLADecodeConfig(32, 4, 3, 2, prefetch_tokens=128),
    MLADecodeConfig(64, 8, 3, 1, fold_merge=True, prefetch_tokens=256),
]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ROTATE_BYTES = 200 << 20  # four times the H200's 50 MB L2
REP_MS = 10
TOLERANCE = 2e-2
PREVIOUS = Path(__file__).with_name("results") / "mla_sweep_h200.json"


class Case:
    """One batch x context: a cache big enough to rotate through, a block table and query per
    rotation, the reference output of the first, counters for a folded merge."""

    def __init__(self, batch: int, context: int, dims: dict) -> None:
        self.batch, self.context = batch, context
        self.rank, rope, heads = dims["kv_lora_rank"], dims["qk_rope_head_dim"], dims["heads"]
        self.scale = (dims["qk_nope_head_dim"] + rope) ** -0.5
        per_set = batch * context * (self.rank + rope) * 2
        sets = max(1, triton.cdiv(ROTATE_BYTES, per_set))
        blocks = context // BLOCK_SIZE
        gen = torch.Generator(device="cuda").manual_seed(batch)
        shape = (1, sets * batch * blocks, BLOCK_SIZE, 1, self.rank + rope)
        self.cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
        order = torch.randperm(shape[1], generator=gen, device="cuda").to(torch.int32)
        self.tables = list(order.view(sets, batch, blocks))
        self.queries = [
            torch.randn(batch, heads, self.rank + rope, generator=gen, device="cuda", dtype=DTYPE)
            for _ in range(sets)
        ]
        self.request = torch.arange(batch, device="cuda", dtype=torch.int32)
        self.length = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        self.counters = torch.zeros(batch * heads, device="cuda", dtype=torch.int32)
        query_bytes = self.queries[0].numel() * 2
        self.bytes_read = per_set + query_bytes + query_bytes * self.rank // (self.rank + rope)
        self.reference = self.attend(0, self.length, None, None, reference=True)

    def attend(self, i, length, splits, config, reference=False, counters=None) -> torch.Tensor:
        args = (self.queries[i], self.cache, self.tables[i], self.request, length, self.scale)
        if reference:
            return attend_latent_torch(*args, self.rank)
        return paged_mla_decode(*args, self.rank, splits, config, counters)

    def time(self, config: MLADecodeConfig, splits: int, empty=False, zeroed_counters=False):
        """Checked against the reference, then seconds per call replayed over the rotation."""
        counters = None if zeroed_counters else self.counters
        error = None
        if not empty:
            out = self.attend(0, self.length, splits, config, counters=counters).double()
            ref = self.reference.double()
            error = ((out - ref).norm() / ref.norm()).item()
        length = torch.zeros_like(self.length) if empty else self.length
        rotation = itertools.cycle(range(len(self.tables)))
        seconds = do_bench_cudagraph(
            lambda: self.attend(next(rotation), length, splits, config, counters=counters),
            rep=REP_MS,
        )
        return {"seconds": seconds / 1e3, "relative_error": error}

    def time_merge(self, config: MLADecodeConfig, splits: int) -> float:
        """Seconds of the merge launch alone, over partials of this case's shape."""
        heads, rank = self.queries[0].shape[1], self.rank
        part_out = torch.zeros(self.batch, heads, splits, rank, device="cuda", dtype=DTYPE)
        part_lse = torch.zeros(self.batch, heads, splits, device="cuda")
        out = torch.empty(self.batch, heads, rank, device="cuda", dtype=DTYPE)

        def merge() -> None:
            merge_mla_splits(part_out, part_lse, self.length, out, config.tile_n)

        return do_bench_cudagraph(merge, rep=REP_MS) / 1e3


def launch_key(config: MLADecodeConfig, splits: int) -> tuple:
    """What the launch depends on: a fold with one split is no fold."""
    return (*asdict(config).values(), config.fold_merge and splits > 1, splits)


def candidates(case: Case, device: torch.device) -> list[tuple[str, MLADecodeConfig, int]]:
    """(label, config, splits): the table's first, then the grid's, each launch once."""
    capacity = case.context  # the block table's width x the block size
    heads = case.queries[0].shape[1]
    named = [("table", mla_decode_config(case.batch, DTYPE))]
    named += [("grid", config) for config in GRID]
    seen, unique = set(), []
    for label, config in named:
        blocks = head_blocks(heads, config.head_groups).count
        splits = choose_mla_splits(case.batch, blocks, capacity, config, device)
        if config.fold_merge and splits == 1:
            continue  # the same launch as the grid's config without the fold
        key = launch_key(config, splits)
        if key not in seen:
            seen.add(key)
            unique.append((label, config, splits))
    return unique


def time_candidate(case: Case, label: str, config: MLADecodeConfig, splits: int, copy_bps):
    row = {"label": label, "config": asdict(config), "splits": splits}
    try:
        row.update(case.time(config, splits))
    except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:
        row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(f"  {case.batch} x {case.context}: {config} failed: {row['failed']}", flush=True)
        return row
    row["fraction_of_copy_bandwidth"] = case.bytes_read / row["seconds"] / copy_bps
    print(
        f"  {case.batch} x {case.context} {label:5s} {splits:3d} splits "
        f"{config.tile_n}/{config.num_warps}w/{config.num_stages}s/{config.programs_per_sm}ps"
        f"/hg{config.head_groups}{'/fold' if config.fold_merge else ''}"
        f"/pf{config.prefetch_tokens}: "
        f"{row['seconds'] * 1e6:.1f} us, {row['fraction_of_copy_bandwidth']:.2f} of copy, "
        f"error {row['relative_error']:.1e}",
        flush=True,
    )
    return row


def breakdown(case: Case, rows: list[dict], best: dict) -> dict:
    """What the best config's time is made of, and what zeroing a fold's counters costs."""
    config = MLADecodeConfig(**best["config"])
    parts = {"empty_contexts_seconds": case.time(config, best["splits"], empty=True)["seconds"]}
    two_launch = [r for r in rows if r["splits"] > 1 and not r["config"]["fold_merge"]]
    if two_launch:
        fastest = min(two_launch, key=lambda r: r["seconds"])
        merge = case.time_merge(MLADecodeConfig(**fastest["config"]), fastest["splits"])
        parts["two_launch_merge_alone_seconds"] = merge
    parts["best_without_pdl_seconds"] = without_pdl(lambda: case.time(config, best["splits"]))[
        "seconds"
    ]
    folds = [r for r in rows if r["splits"] > 1 and r["config"]["fold_merge"]]
    if folds:
        fold = min(folds, key=lambda r: r["seconds"])
        zeroed = case.time(MLADecodeConfig(**fold["config"]), fold["splits"], zeroed_counters=True)
        parts["best_fold_zeroed_counters_seconds"] = zeroed["seconds"]
    return parts


def without_pdl(measure):
    """measure() with programmatic dependent launch off (ASYNCLLM_PDL=0): here the kernel
    before each call is the call before's, which lets the next launch early; an engine's
    einsum before the kernel may not."""
    os.environ["ASYNCLLM_PDL"] = "0"
    uses_pdl.cache_clear()
    try:
        return measure()
    finally:
        del os.environ["ASYNCLLM_PDL"]
        uses_pdl.cache_clear()


def run_case(case: Case, copy_bps: float, device: torch.device) -> dict:
    rows = [time_candidate(case, *c, copy_bps) for c in candidates(case, device)]
    good = [r for r in rows if "seconds" in r and r["relative_error"] < TOLERANCE]
    table = rows[0]
    best = min(good, key=lambda r: r["seconds"], default=table)
    return {
        "batch": case.batch,
        "context": case.context,
        "bytes_read": case.bytes_read,
        "floor_seconds": case.bytes_read / copy_bps,
        "best": best,
        "table": table,
        "breakdown": breakdown(case, rows, best) if "seconds" in best else {},
        "candidates": rows,
    }


def previous_best() -> dict:
    """The committed sweep's best per (batch, context)."""
    if not PREVIOUS.exists():
        return {}
    cases = json.loads(PREVIOUS.read_text()).get("cases", [])
    keep = ("seconds", "fraction_of_copy_bandwidth", "config", "splits")
    return {(c["batch"], c["context"]): {k: c["best"].get(k) for k in keep} for c in cases}


def one_launch_seconds(case: Case) -> float:
    """A single launch of one program (one row of no context, one split) in a graph."""
    config = mla_decode_config(1, DTYPE)
    query, length = case.queries[0][:1], case.length[:1] * 0
    args = (query, case.cache, case.tables[0], case.request[:1], length, case.scale, case.rank)
    return do_bench_cudagraph(lambda: paged_mla_decode(*args, 1, config), rep=REP_MS) / 1e3


def config_table(cases: list[dict]) -> str:
    """The best configs as kernels.mla_decode's CONFIG_TABLE, ready to paste."""
    lines = ["CONFIG_TABLE = ("]
    for case in sorted(cases, key=lambda c: c["batch"]):
        fields = ", ".join(map(str, case["best"]["config"].values()))
        lines.append(f"    ({case['batch']}, {fields}),")
    return "\n".join([*lines, ")"])


def summary(result: dict) -> str:
    lines = [f"copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s; fraction of it (us)"]
    lines.append("batch x context   floor   best           table          previous")
    for case in result["cases"]:
        cells = [case["best"], case["table"], case["previous"]]
        text = [
            f"{c['fraction_of_copy_bandwidth']:.2f} ({c['seconds'] * 1e6:5.1f})"
            if c and c.get("seconds")
            else "-"
            for c in cells
        ]
        floor = f"{case['floor_seconds'] * 1e6:5.1f}"
        head = f"{case['batch']:5d} x {case['context']:5d}   {floor}   "
        lines.append(head + "   ".join(f"{t:12s}" for t in text))
        parts = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in case["breakdown"].items())
        lines.append(f"{'':18s}{parts}")
    lines.append(f"one launch of one program: {result['one_launch_seconds'] * 1e6:.1f} us")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = SHAPES["deepseek-v2-lite"]
    dims = {k: shape[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")}
    dims["heads"] = shape["num_attention_heads"]
    previous = previous_best()
    result = {
        "benchmark": "mla_sweep",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "sms": num_sms(device),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "shape": {**dims, "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
        "copy_bytes_per_s": copy_bandwidth(device),
        "cases": [],
    }
    for batch, context in CASES:
        case = Case(batch, context, dims)
        if "one_launch_seconds" not in result:
            result["one_launch_seconds"] = one_launch_seconds(case)
        outcome = run_case(case, result["copy_bytes_per_s"], device)
        outcome["previous"] = previous.get((batch, context))
        result["cases"].append(outcome)
        result["config_table"] = config_table(result["cases"])
        if args.out:  # after every case: a time limit keeps what finished
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        del case
        torch.cuda.empty_cache()
    print(f"\n{summary(result)}")
    print(f"\nkernels/mla_decode.py, replacing its CONFIG_TABLE:\n{result['config_table']}")


if __name__ == "__main__":
    main()
