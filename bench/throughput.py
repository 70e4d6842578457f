"""Offline throughput: asyncllm against Hugging Face transformers, measured in the same run.

Workload: N requests whose prompt and output lengths are each uniform in [min_len, max_len]
(seed 0), random token ids, ignore_eos. The peer is HF `generate` as its users run it: static
batches, left-padded, each batch run to its longest output, only requested tokens counted.
Also prints the compute floor: model FLOPs of all tokens over a matmul rate measured now.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
import transformers

from asyncllm import LLM, SamplingParams
from asyncllm.models.model_path import resolve_model_path


def make_workload(
    n: int, min_len: int, max_len: int, vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    lengths = [(rng.randint(min_len, max_len), rng.randint(min_len, max_len)) for _ in range(n)]
    # ids from the ordinary vocabulary range, avoiding the special tokens at the start
    return [([rng.randint(100, vocab - 1) for _ in range(p)], o) for p, o in lengths]


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul, best of several runs."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - start) / 10)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def workload_flops(
    config: transformers.PretrainedConfig, workload: list[tuple[list[int], int]]
) -> float:
    """2 FLOPs per weight per token (embedding lookups excluded, lm_head included) + attention."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * config.intermediate_size
    weights = layers * per_layer + h * config.vocab_size
    total = 0.0
    for prompt, out in workload:
        tokens = len(prompt) + out
        # each token attends to all before it: QK^T and PV, 4 * head_dim FLOPs per head per pair
        attention = layers * 4 * heads * head_dim * tokens * (tokens + 1) / 2
        total += 2 * weights * tokens + attention
    return total


def run_asyncllm(model: str | None, workload, args) -> tuple[float, int]:
    llm = LLM(
        model=model,
        load_format=args.load_format,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
    )
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, ignore_eos=True)] * 2, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(o for _, o in workload), "asyncllm did not produce every requested token"
    return elapsed, produced


@torch.inference_mode()
def run_hf(
    path: Path, workload, batch_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[float, int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device
        )
        longest = max(o for _, o in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=0,
        )
    _sync(device)
    return time.perf_counter() - start, sum(o for _, o in workload)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2-135M)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    config = transformers.AutoConfig.from_pretrained(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    workload = make_workload(
        args.num_requests, args.min_len, args.max_len, config.vocab_size, args.seed
    )

    rate = matmul_rate(device, dtype)
    flops = workload_flops(config, workload)
    output_tokens = sum(o for _, o in workload)
    floor = output_tokens / (flops / rate)
    print(
        f"matmul rate {rate / 1e9:.1f} GFLOP/s; workload {flops / 1e12:.2f} TFLOP; "
        f"compute floor {floor:.1f} output tokens/s"
    )

    elapsed, produced = run_asyncllm(args.model, workload, args)
    ours = produced / elapsed
    print(
        f"asyncllm: {produced} tokens in {elapsed:.1f} s = {ours:.1f} output tokens/s "
        f"({ours / floor:.0%} of the compute floor)"
    )
    result = {
        "benchmark": "throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "model": str(path),
        "workload": {
            "num_requests": args.num_requests,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "seed": args.seed,
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": output_tokens,
        },
        "matmul_flops_per_s": rate,
        "workload_flops": flops,
        "floor_output_tokens_per_s": floor,
        "asyncllm": {"seconds": elapsed, "output_tokens_per_s": ours},
    }
    if not args.no_peer:
        hf_elapsed, hf_tokens = run_hf(path, workload, args.hf_batch_size, dtype, device)
        hf = hf_tokens / hf_elapsed
        print(
            f"HF transformers generate (static batches of {args.hf_batch_size}): "
            f"{hf:.1f} output tokens/s; asyncllm / HF = {ours / hf:.2f}x"
        )
        result["hf_generate"] = {
            "seconds": hf_elapsed,
            "output_tokens_per_s": hf,
            "batch_size": args.hf_batch_size,
        }
        result["speedup_vs_hf"] = ours / hf
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
