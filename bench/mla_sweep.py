"""The paged MLA decode kernel's launch configs on one GPU, DeepSeek-V2-Lite's attention (16
heads, latent 512 + rope 64, bf16, 16-token blocks), at the six decode cases of
bench/moe.py's `kernels` run, against the copy bandwidth measured in the same run.

    python bench/mla_sweep.py --out bench/results/mla_sweep_h200.json

Per case: each candidate (kernels.mla_decode.MLADecodeConfig: tile, warps, stages, score
layout, programs per SM; the split count that follows from it) checked against the torch
reference, then timed replayed in CUDA graphs over rotating caches (together four times the
L2, so the latents come from device memory, as the engine's layers' caches do). Beside the
best: the kernel's table as it stands (`table`), the old split rule (at most 32 splits of 128
tokens or more, four programs per SM) with the old tile (`old_rule`), and main's kernel as
bench/moe.py measured it before (`before`, from moe_kernels_deepseek-v2-lite_h200.json: another
run, one cache, so partly from L2). At batch one, `launch_floor` is the table's config over
empty contexts: the two launches and the merge, no latents. Last it prints the CONFIG_TABLE of
the best configs, to paste over the one in kernels/mla_decode.py. About 2 minutes, most of it
compiling (a dozen kernel variants).
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
from triton.testing import do_bench_cudagraph

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.attention.mla import attend_latent_torch  # noqa: E402
from asyncllm.models.shapes import SHAPES  # noqa: E402
from bench.throughput import copy_bandwidth  # noqa: E402
from kernels._common import num_sms  # noqa: E402
from kernels.mla_decode import (  # noqa: E402
    MLADecodeConfig,
    choose_mla_splits,
    mla_decode_config,
    paged_mla_decode,
)

CASES = [(1, 4096), (8, 4096), (32, 2048), (64, 1024), (128, 1024), (256, 512)]
# (tile_n, num_warps, num_stages, tokens_major, programs_per_sm), the old tile first. Shared
# memory a program at these widths (Triton 3.9 for sm_90, the latents' tiles num_stages - 1
# deep): 93 KB (32 tokens, 3 stages), 74, 130 and 168 KB heads-major (mma.sync; 8 warps on a
# [16 heads, 32 tokens] score tile compute it twice, 4 warps once), 168 KB tokens-major (wgmma,
# M = 64; three stages would take 242 KB). More programs a SM only where they fit.
GRID = [
    (32, 8, 3, False, 1),
    (32, 8, 3, False, 2),
    (16, 4, 4, False, 1),
    (16, 4, 4, False, 2),
    (16, 4, 4, False, 3),
    (32, 4, 3, False, 2),
    (32, 8, 4, False, 1),
    (64, 8, 3, False, 1),
    (64, 4, 2, True, 1),
    (64, 8, 2, True, 1),
]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
ROTATE_BYTES = 200 << 20  # four times the H200's 50 MB L2
REP_MS = 10
TOLERANCE = 2e-2
BEFORE = Path(__file__).with_name("results") / "moe_kernels_deepseek-v2-lite_h200.json"


def old_rule_splits(batch: int, capacity: int, device: torch.device) -> int:
    """main's choose_mla_splits before the sweep: four programs per SM, 32 splits at most, none
    under 128 tokens, no split once the rows alone fill the SMs."""
    if batch >= num_sms(device):
        return 1
    return max(1, min(32, triton.cdiv(4 * num_sms(device), batch), triton.cdiv(capacity, 128)))


class Case:
    """One batch x context: a cache big enough to rotate through, a block table and query per
    rotation, the reference output of the first."""

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
        self.bytes_read = per_set + 2 * self.queries[0].numel() * 2  # + the output written
        self.reference = self.attend(0, self.length, None, None, reference=True)

    def attend(self, i, length, splits, config, reference=False) -> torch.Tensor:
        attend = attend_latent_torch if reference else paged_mla_decode
        args = (self.queries[i], self.cache, self.tables[i], self.request, length, self.scale)
        extra = () if reference else (splits, config)
        return attend(*args, self.rank, *extra)

    def time(self, config: MLADecodeConfig, splits: int, empty: bool = False) -> dict:
        """Checked against the reference, then seconds per call replayed over the rotation."""
        error = None
        if not empty:
            out = self.attend(0, self.length, splits, config).double()
            ref = self.reference.double()
            error = ((out - ref).norm() / ref.norm()).item()
        length = torch.zeros_like(self.length) if empty else self.length
        rotation = itertools.cycle(range(len(self.tables)))
        seconds = do_bench_cudagraph(
            lambda: self.attend(next(rotation), length, splits, config), rep=REP_MS
        )
        seconds /= 1e3
        return {"seconds": seconds, "relative_error": error}


def candidates(case: Case, device: torch.device) -> list[tuple[str, MLADecodeConfig, int]]:
    """(label, config, splits), each launch once: programs per SM that give the same split
    count are one launch."""
    capacity = case.context  # the block table's width x the block size
    table = mla_decode_config(case.batch, DTYPE)
    named = [("table", table, choose_mla_splits(case.batch, 1, capacity, table, device))]
    old = MLADecodeConfig(*GRID[0])
    named.append(("old_rule", old, old_rule_splits(case.batch, capacity, device)))
    for fields in GRID:
        config = MLADecodeConfig(*fields)
        named.append(("grid", config, choose_mla_splits(case.batch, 1, capacity, config, device)))
    seen, unique = set(), []
    for label, config, splits in named:
        launch = (config.tile_n, config.num_warps, config.num_stages, config.tokens_major, splits)
        if launch not in seen:
            seen.add(launch)
            unique.append((label, config, splits))
    return unique


def run_case(case: Case, copy_bps: float, device: torch.device) -> dict:
    rows = []
    for label, config, splits in candidates(case, device):
        row = {"label": label, "config": config.__dict__, "splits": splits}
        try:
            row.update(case.time(config, splits))
        except (triton.runtime.errors.OutOfResources, triton.CompilationError) as e:
            row["failed"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"  {case.batch} x {case.context}: {config} failed: {row['failed']}", flush=True)
            rows.append(row)
            continue
        row["fraction_of_copy_bandwidth"] = case.bytes_read / row["seconds"] / copy_bps
        rows.append(row)
        print(
            f"  {case.batch} x {case.context} {label:8s} {splits:3d} splits {config}: "
            f"{row['seconds'] * 1e6:.1f} us, {row['fraction_of_copy_bandwidth']:.2f} of copy, "
            f"error {row['relative_error']:.1e}",
            flush=True,
        )
    good = [r for r in rows if "seconds" in r and r["relative_error"] < TOLERANCE]
    table = next(r for r in rows if r["label"] == "table")
    result = {
        "batch": case.batch,
        "context": case.context,
        "bytes_read": case.bytes_read,
        "best": min(good, key=lambda r: r["seconds"], default=table),
        "table": table,
        "old_rule": next((r for r in rows if r["label"] == "old_rule"), None),
        "candidates": rows,
    }
    if case.batch == 1:
        floor = case.time(MLADecodeConfig(**table["config"]), table["splits"], empty=True)
        result["launch_floor_seconds"] = floor["seconds"]
    return result


def before_figures() -> dict:
    """main's kernel as bench/moe.py kernels measured it, by (batch, context)."""
    if not BEFORE.exists():
        return {}
    rows = json.loads(BEFORE.read_text()).get("mla_decode", [])
    return {(r["batch"], r["context"]): r for r in rows}


def config_table(cases: list[dict]) -> str:
    """The best configs as kernels.mla_decode's CONFIG_TABLE, ready to paste."""
    lines = ["CONFIG_TABLE = ("]
    for case in cases:
        c = case["best"]["config"]
        fields = (c["tile_n"], c["num_warps"], c["num_stages"], c["tokens_major"])
        lines.append(
            f"    ({case['batch']}, {', '.join(map(str, fields))}, {c['programs_per_sm']}),"
        )
    return "\n".join([*lines, ")"])


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
    copy_bps = copy_bandwidth(device)
    before = before_figures()
    cases = []
    for batch, context in CASES:
        result = run_case(Case(batch, context, dims), copy_bps, device)
        old = before.get((batch, context))
        result["before"] = old and {k: old[k] for k in ("seconds", "fraction_of_copy_bandwidth")}
        cases.append(result)
        torch.cuda.empty_cache()
    table = config_table(cases)
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
        "copy_bytes_per_s": copy_bps,
        "cases": cases,
        "config_table": table,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    print(f"\ncopy bandwidth {copy_bps / 1e12:.2f} TB/s; fraction of it (us)")
    print("batch x context   best           table          old_rule       before")
    for case in cases:
        cells = [case["best"], case["table"], case["old_rule"], case["before"]]
        text = [
            f"{c['fraction_of_copy_bandwidth']:.2f} ({c['seconds'] * 1e6:5.1f})"
            if c and "seconds" in c
            else "-"
            for c in cells
        ]
        print(
            f"{case['batch']:5d} x {case['context']:5d}   " + "   ".join(f"{t:12s}" for t in text)
        )
    if "launch_floor_seconds" in cases[0]:
        print(
            f"batch 1 launch floor (empty contexts): {cases[0]['launch_floor_seconds'] * 1e6:.1f} us"
        )
    print(f"\nkernels/mla_decode.py, replacing its CONFIG_TABLE:\n{table}")


if __name__ == "__main__":
    main()
