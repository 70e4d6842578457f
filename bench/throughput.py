"""Offline throughput: asyncllm against Hugging Face transformers, measured in the same run.

Workload: N requests whose prompt lengths are uniform in [min_len, max_len] and output lengths
in [min_output_len, max_output_len] (the same range unless given; seed 0), random token ids,
ignore_eos. The long-context workload of issue 28: `--num-requests 64 --min-len 8192 --max-len
32768 --min-output-len 128 --max-output-len 512 --max-model-len 40960`. The peer is HF transformers as its users run it: on CPU
`generate` in static batches (left-padded, each batch run to its longest output, only requested
tokens counted); on CUDA continuous batching (`continuous_batching_context_manager`, CUDA graphs).
The floor is the workload's physical limit from rates measured in the same run: on CPU all FLOPs
at the matmul rate (the compute floor; also the roofline floor, each decode step the larger of
its FLOPs at the matmul rate and its weights + live KV at the copy bandwidth); on CUDA prefill
FLOPs at the matmul rate plus, for each decode step, the weights and every live request's KV
read once at the copy bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
import triton

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams
from asyncllm.model_files.model_path import resolve_model_path
from asyncllm.models.shapes import SHAPES, write_shape
from asyncllm.worker.model_runner import LaunchedModelStep

Workload = list[tuple[list[int], int]]


def triton_cache_entries() -> set[str]:
    """The kernels in Triton's disk cache: one folder per compiled kernel variant. On a machine
    whose cache started empty, a new one during a timed run is a compile inside it."""
    knobs = getattr(triton, "knobs", None)
    default = Path.home() / ".triton" / "cache"
    folder = Path(knobs.cache.dir if knobs else os.environ.get("TRITON_CACHE_DIR", default))
    return {entry.name for entry in folder.iterdir()} if folder.is_dir() else set()


def make_workload(
    n: int,
    min_len: int,
    max_len: int,
    vocab: int,
    seed: int,
    output_range: tuple[int, int] | None = None,
) -> Workload:
    """Prompts in [min_len, max_len], outputs in output_range (None: the same range)."""
    rng = random.Random(seed)
    low, high = output_range or (min_len, max_len)
    lengths = [(rng.randint(min_len, max_len), rng.randint(low, high)) for _ in range(n)]
    # ids from the ordinary vocabulary range, avoiding the special tokens at the start
    return [([rng.randint(100, vocab - 1) for _ in range(p)], o) for p, o in lengths]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _best_time(fn, device: torch.device, repeats: int = 5, inner: int = 10) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: a @ b, device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / _best_time(lambda: dst.copy_(src), device)


# the x86 vector extensions that decide oneDNN's and the C++ kernels' code paths
VECTOR_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
    "amx_int8",
    "avx_vnni",
)


def cpu_description() -> dict:
    """The CPU model and its vector extensions from /proc/cpuinfo, and the ISA torch dispatches to:
    the same workload ran at 87% of its floor with AVX-512 and 55% with AVX2 only."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    return {
        "model": model,
        "vector_extensions": [f for f in VECTOR_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _geometry(config: transformers.PretrainedConfig) -> tuple[int, int, int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, kv_heads, head_dim


def weight_count(config: transformers.PretrainedConfig) -> int:
    """Weights touched per token: all layers and the lm_head (embedding lookups excluded)."""
    layers, heads, kv_heads, head_dim = _geometry(config)
    h = config.hidden_size
    per_layer = h * head_dim * (2 * heads + 2 * kv_heads) + 3 * h * config.intermediate_size
    return layers * per_layer + h * config.vocab_size


def token_flops(config: transformers.PretrainedConfig, context: int) -> float:
    """FLOPs of one token attending to `context` earlier tokens: 2 per weight + QK^T and PV."""
    layers, heads, _, head_dim = _geometry(config)
    return 2 * weight_count(config) + layers * 4 * heads * head_dim * context


def prefill_flops(config, workload: Workload) -> float:
    """The sum of token_flops over every prompt position, in closed form: a 32k prompt has
    32k positions, which summed one by one took seconds."""
    layers, heads, _, head_dim = _geometry(config)
    weights, attention = 2 * weight_count(config), layers * 4 * heads * head_dim
    return sum(weights * len(p) + attention * len(p) * (len(p) - 1) // 2 for p, _ in workload)


def decode_contexts(workload: Workload) -> Iterator[list[int]]:
    """The live requests' contexts at each decode step, all requests in lockstep."""
    for step in range(max(o for _, o in workload)):
        yield [len(p) + step for p, o in workload if o > step]


def step_bytes(config, contexts: list[int], dtype_bytes: int) -> float:
    """A decode step's reads: the weights once and every live request's KV once."""
    layers, _, kv_heads, head_dim = _geometry(config)
    kv_per_token = 2 * layers * kv_heads * head_dim
    return (weight_count(config) + kv_per_token * sum(contexts)) * dtype_bytes


def cpu_floor_seconds(config, workload: Workload, matmul: float) -> float:
    flops = sum(token_flops(config, t) for p, o in workload for t in range(len(p) + o))
    return flops / matmul


def cpu_roofline_floor_seconds(config, workload: Workload, matmul: float, copy: float) -> float:
    """Prefill at the matmul rate; each decode step the larger of its FLOPs at the matmul rate
    and its bytes (fp32 weights + live KV) at the copy bandwidth (METHOD.md's floor)."""
    seconds = prefill_flops(config, workload) / matmul
    for live in decode_contexts(workload):
        compute = sum(token_flops(config, t) for t in live) / matmul
        seconds += max(compute, step_bytes(config, live, 4) / copy)
    return seconds


def gpu_floor_seconds(
    config, workload: Workload, matmul: float, copy: float, dtype_bytes: int
) -> float:
    """Prefill at the matmul rate; decode steps in lockstep, each reading weights + live KV."""
    seconds = prefill_flops(config, workload) / matmul
    for live in decode_contexts(workload):
        seconds += step_bytes(config, live, dtype_bytes) / copy
    return seconds


def run_asyncllm(model: str, workload: Workload, args) -> dict:
    llm = LLM(
        model=model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        quantization=args.quantization,
        dtype=args.dtype,
    )
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    # reversed, so that the run finds none of its prompts in the prefix cache (4 of the long
    # context workload's 64 prompts would skip their prefill); at most 1,024 tokens, as the
    # default workload's are
    warmup = [{"prompt_token_ids": p[:1024][::-1]} for p, _ in workload[:4]]
    llm.generate(warmup, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    phases = time_phases(llm) if args.profile_steps else None
    cached = triton_cache_entries()
    cpu_start, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    compiled = len(triton_cache_entries() - cached)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(o for _, o in workload), "asyncllm did not produce every requested token"
    result = {
        "seconds": elapsed,
        "output_tokens_per_s": produced / elapsed,
        "cpu_seconds": cpu_seconds,
        "async_scheduling": llm.config.async_scheduling,
        "triton_kernels_compiled_during_run": compiled,
        "engine": engine_facts(llm),
    }
    if phases is not None:
        result["seconds_by_phase"] = dict(phases)
    if args.single_stream:
        if phases is not None:
            phases.clear()
        result["single_stream"] = single_stream(llm, workload[0][0][:128], 256)
        if phases is not None:
            result["single_stream"]["seconds_by_phase"] = dict(phases)
    if getattr(args, "profile_batch1_steps", 0):  # bench/moe.py's option
        from bench.profile_decode import profile_decode

        result["batch1_profile"] = profile_decode(llm, 1, args.profile_batch1_steps)
    return result


def engine_facts(llm: LLM) -> dict:
    """The limits the run met: how many tokens the KV cache holds (a workload needing more at
    once waits or preempts), the preemptions (each recomputes a prompt) and the step budget."""
    capacity, scheduler = llm.core_client.capacity, llm.config.scheduler
    stats = llm.core_client.core.stats()
    return {
        "kv_cache_tokens": capacity.num_blocks * capacity.block_size,
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        "max_model_len": scheduler.max_model_len,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "long_prefill_token_threshold": scheduler.long_prefill_token_threshold,
    }


def time_phases(llm: LLM, extra: tuple[tuple[object, str], ...] = ()) -> dict[str, float]:
    """Wrap the step's phases in timers: where the time of a run goes. On CUDA the GPU runs
    asynchronously, so its busy time shows up in `wait` (the collector thread waiting for a
    step's event) and in synchronous copies; with async scheduling, the GPU runs step N while
    the caller's thread launches step N+1 (schedule, execute_model) and takes in step N
    (_update, process)."""
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(owner: object, name: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[name.strip("_")] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    core = llm.core_client.core
    runner = core.executor.model_runner
    for owner, name in [
        (core.scheduler, "schedule"),
        (runner, "execute_model"),
        (runner.input_batch, "prepare"),
        (runner, "_sampling_metadata"),
        (LaunchedModelStep, "wait"),
        (core, "_update"),
        (llm.output_processor, "process"),
        *extra,
    ]:
        timed(owner, name)
    return totals


def single_stream(llm: LLM, prompt: list[int], n: int) -> dict:
    """Batch-1 decode: 128-token prompt, n output tokens; decode tokens/s after the first."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    total = time.perf_counter() - start
    return {
        "prompt_tokens": len(prompt),
        "output_tokens": n,
        "seconds": total,
        "decode_tokens_per_s": (n - 1) / (total - first),
    }


def load_hf(path: Path, dummy: bool, dtype: torch.dtype, device: torch.device):
    if dummy:
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.inference_mode()
def run_hf_static(model, workload: Workload, batch_size: int, device: torch.device) -> dict:
    cpu_start, start = time.process_time(), time.perf_counter()
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
    elapsed = time.perf_counter() - start
    return {
        "kind": f"generate, static batches of {batch_size}",
        "seconds": elapsed,
        "output_tokens_per_s": sum(o for _, o in workload) / elapsed,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def run_hf_continuous(model, workload: Workload) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    generation = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(o for _, o in workload)
    )
    cb = ContinuousBatchingConfig(
        block_size=256, num_blocks=2400, max_batch_tokens=4096, use_cuda_graph=True
    )
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=cb
    ) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(workload):
            manager.add_request(prompt, request_id=f"req_{i}", max_new_tokens=n)
        produced, finished = 0, 0
        while finished < len(workload):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished += 1
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    return {
        "kind": "continuous batching (paged|sdpa, CUDA graphs)",
        "seconds": elapsed,
        "output_tokens": produced,
        "output_tokens_per_s": produced / elapsed,
    }


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (None: SmolLM2-135M)")
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), help="a benchmark shape with dummy weights"
    )
    parser.add_argument("--load-format", default="auto", help="auto | dummy (with --model)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    parser.add_argument("--min-len", type=int, default=16, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt and output")
    parser.add_argument(
        "--min-output-len", type=int, default=None, help="shortest output (None: --min-len)"
    )
    parser.add_argument(
        "--max-output-len", type=int, default=None, help="longest output (None: --max-len)"
    )
    parser.add_argument("--seed", type=int, default=0, help="of the workload's lengths and ids")
    parser.add_argument("--max-model-len", type=int, default=None, help="the engine's flag")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's flag")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="the engine's flag"
    )
    parser.add_argument(
        "--long-prefill-token-threshold", type=int, default=0, help="the engine's flag"
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (None: on with a GPU)",
    )
    parser.add_argument("--single-stream", action="store_true", help="also time batch-1 decode")
    parser.add_argument("--profile-steps", action="store_true", help="time the step's phases")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="the HF peer's batch")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--quantization",
        default=None,
        help="the engine's flag (fp8; int8 on CPU); the HF peer stays unquantized",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the engine's flag (bfloat16 on CPU: bf16 weights and KV cache); the HF peer runs "
        "in the default dtype (float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    args = parser.parse_args()
    output_range = (
        args.min_len if args.min_output_len is None else args.min_output_len,
        args.max_len if args.max_output_len is None else args.max_output_len,
    )
    print(f"{parser.prog}: {args.num_requests} requests, prompts U[{args.min_len}, "
          f"{args.max_len}], outputs U{list(output_range)}", file=sys.stderr)  # fmt: skip

    if args.shape:
        path = write_shape(args.shape, Path(tempfile.mkdtemp(prefix=f"{args.shape}-")))
        args.load_format = "dummy"
    else:
        path = resolve_model_path(args.model)
    config = transformers.AutoConfig.from_pretrained(path)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    workload = make_workload(
        args.num_requests, args.min_len, args.max_len, config.vocab_size, args.seed, output_range
    )
    output_tokens = sum(o for _, o in workload)

    load_at_start = os.getloadavg()
    rates = {"matmul_flops_per_s": matmul_rate(device, dtype)}
    rates["copy_bytes_per_s"] = copy_bandwidth(device)
    if device.type == "cuda":  # the rates' 2.3 GB back, for the engine's KV cache
        torch.cuda.empty_cache()
    matmul, copy = rates["matmul_flops_per_s"], rates["copy_bytes_per_s"]
    roofline = None
    if device.type == "cuda":
        floor_s = gpu_floor_seconds(config, workload, matmul, copy, 2)
    else:
        floor_s = cpu_floor_seconds(config, workload, matmul)
        roofline = output_tokens / cpu_roofline_floor_seconds(config, workload, matmul, copy)
        print(f"CPU roofline floor {roofline:.1f} output tokens/s (compute floor below)")
    floor = output_tokens / floor_s
    print(
        f"rates {json.dumps({k: f'{v:.3g}' for k, v in rates.items()})}; floor {floor:.1f} output tokens/s"
    )

    load_before = os.getloadavg()
    ours = run_asyncllm(str(path), workload, args)
    print(
        f"asyncllm: {ours['output_tokens_per_s']:.1f} output tokens/s "
        f"({ours['output_tokens_per_s'] / floor:.0%} of the floor)"
    )
    result = {
        "benchmark": "throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            [
                *(f"{k}={v}" for k, v in os.environ.items() if k.startswith(("ASYNCLLM_", "OMP_"))),
                "python",
            ]
            + sys.argv
        ),
        "device": torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"cpu ({platform.machine()})",
        "cpu_threads": torch.get_num_threads(),
        # a shared CPU's others: 1, 5 and 15 minute load averages before the rates and after us
        "load_average": {"start": load_at_start, "after_asyncllm": os.getloadavg()},
        "cpu": cpu_description(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "model": args.shape or str(path),
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtype": str(dtype),  # the floor's matmul rate and the HF peer's
        "engine_dtype": args.dtype,
        "quantization": args.quantization,
        "workload": {
            "num_requests": args.num_requests,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "min_output_len": output_range[0],
            "max_output_len": output_range[1],
            "seed": args.seed,
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": output_tokens,
        },
        "rates": rates,
        "floor_output_tokens_per_s": floor,
        "asyncllm": ours,
        "fraction_of_floor": ours["output_tokens_per_s"] / floor,
    }
    if roofline:  # CPU: the floor above is the compute floor, all FLOPs at the matmul rate
        result["roofline_floor_output_tokens_per_s"] = roofline
        result["fraction_of_roofline_floor"] = ours["output_tokens_per_s"] / roofline
    if "single_stream" in ours:
        layers_bytes = weight_count(config) * (2 if device.type == "cuda" else 4)
        bandwidth = rates.get("copy_bytes_per_s")
        if bandwidth:
            result["single_stream_floor_tokens_per_s"] = bandwidth / layers_bytes
        print(f"single stream: {ours['single_stream']['decode_tokens_per_s']:.1f} tokens/s")
    if not args.no_peer:
        model = load_hf(path, args.load_format == "dummy", dtype, device)
        peer = (
            run_hf_continuous(model, workload)
            if device.type == "cuda"
            else run_hf_static(model, workload, args.hf_batch_size, device)
        )
        result["hf_transformers"] = peer
        result["speedup_vs_hf"] = ours["output_tokens_per_s"] / peer["output_tokens_per_s"]
        if "cpu_seconds" in peer:  # on a loaded machine the CPU time is the steadier ratio
            result["speedup_vs_hf_cpu_time"] = peer["cpu_seconds"] / ours["cpu_seconds"]
        print(
            f"HF transformers ({peer['kind']}): {peer['output_tokens_per_s']:.1f} output tokens/s; "
            f"asyncllm / HF = {result['speedup_vs_hf']:.2f}x"
        )
    # the machine's 1-minute load average (this run included) before and after the run
    result["load_average"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
