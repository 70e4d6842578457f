"""`python -m asyncllm.serve --model PATH`: the OpenAI-compatible server, one process, one uvloop
event loop, the engine task beside the HTTP server. SIGTERM drains: stop accepting, let in-flight
streams finish (up to --shutdown-timeout, then end them with an error event), exit 0."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time

import uvloop
from aiohttp import web

from asyncllm.config import EngineArgs
from asyncllm.debugging import configure_logging, start_function_trace
from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.engine.heap import freeze_startup_objects, use_one_malloc_arena
from asyncllm.server.access_log import ACCESS_LOGGER, AccessLogger
from asyncllm.server.app import STATE, ServerArgs, build_app
from asyncllm.server.header_timeout import HeaderTimeoutRunner
from asyncllm.server.protocol import overloaded
from asyncllm.server.reasoning_parsers import REASONING_PARSERS
from asyncllm.server.response_store import ResponseStoreError, open_response_store
from asyncllm.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("asyncllm.serve")
_BACKLOG = 1024
_FAREWELL_S = 2.0  # after the shutdown timeout: time for the streams to send their error event


# the help of each ServerArgs and EngineArgs flag (a test keeps one for every field)
SERVER_FLAG_HELP = {
    "host": "the address to listen on",
    "port": "0: any free port",
    "api_key": "require Authorization: Bearer KEY (default: $ASYNCLLM_API_KEY); /health and "
    "/metrics stay open",
    "served_model_name": "the name /v1/models lists (None: --model)",
    "root_path": "serve every route under this prefix",
    "max_request_body_bytes": "larger bodies get 413",
    "max_concurrent_requests": "generation requests in flight before 429 (0: no limit)",
    "max_waiting_requests": "requests admitted but not yet scheduled before 503 (0: no limit)",
    "max_queue_wait": "seconds a request may wait to be scheduled before it ends with 503 "
    "(0: no limit)",
    "trust_request_chat_template": "accept a chat_template in a request's chat_template_kwargs "
    "(rendered sandboxed)",
    "keepalive_interval": "seconds without output before a `: keep-alive` SSE comment",
    "shutdown_timeout": "seconds in-flight streams get to finish after SIGTERM",
    "stream_retention": "seconds a resumable stream keeps generating with nobody reading, and "
    "is kept for GET /v1/streams/{id} once finished",
    "stream_buffer_bytes": "bytes of events all resumable streams may hold",
    "response_store": "where the Responses API stores responses: sqlite:///PATH (default: "
    "responses.sqlite3 in the cache folder, $ASYNCLLM_CACHE_DIR or ~/.cache/asyncllm)",
    "keep_alive_timeout": "seconds a connection may take to send a whole request (idle or "
    "slow) before it is closed",
    "header_timeout": "seconds a request's headers may take from their first byte before a 408 "
    "closes the connection (0: no limit but --keep-alive-timeout)",
    "body_timeout": "seconds a request's body may take to arrive after its headers before a 408 "
    "(0: no limit)",
    "engine_restart": "start a new engine core when it dies (/health is 503 meanwhile)",
    "engine_restarts_per_minute": "past this many restarts in 60 s a dead engine stays down, "
    "/health 503",
    "tool_call_parser": "the model's tool-call format, for tool_choice auto",
    "reasoning_parser": "keep <think> reasoning apart, in reasoning_content",
}
ENGINE_FLAG_HELP = {
    "model": "Hugging Face folder or .gguf file (None: the default SmolLM2-135M-Instruct)",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 (on CPU: bf16 weights "
    "and KV cache, float32 activations; needs AVX512_BF16 or AMX to be fast) or float16",
    "device": "auto (cuda when there is one), cpu or cuda",
    "load_format": "auto (the folder's safetensors) or dummy (random weights, for benchmarks)",
    "max_model_len": "the longest sequence, prompt and output (None: the model's limit)",
    "block_size": "tokens per KV cache block",
    "kv_cache_memory": "bytes for the KV cache (None: on CUDA what --gpu-memory-utilization "
    "leaves; on CPU what max_num_seqs x max_model_len can use, at most 256 MiB but one whole "
    "sequence at least)",
    "gpu_memory_utilization": "the share of GPU memory the engine may take, KV cache included",
    "num_kv_blocks": "an exact KV block count, over the memory settings",
    "max_num_seqs": "requests in one engine step",
    "max_num_batched_tokens": "tokens in one engine step",
    "enable_prefix_caching": "reuse the KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "take a long prompt in over several steps",
    "long_prefill_token_threshold": "the most prompt tokens one request computes per step "
    "(0: no cap), so that long prompts stall the streams beside them less",
    "scheduling_policy": "fcfs or priority (a request's priority field, lower first)",
    "attention_backend": "auto (triton on CUDA, torch on CPU), torch or triton",
    "enforce_eager": "no CUDA graphs",
    "async_scheduling": "schedule step N+1 while step N runs (None: on with a GPU)",
    "engine_process": "run the engine core in a process of its own (None: on with a GPU)",
    "seed": "the engine's random seed (requests without one of their own)",
    "max_logprobs": "the most logprobs a request may ask for",
    "generation_config": "the defaults of the sampling fields a request leaves out: auto "
    "(the model's generation_config.json), vllm (none: SamplingParams' own) or a path",
    "override_generation_config": "JSON laid over those defaults, e.g. "
    '\'{"temperature": 0, "max_new_tokens": 64}\'',
    "tensor_parallel_size": "ranks the model is split across, one worker process or Ray actor each",
    "distributed_executor_backend": "mp (worker processes on this machine) or ray (actors on the "
    "machines of a Ray cluster: pip install asyncllm[ray])",
    "speculative_config": "speculative decoding as JSON with vLLM's keys, e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
    "(method ngram; draft_model, eagle, eagle3 or medusa with model)",
    "quantization": "a quantization method for an unquantized checkpoint: fp8 or, on CPU, int8 "
    "(weights quantized at load); None: the checkpoint's own quantization_config, if any",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (e4m3, half a bf16 cache's bytes)",
    "profiler_dir": "a folder for the engine core's torch profiler traces, which turns on POST "
    "/start_profile and /stop_profile (None: $ASYNCLLM_TORCH_PROFILER_DIR, else off)",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help says it already (--api-key: never the key)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    server_flags = {
        "api_key": {"default": os.environ.get("ASYNCLLM_API_KEY")},
        "tool_call_parser": {"choices": sorted(TOOL_PARSERS)},
        "reasoning_parser": {"choices": sorted(REASONING_PARSERS)},
    }
    add_flags(parser.add_argument_group("server"), ServerArgs, SERVER_FLAG_HELP, server_flags)
    add_flags(parser.add_argument_group("engine"), EngineArgs, ENGINE_FLAG_HELP, {})
    return parser


def add_flags(
    group: argparse._ArgumentGroup, cls: type, helps: dict[str, str], special: dict[str, dict]
) -> None:
    """One flag per field of the dataclass `cls`, typed from its default (vLLM's flag names);
    `special` adds or replaces argparse keywords of some."""
    for f in dataclasses.fields(cls):
        options = {"default": f.default, "help": helps.get(f.name, "")}
        if str(f.type).startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif isinstance(f.default, int | float):
            options["type"] = type(f.default)
        else:
            options["type"] = int if str(f.type).startswith("int") else str
        options.update(special.get(f.name, {}))
        group.add_argument("--" + f.name.replace("_", "-"), **options)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        **{f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)}
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, taken before the model loads so that a busy port fails at once;
    connections that come during the load wait in its backlog."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(namespace: argparse.Namespace, sock: socket.socket) -> None:
    server_args = ServerArgs.from_namespace(namespace)
    try:  # before the model loads: a store that cannot be written fails at once
        store = open_response_store(server_args.response_store)
    except ResponseStoreError as e:
        raise SystemExit(f"asyncllm: {e}") from e
    loop = asyncio.get_running_loop()
    engine_args = engine_args_from(namespace)
    started = time.perf_counter()
    logger.info("loading the model: %s", engine_args.model or "the default model")
    engine = await loop.run_in_executor(None, AsyncLLM.from_engine_args, engine_args)
    logger.info("model loaded in %.1f s", time.perf_counter() - started)
    app = build_app(engine, server_args, store)
    freeze_startup_objects()
    runner = HeaderTimeoutRunner(
        app,
        header_timeout=server_args.header_timeout,
        handler_cancellation=True,  # a client that goes away cancels its handler: abort
        access_log_class=AccessLogger,
        access_log=logging.getLogger(ACCESS_LOGGER),
        shutdown_timeout=1.0,
        keepalive_timeout=server_args.keep_alive_timeout,
    )
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    print(f"asyncllm: serving {app[STATE].model_name} on http://{host}:{port}", flush=True)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    state = app[STATE]
    logger.info("shutting down: draining %d request(s) in flight", state.in_flight)
    state.draining = True
    await site.stop()  # stop accepting connections; open ones finish their streams
    if not await state.drain(server_args.shutdown_timeout):
        logger.warning("shutdown timeout: ending %d request(s)", state.in_flight)
        state.end_all(overloaded("the server is shutting down."))
        await state.drain(_FAREWELL_S)
    await runner.cleanup()
    await engine.shutdown()
    logger.info("stopped")


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    use_one_malloc_arena()
    namespace = make_parser(prog).parse_args(argv)
    configure_logging()
    start_function_trace("server")
    try:
        sock = bind_socket(namespace.host, namespace.port)
    except OSError as e:
        where = f"{namespace.host}:{namespace.port}"
        sys.exit(f"asyncllm: cannot listen on {where}: {e.strerror or e} (--port picks another)")
    logger.info("listening on %s:%d", *sock.getsockname()[:2])
    uvloop.run(serve(namespace, sock))


if __name__ == "__main__":
    main()
