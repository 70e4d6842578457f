"""Helpers the server tests share: a real `python -m asyncllm.serve` process on a real port.

No tests here; the other test_server_* files import from this module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from asyncllm import AsyncLLM
from asyncllm.server import ServerArgs, build_app

_SERVING = re.compile(r"serving .* on (http://[\d.]+:\d+)")


class ServerProcess:
    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self.args = [sys.executable, "-m", "asyncllm.serve", "--port", "0", *args]
        self.url = ""
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        env = {**os.environ, "ASYNCLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + timeout
        while not self.url:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited early:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start in time:\n{self.log()}")
            match = _SERVING.search(self.log())
            self.url = match.group(1) if match else ""
            time.sleep(0.1)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def tiny_server_args(model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--max-model-len", "512", "--num-kv-blocks", "2048", *extra]


def parse_sse(raw: bytes) -> list[dict | str]:
    """`data:` events of an SSE body: decoded chunk objects, and "[DONE]" as a string."""
    events = []
    for block in raw.decode().split("\n\n"):
        payload = sse_fields(block).get("data")
        if payload is not None:
            events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def sse_fields(block: str) -> dict[str, str]:
    """The fields of one SSE event (data, id, event)."""
    return dict(line.partition(": ")[::2] for line in block.split("\n") if line)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for unlabelled-by-bucket samples (first label set)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if "_bucket" not in name:
            values.setdefault(name, float(value))
    return values


@asynccontextmanager
async def serving(engine: AsyncLLM, **server_args: Any):
    """build_app on a free loopback port, in this event loop; yields (url, app)."""
    app = build_app(engine, ServerArgs(**server_args))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}", app
    finally:
        await runner.cleanup()
