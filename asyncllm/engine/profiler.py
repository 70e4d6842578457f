"""The torch profiler around the engine core's work, switched on and off by the front end
(POST /start_profile, /stop_profile): each stop writes one trace of what ran between, in the
Chrome / TensorBoard format, into the folder of --profiler-dir (or
$ASYNCLLM_TORCH_PROFILER_DIR)."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


class CoreProfiler:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if self._profile is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        name = f"engine_core_pid{os.getpid()}"
        self._profile = torch.profiler.profile(
            activities=activities,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.folder, name),
        )
        self._profile.start()
        logger.info("profiling the engine core into %s", self.folder)

    def stop(self) -> None:
        if self._profile is None:
            return
        self._profile.stop()  # writes the trace
        self._profile = None
        logger.info("profile of the engine core written to %s", self.folder)
