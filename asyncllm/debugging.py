"""The debugging switches, read from the environment in every process (the server and the engine
core's process alike), as vLLM's VLLM_* variables are:

ASYNCLLM_LOGGING_LEVEL=DEBUG       each request's path: received, tokenized, in the core,
                                   scheduled, finished or aborted (default INFO)
ASYNCLLM_TRACE_FUNCTION=1          every call and return in asyncllm's own code, one file per
                                   process, under ASYNCLLM_TRACE_DIR (default
                                   $TMPDIR/asyncllm_trace); slows everything down many times
ASYNCLLM_LOG_SCHEDULER=1           one line per engine step: what was scheduled, what was
                                   preempted, the token budget used, the KV blocks
ASYNCLLM_TORCH_PROFILER_DIR=DIR    the engine core's torch profiler traces go to DIR
                                   (--profiler-dir takes precedence), POST /start_profile and
                                   /stop_profile are served
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import IO, Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s"
_PACKAGE_DIR = str(Path(__file__).parent)


def configure_logging() -> None:
    level = os.environ.get("ASYNCLLM_LOGGING_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)


def log_scheduler() -> bool:
    return os.environ.get("ASYNCLLM_LOG_SCHEDULER", "0") == "1"


def profiler_dir(configured: str | None) -> str | None:
    """Where the engine core's profiler traces go; None: profiling is off."""
    return configured or os.environ.get("ASYNCLLM_TORCH_PROFILER_DIR") or None


def trace_dir() -> Path:
    default = Path(tempfile.gettempdir()) / "asyncllm_trace"
    return Path(os.environ.get("ASYNCLLM_TRACE_DIR") or default)


def start_function_trace(process_name: str) -> Path | None:
    """With ASYNCLLM_TRACE_FUNCTION=1, traces this process's calls into asyncllm's code (in
    every thread started from now on, and this one); returns the trace file."""
    if os.environ.get("ASYNCLLM_TRACE_FUNCTION", "0") != "1":
        return None
    folder = trace_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    path = folder / f"{process_name}_pid{os.getpid()}_{stamp}.log"
    tracer = FunctionTracer(open(path, "a", buffering=1))  # noqa: SIM115 (open for the process's life)
    threading.settrace(tracer)
    sys.settrace(tracer)
    logging.getLogger(__name__).warning("tracing every function call into %s", path)
    return path


class FunctionTracer:
    """A sys.settrace hook writing one line per call and return of asyncllm's functions."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self._lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> FunctionTracer | None:
        if event not in ("call", "return"):
            return self  # the lines of a traced function: keep tracing it, write nothing
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE_DIR):
            return None  # nor the lines and returns inside it
        where = f"{code.co_qualname} in {code.co_filename}:{frame.f_lineno}"
        if event == "call":
            caller = frame.f_back
            origin = f" from {caller.f_code.co_filename}:{caller.f_lineno}" if caller else ""
            line = f"Call to {where}{origin}"
        else:
            line = f"Return from {where}"
        stamp = datetime.datetime.now().isoformat(timespec="microseconds")
        with self._lock:
            self.out.write(f"{stamp} {threading.current_thread().name} {line}\n")
        return self
