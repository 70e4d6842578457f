"""How long a thread that was waiting outside the GIL (for a pipe, an event, the device) waits
to run again while another thread runs Python, at several switch intervals (`sys.setswitchinterval`;
CPython's default is 5 ms), and what the busy thread loses by it. The engine core's thread runs
Python for milliseconds at a time (schedule, update, outputs) beside threads that wake on I/O:
the grammar fill waiting for sampled ids and the grammar process's reply, the collector
waiting for a step's event. A woken thread asks for the GIL and gets it only when the busy one
is forced to drop it, after the switch interval.

Here a child process writes its clock (CLOCK_MONOTONIC, shared by processes) to a pipe every
2 ms; a thread reads it (the read releases the GIL) and records how long after the write it
ran again, while the main thread runs a Python loop throughout.

    python bench/gil_handoff.py --out bench/results/gil_handoff_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

INTERVALS_S = (0.005, 0.001, 0.0005, 0.0002)


def write_clock(fd: int, period_s: float, stop_at: float) -> None:
    """The child: its clock into the pipe every period until stop_at."""
    while (now := time.perf_counter()) < stop_at:
        os.write(fd, struct.pack("d", now))
        time.sleep(period_s)


def busy_python(stop_at: float) -> int:
    """A Python loop over dicts and lists, as a scheduler's; how many rounds it made."""
    rounds, table = 0, {i: [i] for i in range(256)}
    while time.perf_counter() < stop_at:
        for key, value in table.items():
            value.append(key)
            value.pop()
        rounds += 1
    return rounds


def measure(interval_s: float, seconds: float) -> dict:
    sys.setswitchinterval(interval_s)
    read_fd, write_fd = os.pipe()
    stop_at = time.perf_counter() + seconds
    child = multiprocessing.get_context("fork").Process(
        target=write_clock, args=(write_fd, 0.002, stop_at)
    )
    delays: list[float] = []

    def read() -> None:
        while True:
            data = os.read(read_fd, 8)  # releases the GIL while it waits
            if len(data) < 8:
                return
            delays.append((time.perf_counter() - struct.unpack("d", data)[0]) * 1e3)

    reader = threading.Thread(target=read, daemon=True)
    child.start()
    os.close(write_fd)
    reader.start()
    rounds = busy_python(stop_at)
    child.join()
    reader.join(2)
    os.close(read_fd)
    delays.sort()
    return {
        "switch_interval_ms": interval_s * 1e3,
        "wakes": len(delays),
        "wake_delay_ms_median": statistics.median(delays),
        "wake_delay_ms_p90": delays[int(0.9 * len(delays))],
        "wake_delay_ms_max": delays[-1],
        "busy_rounds_per_s": rounds / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per interval and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved; the medians' median")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    default = sys.getswitchinterval()
    runs = {interval: [] for interval in INTERVALS_S}
    for _ in range(args.rounds):
        for interval in INTERVALS_S:
            runs[interval].append(measure(interval, args.seconds))
            print(json.dumps(runs[interval][-1]))
    sys.setswitchinterval(default)
    result = {
        "benchmark": "gil_handoff",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "cpu": platform.processor() or platform.machine(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "runs": [run for interval in INTERVALS_S for run in runs[interval]],
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
