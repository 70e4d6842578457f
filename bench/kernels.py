"""Kernel benchmarks on one GPU: bandwidth and FLOP rates against ceilings measured in the same run.

    python bench/kernels.py --out bench/results/kernels_h200.json
    python bench/kernels.py --sections decode_long prefill_long mixed_long --long-context 32768

Ceilings: a device-to-device copy (bytes read + written) and an 8192^3 bf16 matmul. Decode
attention counts the KV bytes it must read plus q and out; prefill counts 4 * head_dim FLOPs per
visible (query, key) pair per head. Times are medians of triton.testing.do_bench, which clears
the L2 cache before every call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import (  # noqa: E402
    fused_add_rms_norm,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from kernels._common import AttentionConfig  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    DecodeSplit,
    choose_decode_split,
    default_decode_config,
)
from kernels.prefill_attention import (  # noqa: E402
    default_prefill_config,
    short_query_prefill_config,
)

# Qwen3-0.6B attention shape
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"

DECODE_SWEEP = [
    AttentionConfig(0, block_n, warps, stages)
    for block_n, warps, stages in [
        (16, 2, 4),
        (32, 2, 4),
        (32, 4, 3),
        (32, 4, 4),
        (64, 4, 2),
        (64, 4, 3),
        (64, 4, 4),
        (64, 8, 3),
        (128, 4, 2),
        (128, 4, 3),
        (128, 8, 2),
        (128, 8, 3),
    ]
]
PREFILL_SWEEP = [
    AttentionConfig(*c)
    for c in [
        (128, 64, 4, 3),
        (128, 64, 8, 3),
        (128, 64, 4, 4),
        (128, 64, 4, 2),
        (128, 32, 4, 3),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (64, 64, 4, 4),
        (64, 32, 4, 4),
        (64, 128, 4, 3),
    ]
]


def median_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def measure_copy_tbps() -> float:
    src = torch.randn(1 << 29, device=DEVICE, dtype=torch.float32)  # 2 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e9


def measure_matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=DTYPE)
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def make_cache(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A random cache and block tables whose blocks are scattered over the pool."""
    blocks = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks)
    kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE
    )
    ids = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)
    start = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = ids[start : start + n]
        start += n
    return kv_cache, tables


def bench_decode(
    batch: int,
    context: int | list[int],
    copy_tbps: float,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
) -> dict:
    """context: one length for every request, or each request's length in batch order."""
    seq_lens = [context] * batch if isinstance(context, int) else context
    kv_cache, tables = make_cache(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    # None: the kernel's own choice, which this reports
    chosen = DecodeSplit(num_splits) if num_splits else _default_split(seq_lens)
    ms = median_ms(
        lambda: paged_decode_attention(
            query,
            kv_cache,
            tables,
            lens,
            HEAD_DIM**-0.5,
            out,
            max_seq_len=max(seq_lens),
            num_splits=num_splits,
            config=config,
        )
    )
    nbytes = sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * 2 * 2 + 2 * query.numel() * 2
    tbps = nbytes / ms / 1e9
    config = config or default_decode_config(DTYPE, batch)
    return {
        "batch": batch,
        "context": context if isinstance(context, int) else round(sum(seq_lens) / batch),
        "num_splits": chosen.num_splits,
        "min_split_tokens": chosen.min_tokens,
        "config": vars(config),
        "ms": ms,
        "tbps": tbps,
        "pct_of_copy": 100 * tbps / copy_tbps,
    }


def mixed_lengths(batch: int, low: int, high: int, order: str) -> list[int]:
    """Lengths uniform in [low, high] (seed 0), as drawn or sorted ("drawn", "longest_first",
    "shortest_first"): a decode batch of the offline workload has lengths this spread."""
    lengths = torch.randint(low, high + 1, (batch,), generator=torch.Generator().manual_seed(0))
    if order != "drawn":
        lengths = lengths.sort(descending=order == "longest_first").values
    return lengths.tolist()


def bench_kv_write(num_tokens: int, copy_tbps: float) -> dict:
    num_blocks = num_tokens // BLOCK_SIZE * 2
    kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE
    )
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    value = torch.randn_like(key)
    ms = median_ms(lambda: reshape_and_cache(key, value, kv_cache, slots))
    nbytes = 2 * 2 * key.numel() * 2  # key and value, each read once and written once
    return {
        "tokens": num_tokens,
        "ms": ms,
        "tbps": nbytes / ms / 1e9,
        "pct_of_copy": 100 * nbytes / ms / 1e9 / copy_tbps,
    }


@dataclass
class PrefillInputs:
    """A paged cache holding the requests' seq_lens, and their queries' last query_lens rows."""

    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query: torch.Tensor
    out: torch.Tensor

    @classmethod
    def random(cls, query_lens: list[int], seq_lens: list[int]) -> PrefillInputs:
        kv_cache, tables = make_cache(seq_lens)
        starts = torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
        )
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        return cls(kv_cache, tables, starts, lens, query, torch.empty_like(query))

    def prefill(self, max_query_len: int, first: int = 0, **kwargs) -> None:
        """The prefill kernel over the requests from `first` on."""
        paged_prefill_attention(
            self.query,
            self.kv_cache,
            self.query_start_loc[first:],
            self.seq_lens[first:],
            self.block_tables[first:],
            HEAD_DIM**-0.5,
            max_query_len,
            self.out,
            **kwargs,
        )


def bench_prefill(
    query_lens: list[int],
    seq_lens: list[int],
    matmul_tflops: float,
    config: AttentionConfig | None = None,
) -> dict:
    inputs = PrefillInputs.random(query_lens, seq_lens)
    ms = median_ms(lambda: inputs.prefill(max(query_lens), config=config))
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens, strict=True))
    tflops = 4 * HEAD_DIM * NUM_HEADS * pairs / ms / 1e9
    config = config or default_prefill_config(DTYPE)
    return {
        "query_lens": sorted(set(query_lens)),
        "seq_lens": sorted(set(seq_lens)),
        "num_reqs": len(query_lens),
        "config": vars(config),
        "ms": ms,
        "tflops": tflops,
        "pct_of_matmul": 100 * tflops / matmul_tflops,
    }


def bench_mixed_long(
    decode_lens: list[int],
    chunk: int,
    chunk_context: int,
    matmul_tflops: float,
    decode_splits: int | None,
) -> dict:
    """A long-context mixed step's attention: decodes of decode_lens beside a prompt chunk of
    `chunk` queries ending at chunk_context. decode_splits None: all in the prefill kernel's
    128-row tiles, each decode a tile of its own (the backend under min_split_decodes
    decodes); else the decodes in the decode kernel in that many splits (the backend's 1 from
    min_split_decodes on; 0: as choose_decode_split splits them) and the chunk in the prefill
    kernel."""
    d = len(decode_lens)
    inputs = PrefillInputs.random([1] * d + [chunk], [*decode_lens, chunk_context])

    def step() -> None:
        if decode_splits is not None:
            paged_decode_attention(
                inputs.query[:d],
                inputs.kv_cache,
                inputs.block_tables[:d],
                inputs.seq_lens[:d],
                HEAD_DIM**-0.5,
                inputs.out[:d],
                max_seq_len=max(decode_lens),
                num_splits=decode_splits or None,
            )
        inputs.prefill(chunk, first=0 if decode_splits is None else d)

    ms = median_ms(step)
    pairs = sum(decode_lens) + chunk * (chunk_context - chunk) + chunk * (chunk + 1) // 2
    tflops = 4 * HEAD_DIM * NUM_HEADS * pairs / ms / 1e9
    return {
        "decode_splits": decode_splits,
        "num_decodes": d,
        "decode_context": round(sum(decode_lens) / d),
        "chunk": chunk,
        "seq_lens": [chunk_context],
        "ms": ms,
        "tflops": tflops,
        "pct_of_matmul": 100 * tflops / matmul_tflops,
    }


def bench_sdpa_reference(num_reqs: int, length: int, matmul_tflops: float) -> dict:
    """torch's own causal SDPA (flash) on contiguous K/V of the same shape: a point of comparison."""
    q = torch.randn(num_reqs, NUM_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    k = torch.randn(num_reqs, NUM_KV_HEADS, length, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    tflops = 4 * HEAD_DIM * NUM_HEADS * num_reqs * length * (length + 1) // 2 / ms / 1e9
    return {
        "num_reqs": num_reqs,
        "length": length,
        "ms": ms,
        "tflops": tflops,
        "pct_of_matmul": 100 * tflops / matmul_tflops,
    }


def bench_ops(copy_tbps: float) -> list[dict]:
    tokens, hidden, inter = 16384, 1024, 3072
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEVICE, dtype=DTYPE)
    gate_up = torch.randn(tokens, 2 * inter, device=DEVICE, dtype=DTYPE)
    qkv = torch.randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device=DEVICE, dtype=DTYPE)
    q, k, _ = qkv.split(
        [NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], -1
    )
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    angles = torch.randn(4096, HEAD_DIM, device=DEVICE)
    cases = [
        ("rms_norm", lambda: rms_norm(x, weight, 1e-6), 2 * x.numel() * 2),
        (
            "fused_add_rms_norm",
            lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
            4 * x.numel() * 2,
        ),
        ("silu_and_mul", lambda: silu_and_mul(gate_up), 3 * tokens * inter * 2),
        (
            "rotary_embedding",
            lambda: rotary_embedding(positions, q, k, angles),
            2 * (q.numel() + k.numel()) * 2,
        ),
    ]
    results = []
    for name, fn, nbytes in cases:
        ms = median_ms(fn)
        results.append(
            {
                "op": name,
                "tokens": tokens,
                "ms": ms,
                "tbps": nbytes / ms / 1e9,
                "pct_of_copy": 100 * nbytes / ms / 1e9 / copy_tbps,
            }
        )
    return results


def _default_split(seq_lens: list[int]) -> DecodeSplit:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return choose_decode_split(len(seq_lens), NUM_KV_HEADS, max(seq_lens), sms)


def long_context_sections(
    context: int, copy_tbps: float, matmul_tflops: float
) -> list[tuple[str, Callable[[], object]]]:
    """Attention at long contexts (issue 28's 32k figures): decode at `context` by batch, and
    over 32 and 64 lengths spread as the long-context workload's (U[context / 4, context]) by
    split count (None: choose_decode_split's); prefill chunks ending at `context`; a mixed step
    of that workload, its decodes in the prefill kernel or in the decode kernel; the prefill
    tiles swept over an 8,192-row chunk ending at `context`."""
    spread = mixed_lengths(64, context // 4, context, "drawn")
    return [
        (
            "decode_long",
            lambda: (
                [bench_decode(b, context, copy_tbps) for b in (1, 8, 32, 64)]
                + [
                    {"order": "drawn"} | bench_decode(b, spread[:b], copy_tbps, num_splits=s)
                    for b in (32, 64)
                    for s in (1, 2, 4, 8, None)
                ]
            ),
        ),
        (
            "prefill_long",
            lambda: [
                bench_prefill([chunk], [context], matmul_tflops)
                for chunk in (512, 2048, 8192, context)
            ],
        ),
        (
            "mixed_long",
            lambda: [
                bench_mixed_long(spread[:d], 8192, context, matmul_tflops, splits)
                for d in (8, 32, 63)
                for splits in (None, 1, 0)
            ],
        ),
        (
            # the chunked prefill's tiles at long contexts: the default was chosen at 4 x 4096
            "prefill_long_sweep",
            lambda: [bench_prefill([8192], [context], matmul_tflops, c) for c in PREFILL_SWEEP],
        ),
    ]


def run_all(command: str, only: list[str] | None = None, long_context: int = 32768) -> dict:
    torch.manual_seed(0)
    copy_tbps = measure_copy_tbps()
    matmul_tflops = measure_matmul_tflops()
    print(
        f"ceilings: copy {copy_tbps:.2f} TB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s", flush=True
    )
    result: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": command,
        "shape": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
        },
        "ceilings": {"copy_tbps": copy_tbps, "matmul_bf16_tflops": matmul_tflops},
        "long_context": long_context,
    }
    sections: list[tuple[str, Callable[[], object]]] = [
        ("decode", lambda: [bench_decode(256, ctx, copy_tbps) for ctx in (1024, 4096)]),
        (
            "decode_sweep",
            lambda: [bench_decode(256, 4096, copy_tbps, config=c) for c in DECODE_SWEEP],
        ),
        (
            "decode_split_k",
            lambda: (
                [bench_decode(4, 16384, copy_tbps, num_splits=s) for s in (1, None)]
                + [bench_decode(32, 4096, copy_tbps, num_splits=s) for s in (1, None)]
            ),
        ),
        (
            # where the batch shrinks at the end of a run: is one program per (request, KV
            # head) enough to read KV at full bandwidth, or would splitting pay?
            "decode_mid_batch_splits",
            lambda: [
                bench_decode(batch, context, copy_tbps, num_splits=splits)
                for batch in (16, 32, 64, 128)
                for context in (1024, 2048)
                for splits in (1, 2, 4)
            ],
        ),
        (
            # the offline workload's decode batches: do programs of very different lengths
            # leave SMs idle at the end of the launch (longest first would even that out)?
            "decode_mixed_lengths",
            lambda: [
                {"order": order}
                | bench_decode(
                    batch, mixed_lengths(batch, 100, 2048, order), copy_tbps, num_splits=s
                )
                for batch in (256, 128)
                for order in ("drawn", "longest_first", "shortest_first")
                for s in (1, 2, 4)
            ],
        ),
        (
            "decode_mixed_lengths_sweep",
            lambda: [
                {"order": "drawn"}
                | bench_decode(batch, mixed_lengths(batch, 100, 2048, "drawn"), copy_tbps, c, s)
                for batch, s in ((256, 1), (128, 2))
                for c in DECODE_SWEEP
            ],
        ),
        (
            # the tile length by batch size, at each batch's default split count
            "decode_tiles_by_batch",
            lambda: [
                {"order": "drawn"}
                | bench_decode(batch, mixed_lengths(batch, 100, high, "drawn"), copy_tbps, c)
                for batch, high in ((1, 500), (8, 500), (32, 2048), (64, 2048), (128, 2048))
                for c in (AttentionConfig(0, 64, 4, 3), AttentionConfig(0, 128, 4, 3))
            ],
        ),
        ("kv_write", lambda: [bench_kv_write(n, copy_tbps) for n in (256, 16384)]),
        (
            "prefill",
            lambda: [
                bench_prefill([4096] * 4, [4096] * 4, matmul_tflops),
                bench_prefill([512] * 16, [4096] * 16, matmul_tflops),
                bench_prefill([1024] * 8, [1024] * 8, matmul_tflops),
            ],
        ),
        (
            # a serving step: decodes next to one arriving prompt, then the prompt alone, each
            # in 128-row and in 16-row tiles
            "prefill_mixed",
            lambda: [
                bench_prefill([1] * decodes + [p], [820] * decodes + [p], matmul_tflops, config)
                for decodes in (28, 0)
                for p in (64, 256, 580, 1024, 2048)
                for config in (default_prefill_config(DTYPE), short_query_prefill_config(DTYPE))
            ],
        ),
        (
            "prefill_sweep",
            lambda: [
                bench_prefill([4096] * 4, [4096] * 4, matmul_tflops, c) for c in PREFILL_SWEEP
            ],
        ),
        ("sdpa_reference", lambda: [bench_sdpa_reference(4, 4096, matmul_tflops)]),
        ("ops", lambda: bench_ops(copy_tbps)),
        *long_context_sections(long_context, copy_tbps, matmul_tflops),
    ]
    unknown = set(only or ()) - {name for name, _ in sections}
    if unknown:
        raise ValueError(f"no such sections: {sorted(unknown)}")
    for name, section in sections:
        if only and name not in only:
            continue
        try:
            result[name] = section()
        except Exception as exc:  # one failing section must not lose the others' numbers
            result[name] = {"error": repr(exc)}
        print(f"{name}: {json.dumps(result[name])}", flush=True)
        torch.cuda.empty_cache()
    return result


def _rows(result: dict, name: str) -> list[dict]:
    rows = result.get(name, [])
    return rows if isinstance(rows, list) else [rows]


def summary(result: dict) -> str:
    """A short table for the end of the log."""
    c = result["ceilings"]
    lines = [
        f"{result['gpu']}  torch {result['torch']}  triton {result['triton']}",
        f"copy {c['copy_tbps']:.2f} TB/s   bf16 matmul {c['matmul_bf16_tflops']:.0f} TFLOP/s",
    ]
    bandwidth_keys = (
        "config",
        "order",
        "batch",
        "context",
        "num_splits",
        "tokens",
        "op",
        "ms",
        "tbps",
        "pct_of_copy",
        "error",
    )
    flop_keys = (
        "config",
        "decode_splits",
        "num_decodes",
        "decode_context",
        "chunk",
        "query_lens",
        "seq_lens",
        "num_reqs",
        "length",
        "ms",
        "tflops",
        "pct_of_matmul",
        "error",
    )
    for names, keys in (
        (
            (
                "decode",
                "decode_split_k",
                "decode_mid_batch_splits",
                "decode_mixed_lengths",
                "decode_tiles_by_batch",
                "decode_long",
                "kv_write",
                "ops",
            ),
            bandwidth_keys,
        ),
        (("prefill", "prefill_mixed", "sdpa_reference", "prefill_long", "mixed_long"), flop_keys),
    ):
        for name in names:
            for row in _rows(result, name):
                shown = {
                    k: round(v, 3) if isinstance(v, float) else v
                    for k, v in row.items()
                    if k in keys
                }
                lines.append(f"{name:16s} {json.dumps(shown)}")
    for name, key in (
        ("decode_sweep", "tbps"),
        ("decode_mixed_lengths_sweep", "tbps"),
        ("prefill_sweep", "tflops"),
        ("prefill_long_sweep", "tflops"),
    ):
        rows = [r for r in _rows(result, name) if key in r]
        if rows:
            best = max(rows, key=lambda r: r[key])
            lines.append(f"best {name}: {best['config']} {key}={best[key]:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels_h200.json"))
    parser.add_argument("--sections", nargs="+", help="run only these sections (default: all)")
    parser.add_argument(
        "--long-context",
        type=int,
        default=32768,
        help="the context of the *_long sections (decode, prefill chunks, mixed steps)",
    )
    args = parser.parse_args()
    result = run_all(" ".join(["python", *sys.argv]), args.sections, args.long_context)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))


if __name__ == "__main__":
    main()
