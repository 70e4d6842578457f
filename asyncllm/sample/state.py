"""SamplingState: what sampling keeps from one step to the next.

Per request: the number of tokens it has sampled (on the host: one per step it samples in), and
on the device its token history for the penalties and bad words, which record_sampled updates
from the step's sampled ids tensor, so the next step can be launched before they reach the host.
Per batch composition: a SamplingBatch, rebuilt only when the requests or their order change.

A request's history starts from its host token lists when it is first seen: forget it once
those lists and what was recorded part ways (it finished, or was preempted with a token in
flight, which will be sampled again).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from asyncllm.sample.batch import SamplingBatch
from asyncllm.sample.history import PenaltyHistory, RecentTokens
from asyncllm.sample.metadata import SamplingMetadata, SamplingRequest


class SamplingState:
    def __init__(self, device: torch.device, vocab_size: int, fused: bool | None = None) -> None:
        """vocab_size: token ids are below it. fused: run batches through the Triton sampler
        (by default on CUDA)."""
        self.device = device
        self.fused = device.type == "cuda" if fused is None else fused
        self.penalty_history = PenaltyHistory(vocab_size, device, self.fused)
        self.recent_tokens = RecentTokens(device)
        self._num_sampled: dict[str, int] = {}  # as of the current batch's first step
        self._batch: SamplingBatch | None = None

    def metadata(self, requests: Sequence[SamplingRequest]) -> SamplingMetadata:
        """The metadata of a step in which requests sample, one token each, in this order."""
        request_ids = tuple(r.request_id for r in requests)
        if self._batch is None or self._batch.request_ids != request_ids:
            self._end_batch()
            for request in requests:
                if request.request_id not in self._num_sampled:
                    self._add(request)
            num_sampled = tuple(self._num_sampled[i] for i in request_ids)
            self._batch = SamplingBatch(
                requests,
                num_sampled,
                self.penalty_history,
                self.recent_tokens,
                self.fused,
                self.device,
            )
        return self._batch.step_metadata()

    def record_sampled(self, meta: SamplingMetadata, sampled_token_ids: torch.Tensor) -> None:
        """After sampling meta's step: its ids (device int64 [B]) go into the histories, on the
        device."""
        batch = self._batch
        if batch is None or meta.random.step != batch.steps:
            raise RuntimeError("record_sampled must follow the metadata of the current step")
        batch.record(sampled_token_ids)
        batch.steps += 1

    def forget(self, request_ids: Iterable[str]) -> None:
        known = [i for i in request_ids if i in self._num_sampled]
        if known:
            self._end_batch()
        for request_id in known:
            del self._num_sampled[request_id]
            self.penalty_history.forget(request_id)
            self.recent_tokens.forget(request_id)

    def _add(self, request: SamplingRequest) -> None:
        self._num_sampled[request.request_id] = len(request.output_token_ids)
        if request.sampling_params.uses_penalties:
            self.penalty_history.add(request)
        if request.bad_words_token_ids:
            self.recent_tokens.add(request)

    def _end_batch(self) -> None:
        if self._batch is not None:
            for request_id, n in zip(self._batch.request_ids, self._batch.num_sampled):
                self._num_sampled[request_id] = n + self._batch.steps
        self._batch = None
