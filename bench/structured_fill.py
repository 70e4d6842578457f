"""The host cost of structured outputs in a decode step, on the CPU: filling the token bitmasks of
256 requests, each held to a JSON schema of its own (20 fields, bench/structured.py's schemas,
against a real tokenizer's vocabulary from --tokenizer, padded to Qwen3's 151,936 logits, or
without it bench/structured.py's synthetic worst case of Qwen3's size), one matcher at a
time against xgrammar's batched fill at several thread counts, and through the worker's
GrammarMatchers (the fill thread, the batched fill and the row copies).

Each matcher first takes a random number of tokens (0 to 40, each drawn from those its grammar
allows), so that the rows sit in different states, as a decoding batch's do.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow the
# top-level kernels package that asyncllm imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import xgrammar as xgr  # noqa: E402

from asyncllm.structured_output.matchers import (  # noqa: E402
    ConstrainedRow,
    GrammarMatchers,
    fill_threads,
)

_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "amx_tile")


def structured_bench():
    spec = importlib.util.spec_from_file_location(
        "structured", Path(__file__).with_name("structured.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_description() -> dict:
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", platform.processor()),
        "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags],
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
    }


def allowed(mask_row: torch.Tensor, limit: int) -> list[int]:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < limit]


def advanced_matchers(
    grammars: list[xgr.CompiledGrammar], vocab: int, tokenizer_size: int, tokens: int, seed: int
) -> tuple[list[xgr.GrammarMatcher], list[list[int]]]:
    """A matcher per grammar after a random walk of up to `tokens` allowed tokens."""
    rng = random.Random(seed)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matchers, walks = [], []
    for grammar in grammars:
        matcher, walk = xgr.GrammarMatcher(grammar), []
        for _ in range(rng.randint(0, tokens)):
            matcher.fill_next_token_bitmask(mask)
            choices = allowed(mask[0], tokenizer_size)
            token = rng.choice(choices)
            if not matcher.accept_token(token) or matcher.is_terminated():
                break
            walk.append(token)
        matchers.append(matcher)
        walks.append(walk)
    return matchers, walks


def tokenizer_info(structured, folder: Path | None) -> tuple[xgr.TokenizerInfo, int]:
    """xgrammar's view of the real tokenizer in `folder` (or the synthetic one) and its size."""
    if folder is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=structured.VOCAB)
        return info, len(tokenizer)
    vocab = structured.byte_level_vocab(structured.TOKENIZER_SIZE)
    info = xgr.TokenizerInfo(
        vocab,
        vocab_type=xgr.VocabType.BYTE_LEVEL,
        vocab_size=structured.VOCAB,
        stop_token_ids=[structured.EOS],
    )
    return info, structured.TOKENIZER_SIZE


def median_ms(fill, repeats: int) -> float:
    fill()  # warm: the threads start, the caches fill
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fill()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--fields", type=int, default=20)
    parser.add_argument("--walk", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a real tokenizer's folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    structured = structured_bench()
    info, tokenizer_size = tokenizer_info(structured, args.tokenizer)
    compiler = xgr.GrammarCompiler(info)
    start = time.perf_counter()
    grammars = [
        compiler.compile_json_schema(
            json.dumps(structured.schema(i, args.fields)), any_whitespace=False
        )
        for i in range(args.batch)
    ]
    compile_s = time.perf_counter() - start
    matchers, walks = advanced_matchers(grammars, structured.VOCAB, tokenizer_size, args.walk, 0)
    mask = xgr.allocate_token_bitmask(args.batch, structured.VOCAB)

    def one_at_a_time() -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, i)

    reference = mask.clone()
    one_at_a_time_ms = median_ms(one_at_a_time, args.repeats)
    reference.copy_(mask)
    thread_counts = sorted({1, 2, 4, 8, fill_threads(), len(os.sched_getaffinity(0))})
    batched_ms = {}
    for threads in thread_counts:
        batch = xgr.BatchGrammarMatcher(threads)
        mask.zero_()
        batched_ms[threads] = median_ms(
            lambda b=batch: b.batch_fill_next_token_bitmask(matchers, mask), args.repeats
        )
        assert torch.equal(mask, reference), f"{threads} threads filled another mask"

    runner = GrammarMatchers(structured.VOCAB, args.batch, torch.device("cpu"))
    rows = [
        ConstrainedRow(i, i, str(i), grammars[i], walk, len(walk), [], None)
        for i, walk in enumerate(walks)
    ]

    def through_runner() -> None:
        runner.start_fill(rows)
        runner.bitmask(rows, args.batch)

    runner_ms = median_ms(through_runner, args.repeats)
    best = min(batched_ms.values())
    result = {
        "tokenizer": str(args.tokenizer) if args.tokenizer else "synthetic (worst case)",
        "tokenizer_size": tokenizer_size,
        "batch": args.batch,
        "fields": args.fields,
        "walk_tokens_max": args.walk,
        "walk_tokens_mean": statistics.mean(len(w) for w in walks),
        "compile_s_all": compile_s,
        "one_at_a_time_ms": one_at_a_time_ms,
        "batched_ms_by_threads": batched_ms,
        "runner_threads": runner.num_threads,
        "runner_fill_ms": runner_ms,
        "speedup_best_batched": one_at_a_time_ms / best,
    }
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu_description(),
        "load_average_1m": os.getloadavg()[0],
        "torch": torch.__version__,
        "xgrammar": structured._version("xgrammar"),
        "result": result,
    }
    print(json.dumps(report, indent=2), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
