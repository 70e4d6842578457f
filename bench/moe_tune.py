"""The fused MoE's tile sweep: per shape and batch size, each grouped GEMM's tiles timed on
their own, the fastest pair written where kernels.fused_moe.tile_config reads it.

    python bench/moe_tune.py --shape qwen3-30b-a3b --out bench/results/moe_tune_qwen3-30b-a3b_h200.json

For each batch size: for each alignment that fits the experts' runs (block_m, with or without
tails of tail_m rows), the alignment, the gate/up GEMM under each of its candidate tiles and
the down GEMM under each of its own, all CUDA-graph replayed. The alignment whose align + up +
down is least wins; its best few tiles of each GEMM are timed again under other GROUP_M orders
and with the weights read through TMA descriptors (down also by its persistent kernel). Then
the whole fused_experts is timed with the winner, with the table it replaces (before), with the
default rule and, at one pair a tile (a token or two), with the winner's gate/up, down or both
as grouped GEMVs (MoeTiles.up_gemv, down_gemv), in one process, and the table keeps the
fastest. The table file is rewritten after every size, so a run cut short keeps what it found.

The candidates compile first, in a pool of processes (Triton's disk cache then serves the
sweep): a config compiles once for all shapes and sizes, its integers being unspecialized.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.moe import (  # noqa: E402
    DTYPE,
    MOE_SHAPES,
    MoeProblem,
    expert_weights,
    graph_seconds,
    moe_geometry,
    result_header,
    routed,
    shape_config,
)
from kernels.fused_moe import (  # noqa: E402
    CONFIG_DIR,
    MoeTileConfig,
    MoeTiles,
    align_for,
    config_file_name,
    default_tile_config,
    tile_config,
    tiles_to_json,
    uses_one_pair_tiles,
)

TUNE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
GROUP_ORDERS = [1, 16, 64]
RETIMED = 2  # the winning alignment's best of each GEMM, timed again (see _refined)
PRECOMPILE_WAIT_S = 60

# (block_m, block_n, block_k, num_warps, num_stages); group_m is swept apart (no compile)
UP_TILES = [
    # decode: memory-bound, more bytes in flight per stage, narrow N for more programs (at one
    # token of Qwen3-30B-A3B: 8 pairs x 768 / block_n, so 96 programs of 64 for 132 SMs)
    (16, 16, 128, 4, 4),
    (16, 16, 256, 4, 3),
    (16, 32, 64, 4, 5),
    (16, 32, 128, 4, 4),
    (16, 32, 256, 4, 3),
    (16, 64, 64, 4, 5),
    (16, 64, 128, 4, 3),
    (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3),
    (16, 128, 64, 4, 4),
    (16, 128, 128, 8, 3),
    (32, 64, 64, 4, 4),
    (32, 64, 128, 4, 3),
    (32, 128, 64, 4, 4),
    (32, 128, 128, 8, 3),
    # prefill: gate and up are two accumulators, so 128 x 128 holds 128 x 256 of output
    (64, 64, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 8, 4),
    (64, 256, 64, 8, 3),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 4),
    (128, 64, 128, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 32, 8, 5),
]
DOWN_TILES = [
    (16, 32, 128, 4, 4),
    (16, 32, 256, 4, 3),
    (16, 64, 64, 4, 5),
    (16, 64, 128, 4, 4),
    (16, 64, 256, 4, 3),
    (16, 128, 64, 4, 4),
    (16, 128, 128, 4, 3),
    (16, 128, 128, 8, 3),
    (16, 256, 64, 4, 4),
    (32, 64, 128, 4, 3),
    (32, 128, 64, 4, 4),
    (32, 128, 128, 4, 3),
    (32, 256, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3),
    (64, 256, 64, 4, 3),
    (64, 256, 64, 8, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
]


def as_config(tile: tuple[int, ...], group_m: int = 8) -> MoeTileConfig:
    block_m, block_n, block_k, num_warps, num_stages = tile
    return MoeTileConfig(block_m, block_n, block_k, group_m, num_warps, num_stages)


def alignments(num_tokens: int, top_k: int, num_experts: int) -> list[tuple[int, int]]:
    """The (block_m, tail_m) worth timing: one pair a tile at a token or two; else heights near
    each expert's run (rows_per_expert), with and without tails, where padding stays a
    fraction of the work."""
    if uses_one_pair_tiles(num_tokens, top_k, num_experts):
        return [(16, 0)]
    rows = num_tokens * top_k / num_experts
    if rows < 24:
        return [(16, 0), (32, 0), (32, 16)]
    if rows < 48:
        return [(32, 0), (32, 16), (64, 16), (64, 32)]
    if rows < 192:
        return [(64, 0), (64, 16), (64, 32), (128, 0), (128, 32)]
    return [(64, 0), (64, 16), (128, 0), (128, 16), (128, 32)]


def timed_tiles(gemm, alignment, tiles: list[MoeTileConfig]) -> list[tuple[float, MoeTileConfig]]:
    """Each config timed; fastest first."""
    timed = [_time_gemm(gemm, alignment, config) for config in tiles]
    return sorted((t for t in timed if t[0] is not None), key=lambda t: t[0])


def _time_gemm(gemm, alignment, config: MoeTileConfig) -> tuple[float | None, MoeTileConfig]:
    try:
        return graph_seconds(functools.partial(gemm, alignment, config)), config
    except Exception as error:  # noqa: BLE001 (a config that fails to compile or fit is skipped)
        print(f"    {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        return None, config


def tune_size(problem: MoeProblem, num_experts: int) -> dict:
    """The fastest tiles at this size: per alignment each GEMM's candidates (GROUP_M 8), the
    alignment of least align + up + down + top-k sum, then its best RETIMED of each GEMM under
    every GROUP_ORDERS (rows sorted by expert). Also what each alignment's best came to."""
    num_tokens, top_k = problem.ids.shape
    sum_s = graph_seconds(problem.top_k_sum)
    options = {}
    for block_m, tail_m in alignments(num_tokens, top_k, num_experts):
        alignment = problem.align(block_m, tail_m)
        one_pair = alignment.one_pair_tiles
        align_s = (
            0.0 if one_pair else graph_seconds(functools.partial(problem.align, block_m, tail_m))
        )
        up = timed_tiles(problem.up, alignment, [as_config(t) for t in UP_TILES if t[0] == block_m])
        down = timed_tiles(
            problem.down, alignment, [as_config(t) for t in DOWN_TILES if t[0] == block_m]
        )
        if not up or not down:
            continue
        name = f"{block_m}+{tail_m}"
        options[name] = {
            "align_s": align_s,
            "up": up,
            "down": down,
            "total_s": align_s + up[0][0] + down[0][0] + sum_s,
            "alignment": alignment,
            "tail_m": tail_m,
        }
        print(
            f"  {num_tokens} tokens, {name}: align {align_s * 1e6:.1f} up "
            f"{up[0][0] * 1e6:.1f} down {down[0][0] * 1e6:.1f} sum {sum_s * 1e6:.1f} us; "
            f"{up[0][1]} / {down[0][1]}",
            flush=True,
        )
    best = min(options.values(), key=lambda o: o["total_s"])
    if not best["alignment"].one_pair_tiles:
        best["up"] = _refined(problem.up, best["alignment"], best["up"])
        best["down"] = _refined(problem.down, best["alignment"], best["down"], persistent=True)
    up, down = best["up"][0][1], best["down"][0][1]
    tiles = MoeTiles(up, down, best["tail_m"])
    return {"tiles": tiles, "options": {name: _summary(o) for name, o in options.items()}}


def _refined(
    gemm, alignment, timed: list, persistent: bool = False
) -> list[tuple[float, MoeTileConfig]]:
    """The best RETIMED again under each GROUP_ORDERS, and with their weights through TMA
    (with persistent, down's, also as the persistent kernel)."""
    configs = []
    for _, config in timed[:RETIMED]:
        configs += [dataclasses.replace(config, group_m=g) for g in GROUP_ORDERS]
        if tma_fits(config):
            configs.append(dataclasses.replace(config, weight_tma=True))
            if persistent:
                configs.append(dataclasses.replace(config, weight_tma=True, persistent=True))
    return sorted(timed + timed_tiles(gemm, alignment, configs), key=lambda t: t[0])


def tma_fits(config: MoeTileConfig) -> bool:
    """A weight tile's rows of at most 128 bytes: one TMA box under the 128-byte swizzle."""
    return config.block_k * 2 <= 128


def _summary(option: dict) -> dict:
    """An alignment's times and its best few tiles of each GEMM, for the result file."""
    times = {k: option[k] for k in ("align_s", "total_s")}
    return times | {"up": _best_few(option["up"]), "down": _best_few(option["down"])}


def _best_few(timed: list[tuple[float, MoeTileConfig]]) -> list[dict]:
    return [dataclasses.asdict(config) | {"s": seconds} for seconds, config in timed[:3]]


def whole_seconds(problem: MoeProblem, tiles: MoeTiles) -> float:
    return graph_seconds(functools.partial(problem.whole, tiles), 10.0)


def tune(shape: str, sizes: list[int]) -> dict:
    _, config = shape_config(shape)
    w13, w2, routing = expert_weights(config)
    g = moe_geometry(config)
    device_name = torch.cuda.get_device_name().replace(" ", "_")
    path = CONFIG_DIR / config_file_name(g["experts"], g["inner"], config.hidden_size, device_name)
    dims = (g["experts"], g["inner"], config.hidden_size)
    before = {m: tile_config(*dims, m, w13.device, g["top_k"]) for m in sizes}  # read once, cached
    table = json.loads(path.read_text()) if path.exists() else {}
    table = {m: entry for m, entry in table.items() if int(m) not in sizes}
    rows = []
    for tokens in sizes:
        x, weights, ids = routed(config, tokens, routing)
        problem = MoeProblem.make(x, w13, w2, weights, ids)
        found = tune_size(problem, g["experts"])
        rows.append(_size_row(problem, tokens, g, found["tiles"], before[tokens], found))
        table[str(tokens)] = rows[-1]["kept_tiles"]
        path.write_text(
            json.dumps(dict(sorted(table.items(), key=lambda e: int(e[0]))), indent=2) + "\n"
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k.endswith("_s")}), flush=True)
    print(f"wrote {path}", flush=True)
    return {"table_file": path.name, "table": table, "sizes": rows}


def _size_row(problem, tokens: int, g: dict, tiles: MoeTiles, old: MoeTiles, found: dict) -> dict:
    """The winner against the tiles it replaces and the default rule, and at one pair a tile
    the winner with its gate/up, its down or both as grouped GEMVs, whole calls in one run;
    the table keeps the fastest (the phases timed apart may not add up)."""
    default = MoeTiles.same(default_tile_config(tokens, tokens * g["top_k"] / g["experts"]))
    candidates = {"tuned": tiles, "before": old, "default": default}
    if problem.align(tiles.up.block_m).one_pair_tiles:
        candidates["tuned_up_gemv"] = dataclasses.replace(tiles, up_gemv=True)
        candidates["tuned_down_gemv"] = dataclasses.replace(tiles, down_gemv=True)
        candidates["tuned_gemvs"] = dataclasses.replace(tiles, up_gemv=True, down_gemv=True)
    whole = {name: (whole_seconds(problem, t), t) for name, t in candidates.items()}
    kept = min(whole, key=lambda name: whole[name][0])
    return {
        "tokens": tokens,
        **{f"{name}_s": seconds for name, (seconds, _) in whole.items()},
        "kept": kept,
        "kept_tiles": tiles_to_json(whole[kept][1]),
        "tiles": tiles_to_json(tiles),
        "before_tiles": tiles_to_json(old),
        "alignments": found["options"],
    }


# ---- compiling the candidates in parallel ----


def precompile(shapes: list[str], workers: int) -> float:
    """Every candidate of both GEMMs, both ways of tiling rows, compiled into Triton's disk cache
    by a pool of processes on tiny problems with the shapes' own widths (so K's fit to BLOCK_K,
    a compile-time flag, is the sweep's). Returns the seconds it took. A worker that dies
    never answers: past PRECOMPILE_WAIT_S without an answer the pool is given up, and the sweep
    compiles what is left as it meets it."""
    start = datetime.datetime.now()
    jobs = [(shape, tile) for shape in shapes for tile in sorted(set(UP_TILES) | set(DOWN_TILES))]
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        answers = pool.imap_unordered(_compile_job, jobs)
        for _ in jobs:
            try:
                failed = answers.next(timeout=PRECOMPILE_WAIT_S)
            except multiprocessing.TimeoutError:
                print(f"  precompile: no answer in {PRECOMPILE_WAIT_S} s, given up", flush=True)
                break
            if failed:
                print(f"  precompile: {failed}", flush=True)
    return (datetime.datetime.now() - start).total_seconds()


def _compile_job(job: tuple[str, tuple[int, ...]]) -> str:
    shape, tile = job
    try:
        _, config = shape_config(shape)
        g = moe_geometry(config)
        tails = [0] + [t for t in (16, 32) if t < tile[0]]  # alignments()' tails
        ids = torch.randint(0, g["experts"], (256, g["top_k"]), device="cuda", dtype=torch.int32)
        for tail_m in tails:  # the alignment of the shape's expert count
            align_for(ids, tile[0], g["experts"], tail_m)
        for tokens in (1, 256):  # one pair a tile, then sorted by expert (2 experts)
            problem = _two_expert_problem(config, tokens)
            for tail_m in tails:
                alignment = problem.align(tile[0], tail_m)
                if alignment.one_pair_tiles and tile[0] != 16:  # the sweep's one-pair tiles
                    continue
                tma = {False, tma_fits(as_config(tile)) and not alignment.one_pair_tiles}
                for variant in (dataclasses.replace(as_config(tile), weight_tma=t) for t in tma):
                    if tile in UP_TILES:
                        problem.up(alignment, variant)
                    if tile in DOWN_TILES:
                        problem.down(alignment, variant)
        torch.cuda.synchronize()
        return ""
    except Exception as error:  # noqa: BLE001 (a config that cannot compile is reported, skipped)
        return f"{shape} {tile}: {type(error).__name__}: {str(error)[:200]}"


def _two_expert_problem(config, tokens: int) -> MoeProblem:
    """The shape's widths (K's fit to BLOCK_K is a compile-time flag) over two experts."""
    g = moe_geometry(config)
    hidden, inner, top_k = config.hidden_size, g["inner"], g["top_k"]
    w13 = torch.empty(2, 2 * inner, hidden, device="cuda", dtype=DTYPE)
    w2 = torch.empty(2, hidden, inner, device="cuda", dtype=DTYPE)
    ids = (torch.arange(tokens * top_k, device="cuda") % 2).view(tokens, top_k)
    x = torch.zeros(tokens, hidden, device="cuda", dtype=DTYPE)
    weights = torch.ones(tokens, top_k, device="cuda")
    return MoeProblem.make(x, w13, w2, weights, ids.to(torch.int32))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=MOE_SHAPES, nargs="+", required=True)
    parser.add_argument("--sizes", type=int, nargs="*", default=TUNE_SIZES)
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    result = {
        **result_header("moe_tune"),
        "precompile_s": precompile(args.shape, args.workers) if args.workers > 1 else 0.0,
        "shapes": {},
    }
    print(f"precompiled in {result['precompile_s']:.0f} s", flush=True)
    for shape in args.shape:
        result["shapes"][shape] = tune(shape, args.sizes)
        if args.out:  # after every shape: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
