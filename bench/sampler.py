"""Sampler micro-benchmark: one sampling step for a batch of B x V logits (default 256 x 151,936,
Qwen3's vocabulary), greedy against every processor on, metadata build and sampling timed apart.

    python bench/sampler.py --device cpu --out bench/results/sampler_cpu.json
    python bench/sampler.py --device cuda --decode-step --out $OUT/sampler_h200.json

The sampler is the one a SamplingState picks for the device (on CUDA the fused Triton path;
--torch-sampler forces the torch one). build_ms is SamplingState.metadata; sample_ms the sampler,
record_sampled and the ids' copy to the host. Every step but in scenarios ending in
"_batch_changes" keeps the batch, so the metadata comes from the state's cache; there the batch
order rotates each step, as when requests come and go, and the metadata is rebuilt.
--decode-step also times whole engine decode steps of a dummy-weight Qwen3-0.6B at the same
batch (greedy, and with every processor on) and the sampler's share of them.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow the
# top-level kernels package that asyncllm imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from asyncllm.request import Request  # noqa: E402
from asyncllm.sample.sampler import Sampler  # noqa: E402
from asyncllm.sample.state import SamplingState  # noqa: E402
from asyncllm.sampling_params import SamplingParams  # noqa: E402

EOS = 151645


def scenarios(vocab: int) -> dict[str, list[SamplingParams]]:
    """name -> the params of a batch's rows, cycled over the batch."""
    rng = random.Random(0)
    everything = dict(
        temperature=0.8,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.5,
        logit_bias={rng.randrange(vocab): 2.0 for _ in range(10)},
        max_tokens=None,
        min_tokens=300,  # still active: outputs hold 256 tokens
        bad_words=["x"],
        logprobs=5,
    )
    return {
        "greedy": [SamplingParams(temperature=0)],
        "temperature": [SamplingParams(temperature=0.8)],
        "top_k": [SamplingParams(temperature=0.8, top_k=50)],
        "top_p": [SamplingParams(temperature=0.8, top_p=0.9)],
        # the same on flat logits: top-p mass spreads past the candidates, so a full sort runs
        "top_p_flat_logits": [SamplingParams(temperature=0.8, top_p=0.9)],
        "min_p": [SamplingParams(temperature=0.8, min_p=0.05)],
        "penalties": [
            SamplingParams(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)
        ],
        "logprobs_20": [SamplingParams(temperature=0.8, logprobs=20)],
        # half the rows seeded: their draws depend only on their seed and tokens so far
        "all": [SamplingParams(**everything, seed=1), SamplingParams(**everything)],
        "mixed_greedy_and_all": [SamplingParams(temperature=0), SamplingParams(**everything)],
        "all_batch_changes": [SamplingParams(**everything, seed=1), SamplingParams(**everything)],
    }


def make_logits(batch: int, vocab: int, flat: bool, device: torch.device) -> torch.Tensor:
    """LM-like logits: Zipf-shaped (p ~ rank^-1.2) over a random order of the vocabulary per
    row; or flat ones, N(0, 1), a worst case for top-p."""
    generator = torch.Generator().manual_seed(0)
    if flat:
        return torch.randn(batch, vocab, generator=generator).to(device)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -1.2 * ranks.log()
    order = torch.rand(batch, vocab, generator=generator).argsort(dim=-1)
    return logits[order].to(device)


def make_requests(
    params: list[SamplingParams], batch: int, vocab: int, prompt_len: int, output_len: int
) -> list[Request]:
    rng = random.Random(1)
    requests = []
    for i in range(batch):
        p = params[i % len(params)]
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        eos = frozenset({min(EOS, vocab - 1)})  # a small --vocab has no id 151645
        request = Request(str(i), prompt, p, eos_token_ids=eos, max_tokens=10**6)
        request.bad_words_token_ids = (
            [[rng.randrange(vocab), rng.randrange(vocab)]] if p.bad_words else []
        )
        for _ in range(output_len):
            request.append_output_token(rng.randrange(vocab))
        requests.append(request)
    return requests


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_sampler(
    requests: list[Request],
    logits: torch.Tensor,
    steps: int,
    warmup: int,
    fused: bool | None,
    rotate: bool,
) -> dict[str, float]:
    """Median ms of building the metadata, and of sampling with the results on the host.
    Every step appends its sampled tokens to the requests, as decoding does; rotate: the
    batch's order shifts by one every step."""
    device = logits.device
    sampler = Sampler()
    state = SamplingState(device, vocab_size=logits.shape[1], fused=fused)
    work = torch.empty_like(logits)
    build_ms, sample_ms = [], []
    for step in range(warmup + steps):
        shift = step % len(requests) if rotate else 0
        batch = requests[shift:] + requests[:shift]
        work.copy_(logits)
        sync(device)
        start = time.perf_counter()
        meta = state.metadata(batch)
        sync(device)
        built = time.perf_counter()
        sampled = sampler(work, meta)
        state.record_sampled(meta, sampled.sampled_token_ids)
        token_ids, _ = sampled.to_host(meta)
        done = time.perf_counter()
        for request, token_id in zip(batch, token_ids):
            request.append_output_token(token_id)
        if step >= warmup:
            build_ms.append((built - start) * 1e3)
            sample_ms.append((done - built) * 1e3)
    return {
        "build_ms": statistics.median(build_ms),
        "sample_ms": statistics.median(sample_ms),
        "total_ms": statistics.median(b + s for b, s in zip(build_ms, sample_ms)),
    }


def qwen3_0_6b_folder() -> Path:
    """A config-only Qwen3-0.6B folder (its published shape) for dummy weights."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1_000_000,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        eos_token_id=EOS,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    path = Path(tempfile.mkdtemp(prefix="qwen3-0.6b-dummy-"))
    config.save_pretrained(path)
    return path


def time_decode_steps(
    params: list[SamplingParams], batch: int, prompt_len: int, steps: int, device: str
) -> dict[str, float]:
    """Median ms of an engine step once every request decodes, and of the sampler inside it."""

    from asyncllm import LLM

    max_model_len = prompt_len + 4 * steps
    llm = LLM(
        model=str(qwen3_0_6b_folder()),
        load_format="dummy",
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        # room for the whole batch, and no more: the next scenario builds its own engine
        num_kv_blocks=batch * (max_model_len // 16 + 2),
    )
    core = llm.core_client.core
    runner = core.executor.model_runner
    sampler_ms: list[float] = []
    real_sampler = runner.sampler
    device_of_runner = runner.device

    def timed_sampler(logits, meta):
        sync(device_of_runner)
        start = time.perf_counter()
        out = real_sampler(logits, meta)
        out.sampled_token_ids.tolist()
        sampler_ms.append((time.perf_counter() - start) * 1e3)
        return out

    runner.sampler = timed_sampler
    rng = random.Random(2)
    for i in range(batch):
        p = params[i % len(params)]
        # min_tokens stays active throughout: eos and stop ids are masked every step
        overrides = {"max_tokens": 3 * steps, "min_tokens": min(p.min_tokens, 3 * steps)}
        p = SamplingParams(**{**p.__dict__, **overrides, "ignore_eos": True, "bad_words": None})
        prompt = [rng.randrange(100, 150000) for _ in range(prompt_len)]
        request, _ = llm.input_processor.process(str(i), {"prompt_token_ids": prompt}, p)
        llm.add_request(request, None)
    step_ms, sampler_in_step_ms = [], []
    has_work = True
    while has_work and len(step_ms) < steps:
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in core.scheduler.running)
        decoding = decoding and core.scheduler.num_running == batch
        sampler_ms.clear()
        sync(runner.device)
        start = time.perf_counter()
        step = llm.core_client.get_output()
        has_work = step.has_work
        llm.process_step(step)
        sync(runner.device)
        if decoding:
            step_ms.append((time.perf_counter() - start) * 1e3)
            sampler_in_step_ms.append(sum(sampler_ms))
    warm = len(step_ms) // 4  # the first steps warm up
    result = {
        "step_ms": statistics.median(step_ms[warm:]),
        "sampler_in_step_ms": statistics.median(sampler_in_step_ms[warm:]),
    }
    runner.sampler = real_sampler
    llm.core_client.shutdown()
    del llm, core, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--decode-step", action="store_true")
    parser.add_argument("--decode-steps", type=int, default=40, help="decode steps to time")
    parser.add_argument("--torch-sampler", action="store_true", help="no fused path on CUDA")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    fused = False if args.torch_sampler else None
    steps = args.steps or (30 if device.type == "cuda" else 5)
    torch.manual_seed(0)
    lm_like = make_logits(args.batch, args.vocab, False, device)
    flat = make_logits(args.batch, args.vocab, True, device)
    results = {}
    for name, params in scenarios(args.vocab).items():
        logits = flat if name.endswith("flat_logits") else lm_like
        requests = make_requests(params, args.batch, args.vocab, args.prompt_len, args.output_len)
        rotate = name.endswith("_batch_changes")
        results[name] = time_sampler(requests, logits, steps, 2, fused, rotate)
        print(
            f"{name:>22}: {json.dumps({k: round(v, 3) for k, v in results[name].items()})}",
            flush=True,
        )
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        # the machine may be shared: the 1-minute load average when the run ended
        "load_average_1m": os.getloadavg()[0],
        "torch": torch.__version__,
        "batch": args.batch,
        "vocab": args.vocab,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "steps": steps,
        "sampler_path": "fused" if SamplingState(device, 1, fused).fused else "torch",
        "logits": "Zipf-shaped, p ~ rank^-1.2 (flat N(0, 1) where the scenario says flat_logits)",
        "sampler": results,
    }
    if args.decode_step:
        decode = {}
        for name in ("greedy", "all"):
            decode[name] = time_decode_steps(
                scenarios(args.vocab)[name], args.batch, 128, 40, args.device
            )
            print(f"decode step {name}: {decode[name]}", flush=True)
        # the sampler with every processor on, against a greedy decode step of the whole model
        decode["sampler_share_all"] = results["all"]["total_ms"] / decode["greedy"]["step_ms"]
        decode["all_minus_greedy_step_ms"] = decode["all"]["step_ms"] - decode["greedy"]["step_ms"]
        report["qwen3_0_6b_decode"] = decode
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
