"""Admission of a burst of text prompts: how long a running `asyncllm serve` takes to take in N
prompts sent at once (each asks for one token), and how long its event loop is held meanwhile,
seen as the latency of /health probes sent every 10 ms during the burst.

Prompts are random token ids (past the special tokens) decoded to text with the model folder's
tokenizer, lengths uniform in [--min-len, --max-len] (seed 0): the server tokenizes them again.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import random
import sys
import time
from pathlib import Path

import aiohttp
import transformers


def text_prompts(model: Path, n: int, min_len: int, max_len: int, seed: int) -> list[str]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    ids = [[rng.randrange(100, tokenizer.vocab_size) for _ in range(k)] for k in lengths]
    return tokenizer.batch_decode(ids)


async def complete(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    start = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()
    return time.perf_counter() - start


async def probe(session: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        async with session.get(f"{url}/health") as response:
            await response.read()
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.01)
    return latencies


async def burst(url: str, prompts: list[str]) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await complete(session, url, "warm up")
        stop = asyncio.Event()
        probing = asyncio.ensure_future(probe(session, url, stop))
        start = time.perf_counter()
        latencies = await asyncio.gather(*(complete(session, url, p) for p in prompts))
        seconds = time.perf_counter() - start
        stop.set()
        health = await probing
    latencies.sort()
    return {
        "seconds": seconds,
        "prompts_per_s": len(prompts) / seconds,
        "median_request_s": latencies[len(latencies) // 2],
        "health_probes": len(health),
        "max_health_latency_ms": 1e3 * max(health),
        "median_health_latency_ms": 1e3 * sorted(health)[len(health) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", type=Path, required=True, help="the tokenizer's folder")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="what this run measures, for the JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = text_prompts(args.model, args.num_prompts, args.min_len, args.max_len, args.seed)
    result = {
        "benchmark": "admission",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "label": args.label,
        "device": f"cpu ({platform.machine()})",
        "num_prompts": args.num_prompts,
        **asyncio.run(burst(args.base_url, prompts)),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
