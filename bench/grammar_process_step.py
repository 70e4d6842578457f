"""The grammar process's side of a decode step at batch 256, on the CPU: the step message
unpickled, the 256 sampled tokens taken in and the 256 rows' masks filled, each request held to
a JSON schema of its own (bench/structured.py's 20-field schemas) over the default model's
tokenizer. Run in this process through the process's own step function, so that its time is
the process's work alone (the H200's structured bench sees it as `grammar_process_wait_ms`).

    python bench/grammar_process_step.py --out bench/results/grammar_process_step_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm.model_files.model_path import resolve_model_path  # noqa: E402
from asyncllm.sampling_params import StructuredOutputsParams  # noqa: E402
from asyncllm.structured_output.compiler import GrammarCompiler, tokenizer_info  # noqa: E402
from asyncllm.structured_output.grammar_process import Adopt, Step, _HeldGrammars  # noqa: E402
from bench.structured_fill import cpu_description, random_walks, structured_bench  # noqa: E402


def held_requests(
    batch: int, rounds: int, threads: int, tokenizer: Path | None
) -> tuple[_HeldGrammars, list, list]:
    """The process's state with `batch` requests adopted and compiled, each some tokens into
    its walk; their walks and starts. tokenizer: a folder with the default model's tokenizer
    (where its package is not installed: the GPU image), else the default model's."""
    structured = structured_bench()
    folder = tokenizer or resolve_model_path(None)
    from transformers import AutoTokenizer

    eos = [AutoTokenizer.from_pretrained(folder).eos_token_id]
    info = tokenizer_info(folder, structured.VOCAB, eos)
    compiler = GrammarCompiler(lambda: info)
    params = [
        StructuredOutputsParams(json=json.dumps(structured.schema(i, 20))) for i in range(batch)
    ]
    grammars = [compiler.compile(p) for p in params]
    rng = random.Random(1)
    starts = [rng.randint(0, 40) for _ in range(batch)]
    walks = random_walks(grammars, info.vocab_size, [s + rounds + 1 for s in starts], 0)
    held = _HeldGrammars(xgr.allocate_token_bitmask(batch, info.vocab_size), compiler, threads)
    adopt = [Adopt(str(i), params[i], None, [1], walks[i][: starts[i]]) for i in range(batch)]
    held.step(Step(adopt=adopt))
    while any(h.state is None for h in held._held.values()):
        time.sleep(0.01)
        held.step(Step())
    return held, walks, starts


def time_steps(held: _HeldGrammars, walks: list, starts: list, rounds: int) -> dict:
    """Thread CPU and wall ms of each step, from its pickled message to its masks."""
    cpu, wall = [], []
    for r in range(rounds):
        step = Step(
            accepts=[
                (str(i), [walk[start + r]]) for i, (walk, start) in enumerate(zip(walks, starts))
            ],
            rows=[(str(i), i, ()) for i in range(len(walks))],
        )
        message = pickle.dumps(step)
        begin_cpu, begin_wall = time.thread_time(), time.perf_counter()
        held.step(pickle.loads(message))
        cpu.append((time.thread_time() - begin_cpu) * 1e3)
        wall.append((time.perf_counter() - begin_wall) * 1e3)
    return {
        "thread_cpu_ms_min": min(cpu),
        "thread_cpu_ms_median": statistics.median(cpu),
        "wall_ms_min": min(wall),
        "wall_ms_median": statistics.median(wall),
        "message_bytes": len(message),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40, help="steps timed")
    parser.add_argument(
        "--threads", type=int, default=2, help="the fill's threads (the H200 host's)"
    )
    parser.add_argument("--tokenizer", type=Path, default=None, help="the tokenizer's folder")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    held, walks, starts = held_requests(args.batch, args.rounds, args.threads, args.tokenizer)
    result = {
        "benchmark": "grammar_process_step",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "cpu": cpu_description(),
        "versions": {
            "torch": torch.__version__,
            "xgrammar": importlib.metadata.version("xgrammar"),
        },
        "note": args.note,
        "batch": args.batch,
        "fill_threads": args.threads,
        **time_steps(held, walks, starts, args.rounds),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
