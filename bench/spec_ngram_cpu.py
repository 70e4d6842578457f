"""n-gram speculation on CPU against none, in the same run: the default model (SmolLM2-135M
Instruct), greedy, on a workload whose answers copy from their prompts (editing, extraction,
summaries that quote). Batch 1 (one request at a time) and batch 8 (all together); output
tokens/s of each, the speedup, the mean acceptance length (tokens a verify step gives a
request), the engine steps and a step's time (a verify step's over a decode step's: the
speedup is the acceptance length over that ratio), and whether the tokens are the same with
and without speculation. Each run's process CPU time too, and the speedup in it: on a machine
others load, wall-clock time counts their use of the cores (run with OMP_NUM_THREADS=1 there).
The two engines run in --rounds interleaved pairs per batch size (none, n-gram, none, ...): this
VM's speed drifts by 15-20% within minutes, so one pair of runs can say 1.8x or 2.1x of the same
code; the speedup reported is the median over the rounds' pairs, with each round's.

    python bench/spec_ngram_cpu.py --out bench/results/spec_ngram_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams  # noqa: E402
from bench.spec_decode import count_steps  # noqa: E402
from bench.throughput import cpu_description  # noqa: E402

PARAGRAPH = (
    "The commitee met on tuesday to discus the new budjet. Members agreed that the library "
    "should recieve more funding, and that the park renovations would be postponed untill "
    "next spring. The treasurer noted that revenue from parking fees had increased by twelve "
    "percent, which was more then expected."
)
EMAIL = (
    "From: Dana Smith <dana.smith@example.com>\nTo: Lee Wong <lee.wong@example.org>\n"
    "Subject: Order 48213 delayed\nDate: 3 March 2025\n\nHi Lee, your order 48213 of two "
    "standing desks will ship on 10 March 2025 from our Leeds warehouse. Call 0113 496 0000 "
    "with questions. Regards, Dana"
)
CODE = (
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
    "        total = total + item.price * item.quantity\n    return total * (1 + tax_rate)\n"
)
TASKS = [
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{PARAGRAPH}",
    f"Extract the sender, the recipient, the order number and the ship date from this email, "
    f"one per line as 'field: value':\n\n{EMAIL}",
    f"Summarize this text in two sentences, quoting its key phrases exactly:\n\n{PARAGRAPH}",
    f"Rename the variable `total` to `subtotal` in this code and return the whole code:\n\n{CODE}",
    f"Copy this email, replacing the ship date with 12 March 2025:\n\n{EMAIL}",
    f"Add a docstring to this function and return the whole function:\n\n{CODE}",
    f"Rewrite this text in British spelling, changing nothing else:\n\n{PARAGRAPH}",
    f"Quote the sentence of this email that gives the phone number, then the number:\n\n{EMAIL}",
]


def run(llm: LLM, batch: int, params: SamplingParams) -> tuple[float, float, int, list[list[int]]]:
    """Seconds, process CPU seconds, engine steps, and each task's tokens."""
    conversations = [[{"role": "user", "content": task}] for task in TASKS]
    steps = count_steps(llm)
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = []
    for i in range(0, len(conversations), batch):
        outputs += llm.chat(conversations[i : i + batch], params, use_tqdm=False)
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    return seconds, cpu_s, len(steps), [list(o.outputs[0].token_ids) for o in outputs]


def compare(plain: LLM, spec: LLM, batch: int, params: SamplingParams, rounds: int) -> dict:
    """`rounds` pairs of runs (none, then n-gram) over the tasks at `batch`; the speedups are the
    medians of the pairs' ratios, the rates those of the runs."""
    stats = spec.core_client.core.spec_decoding_stats
    before = stats.snapshot()
    pairs = [(run(plain, batch, params), run(spec, batch, params)) for _ in range(rounds)]
    (_, _, base_steps, base_tokens), (_, _, spec_steps, spec_tokens) = pairs[0]
    num_drafts = stats.num_drafts - before.num_drafts
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    draft_tokens = stats.num_draft_tokens - before.num_draft_tokens
    tokens = sum(len(t) for t in base_tokens)
    base_s = statistics.median(base[0] for base, _ in pairs)
    spec_s = statistics.median(sped[0] for _, sped in pairs)
    speedups = [base[0] / sped[0] for base, sped in pairs]
    return {
        "output_tokens": tokens,
        "no_speculation_tokens_per_s": tokens / base_s,
        "ngram_tokens_per_s": sum(len(t) for t in spec_tokens) / spec_s,
        "speedup": statistics.median(speedups),
        "round_speedups": [round(x, 3) for x in speedups],
        "cpu_s": {"no_speculation": [base[1] for base, _ in pairs],
                  "ngram": [sped[1] for _, sped in pairs]},
        "speedup_in_cpu_time": statistics.median(base[1] / sped[1] for base, sped in pairs),
        "mean_acceptance_length": 1 + accepted / max(num_drafts, 1),
        "draft_acceptance_rate": accepted / max(draft_tokens, 1),
        "engine_steps": {"no_speculation": base_steps, "ngram": spec_steps},
        # prompt steps included in both, as few in each
        "step_ms_over_no_speculation": (spec_s / spec_steps) / (base_s / base_steps),
        "same_tokens_as_without": all(
            sped[3] == base_tokens and base[3] == base_tokens for base, sped in pairs
        ),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved pairs per batch size")
    parser.add_argument("--note", default="", help="recorded with the result (the machine's load)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    speculative = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    # two engines side by side: a KV cache of 512 MiB each holds batch 8 at full length
    engine = dict(max_model_len=1024, kv_cache_memory=512 << 20)
    plain = LLM(**engine)
    spec = LLM(**engine, speculative_config=speculative)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (plain, spec):  # warm-up
        llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # fmt: skip
    runs = {}
    for batch in args.batch_sizes:
        runs[str(batch)] = compare(plain, spec, batch, params, args.rounds)
        r = runs[str(batch)]
        print(
            f"batch {batch}: {r['no_speculation_tokens_per_s']:.1f} -> "
            f"{r['ngram_tokens_per_s']:.1f} tok/s (median of {args.rounds} rounds "
            f"{r['speedup']:.2f}x, rounds {r['round_speedups']}; CPU time "
            f"{r['speedup_in_cpu_time']:.2f}x), acceptance length "
            f"{r['mean_acceptance_length']:.2f}, same tokens: {r['same_tokens_as_without']}"
        )
    result = {
        "benchmark": "spec_ngram_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": f"cpu ({platform.machine()})",
        "cpu": cpu_description(),
        "cpu_threads": torch.get_num_threads(),
        "load_average_at_end": os.getloadavg(),
        "note": args.note,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "model": "SmolLM2-135M-Instruct (default)",
        "speculative_config": speculative,
        "max_tokens": args.max_tokens,
        "num_tasks": len(TASKS),
        "rounds": args.rounds,
        "runs": runs,
    }  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
