"""Quantized weights against bf16 on the Llama-3.1-8B shape (dummy weights), in the same run.

Parts (each under 3 minutes on an H200; every engine runs in a child process of its own, so
one mode's memory never crowds the next):
  offline  the offline workload (256 requests, prompt and output lengths U[100, 1024], seed 0,
           ignore_eos) per mode, output tokens/s; the issue asks FP8 >= 1.3x bf16
  decode   batch-1 decode (128-token prompt, 256 tokens) per mode, tokens/s against the floor of
           reading the weights once per token at the copy bandwidth; the issue asks FP8 >= 1.7x
           and 4-bit >= 2.5x bf16
  kernels  the projections' GEMMs alone at 1 and 256 rows, replayed in CUDA graphs as decode
           runs them (no Python launch cost): bf16 (kernels.gemv at one row,
           cuBLAS else), FP8 as its layer runs it (kernels.gemv over e4m3 at one row, else
           kernels.quantize_fp8 then torch._scaled_mm, row-wise scales), 4-bit (kernels.int4_gemm),
           each as bytes of weights read per second against the copy bandwidth; and decode
           attention at batch 256 (1,024 tokens of context each) over a bf16 and an FP8 cache
           (with per-layer k/v scales, as from a checkpoint), as cache bytes read per second
           against it (the issue asks FP8 >= 70%)
Modes: bf16; fp8 (`--quantization fp8`, quantized at load); int4 (GPTQ 4-bit, group 128,
symmetric, dummy packed weights); fp8-kv (bf16 weights, `--kv-cache-dtype fp8`; the issue asks
its offline workload to be at least as fast as bf16's); fp8-all (FP8 weights and an FP8 cache).
Offline, each mode is also set against its own floor (offline_floor_seconds), from the bf16
and FP8 matmul rates and the copy bandwidth measured in the same run.

`--part decode,offline` runs both on one load of each engine (the load and its graphs take
most of a part's minutes): every mode decodes, the modes of --offline-modes also run the
offline workload, and --out names a file per part through {part}. The kernels' launch-setting
overrides in the environment (ASYNCLLM_INT4_GEMV, ASYNCLLM_FP8_GEMV, ASYNCLLM_FP8_GEMM: a
sweep's winners) reach every engine and are recorded in the result.

    python bench/quant.py --part kernels --out bench/results/quant_kernels_h200.json
    python bench/quant.py --part decode --out bench/results/quant_decode_h200.json
    python bench/quant.py --part offline --modes bf16,fp8 --out bench/results/quant_offline_fp8_h200.json
    python bench/quant.py --part offline --modes bf16,int4,fp8-kv --out bench/results/quant_offline_int4_kv_h200.json
    python bench/quant.py --part decode,offline --modes bf16,fp8,int4 --offline-modes bf16,fp8 --out 'bench/results/quant_{part}_h200.json'
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
import triton

if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.layers.quantization.fp8 import quantize_activations, quantize_per_row  # noqa: E402
from asyncllm.layers.quantization.int4 import pack_int4  # noqa: E402
from asyncllm.models.shapes import SHAPES, write_shape  # noqa: E402
from bench.throughput import (  # noqa: E402
    copy_bandwidth,
    decode_contexts,
    make_workload,
    matmul_rate,
    prefill_flops,
    single_stream,
)

SHAPE = "llama-3.1-8b"
MODES = ("bf16", "fp8", "int4", "fp8-kv", "fp8-all")
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
# (N, K) of a layer's projections: qkv_proj, o_proj, gate_up_proj, down_proj
PROJECTIONS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
OVERRIDES = ("ASYNCLLM_INT4_GEMV", "ASYNCLLM_FP8_GEMV", "ASYNCLLM_FP8_GEMM")


def model_folder(mode: str) -> Path:
    folder = write_shape(SHAPE, Path(tempfile.mkdtemp(prefix=f"{SHAPE}-{mode}-")))
    if mode == "int4":
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = GPTQ
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_engine(mode: str, parts: list[str]) -> dict:
    """{part: result} of one engine of the mode, loaded once."""
    llm = LLM(
        model=str(model_folder(mode)),
        load_format="dummy",
        quantization="fp8" if mode in ("fp8", "fp8-all") else None,
        kv_cache_dtype="fp8" if mode in ("fp8-kv", "fp8-all") else "auto",
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    workload = make_workload(256, 100, 1024, SHAPES[SHAPE]["vocab_size"], 0)
    warm = [{"prompt_token_ids": p} for p, _ in workload[:4]]
    llm.generate(warm, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    results = {}
    if "decode" in parts:
        results["decode"] = single_stream(llm, workload[0][0][:128], 256)
    if "offline" in parts:
        results["offline"] = run_offline(llm, workload)
    return results


def run_offline(llm: LLM, workload) -> dict:
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
    }


def run_child(mode: str, parts: list[str]) -> dict:
    command = [sys.executable, __file__, "--part", ",".join(parts), "--child", mode]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} {parts} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def weight_bytes(mode: str) -> float:
    """Bytes a decode step reads: every projection plus the bf16 lm_head (4-bit adds its fp16
    scales and zeros per 128 values, FP8 its fp32 scale per row)."""
    shape = SHAPES[SHAPE]
    per_layer = sum(n * k for n, k in PROJECTIONS)
    width = {"bf16": 2.0, "fp8-kv": 2.0, "fp8": 1.0, "fp8-all": 1.0, "int4": 0.5 + 4 / 128}[mode]
    lm_head = shape["vocab_size"] * shape["hidden_size"] * 2
    return shape["num_hidden_layers"] * per_layer * width + lm_head


def fp8_matmul_rate(device: torch.device) -> float:
    """FLOP/s of torch._scaled_mm on square 8,192 e4m3 operands (row-wise scales)."""
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(n, 1, device=device)
    scale_b = torch.ones(1, n, device=device)
    ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16))
    return 2 * n**3 / (ms / 1e3)


def offline_floor_seconds(mode: str, rates: dict[str, float], bandwidth: float) -> float:
    """bench/throughput.py's floor of the offline workload in this mode: the prompts'
    projection FLOPs at the mode's GEMM rate (FP8's for FP8 weights, bf16's else: 4-bit
    computes in bf16), the rest (lm_head, attention) at bf16's, then each decode step (all
    requests in lockstep) reading the mode's weight bytes and every live request's KV in the
    cache's width once at the copy bandwidth."""
    config = transformers.LlamaConfig(**SHAPES[SHAPE])
    workload = make_workload(256, 100, 1024, SHAPES[SHAPE]["vocab_size"], 0)
    projections = config.num_hidden_layers * sum(n * k for n, k in PROJECTIONS)
    projection_flops = 2 * projections * sum(len(p) for p, _ in workload)
    rest_flops = prefill_flops(config, workload) - projection_flops
    gemm_rate = rates["fp8" if mode in ("fp8", "fp8-all") else "bf16"]
    seconds = projection_flops / gemm_rate + rest_flops / rates["bf16"]
    kv_width = 1 if mode in ("fp8-kv", "fp8-all") else 2
    head_dim = config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    for live in decode_contexts(workload):
        seconds += (weight_bytes(mode) + kv_per_token * sum(live) * kv_width) / bandwidth
    return seconds


def median_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median")


def time_kernels() -> list[dict]:
    rows = []
    for n, k in PROJECTIONS:
        for m in (1, 256):
            for mode, fn, nbytes in projection_gemms(n, k, m):
                ms = median_ms(fn)
                rows.append(
                    {
                        "n": n,
                        "k": k,
                        "rows": m,
                        "mode": mode,
                        "ms": ms,
                        "weight_bytes_per_s": nbytes / ms * 1e3,
                    }
                )
    return rows


def time_decode_attention() -> list[dict]:
    """Decode attention of 256 sequences of 1,024 tokens, blocks scattered over the pool."""
    import kernels

    shape = SHAPES[SHAPE]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    seqs, context, block = 256, 1024, 16
    blocks = seqs * context // block
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
    seq_lens = torch.full((seqs,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(seqs, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cache = torch.randn(2, blocks, block, kv_heads, head_dim, device="cuda").to(dtype)
        scales = {"k_scale": 0.5, "v_scale": 0.25} if dtype.itemsize == 1 else {}
        fn = functools.partial(
            kernels.paged_decode_attention,
            query,
            cache,
            tables,
            seq_lens,
            head_dim**-0.5,
            max_seq_len=context,
            **scales,
        )
        ms = median_ms(fn)
        rows.append(
            {
                "cache_dtype": str(dtype),
                "kv_scales": scales,
                "seqs": seqs,
                "context": context,
                "ms": ms,
                "cache_bytes_per_s": cache.numel() * cache.element_size() / ms * 1e3,
            }
        )
    return rows


def projection_gemms(n: int, k: int, m: int) -> list[tuple[str, object, float]]:
    """(mode, a call running the GEMM, weight bytes it reads) for x [m, k] @ W [k, n]."""
    import kernels

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, w_scale = quantize_per_row(w)
    qweight = pack_int4(torch.randint(0, 16, (k, n), device="cuda", dtype=torch.int32), 0)
    scales = torch.rand(k // 128, n, device="cuda", dtype=torch.bfloat16) * 0.01
    zeros = torch.full_like(scales, 8)
    bf16 = (
        functools.partial(kernels.gemv, x, w, None)
        if m == 1
        else functools.partial(torch.matmul, x, w.t())
    )
    w_scale = w_scale.view(1, -1)

    def fp8():  # Fp8LinearMethod's path: the GEMV at one row, else quantize x and cuBLAS
        if m == 1:
            return kernels.gemv(x, wq, None, scale=w_scale)
        xq, x_scale = quantize_activations(x)
        return torch._scaled_mm(xq, wq.t(), x_scale, w_scale, out_dtype=torch.bfloat16)

    int4 = functools.partial(kernels.int4_gemm, x, qweight, scales, zeros, 128)
    return [
        ("bf16", bf16, 2 * n * k),
        ("fp8", fp8, n * k),
        ("int4", int4, n * k / 2 + 4 * n * k / 128),
    ]


def summarize(part: str, runs: dict[str, dict], header: dict) -> dict[str, dict]:
    """Each mode's run of the part against bf16's and against its floor; prints the latest
    mode's."""
    key = "output_tokens_per_s" if part == "offline" else "decode_tokens_per_s"
    bandwidth = header["copy_bytes_per_s"]
    for mode, run in runs.items():
        if "bf16" in runs:
            run["vs_bf16"] = run[key] / runs["bf16"][key]
        if part == "decode":
            run["floor_tokens_per_s"] = bandwidth / weight_bytes(mode)
        else:
            floor = offline_floor_seconds(mode, header["matmul_flops_per_s"], bandwidth)
            run["floor_tokens_per_s"] = run["output_tokens"] / floor
        run["of_floor"] = run[key] / run["floor_tokens_per_s"]
    print(
        f"{part} {mode}: {run[key]:.1f} tokens/s"
        + (f", {run['vs_bf16']:.2f}x bf16" if "vs_bf16" in run else "")
    )
    return runs


def run_modes(args: argparse.Namespace, parts: list[str], header: dict) -> None:
    """One child process a mode, the parts' files rewritten after each (a run cut short keeps
    the modes done); a failed mode is reported and left out, so the others still count."""
    modes = args.modes.split(",")
    offline_modes = args.offline_modes.split(",") if args.offline_modes else modes
    runs = {}
    for mode in modes:
        mode_parts = [p for p in parts if p != "offline" or mode in offline_modes]
        try:
            runs[mode] = run_child(mode, mode_parts)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            continue
        for part in mode_parts:
            part_runs = {m: dict(run[part]) for m, run in runs.items() if part in run}
            result = {"benchmark": f"quant_{part}", **header}
            result["modes"] = summarize(part, part_runs, header)
            write(result, args.out, part)


def time_kernel_part(result: dict, bandwidth: float) -> None:
    result["kernels"] = time_kernels()
    for row in result["kernels"]:
        row["of_copy_bandwidth"] = row["weight_bytes_per_s"] / bandwidth
        print(
            f"{row['n']:>6} x {row['k']:>6} rows {row['rows']:>3} {row['mode']:>4}: "
            f"{row['ms'] * 1e3:8.1f} us, {row['of_copy_bandwidth']:.0%} of copy"
        )
    result["decode_attention"] = time_decode_attention()
    for row in result["decode_attention"]:
        row["of_copy_bandwidth"] = row["cache_bytes_per_s"] / bandwidth
        print(
            f"decode attention, {row['cache_dtype']} cache: {row['ms'] * 1e3:.1f} us, "
            f"{row['of_copy_bandwidth']:.0%} of copy"
        )


def write(result: dict, out: str | None, part: str) -> None:
    if out:
        path = Path(out.format(part=part))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", required=True, help="kernels, or decode and/or offline")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--offline-modes", help="modes that run offline too (default: all)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help="result file; {part} in it names each part's")
    args = parser.parse_args()
    parts = args.part.split(",")
    if parts != ["kernels"] and not set(parts) <= {"decode", "offline"}:
        parser.error("--part is kernels, or decode and/or offline")
    if args.child:
        print(json.dumps(run_engine(args.child, parts)))
        return
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "shape": SHAPE,
        "copy_bytes_per_s": bandwidth,
        "matmul_flops_per_s": {
            "bf16": matmul_rate(device, torch.bfloat16),
            "fp8": fp8_matmul_rate(device),
        },
        "launch_overrides": {name: os.environ[name] for name in OVERRIDES if name in os.environ},
    }
    if parts == ["kernels"]:
        result = {"benchmark": "quant_kernels", **header}
        time_kernel_part(result, bandwidth)
        write(result, args.out, "kernels")
        return
    run_modes(args, parts, header)


if __name__ == "__main__":
    main()
