"""Per-request token histories kept on the device between steps.

Each is updated from a step's sampled ids tensor (record), never from host lists, so the next
step may be launched before those ids reach the host. A request gets a row (slot) of the
history's tables when first added, filled from its host token lists, and gives it back on forget.
"""

from __future__ import annotations

import numpy as np
import torch

import kernels
from asyncllm.sample.metadata import SamplingRequest


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """Through pinned memory on CUDA: a copy from pageable memory would wait for the stream."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _ids(token_ids: list[int], device: torch.device, dtype: type = np.int64) -> torch.Tensor:
    return to_device(np.asarray(token_ids, dtype=dtype), device)


class Slots:
    """Rows of a table, one per request, reused after forget."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}
        self._free: list[int] = []

    def add(self, request_id: str) -> int:
        slot = self._free.pop() if self._free else len(self.of)
        self.of[request_id] = slot
        return slot

    def forget(self, request_id: str) -> None:
        if (slot := self.of.pop(request_id, None)) is not None:
            self._free.append(slot)


def _grown(table: torch.Tensor, rows: int, cols: int, fill: int = 0) -> torch.Tensor:
    """table, or a copy at least rows x cols (doubling) with the old entries at the top left,
    or the top right when fill is -1 (right-aligned tables)."""
    old_rows, old_cols = table.shape
    if rows <= old_rows and cols <= old_cols:
        return table
    new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
    new_cols = max(cols, 2 * old_cols) if cols > old_cols else old_cols
    grown = torch.full((new_rows, new_cols), fill, dtype=table.dtype, device=table.device)
    first_col = new_cols - old_cols if fill == -1 else 0
    grown[:old_rows, first_col : first_col + old_cols] = table
    return grown


class PenaltyHistory:
    """The tokens of the requests with penalties: each one's output token counts and (with a
    repetition penalty) prompt token flags as [V] rows, for lookups, and the distinct tokens
    among them as a list, so that a step visits only those. fused: record with one kernel."""

    def __init__(self, vocab_size: int, device: torch.device, fused: bool) -> None:
        self.vocab_size = vocab_size
        self.fused = fused
        self.slots = Slots()
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.uint8, device=device)
        self.tokens = torch.zeros(0, 64, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(0, 1, dtype=torch.int32, device=device)  # of the lists
        # per slot, a bound on its list's length known without reading lengths
        self._bounds = np.zeros(0, dtype=np.int64)

    def add(self, request: SamplingRequest) -> None:
        slot = self.slots.add(request.request_id)
        params = request.sampling_params
        prompt = request.prompt_token_ids if params.repetition_penalty != 1.0 else []
        outputs = request.output_token_ids
        distinct = list(dict.fromkeys(prompt + outputs))
        if slot >= len(self._bounds):
            self._bounds = np.pad(self._bounds, (0, slot + 1))
        self._bounds[slot] = len(distinct)
        self._grow(slot + 1, len(distinct))
        device = self.counts.device
        output_ids = _ids(outputs, device)
        self.counts[slot] = 0
        self.counts[slot].index_add_(0, output_ids, torch.ones_like(output_ids, dtype=torch.int32))
        self.seen[slot] = 0
        self.seen[slot].index_fill_(0, _ids(prompt, device), 1)
        self.tokens[slot, : len(distinct)] = _ids(distinct, device, np.int32)
        self.lengths[slot] = len(distinct)

    def record(
        self, sampled: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray
    ) -> None:
        """Counts sampled[rows[i]] for the request in slots[i] (distinct slots; host_slots on
        the host), and lists it if new."""
        self._bounds[host_slots] += 1
        self._grow(self.counts.shape[0], int(self._bounds[host_slots].max()))
        if self.fused:
            kernels.record(sampled, rows, slots, self.counts, self.seen, self.tokens, self.lengths)
            return
        token_ids = sampled.index_select(0, rows)
        keys = slots * self.vocab_size + token_ids
        new = (self.counts.view(-1)[keys] == 0) & (self.seen.view(-1)[keys] == 0)
        # written whether new or not: past the end of the list unless its length grows
        self.tokens[slots, self.lengths[slots, 0].long()] = token_ids.to(torch.int32)
        self.lengths[slots, 0] += new.to(torch.int32)
        self.counts.view(-1).index_add_(0, keys, torch.ones_like(keys, dtype=torch.int32))

    def forget(self, request_id: str) -> None:
        self.slots.forget(request_id)

    def _grow(self, rows: int, longest: int) -> None:
        self.counts = _grown(self.counts, rows, self.vocab_size)
        self.seen = _grown(self.seen, rows, self.vocab_size)
        self.tokens = _grown(self.tokens, rows, longest + 1)
        self.lengths = _grown(self.lengths, rows, 1)


class RecentTokens:
    """The last output ids of the requests with bad words, right-aligned in an [S, W] table, W
    the longest bad-word prefix so far; -1 where the output is shorter."""

    def __init__(self, device: torch.device) -> None:
        self.slots = Slots()
        self.table = torch.full((0, 1), -1, dtype=torch.int64, device=device)

    def add(self, request: SamplingRequest) -> None:
        slot = self.slots.add(request.request_id)
        width = max(len(word) - 1 for word in request.bad_words_token_ids)
        self.table = _grown(self.table, slot + 1, width, fill=-1)
        self.table[slot] = -1
        last = request.output_token_ids[-self.table.shape[1] :]
        if last:
            self.table[slot, -len(last) :] = _ids(last, self.table.device)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        shifted = torch.cat([self.table[slots, 1:], token_ids[:, None]], dim=1)
        self.table.index_copy_(0, slots, shifted)

    def forget(self, request_id: str) -> None:
        self.slots.forget(request_id)
