"""The host cost of structured outputs in a decode step, on the CPU: taking in the step's sampled
tokens and filling the token bitmasks of 256 requests, each held to a JSON schema of its own (20
fields, bench/structured.py's schemas), against a real tokenizer's vocabulary from --tokenizer
under Qwen3's 151,936 logits, or without it bench/structured.py's synthetic worst case of Qwen3's
size.

With a real tokenizer two grammar vocabularies are measured, interleaved: the tokenizer's own (the
engine's, asyncllm.structured_output.compiler.tokenizer_info) and the one padded to the logits'
width (the engine's before, where xgrammar counts every padding id as a special token). For each:
xgrammar's accept per token (thread CPU time, through batch_accept_token as the worker calls it),
the fills one matcher at a time and batched at several thread counts, and a step through the
worker's GrammarMatchers (the step before's 256 tokens taken in, then the 256 masks filled).

Each matcher first takes a random number of tokens (0 to 40, each drawn from those its grammar
allows), so that the rows sit in different states, as a decoding batch's do. Timings are the
minimum over interleaved rounds (the machine may be shared); CPU times are the process's.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow the
# top-level kernels package that asyncllm imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import xgrammar as xgr  # noqa: E402

from asyncllm.structured_output.compiler import tokenizer_info  # noqa: E402
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
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")
    return bits[:limit].nonzero()[0].tolist()


def random_walks(
    grammars: list[xgr.CompiledGrammar], tokenizer_size: int, lengths: list[int], seed: int
) -> list[list[int]]:
    """Per grammar, `length` tokens, each drawn from those its grammar allows after the ones
    before (the schemas are long: none ends within a walk)."""
    rng = random.Random(seed)
    walks = []
    for grammar, length in zip(grammars, lengths):
        matcher, walk = xgr.GrammarMatcher(grammar), []
        mask = xgr.allocate_token_bitmask(1, grammar.tokenizer_info.vocab_size)
        for _ in range(length):
            matcher.fill_next_token_bitmask(mask)
            token = rng.choice(allowed(mask[0], tokenizer_size))
            assert matcher.accept_token(token) and not matcher.is_terminated()
            walk.append(token)
        walks.append(walk)
    return walks


@dataclass
class Vocabulary:
    """The grammars of the batch compiled against one xgrammar vocabulary, their walks, and
    the state each round starts from."""

    name: str
    info: xgr.TokenizerInfo
    tokenizer_size: int
    grammars: list[xgr.CompiledGrammar]
    compile_s: float
    starts: list[int]  # tokens of its walk a row has taken before the timed rounds
    walks: list[list[int]]

    def advanced_matchers(self) -> list[xgr.GrammarMatcher]:
        matchers = []
        for grammar, start, walk in zip(self.grammars, self.starts, self.walks):
            matcher = xgr.GrammarMatcher(grammar)
            for token in walk[:start]:
                matcher.accept_token(token)
            matchers.append(matcher)
        return matchers


def compiled(name, info, tokenizer_size, schemas, starts, rounds, walks=None) -> Vocabulary:
    """The schemas compiled against `info`, with `walks` or, without them, random ones long
    enough for the rounds after the starts."""
    compiler = xgr.GrammarCompiler(info)
    start = time.perf_counter()
    grammars = [compiler.compile_json_schema(s, any_whitespace=False) for s in schemas]
    compile_s = time.perf_counter() - start
    if walks is None:
        walks = random_walks(grammars, tokenizer_size, [s + rounds + 1 for s in starts], 0)
    return Vocabulary(name, info, tokenizer_size, grammars, compile_s, starts, walks)


def vocabularies(structured, folder: Path | None, batch: int, walk: int, rounds: int):
    """The vocabularies to compare: with a real tokenizer the engine's and the padded one."""
    schemas = [json.dumps(structured.schema(i, 20)) for i in range(batch)]
    rng = random.Random(1)
    starts = [rng.randint(0, walk) for _ in range(batch)]
    if folder is None:
        vocab = structured.byte_level_vocab(structured.TOKENIZER_SIZE)
        info = xgr.TokenizerInfo(
            vocab,
            vocab_type=xgr.VocabType.BYTE_LEVEL,
            vocab_size=structured.VOCAB,
            stop_token_ids=[structured.EOS],
        )
        size = structured.TOKENIZER_SIZE
        return [compiled("synthetic", info, size, schemas, starts, rounds)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = [tokenizer.eos_token_id]
    own = tokenizer_info(folder, structured.VOCAB, eos)
    padded = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=structured.VOCAB, stop_token_ids=eos
    )
    size = len(tokenizer)
    first = compiled("tokenizer", own, size, schemas, starts, rounds)
    # the same walks: both vocabularies allow the same tokens (same_masks checks it)
    second = compiled("padded_to_logits", padded, size, schemas, starts, rounds, first.walks)
    return [first, second]


def accept_us(vocabulary: Vocabulary, rounds: int) -> float:
    """Thread CPU us of one token taken in, over the rounds' tokens of every row, each round's
    tokens through one batch_accept_token call as the worker makes it."""
    matchers = vocabulary.advanced_matchers()
    spent = 0
    for r in range(rounds):
        tokens = [walk[start + r] for start, walk in zip(vocabulary.starts, vocabulary.walks)]
        begin = time.thread_time_ns()
        taken = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        spent += time.thread_time_ns() - begin
        assert all(taken)
    return spent / 1e3 / (rounds * len(matchers))


def fill_ms(vocabulary: Vocabulary, threads: int | None) -> tuple[float, torch.Tensor]:
    """Wall ms of the batch's masks filled one matcher at a time (threads None) or batched."""
    matchers = vocabulary.advanced_matchers()
    mask = xgr.allocate_token_bitmask(len(matchers), vocabulary.info.vocab_size)
    if threads is None:
        begin = time.perf_counter()
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(mask, i)
    else:
        batch = xgr.BatchGrammarMatcher(threads)
        batch.batch_fill_next_token_bitmask(matchers, mask)  # its threads start
        begin = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, mask)
    return (time.perf_counter() - begin) * 1e3, mask


def worker_steps(vocabulary: Vocabulary, rounds: int) -> tuple[float, float]:
    """Through the worker's GrammarMatchers, as a decode step: the step before's tokens taken
    in, then every row's mask filled; (wall ms, process CPU ms) of the cheapest step."""
    runner = GrammarMatchers(
        vocabulary.info.vocab_size, len(vocabulary.grammars), torch.device("cpu")
    )
    batch = len(vocabulary.grammars)
    walls, cpus = [], []
    for r in range(rounds):
        rows = [
            ConstrainedRow(i, i, str(i), grammar, walk, start + r, [], None)
            for i, (grammar, start, walk) in enumerate(
                zip(vocabulary.grammars, vocabulary.starts, vocabulary.walks)
            )
        ]
        wall, cpu = time.perf_counter(), time.process_time()
        runner.start_fill(rows)
        runner.bitmask(rows, batch)
        walls.append((time.perf_counter() - wall) * 1e3)
        cpus.append((time.process_time() - cpu) * 1e3)
        sampled = torch.tensor(
            [walk[start + r] for start, walk in zip(vocabulary.starts, vocabulary.walks)]
        )
        runner.record_sampled(rows, sampled, None, None)
    # the first step starts every matcher from its outputs: not a decode step's work
    return min(walls[1:]), min(cpus[1:])


def measured(vocabularies_: list[Vocabulary], rounds: int, repeats: int) -> dict:
    thread_counts = sorted({1, 2, 4, 8, fill_threads(), len(os.sched_getaffinity(0))})
    kinds: list[tuple[str, Callable[[Vocabulary], object]]] = [
        ("accept_us", lambda v: accept_us(v, rounds)),
        ("fill_one_at_a_time_ms", lambda v: fill_ms(v, None)[0]),
        *((f"fill_batched_ms_{t}_threads", lambda v, t=t: fill_ms(v, t)[0]) for t in thread_counts),
        ("worker_step", lambda v: worker_steps(v, rounds)),
    ]
    times: dict[str, dict[str, list]] = {v.name: {k: [] for k, _ in kinds} for v in vocabularies_}
    for _ in range(repeats):  # interleaved, so that a burst of load does not pick a side
        for vocabulary in vocabularies_:
            for kind, measure in kinds:
                times[vocabulary.name][kind].append(measure(vocabulary))
    return {
        name: summary(by_kind, len(vocabularies_[0].grammars)) for name, by_kind in times.items()
    }


def summary(by_kind: dict[str, list], batch: int) -> dict:
    result = {kind: min(values) for kind, values in by_kind.items() if kind != "worker_step"}
    result[f"accepts_{batch}_ms"] = result["accept_us"] * batch / 1e3
    result["worker_step_wall_ms"] = min(w for w, _ in by_kind["worker_step"])
    result["worker_step_cpu_ms"] = min(c for _, c in by_kind["worker_step"])
    return result


def same_masks(vocabularies_: list[Vocabulary]) -> bool:
    """Whether the vocabularies allow the same tokens of the tokenizer at every row."""
    masks = [fill_ms(v, 1)[1] for v in vocabularies_]
    width = min(m.shape[1] for m in masks)
    return all(torch.equal(m[:, :width], masks[0][:, :width]) for m in masks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--walk", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5, help="decode steps timed per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a real tokenizer's folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    structured = structured_bench()
    compared = vocabularies(structured, args.tokenizer, args.batch, args.walk, args.rounds)
    load_before = os.getloadavg()[0]
    result = {
        "tokenizer": str(args.tokenizer) if args.tokenizer else "synthetic (worst case)",
        "tokenizer_size": compared[0].tokenizer_size,
        "logits": structured.VOCAB,
        "batch": args.batch,
        "fields": 20,
        "walk_tokens_max": args.walk,
        "walk_tokens_mean": statistics.mean(compared[0].starts),
        "special_token_ids": {v.name: len(v.info.special_token_ids) for v in compared},
        "compile_s_all": {v.name: v.compile_s for v in compared},
        "same_masks": same_masks(compared),
        "by_vocabulary": measured(compared, args.rounds, args.repeats),
    }
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu_description(),
        "load_average_1m": [load_before, os.getloadavg()[0]],
        "torch": torch.__version__,
        "triton": structured._version("triton"),
        "xgrammar": structured._version("xgrammar"),
        "result": result,
    }
    print(json.dumps(report, indent=2), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
