"""The engine's cost of speculation alone (H200, a model shape with dummy weights).

A benchmark proposer replays the target's own greedy tokens, each draft position kept with
probability --acceptance and otherwise replaced by a token the target does not pick. So that
the target's greedy tokens are known whatever the dummy weights and the bf16 rounding of each
step's shape (random weights leave top logits so close that a verify step's rounding would
flip some), every request carries a logit bias that makes one token its greedy choice; the
engine without speculation runs the same requests. Against that engine in the same run: output
tokens/s at batch 1 and batch 32 (and with speculation not run ahead: each verify step waits for
the one before on the host), the mean tokens a verify step gives each request, the verify
step's time over a plain decode step's (engine steps counted at the executor) beside their
floors (a decode step reads the weights once; a verify step too, and computes
1 + num_speculative_tokens tokens a request), and the verify graphs replayed, by size.

    python bench/spec_decode.py --shape llama-3.1-8b --out bench/results/spec_decode_h200.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.models.shapes import SHAPES, write_shape  # noqa: E402
from asyncllm.spec_decode.draft_step import DraftBatch  # noqa: E402
from asyncllm.worker.step_plan import StepRunner  # noqa: E402
from bench.throughput import copy_bandwidth, matmul_rate, weight_count  # noqa: E402

GREEDY_TOKEN = 1234  # every request's greedy choice, by its logit bias


class ReplayProposer:
    """Drafts the target's greedy token at every position, each kept with probability
    `acceptance` (else the next id, which the target does not choose). It drafts on the
    device, as a proposer next to the model, so speculating steps run ahead of each other."""

    drafts_on_device = True
    reads_hidden = False
    aux_layers: tuple[int, ...] = ()

    def __init__(self, k: int, acceptance: float, seed: int, device: torch.device) -> None:
        self.k = k
        self.acceptance = acceptance
        self.generator = torch.Generator(device).manual_seed(seed)

    def propose(self, batch: DraftBatch) -> torch.Tensor:
        shape, device = (len(batch.next_token_ids), self.k), batch.next_token_ids.device
        draws = torch.rand(shape, generator=self.generator, device=device)
        return GREEDY_TOKEN + (draws >= self.acceptance).long()


def install_device_proposer(llm: LLM, proposer) -> None:
    """proposer (drafts_on_device, propose(DraftBatch) -> [R, k]) in place of the engine's
    own; a speculating engine of method ngram drafts on the device."""
    llm.core_client.core.executor.model_runner.drafter = proposer


def install_replay_proposer(llm: LLM, k: int, acceptance: float, seed: int) -> None:
    device = llm.core_client.core.executor.model_runner.device
    install_device_proposer(llm, ReplayProposer(k, acceptance, seed, device))


def count_steps(llm: LLM) -> list[int]:
    """Scheduled tokens of each step the engine launches from now on."""
    executor = llm.core_client.core.executor
    launch = executor.execute_model
    steps: list[int] = []

    def counted(scheduler_output):
        steps.append(scheduler_output.total_num_scheduled_tokens)
        return launch(scheduler_output)

    executor.execute_model = counted
    return steps


def count_rows_ahead(llm: LLM) -> collections.Counter:
    """Rows the engine launches from now on, and those scheduled ahead of their request's
    step in flight (speculating: their drafts on the device)."""
    executor = llm.core_client.core.executor
    launch, counts = executor.execute_model, collections.Counter()

    def counted(scheduler_output):
        counts["rows"] += len(scheduler_output.scheduled)
        counts["ahead"] += sum(s.drafts_on_device for s in scheduler_output.scheduled)
        return launch(scheduler_output)

    executor.execute_model = counted
    return counts


def count_graph_replays(llm: LLM, runner: StepRunner) -> collections.Counter:
    """Token count -> replays of the runner's graphs from now on (empty where it has none)."""
    replays: collections.Counter = collections.Counter()
    graphs = llm.core_client.core.executor.model_runner.graphs.get(runner)
    if graphs is not None:
        run = graphs.run
        graphs.run = lambda size, meta: replays.update([size]) or run(size, meta)
    return replays


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logit_bias={GREEDY_TOKEN: 100.0}
    )


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    """The prompts go in first, so the timed part is decode only, and a few steps of the same
    kind run before it (the first verify steps compile and load their kernels)."""
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(32), use_tqdm=False)


def timed_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list]:
    params = greedy(max_tokens)
    steps = count_steps(llm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # the prefix cache holds each prompt but its last token: one short step takes them in
    decode_steps = len(steps) - 1
    result = {
        "seconds": seconds,
        "output_tokens_per_s": tokens / seconds,
        "engine_steps": len(steps),
        "ms_per_decode_step": 1e3 * seconds / max(decode_steps, 1),
        "tokens_per_step_per_request": tokens / max(decode_steps, 1) / len(prompts),
    }
    return result, [list(o.outputs[0].token_ids) for o in outputs]


def serial_run(spec: LLM, prompts: list[list[int]], args, seed: int) -> dict:
    """The same speculating run with no step scheduled ahead of its request's step in flight
    (each verify step's host work exposed), for the difference run-ahead makes."""
    config = spec.core_client.core.scheduler.config
    install_replay_proposer(spec, args.num_speculative_tokens, args.acceptance, seed)
    config.drafts_on_device = False
    try:
        result, _ = timed_run(spec, prompts, args.max_tokens)
    finally:
        config.drafts_on_device = True
    return result


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[i, *(rng.randrange(vocab) for _ in range(length - 1))] for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile", type=Path, default=None,
        help="write torch.profiler tables of a speculating run at the first batch size here",
    )  # fmt: skip
    args = parser.parse_args()

    path = write_shape(args.shape, Path(tempfile.mkdtemp(prefix=f"{args.shape}-")))
    config = transformers.AutoConfig.from_pretrained(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = args.num_speculative_tokens
    engine = dict(
        model=str(path),
        load_format="dummy",
        max_model_len=args.prompt_len + args.max_tokens + k + 8,
        max_num_seqs=max(args.batch_sizes),
        num_kv_blocks=args.num_kv_blocks,
        enforce_eager=args.enforce_eager,
    )
    plain = LLM(**engine)
    spec = LLM(**engine, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    dtype_bytes = 2 if device.type == "cuda" else 4
    rates = {
        "matmul_flops_per_s": matmul_rate(
            device, torch.bfloat16 if dtype_bytes == 2 else torch.float32
        )
    }
    if device.type == "cuda":
        rates["copy_bytes_per_s"] = copy_bandwidth(device)
    weights = weight_count(config)

    runs = {}
    result = {
        "benchmark": "spec_decode",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.machine()})",
        "versions": {"torch": torch.__version__, "triton": triton_version(),
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "shape": args.shape,
        "acceptance": args.acceptance,
        "num_speculative_tokens": k,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rates": rates,
        "runs": runs,
    }  # fmt: skip
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, config.vocab_size, seed=batch)
        warm_up(plain, prompts)
        base, references = timed_run(plain, prompts, args.max_tokens)
        install_replay_proposer(spec, k, args.acceptance, seed=batch)
        warm_up(spec, prompts)
        stats = spec.core_client.core.spec_decoding_stats
        before = stats.snapshot()
        replays = count_graph_replays(spec, StepRunner.VERIFY_GRAPH)
        ahead = count_rows_ahead(spec)
        drafted, spec_outputs = timed_run(spec, prompts, args.max_tokens)
        drafted["rows_scheduled_ahead"] = ahead["ahead"] / max(ahead["rows"], 1)
        # token count -> verify steps that replayed a verify graph of that size
        drafted["verify_graph_replays"] = {str(k): v for k, v in sorted(replays.items())}
        num_drafts = stats.num_drafts - before.num_drafts
        accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        drafted["mean_acceptance_length"] = 1 + accepted / max(num_drafts, 1)
        drafted["same_tokens_as_without"] = spec_outputs == references
        floors = {"decode_step_ms_weights_once": 1e3 * weights * dtype_bytes / rates["copy_bytes_per_s"]} if "copy_bytes_per_s" in rates else {}  # fmt: skip
        floors["verify_step_ms_flops"] = (
            1e3 * 2 * weights * batch * (k + 1) / rates["matmul_flops_per_s"]
        )
        floors["decode_step_ms_flops"] = 1e3 * 2 * weights * batch / rates["matmul_flops_per_s"]
        serial = serial_run(spec, prompts, args, seed=batch)
        runs[str(batch)] = {
            "no_speculation": base,
            "speculation": drafted,
            "speedup": drafted["output_tokens_per_s"] / base["output_tokens_per_s"],
            "verify_step_over_decode_step": drafted["ms_per_decode_step"] / base["ms_per_decode_step"],
            "speculation_not_run_ahead": serial,
            "speedup_not_run_ahead": serial["output_tokens_per_s"] / base["output_tokens_per_s"],
            "floors": floors,
        }  # fmt: skip
        print(
            f"batch {batch}: {base['output_tokens_per_s']:.1f} -> "
            f"{drafted['output_tokens_per_s']:.1f} tok/s ({runs[str(batch)]['speedup']:.2f}x), "
            f"acceptance length {drafted['mean_acceptance_length']:.2f}, step "
            f"{base['ms_per_decode_step']:.2f} -> {drafted['ms_per_decode_step']:.2f} ms, "
            f"same tokens: {drafted['same_tokens_as_without']}; not run ahead "
            f"{serial['output_tokens_per_s']:.1f} tok/s, step {serial['ms_per_decode_step']:.2f} ms"
        )
        if args.out:  # after each batch size: a run cut short keeps the ones done
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        if args.profile and batch == args.batch_sizes[0]:  # a run of its own, not the timed one
            with torch.profiler.profile() as profiler:
                timed_run(spec, prompts, args.max_tokens)
            averages = profiler.key_averages()
            args.profile.write_text("\n\n".join(
                averages.table(sort_by=key, row_limit=30)
                for key in ("self_cuda_time_total", "self_cpu_time_total")
            ))  # fmt: skip


if __name__ == "__main__":
    main()
