"""Online serving benchmark: a load generator over real HTTP against a running `asyncllm serve`,
in the manner of `vllm bench serve`.

Every request is a streaming `POST /v1/completions` whose `prompt` is a list of random token ids
(drawn from [100, --vocab-size), past the special tokens), with `max_tokens` set to its output
length, `ignore_eos: true`, `temperature: 0` and `stream_options.include_usage`.

Workloads (seeded by --seed, nothing is downloaded):
  random         prompt and output lengths each uniform in [--min-len, --max-len].
  sharegpt-like  prompt and output lengths log-normal, shaped like ShareGPT's conversations
                 (mostly short, a long right tail) but chosen, not fitted: medians of 160 prompt
                 tokens (sigma 1.0) and 120 output tokens (sigma 0.9), rounded and clipped to
                 [--min-len, --max-len].

Arrivals: a Poisson process at --request-rate requests/s (exponential gaps from a seeded
generator; `inf` sends every request at once), optionally capped at --max-concurrency requests
in flight. Like vLLM, a request's clock starts when it is sent, not while it waits for a slot.

Per request: TTFT is the time to the first chunk with text; E2E the time to `data: [DONE]`;
output tokens are the `usage.completion_tokens` of the final chunk; TPOT = (E2E - TTFT) /
(output tokens - 1). ITL is vLLM's: the gap between consecutive chunks with text, one value per
chunk, not spread over the tokens a chunk carries (a server merges deltas for a slow reader);
`mean_tokens_per_chunk` in the result says how often that happened. Percentiles interpolate
linearly between order statistics, as numpy's default does.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import math
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
from tqdm import tqdm

SHAREGPT_LIKE = {
    "prompt_median": 160,
    "prompt_sigma": 1.0,
    "output_median": 120,
    "output_sigma": 0.9,
}
PERCENTILES = (50, 90, 99)
METRICS = {  # key: (table title, table abbreviation)
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


# -- workload -----------------------------------------------------------------------------------


def random_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    return [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(n)]


def sharegpt_like_lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    def draw(median: float, sigma: float) -> int:
        return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))

    p = SHAREGPT_LIKE
    return [
        (draw(p["prompt_median"], p["prompt_sigma"]), draw(p["output_median"], p["output_sigma"]))
        for _ in range(n)
    ]


DATASETS = {"random": random_lengths, "sharegpt-like": sharegpt_like_lengths}


def make_workload(
    dataset: str, n: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[SampleRequest]:
    rng = random.Random(seed)
    lengths = DATASETS[dataset](rng, n, min_len, max_len)
    return [
        SampleRequest([rng.randrange(100, vocab_size) for _ in range(p)], o) for p, o in lengths
    ]


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: a Poisson process at `rate` requests/s, the first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# -- one request --------------------------------------------------------------------------------


def completion_body(model: str, request: SampleRequest) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": request.prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )


async def send_request(
    session: aiohttp.ClientSession, url: str, headers: dict, model: str, request: SampleRequest
) -> RequestResult:
    result = RequestResult(len(request.prompt), request.output_len)
    arrivals: list[float] = []
    done = False
    start = time.perf_counter()
    try:
        async with session.post(url, data=completion_body(model, request), headers=headers) as r:
            if r.status != 200:
                result.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return result
            async for line in r.content:
                now = time.perf_counter()
                if not line.startswith(b"data: "):
                    continue  # blank separators and `: keep-alive` comments
                payload = line[len(b"data: ") :].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if any(c.get("text") for c in choices) or (choices and not arrivals):
                    arrivals.append(now)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    end = time.perf_counter()
    if not done or not arrivals:
        result.error = "the stream ended before [DONE]" if not done else "no output chunk"
        return result
    result.success = True
    result.ttft = arrivals[0] - start
    result.e2el = end - start
    result.itl = [b - a for a, b in zip(arrivals, arrivals[1:])]
    result.chunks = len(arrivals)
    result.output_tokens = result.output_tokens or len(arrivals)  # no usage: a lower bound
    return result


# -- the run ------------------------------------------------------------------------------------


@dataclass
class Server:
    base_url: str
    headers: dict[str, str]
    model: str = ""
    version: str = ""
    max_model_len: int | None = None


async def get_json(session: aiohttp.ClientSession, server: Server, path: str) -> dict:
    async with session.get(server.base_url + path, headers=server.headers) as response:
        if response.status != 200:
            sys.exit(f"GET {path}: HTTP {response.status}: {(await response.text())[:300]}")
        return await response.json()


async def describe_server(session: aiohttp.ClientSession, server: Server, model: str | None):
    server.version = (await get_json(session, server, "/version")).get("version", "")
    models = (await get_json(session, server, "/v1/models"))["data"]
    served = next((m for m in models if m["id"] == model), models[0])
    server.model = model or served["id"]
    server.max_model_len = served.get("max_model_len")


async def run_load(
    session: aiohttp.ClientSession,
    server: Server,
    workload: list[SampleRequest],
    times: list[float],
    max_concurrency: int | None,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    url = server.base_url + "/v1/completions"
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(workload), disable=not show_progress, file=sys.stderr)
    start = time.perf_counter()

    async def launch(request: SampleRequest, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with slots:
            result = await send_request(session, url, server.headers, server.model, request)
        progress.update(1)
        return result

    results = await asyncio.gather(*(launch(r, t) for r, t in zip(workload, times)))
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


async def benchmark(args: argparse.Namespace, workload: list[SampleRequest]) -> dict:
    server = Server(args.base_url.rstrip("/"), {"Content-Type": "application/json"})
    if args.api_key:
        server.headers["Authorization"] = f"Bearer {args.api_key}"
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await describe_server(session, server, args.model)
        check_fits(workload, server.max_model_len)
        url = server.base_url + "/v1/completions"
        for request in workload[: args.num_warmups]:
            warmup = SampleRequest(request.prompt, min(request.output_len, 4))
            result = await send_request(session, url, server.headers, server.model, warmup)
            if not result.success:
                sys.exit(f"the warm-up request failed: {result.error}")
        times = arrival_times(len(workload), args.request_rate, args.seed)
        print(f"sending {len(workload)} requests: {describe_traffic(args)}", file=sys.stderr)
        cpu_before = await server_cpu_seconds(session, server)
        results, duration = await run_load(
            session, server, workload, times, args.max_concurrency, not args.disable_tqdm
        )
        cpu_after = await server_cpu_seconds(session, server)
    described = {k: getattr(server, k) for k in ("base_url", "model", "version", "max_model_len")}
    summary = summarize(results, duration)
    if cpu_before is not None and cpu_after is not None:
        summary |= server_cpu(cpu_after - cpu_before, results)
    return {"server": described} | summary


async def server_metrics(session: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    """The server's /metrics samples by name, summed over their labels (a counter's total over
    models); empty where it has no /metrics."""
    async with session.get(server.base_url + "/metrics", headers=server.headers) as response:
        if response.status != 200:
            return {}
        samples: dict[str, float] = collections.defaultdict(float)
        for line in (await response.text()).splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                samples[name_labels.partition("{")[0]] += float(value)
        return dict(samples)


async def server_cpu_seconds(session: aiohttp.ClientSession, server: Server) -> float | None:
    """The server process's CPU time from its /metrics (None where it does not report it).
    With the engine core in a process of its own, this is the front end's alone."""
    return (await server_metrics(session, server)).get("process_cpu_seconds_total")


def server_cpu(seconds: float, results: list[RequestResult]) -> dict:
    done = [r for r in results if r.success]
    chunks = sum(r.chunks for r in done)
    return {
        "server_cpu_s": seconds,
        "server_cpu_us_per_chunk": 1e6 * seconds / chunks if chunks else None,
    }


def check_fits(workload: list[SampleRequest], max_model_len: int | None) -> None:
    if max_model_len is None:
        return
    longest = max(len(r.prompt) + r.output_len for r in workload)
    if longest > max_model_len:
        sys.exit(
            f"a request needs {longest} tokens, over the server's max_model_len "
            f"{max_model_len}: lower --max-len"
        )


def describe_traffic(args: argparse.Namespace) -> str:
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    cap = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    return rate + cap


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(name: str, seconds: list[float]) -> dict[str, float | None]:
    ms = [s * 1000 for s in seconds]
    stats: dict[str, float | None] = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        key = f"median_{name}_ms" if q == 50 else f"p{q}_{name}_ms"
        stats[key] = percentile(ms, q) if ms else None
    return stats


def summarize(results: list[RequestResult], duration: float) -> dict:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    chunks = sum(r.chunks for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "mean_tokens_per_chunk": output_tokens / chunks if chunks else None,
    }
    summary |= distribution("ttft", [r.ttft for r in done])
    summary |= distribution("tpot", [r.tpot for r in done if r.tpot is not None])
    summary |= distribution("itl", [gap for r in done for gap in r.itl])
    summary |= distribution("e2el", [r.e2el for r in done])
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    return summary


def print_table(result: dict) -> None:
    workload = result["workload"]
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Request rate configured (RPS):", workload["request_rate"]),
        ("Maximum request concurrency:", workload["max_concurrency"]),
        ("Benchmark duration (s):", result["duration_s"]),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", result["request_throughput"]),
        ("Output token throughput (tok/s):", result["output_throughput"]),
        ("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for label, value in rows:
        print(f"{label:<40} {_cell(value)}")
    for name, (title, short) in METRICS.items():
        print(f"{title:-^50}")
        for stat, label in [("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")]:
            print(f"{f'{label} {short} (ms):':<40} {_cell(result[f'{stat}_{name}_ms'])}")
    print("=" * 50)


def _cell(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"


# -- command line -------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each flag's default."""


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--model", default=None, help="the name sent (None: the served one)")
    parser.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    parser.add_argument(
        "--dataset", choices=sorted(DATASETS), default="random", help="the length distribution"
    )
    parser.add_argument("--num-prompts", type=int, default=100, help="requests sent")
    parser.add_argument("--min-len", type=int, default=32, help="shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=256, help="longest prompt and output")
    parser.add_argument("--vocab-size", type=int, default=32000, help="token ids < this")
    parser.add_argument("--seed", type=int, default=0, help="of the lengths, ids and arrivals")
    parser.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson req/s (inf: all at once)"
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    parser.add_argument("--num-warmups", type=int, default=1, help="short requests sent first")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds each")
    parser.add_argument(
        "--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="recorded in the result"
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.vocab_size <= 100:
        parser.error("--vocab-size must be over 100")
    if not args.request_rate > 0:
        parser.error("--request-rate must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error("--max-concurrency must be at least 1")
    if any("=" not in item for item in args.metadata):
        parser.error("--metadata takes KEY=VALUE items")


def workload_record(args: argparse.Namespace, workload: list[SampleRequest]) -> dict:
    record = {
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "min_len": args.min_len,
        "max_len": args.max_len,
        "vocab_size": args.vocab_size,
        "seed": args.seed,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "prompt_tokens": sum(len(r.prompt) for r in workload),
        "output_tokens": sum(r.output_len for r in workload),
    }
    if args.dataset == "sharegpt-like":
        record["lognormal"] = SHAREGPT_LIKE
    return record


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    workload = make_workload(
        args.dataset, args.num_prompts, args.min_len, args.max_len, args.vocab_size, args.seed
    )
    summary = asyncio.run(benchmark(args, workload))
    result = {
        "benchmark": "serving",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", sys.argv[0], *argv]),
        "client": {"python": platform.python_version(), "aiohttp": aiohttp.__version__},
        "metadata": dict(item.split("=", 1) for item in args.metadata),
        "workload": workload_record(args, workload),
        "itl_definition": "gaps between chunks with text, one per chunk (vLLM's)",
    } | summary
    print_table(result)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if result["completed"] == 0:
        sys.exit(f"every request failed: {result['errors']}")


if __name__ == "__main__":
    main()
