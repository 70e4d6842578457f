"""The GIL's switch interval for the engine's threads. A thread waking from a wait outside the
GIL (the grammar fill on the step's sampled ids and on the grammar process's reply, the
collector on the device, the event loop on a socket) runs again only once the thread running
Python drops the GIL, which CPython forces after the switch interval: 5 ms by default, about
the length of a whole decode step. On the CPU here a woken thread waited a median 3.1 ms (p90
5-7 ms, up to 19) beside a busy one at 5 ms, 0.62 ms at 0.5 ms, with the busy thread's rate
unchanged within the noise (bench/results/gil_handoff_cpu_zen5.json). On CPU the model runs on
the core's own thread, so no step waits on the device: there the default stays (the offline
workload ran 0.6-3.9% slower with 0.5 ms, four interleaved pairs; bench/NOTES.md)."""

from __future__ import annotations

import sys

import torch

SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval(device: torch.device) -> None:
    """At most SWITCH_INTERVAL_S for this process where the model runs on a GPU (a shorter
    one set already stays)."""
    if device.type == "cuda":
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
