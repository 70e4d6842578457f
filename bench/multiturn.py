"""Multi-turn chat with shared prefixes over HTTP (issue 28 point 5), against the offline engine
on the same requests.

Conversations (seeded by --seed, nothing downloaded): turns uniform in [--min-turns,
--max-turns], each a user message and an assistant reply of ShareGPT-like lengths (the
log-normals of bench/serving.py's sharegpt-like dataset, clipped to [--min-len, --max-len]),
random token ids. Turn k's prompt is the whole history (turns 1..k-1's messages and replies)
and then turn k's message; its max_tokens is its reply's length (ignore_eos). The history
resends the dataset's replies, not the model's, so that the requests are fixed and the same
for the server and the offline engine: each turn finds the previous turn's prompt in the
prefix cache (its full blocks) and computes the reply and the new message. A conversation
ends before a turn that would pass --max-context tokens.

    python bench/multiturn.py offline --model DIR [--load-format dummy] --out offline.json
    python bench/multiturn.py serve --base-url URL --offline offline.json --out result.json

offline: LLM.generate on every turn of every conversation at once, ordered by turn (the
engine admits a conversation's turns in that order), in this process.
serve: each conversation sends its turns in order, the next when the previous stream ends
(bench/serving.py's SSE client), conversations starting at Poisson times of
--conversation-rate per second while the others run. Without a rate: a saturation run (all at
once), then a half-load run at half its conversation throughput, on other conversations of the
same shape (seed + 1) so that it finds nothing of the first run's in the prefix cache. Each
run reports TTFT (and by first and later turns), ITL, and the prefix-cache hit rate of its
requests from /metrics (hit tokens over looked-up tokens, vLLM's counters).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# run as a script, bench/ heads sys.path, where kernels.py would shadow the kernels package
if sys.path[0] == str(Path(__file__).resolve().parent):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import aiohttp  # noqa: E402

from bench.serving import (  # noqa: E402
    HelpFormatter,
    RequestResult,
    SampleRequest,
    Server,
    arrival_times,
    check_fits,
    describe_server,
    distribution,
    send_request,
    server_cpu,
    server_metrics,
    sharegpt_like_lengths,
    summarize,
)

HITS, QUERIES = "asyncllm:prefix_cache_hits_total", "asyncllm:prefix_cache_queries_total"
CPU_SECONDS = "process_cpu_seconds_total"


@dataclass(frozen=True)
class ConversationShape:
    num_conversations: int
    min_turns: int
    max_turns: int
    min_len: int
    max_len: int
    max_context: int
    vocab_size: int


@dataclass(frozen=True)
class Conversation:
    turns: list[SampleRequest]  # in order: each prompt starts with the one before and its reply


# -- workload -----------------------------------------------------------------------------------


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def make_conversation(rng: random.Random, shape: ConversationShape) -> Conversation:
    num_turns = rng.randint(shape.min_turns, shape.max_turns)
    history: list[int] = []
    turns = []
    for message_len, reply_len in sharegpt_like_lengths(
        rng, num_turns, shape.min_len, shape.max_len
    ):
        prompt = history + random_tokens(rng, message_len, shape.vocab_size)
        if len(prompt) + reply_len > shape.max_context:
            break
        turns.append(SampleRequest(prompt, reply_len))
        history = prompt + random_tokens(rng, reply_len, shape.vocab_size)
    return Conversation(turns)


def make_conversations(shape: ConversationShape, seed: int) -> list[Conversation]:
    rng = random.Random(f"conversations-{seed}")
    return [make_conversation(rng, shape) for _ in range(shape.num_conversations)]


def by_turn(conversations: list[Conversation]) -> list[SampleRequest]:
    """Every conversation's first turn, then every second turn, and so on."""
    most = max(len(c.turns) for c in conversations)
    return [c.turns[k] for k in range(most) for c in conversations if k < len(c.turns)]


def workload_record(shape: ConversationShape, seed: int, conversations: list[Conversation]) -> dict:
    """The shape and what it drew; cacheable_share: the share of the prompt tokens that the
    previous turn's prompt sent already, what the prefix cache can find (less each prompt's
    last, partial block; the replies resent are the dataset's, not what the model computed)."""
    requests = by_turn(conversations)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    resent = sum(len(a.prompt) for c in conversations for a in c.turns[:-1])
    return asdict(shape) | {
        "seed": seed,
        "turns": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(r.output_len for r in requests),
        "cacheable_share": resent / prompt_tokens,
    }


# -- offline ------------------------------------------------------------------------------------


def run_offline(args: argparse.Namespace, conversations: list[Conversation]) -> dict:
    from asyncllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    # prompts of another seed: warm, but nothing of the run's in the prefix cache
    rng = random.Random("warm-up")
    warmup = [
        {"prompt_token_ids": random_tokens(rng, args.max_len, args.vocab_size)} for _ in range(4)
    ]
    llm.generate(warmup, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    requests = by_turn(conversations)
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    core = llm.core_client.core
    before = core.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = core.stats()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.output_len for r in requests), "not every requested token came out"
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return {
        "seconds": elapsed,
        "output_throughput": produced / elapsed,
        "total_token_throughput": (produced + sum(len(r.prompt) for r in requests)) / elapsed,
        "prefix_cache_hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits)
        / max(queries, 1),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
    }


# -- serving ------------------------------------------------------------------------------------


async def run_conversations(
    session: aiohttp.ClientSession,
    server: Server,
    conversations: list[Conversation],
    times: list[float],
) -> tuple[list[list[RequestResult]], float]:
    """Each conversation's turns in order from its start time on; their results, and the run's
    duration."""
    url = server.base_url + "/v1/completions"
    start = time.perf_counter()

    async def converse(conversation: Conversation, at: float) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return [
            await send_request(session, url, server.headers, server.model, turn)
            for turn in conversation.turns
        ]

    results = await asyncio.gather(*(converse(c, t) for c, t in zip(conversations, times)))
    return list(results), time.perf_counter() - start


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    queries = after.get(QUERIES, 0.0) - before.get(QUERIES, 0.0)
    return (after[HITS] - before[HITS]) / queries if queries > 0 else None


async def one_run(
    session: aiohttp.ClientSession,
    server: Server,
    conversations: list[Conversation],
    rate: float,
    seed: int,
) -> dict:
    check_fits(by_turn(conversations), server.max_model_len)
    before = await server_metrics(session, server)
    times = arrival_times(len(conversations), rate, seed)
    per_conversation, duration = await run_conversations(session, server, conversations, times)
    after = await server_metrics(session, server)
    results = [r for turns in per_conversation for r in turns]
    run = {
        "conversation_rate": "inf" if math.isinf(rate) else rate,
        "conversations": len(conversations),
        "conversation_throughput": len(conversations) / duration,
        "prefix_cache_hit_rate": hit_rate(before, after),
    } | summarize(results, duration)
    firsts = [turns[0] for turns in per_conversation if turns[0].success]
    laters = [r for turns in per_conversation for r in turns[1:] if r.success]
    run |= distribution("ttft_first_turn", [r.ttft for r in firsts])
    run |= distribution("ttft_later_turns", [r.ttft for r in laters])
    if run["median_ttft_ms"]:
        run["p99_ttft_over_median"] = run["p99_ttft_ms"] / run["median_ttft_ms"]
    if CPU_SECONDS in before and CPU_SECONDS in after:
        run |= server_cpu(after[CPU_SECONDS] - before[CPU_SECONDS], results)
    return run


async def warm_up(session: aiohttp.ClientSession, server: Server, shape: ConversationShape):
    """One short request of another seed's tokens: nothing of the runs' in the prefix cache."""
    prompt = random_tokens(random.Random("warm-up"), shape.min_len, shape.vocab_size)
    url = server.base_url + "/v1/completions"
    result = await send_request(
        session, url, server.headers, server.model, SampleRequest(prompt, 4)
    )
    if not result.success:
        sys.exit(f"the warm-up request failed: {result.error}")


async def serve(args: argparse.Namespace, shape: ConversationShape) -> dict:
    server = Server(args.base_url.rstrip("/"), {"Content-Type": "application/json"})
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        await describe_server(session, server, args.model)
        await warm_up(session, server, shape)
        runs = {}
        if args.conversation_rate is not None:
            conversations = make_conversations(shape, args.seed)
            runs["at_rate"] = await one_run(
                session, server, conversations, args.conversation_rate, args.seed
            )
        else:
            saturation = make_conversations(shape, args.seed)
            runs["saturation"] = await one_run(session, server, saturation, math.inf, args.seed)
            half = runs["saturation"]["conversation_throughput"] / 2
            other = make_conversations(shape, args.seed + 1)
            runs["half_load"] = await one_run(session, server, other, half, args.seed + 1)
    described = {k: getattr(server, k) for k in ("base_url", "model", "version", "max_model_len")}
    return {"server": described, "runs": runs}


def against_offline(result: dict, offline_path: Path) -> dict:
    """The offline run's figures, and the first run's output throughput over them; the offline
    run must have drawn the same conversations."""
    offline = json.loads(offline_path.read_text())
    if offline["workload"] != result["workload"]:
        sys.exit(f"{offline_path} ran other conversations: {offline['workload']}")
    first = next(iter(result["runs"].values()))
    return {
        "offline": offline["offline"]
        | {k: offline[k] for k in ("device", "cpu", "torch", "triton") if k in offline}
        | {"file": str(offline_path)},
        "serving_over_offline": first["output_throughput"]
        / offline["offline"]["output_throughput"],
    }


def print_runs(result: dict) -> None:
    keys = (
        "conversation_rate",
        "completed",
        "failed",
        "output_throughput",
        "prefix_cache_hit_rate",
        "median_ttft_ms",
        "p99_ttft_ms",
        "p99_ttft_over_median",
        "median_ttft_later_turns_ms",
        "median_itl_ms",
        "p99_itl_ms",
    )
    for name, run in result["runs"].items():
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in run.items() if k in keys}
        print(f"{name}: {json.dumps(shown)}")
    if "serving_over_offline" in result:
        offline = result["offline"]
        print(
            f"offline: {offline['output_throughput']:.1f} output tok/s, hit rate "
            f"{offline['prefix_cache_hit_rate']:.3f}; serving / offline "
            f"{result['serving_over_offline']:.3f}"
        )


# -- command line -------------------------------------------------------------------------------


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("mode", choices=("offline", "serve"), help="which side to run")
    workload = parser.add_argument_group("conversations (the same for both modes)")
    workload.add_argument("--num-conversations", type=int, default=256)
    workload.add_argument("--min-turns", type=int, default=2, help="fewest turns a conversation")
    workload.add_argument("--max-turns", type=int, default=6, help="most turns a conversation")
    workload.add_argument("--min-len", type=int, default=4, help="shortest message and reply")
    workload.add_argument("--max-len", type=int, default=1024, help="longest message and reply")
    workload.add_argument("--max-context", type=int, default=4096, help="longest turn, in tokens")
    workload.add_argument("--vocab-size", type=int, default=32000, help="token ids < this")
    workload.add_argument("--seed", type=int, default=0, help="of the conversations and arrivals")
    offline = parser.add_argument_group("offline")
    offline.add_argument("--model", default=None, help="offline: HF folder (serve: name sent)")
    offline.add_argument("--load-format", default="auto", help="auto | dummy")
    offline.add_argument("--max-model-len", type=int, default=None)
    offline.add_argument("--max-num-batched-tokens", type=int, default=8192)
    offline.add_argument("--long-prefill-token-threshold", type=int, default=0)
    served = parser.add_argument_group("serve")
    served.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server")
    served.add_argument(
        "--conversation-rate",
        type=float,
        default=None,
        help="conversations started per second (None: saturation, then half its throughput)",
    )
    served.add_argument("--request-timeout", type=float, default=600.0, help="seconds each")
    served.add_argument("--offline", type=Path, default=None, help="an offline run's result")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_conversations < 1:
        parser.error("--num-conversations must be at least 1")
    if not 1 <= args.min_turns <= args.max_turns:
        parser.error("need 1 <= --min-turns <= --max-turns")
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")
    if args.max_context < 2 * args.max_len:
        parser.error("--max-context must hold a first turn: at least 2 * --max-len")
    if args.vocab_size <= 100:
        parser.error("--vocab-size must be over 100")
    if args.conversation_rate is not None and not args.conversation_rate > 0:
        parser.error("--conversation-rate must be positive")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    shape = ConversationShape(
        args.num_conversations,
        args.min_turns,
        args.max_turns,
        args.min_len,
        args.max_len,
        args.max_context,
        args.vocab_size,
    )
    conversations = make_conversations(shape, args.seed)
    result = {
        "benchmark": f"multiturn {args.mode}",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", sys.argv[0], *argv]),
        "python": platform.python_version(),
        "workload": workload_record(shape, args.seed, conversations),
    }
    if args.mode == "offline":
        result |= offline_record(args) | {"offline": run_offline(args, conversations)}
    else:
        result |= asyncio.run(serve(args, shape))
        if args.offline:
            result |= against_offline(result, args.offline)
    if args.mode == "serve":
        print_runs(result)
    else:
        print(f"offline: {json.dumps(result['offline'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


def offline_record(args: argparse.Namespace) -> dict:
    """The machine (on CPU its model and vector extensions) and the versions."""
    import torch
    import triton

    from bench.throughput import cpu_description

    if torch.cuda.is_available():
        machine = {"device": torch.cuda.get_device_name()}
    else:
        machine = {"device": f"cpu ({platform.machine()})", "cpu": cpu_description()}
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    return machine | {"model": args.model} | versions


if __name__ == "__main__":
    main()
