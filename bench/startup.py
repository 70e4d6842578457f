"""Time to healthy and memory of `make serve` on this machine, the first ten minutes of a user.

Runs `make serve` (the venv already installed: `-o` keeps make from reinstalling it), polls the
port and /health from the moment it starts, asks the README's question once, and reads the
server's RSS (VmRSS now, VmHWM its peak) from /proc. Writes a JSON result with the CPU model and
its vector extensions, as every CPU result names them:

    python bench/startup.py --venv /work/main/.venv --out bench/results/startup_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
_VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile")


def cpu_description() -> dict[str, object]:
    info = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    flags = info.get("Flags", "").split()
    return {
        "model": info.get("Model name", platform.processor()),
        "cores": os.cpu_count(),
        "vector_extensions": [f for f in _VECTOR_FLAGS if f in flags],
    }


def wait_for(check, deadline: float) -> float | None:
    """Seconds since the start when check() first held; None past the deadline."""
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.05)
    return None


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def ask(base: str) -> tuple[str, float]:
    body = json.dumps({"messages": QUESTION, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    start = time.monotonic()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())["choices"][0]["message"]["content"]
    return answer, time.monotonic() - start


def server_pid(make_pid: int) -> int:
    """The python process make started (its only child)."""
    children = Path(f"/proc/{make_pid}/task/{make_pid}/children").read_text().split()
    return int(children[0])


def memory_mib(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mib": fields["VmRSS"], "peak_rss_mib": fields["VmHWM"]}


def measure(venv: str, port: int, timeout: float) -> dict[str, object]:
    command = ["make", "-o", f"{venv}/.installed", "serve", f"VENV={venv}", f"PORT={port}"]
    base = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    make = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = start + timeout
        listening = wait_for(lambda: port_open(port), deadline)
        ready = wait_for(lambda: healthy(base), deadline)
        if ready is None:
            raise RuntimeError("the server did not become healthy in time")
        answer, answer_s = ask(base)
        memory = memory_mib(server_pid(make.pid))
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        log = make.communicate(timeout=60)[0].decode(errors="replace")
    return {
        "command": " ".join(command),
        "port_open_s": None if listening is None else round(listening - start, 2),
        "healthy_s": round(ready - start, 2),
        "answer": answer,
        "answer_s": round(answer_s, 2),
        **memory,
        "server_log_tail": log.splitlines()[-12:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".venv", help="an installed venv (make's VENV)")
    parser.add_argument("--port", type=int, default=8765, help="the port make serve gets")
    parser.add_argument("--runs", type=int, default=2, help="starts to time, one after another")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait per start")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args()
    print("bench/startup.py: time to healthy and RSS of `make serve`", file=sys.stderr)
    runs = [measure(args.venv, args.port, args.timeout) for _ in range(args.runs)]
    import torch

    result = {
        "benchmark": "time to healthy and RSS of make serve (default model, CPU)",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_description(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
