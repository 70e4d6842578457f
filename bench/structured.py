"""Structured outputs on the H200: the cost of grammars in the decode step, compile time, and the
event loop during compiles.

--part step: batch-256 decode of a dummy-weight Qwen3-0.6B, every request held to a JSON schema
of its own, against the same batch unconstrained (greedy both; target: at most 1.1x). Also the
host time per step of the bitmask fill (on the matchers' thread, overlapping the forward pass:
the step before's sampled ids taken in, then the masks filled), the runner's wait for it and its
own work for the grammars, and the floor of applying the mask on the device (the bf16 logits
read and written once and the bitmask read once, at a copy bandwidth measured in the same run).
--part compile: xgrammar compile time of 50-field schemas against the 151,643-token vocabulary.
--part health: a running `asyncllm serve` takes 64 requests with a distinct 50-field schema each;
the longest /health reply while they compile (probes every 10 ms).

The model folder's tokenizer is a real one copied from --tokenizer (a folder with tokenizer.json,
e.g. the default model's converted folder: no tokenizer of Qwen3's own is on the H200), its ids
below Qwen3's 151,936 logits, which the grammars' bitmasks forbid past it; without --tokenizer a synthetic byte-level one of
Qwen3's size: byte tokens, then 2- and 3-character pieces of JSON's alphabet, then random words.
The synthetic one is a worst case, not a model's: nearly every token is a possible piece of a
JSON string, so xgrammar can settle few of them ahead and its fill costs about 1.4 ms a row on
the CPU here against 6 us with SmolLM2's tokenizer (bench/NOTES.md).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

# run as a script, bench/ comes first on sys.path, where bench/kernels.py would shadow the
# top-level kernels package that asyncllm imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from asyncllm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

VOCAB, TOKENIZER_SIZE, EOS = 151936, 151643, 151645
_JSON_CHARS = 'abcdefghijklmnopqrstuvwxyz0123456789{}[]":,_ .-'


def byte_level_vocab(size: int, seed: int = 0) -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    pieces = dict.fromkeys(sorted(alphabet))
    space = "Ġ"
    chars = [space if c == " " else c for c in _JSON_CHARS]
    for a in chars:
        for b in chars:
            pieces[a + b] = None
    rng = random.Random(seed)
    while len(pieces) < size:
        length = rng.randint(3, 8)
        pieces["".join(rng.choice(chars) for _ in range(length))] = None
    return list(pieces)[:size]


def qwen3_folder_with_tokenizer(tokenizer: Path | None) -> Path:
    """bench/sampler.py's dummy Qwen3-0.6B folder, with the real tokenizer of the folder
    `tokenizer` or, without one, the synthetic one added."""
    spec = importlib.util.spec_from_file_location("sampler", Path(__file__).with_name("sampler.py"))
    sampler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sampler)
    path = sampler.qwen3_0_6b_folder()
    if tokenizer is not None:
        from transformers import AutoTokenizer

        real = AutoTokenizer.from_pretrained(tokenizer)
        real.save_pretrained(path)
        # the model ends on its tokenizer's EOS, as Qwen3 on its own (151,645 is no token of
        # another tokenizer: a grammar's vocabulary would reach it through 100k empty ids)
        config = json.loads((path / "config.json").read_text())
        config["eos_token_id"] = real.eos_token_id
        (path / "config.json").write_text(json.dumps(config, indent=2))
    else:
        save_synthetic_tokenizer(path)
    return path


def save_synthetic_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {piece: i for i, piece in enumerate(byte_level_vocab(TOKENIZER_SIZE))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    fast.save_pretrained(path)


def tokenizer_size_and_eos(folder: Path) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return len(tokenizer), tokenizer.eos_token_id


def schema(index: int, num_fields: int) -> dict:
    """A schema of its own per index: field names, types and order differ."""
    rng = random.Random(index)
    types = [
        {"type": "string", "maxLength": 12},
        {"type": "integer"},
        {"type": "boolean"},
        {"enum": ["alpha", "beta", "gamma"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 4},
    ]
    properties = {f"field_{index}_{j}": rng.choice(types) for j in range(num_fields)}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def sync() -> None:
    torch.cuda.synchronize()


def copy_bandwidth_gbs() -> float:
    """Bytes read plus bytes written per second by a 1 GiB device-to-device copy (median)."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        sync()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def decode_steps(folder: Path, constrained: bool, batch: int, steps: int) -> dict[str, float]:
    """Median ms between engine steps once every request decodes (no synchronization between
    them: under async scheduling a step is launched while the one before runs), and in each
    step the ms of the bitmask fill on the matchers' thread and of the runner's wait for it."""
    from asyncllm import LLM

    prompt_len, max_model_len = 128, 128 + 4 * steps
    llm = LLM(
        model=str(folder),
        load_format="dummy",
        max_model_len=max_model_len,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        num_kv_blocks=batch * (max_model_len // 16 + 2),
    )
    from asyncllm.engine.core import EngineCore
    from asyncllm.structured_output import matchers
    from asyncllm.worker.model_runner import ModelRunner

    core = llm.core_client.core
    # per step, the ms in each: the whole fill on its thread (and its thread CPU time), its wait
    # for the step before's sampled ids, xgrammar's accepts of them (holding the GIL) and batched
    # fills, the runner's wait for the fill, and the runner's own work for the grammars (its
    # constrained rows, the sampled ids recorded for the matchers); on the core's thread, the
    # launch, the step's output taken in and of it the update (the rest is the wait for the
    # output: where the device sets the pace); on the collector, the deferred sampling
    timed_methods = {
        "execute_model": ModelRunner,
        "_finish": EngineCore,
        "_update": EngineCore,
        "_sample_later": ModelRunner,
        "_fill_host": matchers.GrammarMatchers,
        "_take_sampled": matchers.GrammarMatchers,
        "_receive_step": matchers.GrammarMatchers,
        "bitmask": matchers.GrammarMatchers,
        "record_sampled": matchers.GrammarMatchers,
        "_constrained_rows": ModelRunner,
    }
    real = {name: getattr(owner, name) for name, owner in timed_methods.items()}
    real_accept, real_fill = matchers.accept_in_batch, matchers.fill_masks
    spent = {name: [] for name in [*timed_methods, "accept", "fill", "fill_cpu"]}

    def timed(name, function):
        def call(*args):
            start, cpu = time.perf_counter(), time.thread_time()
            out = function(*args)
            spent[name].append((time.perf_counter() - start) * 1e3)
            if name == "_fill_host":
                spent["fill_cpu"].append((time.thread_time() - cpu) * 1e3)
            return out

        return call

    for name, owner in timed_methods.items():
        setattr(owner, name, timed(name, real[name]))
    matchers.accept_in_batch = timed("accept", real_accept)
    matchers.fill_masks = timed("fill", real_fill)
    # of the fill thread's wait for the sampled ids, the part spent waiting for the device
    real_synchronize = torch.cuda.Event.synchronize
    spent["device_wait"] = []

    def synchronize(event):
        start = time.perf_counter()
        real_synchronize(event)
        if threading.current_thread().name.startswith("grammar-fill"):
            spent["device_wait"].append((time.perf_counter() - start) * 1e3)

    torch.cuda.Event.synchronize = synchronize
    schemas = [StructuredOutputsParams(json=schema(i, 20)) for i in range(batch)]
    if constrained:  # compiled ahead, so that every request is admitted at once
        concurrent.futures.wait([core.grammar_compiler.submit(p) for p in schemas])
        start_grammar_process(llm)
    tokenizer_size, _ = tokenizer_size_and_eos(folder)
    rng = random.Random(1)
    for i in range(batch):
        structured = schemas[i] if constrained else None
        params = SamplingParams(
            temperature=0,
            max_tokens=3 * steps,
            ignore_eos=not constrained,
            structured_outputs=structured,
        )
        prompt = [rng.randrange(100, tokenizer_size) for _ in range(prompt_len)]
        request, _ = llm.input_processor.process(str(i), {"prompt_token_ids": prompt}, params)
        llm.add_request(request, None)
    step_ms: list[float] = []
    takeover_deadline = time.monotonic() + 20  # then timed as it stands (grammar_process_rows)
    in_step: dict[str, list[float]] = {name: [] for name in spent}
    has_work = True
    sync()
    last = time.perf_counter()
    while has_work and len(step_ms) < steps:
        running = core.scheduler.running
        decoding = core.scheduler.num_running == batch
        decoding = decoding and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        waiting = time.monotonic() < takeover_deadline and not grammar_process_holds(llm, batch)
        if decoding and constrained and waiting:
            time.sleep(0.2)  # it compiles the schemas meanwhile
            decoding = False
        for times in spent.values():
            times.clear()
        step = llm.core_client.get_output()
        has_work = step.has_work
        llm.process_step(step)
        now = time.perf_counter()
        if decoding:
            step_ms.append((now - last) * 1e3)
            for name, times in spent.items():
                in_step[name].append(sum(times))
        last = now
    warm = len(step_ms) // 4
    grammar_matchers = core.executor.model_runner.grammar_matchers

    def median_in_step(name: str) -> float:
        return statistics.median(in_step[name][warm:])

    result = {
        "steps_timed": len(step_ms) - warm,
        "step_ms": statistics.median(step_ms[warm:]),
        "bitmask_fill_ms": median_in_step("_fill_host"),
        "bitmask_fill_thread_cpu_ms": median_in_step("fill_cpu"),
        "sampled_ids_wait_ms": median_in_step("_take_sampled"),
        "device_wait_ms": median_in_step("device_wait"),
        "accept_ms": median_in_step("accept"),
        "xgrammar_fill_ms": median_in_step("fill"),
        "grammar_process_wait_ms": median_in_step("_receive_step"),
        "bitmask_wait_ms": median_in_step("bitmask"),
        "constrained_rows_ms": median_in_step("_constrained_rows"),
        "record_sampled_ms": median_in_step("record_sampled"),
        "core_launch_ms": median_in_step("execute_model"),
        "core_update_ms": median_in_step("_update"),
        "core_output_wait_ms": statistics.median(
            [f - u for f, u in zip(in_step["_finish"][warm:], in_step["_update"][warm:])]
        ),
        "deferred_sampling_ms": median_in_step("_sample_later"),
        "fill_threads": grammar_matchers.num_threads if grammar_matchers is not None else 0,
        "grammar_vocabulary": grammar_matchers.vocab_size if grammar_matchers is not None else 0,
        "grammar_process_rows": (
            0 if grammar_matchers is None else grammar_matchers.num_held_by_process
        ),
        "cores_usable": len(os.sched_getaffinity(0)),
    }
    for name, owner in timed_methods.items():
        setattr(owner, name, real[name])
    matchers.accept_in_batch, matchers.fill_masks = real_accept, real_fill
    torch.cuda.Event.synchronize = real_synchronize
    llm.core_client.shutdown()
    return result


def start_grammar_process(llm) -> None:
    """Where the engine gives the grammars a process of their own, it is started (a few
    seconds: torch, the tokenizer) by a first constrained request, before the timed batch."""
    params = SamplingParams(
        max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema(-1, 2))
    )
    llm.generate("warm up", params, use_tqdm=False)
    process = llm.core_client.core.executor.model_runner.grammar_matchers.process
    deadline = time.monotonic() + 60
    while process is not None and not process.started():
        if time.monotonic() > deadline:
            raise RuntimeError("the grammar process did not start in 60 s")
        time.sleep(0.1)


def grammar_process_holds(llm, batch: int) -> bool:
    """Whether every request's rows are filled where they will be in the steady state: by the
    grammar process once it has compiled their schemas, or here without one."""
    matchers = llm.core_client.core.executor.model_runner.grammar_matchers
    return matchers is None or matchers.process is None or matchers.num_held_by_process >= batch


def part_step(batch: int, steps: int, tokenizer: Path | None) -> dict:
    folder = qwen3_folder_with_tokenizer(tokenizer)
    free = decode_steps(folder, False, batch, steps)
    print(f"unconstrained: {free}", flush=True)
    held = decode_steps(folder, True, batch, steps)
    print(f"constrained:   {held}", flush=True)
    mask_bytes = batch * VOCAB * 2 * 2 + batch * (-(-held["grammar_vocabulary"] // 32)) * 4
    bandwidth = copy_bandwidth_gbs()
    return {
        "unconstrained": free,
        "constrained": held,
        "step_ratio": held["step_ms"] / free["step_ms"],
        "target_ratio": 1.1,
        "mask_apply_bytes": mask_bytes,
        "copy_bandwidth_gbs": bandwidth,
        "mask_apply_floor_ms": mask_bytes / (bandwidth * 1e9) * 1e3,
    }


def part_compile(num_schemas: int, tokenizer: Path | None) -> dict:
    import xgrammar as xgr

    from asyncllm.structured_output.compiler import GrammarCompiler, tokenizer_info

    folder = qwen3_folder_with_tokenizer(tokenizer)
    start = time.perf_counter()
    info = tokenizer_info(folder, VOCAB, [tokenizer_size_and_eos(folder)[1]])
    vocabulary_s = time.perf_counter() - start
    compiler = GrammarCompiler(lambda: info)
    compiler.compile(StructuredOutputsParams(json_object=True))  # builds xgrammar's compiler
    times = []
    for i in range(num_schemas):
        params = StructuredOutputsParams(json=schema(1000 + i, 50))
        start = time.perf_counter()
        compiled = compiler.compile(params)
        times.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=schema(1000, 50)))
    cached_ms = (time.perf_counter() - start) * 1e3
    compiler.shutdown()
    assert isinstance(compiled, xgr.CompiledGrammar)
    return {
        "vocabulary_load_s": vocabulary_s,
        "schemas": num_schemas,
        "fields": 50,
        "compile_ms_median": statistics.median(times),
        "compile_ms_max": max(times),
        "cached_compile_ms": cached_ms,
    }


async def _health_during_compiles(url: str, num_requests: int) -> dict:
    import aiohttp

    async def probe(session, stop) -> list[float]:
        latencies = []
        while not stop.is_set():
            start = time.perf_counter()
            async with session.get(f"{url}/health") as response:
                await response.read()
            latencies.append((time.perf_counter() - start) * 1e3)
            await asyncio.sleep(0.01)
        return latencies

    async def constrained(session, i) -> None:
        body = {
            "prompt": "x",
            "max_tokens": 1,
            "structured_outputs": {"json": schema(5000 + i, 50)},
        }
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await constrained(session, -1)  # the vocabulary loads with the first grammar
        stop = asyncio.Event()
        probing = asyncio.ensure_future(probe(session, stop))
        start = time.perf_counter()
        await asyncio.gather(*(constrained(session, i) for i in range(num_requests)))
        seconds = time.perf_counter() - start
        stop.set()
        health = await probing
    return {
        "requests": num_requests,
        "fields": 50,
        "seconds": seconds,
        "health_probes": len(health),
        "max_health_ms": max(health),
        "median_health_ms": statistics.median(health),
    }


def part_health(num_requests: int, tokenizer: Path | None) -> dict:
    import re

    folder = qwen3_folder_with_tokenizer(tokenizer)
    log = folder / "server.log"
    command = [
        sys.executable,
        "-m",
        "asyncllm.serve",
        "--model",
        str(folder),
        "--load-format",
        "dummy",
        "--port",
        "0",
        "--max-model-len",
        "1024",
        "--enforce-eager",
    ]
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = ""
        deadline = time.monotonic() + 150
        while not url and time.monotonic() < deadline and server.poll() is None:
            found = re.search(r"serving .* on (http://[\d.]+:\d+)", log.read_text())
            url = found.group(1) if found else ""
            time.sleep(0.2)
        if not url:
            raise RuntimeError(f"the server did not start:\n{log.read_text()[-3000:]}")
        return asyncio.run(_health_during_compiles(url, num_requests))
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["step", "compile", "health"], required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--schemas", type=int, default=10)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a real tokenizer's folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.part == "step":
        result = part_step(args.batch, args.steps, args.tokenizer)
    elif args.part == "compile":
        result = part_compile(args.schemas, args.tokenizer)
    else:
        result = part_health(args.requests, args.tokenizer)
    print(json.dumps(result, indent=2), flush=True)
    import xgrammar

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.machine(),
        "load_average_1m": os.getloadavg()[0],
        "torch": torch.__version__,
        "triton": _version("triton"),
        "xgrammar": getattr(xgrammar, "__version__", None) or _version("xgrammar"),
        "part": args.part,
        "tokenizer": str(args.tokenizer) if args.tokenizer else "synthetic (worst case)",
        "result": result,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
