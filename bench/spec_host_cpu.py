"""The host work of a verify step against a plain decode step, on CPU, with a model so small
(2 layers, 64 wide, a 2,048-token vocabulary) that nearly all of a step is the engine's Python.

The speculating engine drafts with bench/spec_decode.py's replay proposer (the target's greedy
token kept with probability --acceptance). Each engine runs the same requests twice, the
first as warm-up; cProfile covers the second. Per engine step: the thread CPU time of the
step loop (min of --rounds interleaved rounds), and the cumulative time of the parts a step is
made of (the profile's, so with its overhead; they say where the time goes, not its size).

    python bench/spec_host_cpu.py --out bench/results/spec_host_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM  # noqa: E402
from bench.soak import machine  # noqa: E402
from bench.spec_decode import greedy, install_replay_proposer, make_prompts  # noqa: E402

# (label, file suffix, function name): the parts of an engine step, outermost first
PARTS = [
    ("engine step", "engine/core.py", "step"),
    ("schedule", "core/scheduler.py", "schedule"),
    ("runner launch (all of it)", "worker/model_runner.py", "_launch"),
    ("  input batch prepare", "worker/input_batch.py", "prepare"),
    ("  step plan", "worker/step_plan.py", "plan"),
    ("  model forward", "worker/model_runner.py", "_forward"),
    ("  sampling metadata", "worker/model_runner.py", "_sampling_metadata"),
    ("  sampler (plain step)", "sample/sampler.py", "__call__"),
    ("  verify_drafts", "spec_decode/verify.py", "verify_drafts"),
    ("    draft layout tensors", "spec_decode/verify.py", "of"),
    ("    repeat_metadata", "spec_decode/verify.py", "repeat_metadata"),
    ("  draft proposer (host lists)", "worker/model_runner.py", "_draft"),
    ("  draft batch (device drafts)", "worker/model_runner.py", "_draft_batch"),
    ("  replay proposer", "bench/spec_decode.py", "propose"),
    ("  record_sampled", "sample/state.py", "record_sampled"),
    ("output to host lists (wait)", "worker/model_runner.py", "wait"),
    ("  verification results", "spec_decode/verify.py", "results"),
    ("update (core)", "engine/core.py", "_update"),
    ("  scheduler update_from_output", "core/scheduler.py", "update_from_output"),
]


def tiny_model(folder: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    return folder


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int, list]:
    """(thread CPU seconds, engine steps, outputs) of one generate call."""
    params = greedy(max_tokens)
    core = llm.core_client.core
    step, steps = core.step, [0]

    def counted():
        steps[0] += 1
        return step()

    core.step = counted
    start = time.thread_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.thread_time() - start
    core.step = step
    return seconds, steps[0], [list(o.outputs[0].token_ids) for o in outputs]


def profile_parts(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Cumulative ms per engine step of each of PARTS (0 where a part did not run)."""
    profiler = cProfile.Profile()
    profiler.enable()
    _, steps, _ = run(llm, prompts, max_tokens)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    parts = {}
    for label, suffix, name in PARTS:
        cumulative = sum(
            entry[3]
            for (path, _, func), entry in stats.items()
            if path.endswith(suffix) and func == name
        )
        parts[label] = round(1e3 * cumulative / steps, 3)
    return parts


def torch_ops_per_step(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Torch ops an engine step runs outside the model's forward pass (each a kernel launch
    or more on a GPU, where the forward pass is one graph)."""
    runner = llm.core_client.core.executor.model_runner
    forward = runner._forward

    def marked(*args):
        with torch.profiler.record_function("forward"):
            return forward(*args)

    runner._forward = marked
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        _, steps, _ = run(llm, prompts, max_tokens)
    del runner._forward
    events = profiler.events()
    top = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
    return round(len(top) / steps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    path = tiny_model(Path(tempfile.mkdtemp(prefix="spec-host-")))
    k = args.num_speculative_tokens
    engine = dict(
        model=str(path),
        load_format="dummy",
        max_model_len=args.prompt_len + args.max_tokens + k + 8,
        max_num_seqs=max(args.batch_sizes),
        async_scheduling=args.async_scheduling,
    )
    plain = LLM(**engine)
    spec = LLM(**engine, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    runs = {}
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.prompt_len, 2048, seed=batch)
        install_replay_proposer(spec, k, args.acceptance, seed=batch)
        best = {"plain": float("inf"), "spec": float("inf")}
        steps, same = {}, True
        run(plain, prompts, args.max_tokens), run(spec, prompts, args.max_tokens)  # warm-up
        for _ in range(args.rounds):
            for name, llm in (("plain", plain), ("spec", spec)):
                seconds, steps[name], outputs = run(llm, prompts, args.max_tokens)
                best[name] = min(best[name], seconds)
                if name == "plain":
                    reference = outputs
                else:
                    same = same and outputs == reference
        per_step = {name: 1e3 * best[name] / steps[name] for name in best}
        runs[str(batch)] = {
            "engine_steps": steps,
            "thread_cpu_ms_per_step": {n: round(v, 3) for n, v in per_step.items()},
            "verify_over_decode_step": round(per_step["spec"] / per_step["plain"], 3),
            "same_tokens": same,
            "torch_ops_per_step": {
                "plain": torch_ops_per_step(plain, prompts, args.max_tokens),
                "spec": torch_ops_per_step(spec, prompts, args.max_tokens),
            },
            "profiled_ms_per_step": {
                "plain": profile_parts(plain, prompts, args.max_tokens),
                "spec": profile_parts(spec, prompts, args.max_tokens),
            },
        }
        print(f"batch {batch}: " + json.dumps(runs[str(batch)], indent=1))
    result = {
        "benchmark": "spec_host_cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": machine(),
        "timing": f"thread CPU time, min of {args.rounds} interleaved rounds, 1 torch thread",
        "acceptance": args.acceptance,
        "num_speculative_tokens": k,
        "async_scheduling": args.async_scheduling,
        "runs": runs,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
