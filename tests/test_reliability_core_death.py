"""The engine core's process dies (SIGKILL while idle or mid-stream) or raises: within 1 s every
open stream ends with an error event and /health answers 503; the server then starts a new core
by itself and serves again, up to --engine-restarts-per-minute, past which it stays down with
503. The dead core leaves no process, pipe or shared memory behind (read from /proc)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from test_reliability_support import is_openai_error, report, serving
from test_server_support import ServerProcess, parse_sse, tiny_server_args

from asyncllm import AsyncLLM, EngineArgs
from asyncllm.engine.core import EngineCore
from asyncllm.engine.core_client import CoreProcessClient
from asyncllm.engine.core_process import run_core_loop
from asyncllm.engine.messages import Failed
from asyncllm.executor.abstract import WorkerDiedError
from asyncllm.server.supervisor import RestartLimit

pytestmark = pytest.mark.asyncio(loop_scope="module")

NOTICE_S = 1.0  # the bound: streams ended and /health 503 this soon after the death
RESTART_BOUND_S = 120.0  # a new core loads the model; on a loaded machine this takes a while
STREAM = {"max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("core-death") / "server.log"
    process = ServerProcess(log, *tiny_server_args(tiny_model_dir, "--engine-process")).start()
    yield process
    process.stop()


def children(pid: int) -> list[int]:
    """Child processes of any of its threads (each thread's children are listed apart)."""
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return sorted(int(c) for t in tasks for c in (t / "children").read_text().split())


def pipes(pid: int) -> int:
    """Its open pipes and process handles (pidfds)."""
    targets = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            targets.append(os.readlink(fd))
    return sum(t.startswith(("pipe:", "anon_inode:[pidfd]")) for t in targets)


def shared_memory() -> set[str]:
    return set(os.listdir("/dev/shm"))


async def health(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(f"{url}/health") as response:
        return response.status


async def seconds_until_health(session, url: str, status: int, bound: float) -> float:
    start = time.monotonic()
    while await health(session, url) != status:
        assert time.monotonic() - start < bound, f"/health never answered {status}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def serves_a_request(session, url: str) -> bool:
    body = {"prompt": "after", "max_tokens": 4}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status == 200 and len((await response.json())["choices"]) == 1


async def core_pid(server: ServerProcess) -> int:
    (pid,) = children(server.process.pid)
    return pid


async def test_a_core_killed_while_idle_is_noticed_and_replaced(server) -> None:
    pid = server.process.pid
    async with aiohttp.ClientSession() as session:
        assert await serves_a_request(session, server.url)
        before = (pipes(pid), shared_memory())
        old = await core_pid(server)
        os.kill(old, signal.SIGKILL)
        noticed = await seconds_until_health(session, server.url, 503, NOTICE_S)
        back = await seconds_until_health(session, server.url, 200, RESTART_BOUND_S)
        assert await serves_a_request(session, server.url)
    report("core killed idle", health_503_s=noticed, serving_again_s=back)
    assert noticed < NOTICE_S
    assert not Path(f"/proc/{old}").exists()  # reaped, not a zombie
    (new,) = children(pid)
    assert new != old
    assert (pipes(pid), shared_memory()) == before


async def open_sse(session, url: str, i: int) -> tuple[aiohttp.ClientResponse, bytes]:
    response = await session.post(f"{url}/v1/completions", json={"prompt": f"s{i}", **STREAM})
    return response, await response.content.readuntil(b"\n\n")


async def test_a_core_killed_mid_stream_ends_every_stream_within_a_second(server) -> None:
    async with aiohttp.ClientSession() as session:
        await seconds_until_health(session, server.url, 200, RESTART_BOUND_S)
        streams = await asyncio.gather(*(open_sse(session, server.url, i) for i in range(4)))
        ws = await session.ws_connect(f"{server.url}/v1/stream")
        await ws.send_json({"id": "w", "endpoint": "completions", "body": {"prompt": "w", **STREAM}})  # fmt: skip
        frames = [await ws.receive_json()]
        killed = time.monotonic()
        os.kill(await core_pid(server), signal.SIGKILL)
        bodies = await asyncio.wait_for(
            asyncio.gather(*(r.read() for r, _ in streams)), NOTICE_S * 2
        )
        sse_s = time.monotonic() - killed
        while frames[-1]["type"] != "done":
            frames.append(await asyncio.wait_for(ws.receive_json(), NOTICE_S))
        ws_s = time.monotonic() - killed
        await ws.close()
        health_s = await seconds_until_health(session, server.url, 503, NOTICE_S)
        await seconds_until_health(session, server.url, 200, RESTART_BOUND_S)
        assert await serves_a_request(session, server.url)
    report("core killed mid-stream", sse_ended_s=sse_s, ws_ended_s=ws_s)
    for (_, head), body in zip(streams, bodies):
        events = parse_sse(head + body)
        assert events[-1] == "[DONE]" and is_openai_error(events[-2])
        assert events[-2]["error"]["type"] == "service_unavailable"
    assert [f["type"] for f in frames[-2:]] == ["error", "done"]
    assert max(sse_s, ws_s) < NOTICE_S and health_s < NOTICE_S


def make_core_raise(engine: AsyncLLM) -> None:
    """A message the core cannot apply: its loop raises, and the process reports Failed."""
    engine.core_client._inbox.send("not a message")


async def test_a_core_that_raises_is_replaced_until_the_limit(tiny_model_dir) -> None:
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, engine_process=True)
    engine = AsyncLLM.from_engine_args(args)
    try:
        async with serving(engine, engine_restarts_per_minute=1) as (url, _):
            async with aiohttp.ClientSession() as session:
                assert await serves_a_request(session, url)
                first = engine.core_client
                make_core_raise(engine)
                await seconds_until_health(session, url, 503, NOTICE_S)
                await seconds_until_health(session, url, 200, RESTART_BOUND_S)
                assert engine.core_client is not first and first.process.poll() == 0
                assert await serves_a_request(session, url)
                make_core_raise(engine)  # the second death within a minute: past the limit
                await seconds_until_health(session, url, 503, NOTICE_S)
                await asyncio.sleep(1.0)
                assert await health(session, url) == 503
                body = {"prompt": "refused", "max_tokens": 4}
                async with session.post(f"{url}/v1/completions", json=body) as refused:
                    assert refused.status == 503
                    assert is_openai_error(await refused.json())
            assert isinstance(engine.core_client, CoreProcessClient)
    finally:
        await engine.shutdown()
    assert engine.core_client.process.poll() is not None


async def test_an_in_process_core_whose_loop_raises_is_replaced_too(tiny_model_dir) -> None:
    """The CPU default: the core in the server's process, its step raising outside a request."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=256))
    broken = engine.core_client.core

    def schedule():
        raise RuntimeError("injected fault: the scheduler's state is broken")

    broken.scheduler.schedule = schedule
    try:
        async with serving(engine) as (url, _), aiohttp.ClientSession() as session:
            body = {"prompt": "doomed", "max_tokens": 4}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 503 and is_openai_error(await response.json())
            await seconds_until_health(session, url, 200, RESTART_BOUND_S)
            assert engine.core_client.core is not broken
            assert await serves_a_request(session, url)
    finally:
        await engine.shutdown()


async def test_restarts_are_limited_per_minute() -> None:
    now = [0.0]
    limit = RestartLimit(2, clock=lambda: now[0])
    assert limit.take()
    now[0] = 30.0
    assert limit.take()
    now[0] = 59.0
    assert not limit.take()
    now[0] = 60.5  # the first has left the window; the refused one was not counted
    assert limit.take()
    assert not limit.take()


async def test_a_failed_executor_fails_the_core_process_loop(tiny_model_dir) -> None:
    """A worker that dies while the core idles: the executor's failure callback queues Failed,
    and the loop raises, so the core process reports Failed like any death."""
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256)
    core = EngineCore(args.create_engine_config())
    messages: queue.Queue = queue.Queue()
    messages.put(Failed("worker 1 exited with code -9"))
    try:
        with pytest.raises(WorkerDiedError, match="worker 1 exited"):
            run_core_loop(core, messages, lambda step: None)
    finally:
        core.shutdown()
