"""Persistent step inputs: block tables that live across steps and staging buffers reused
every step, so a decode step appends a block id now and then instead of rebuilding tables.

Host arrays are numpy views of pinned tensors (on CUDA), copied to fixed device buffers with
non_blocking copies; the device buffers double as the static inputs of the CUDA graphs. With
async scheduling a step is prepared while the one before runs: the host staging is double
buffered, and a token the step before is still sampling is copied over on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.attention.backend import AttentionMetadata
from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.worker.step_plan import StepPlan, StepRunner


@dataclass
class StepInputs:
    # tokens handed to the model: padded up to a CUDA graph's size
    padded_tokens: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # flat row of the last token of each request that samples; a slice of the first rows when
    # every token samples (a decode step), so that picking them copies nothing
    logits_indices: torch.Tensor | slice
    sampling_rows: list[int]  # scheduled index of each logits row
    batch_rows: np.ndarray  # each scheduled request's row of the batch
    token_rows: np.ndarray  # each (unpadded) token's row of the batch
    new_rows: list[int]  # scheduled indices of the requests given a row this step


@dataclass
class DeviceTokens:
    """The ids a launched step sampled, still on the device: inputs of the next step for the
    requests it was scheduled ahead for, with the drafts proposed after them and how many of
    each row's drafts the step rejected (how far back of its scheduled start the next step
    begins). When that step failed (lost), its requests are being failed too: their rows
    compute on placeholder tokens and their outputs are discarded."""

    token_ids: torch.Tensor  # int64 [R]
    rows: dict[str, int]  # request id -> index in token_ids
    lost: bool = False
    drafts: torch.Tensor | None = None  # int64 [R, k]; -1: no draft
    num_rejected: torch.Tensor | None = None  # int64 [R]; None: no drafts were verified


@dataclass
class _OnDevice:
    """The inputs of a step's rows scheduled ahead, as flat host arrays: per token, its flat
    row, its source row in DeviceTokens, its column (0: the sampled token, j: draft j) and its
    request's row in the step; per request, its row in the step and its source row."""

    targets: np.ndarray
    sources: np.ndarray
    columns: np.ndarray
    owners: np.ndarray
    request_rows: np.ndarray
    request_sources: np.ndarray

    @classmethod
    def of(
        cls, rows: list[int], starts: list[int], counts: list[int], sources: list[int]
    ) -> _OnDevice:
        """Request i's `counts[i]` inputs from flat row `starts[i]` on come from its row
        `sources[i]` of DeviceTokens (built in numpy: a Python list per token cost 1 us a
        request at 256 decodes)."""
        counts_np = np.array(counts, dtype=np.int64)
        firsts = np.cumsum(counts_np) - counts_np
        columns = np.arange(int(counts_np.sum())) - np.repeat(firsts, counts_np)
        request_rows = np.array(rows, dtype=np.int64)
        request_sources = np.array(sources, dtype=np.int64)
        return cls(
            targets=np.repeat(np.array(starts, dtype=np.int64), counts_np) + columns,
            sources=np.repeat(request_sources, counts_np),
            columns=columns,
            owners=np.repeat(request_rows, counts_np),
            request_rows=request_rows,
            request_sources=request_sources,
        )


def _logits_rows(ends: np.ndarray, sampling: list[ScheduledRequest]) -> np.ndarray:
    """Flat rows whose logits are sampled: each request's last, and before it one per draft
    it verifies (the position of the token each draft follows)."""
    num_drafts = np.array([len(s.spec_token_ids) for s in sampling], dtype=np.int64)
    if not num_drafts.any():
        return ends - 1
    counts = num_drafts + 1
    firsts = np.repeat(ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class _Buffer:
    """Pinned host tensors with numpy views, and their device twin. Steps alternate between two
    host tensors: when step N+1 is filled, step N's copy may still wait on the stream, but step
    N-1, which used the same tensor, is done."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        hosts = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self._sides = [(host, host.numpy()) for host in hosts]
        self._side = 0
        self.host, self.np = self._sides[0]
        self.device = torch.zeros(shape, dtype=dtype, device=device)

    def flip(self) -> None:
        self._side = 1 - self._side
        self.host, self.np = self._sides[self._side]

    def copy_rows(self, n: int) -> torch.Tensor:
        self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_reqs = max_num_reqs
        max_blocks = -(-max_model_len // block_size)
        num_rows = self.rows_for(max_num_reqs)
        self.block_table = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int32)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.input_ids = _Buffer((max_num_tokens,), torch.int64, device)
        self.positions = _Buffer((max_num_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_num_tokens,), torch.int64, device)
        self.query_start_loc = _Buffer((max_num_reqs + 1,), torch.int32, device)
        self.seq_lens = _Buffer((max_num_reqs,), torch.int32, device)
        self.block_tables = _Buffer((max_num_reqs, max_blocks), torch.int32, device)
        # a row per sampling request, or per scored position of a step verifying drafts
        self.logits_indices = _Buffer((max_num_tokens,), torch.int64, device)
        # the inputs of rows scheduled ahead, sent in one copy (_OnDevice's lists end to end)
        self.on_device = _Buffer((4 * max_num_tokens + 2 * max_num_reqs,), torch.int64, device)
        self._buffers = [v for v in vars(self).values() if isinstance(v, _Buffer)]

    @staticmethod
    def rows_for(max_num_reqs: int) -> int:
        # rows outlive a request by one step (finished ids arrive with the next schedule)
        return 2 * max_num_reqs

    def remove_requests(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.num_blocks[row] = 0
                self.free_rows.append(row)

    def prepare(
        self,
        scheduler_output: SchedulerOutput,
        plan: StepPlan | None = None,
        previous: DeviceTokens | None = None,
    ) -> StepInputs:
        """Fill the buffers for this step, padded to the plan's tokens and requests (None: as
        scheduled); previous: the ids sampled by the step before, for inputs not yet on the
        host."""
        self.remove_requests(scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids)
        for buffer in self._buffers:
            buffer.flip()
        scheduled = scheduler_output.scheduled
        new_rows = [i for i, s in enumerate(scheduled) if s.request.request_id not in self.rows]
        rows = np.array([self._sync_row(s.request.request_id, s.block_ids) for s in scheduled])
        starts = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64)
        counts = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        num_reqs, num_tokens = len(scheduled), int(counts.sum())
        plan = plan or StepPlan(StepRunner.EAGER, num_tokens, num_reqs)
        cu = np.cumsum(counts)
        on_device = self._fill_input_ids(scheduler_output, cu, previous)
        owner = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens) - np.repeat(cu - counts, counts) + starts[owner]
        self.positions.np[:num_tokens] = positions
        blocks = self.block_table[rows[owner], positions // self.block_size]
        self.slot_mapping.np[:num_tokens] = (
            blocks.astype(np.int64) * self.block_size + positions % self.block_size
        )
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu
        seq_lens = starts + counts
        self.seq_lens.np[:num_reqs] = seq_lens
        width = int(self.num_blocks[rows].max())
        self.block_tables.np[:num_reqs, :width] = self.block_table[rows, :width]

        sampling_rows = [i for i, s in enumerate(scheduled) if s.completes_prompt]
        if len(sampling_rows) == num_tokens:  # one token a request, each sampling: rows in order
            logits_indices: torch.Tensor | slice = slice(0, num_tokens)
        else:
            rows_logits = _logits_rows(cu[sampling_rows], [scheduled[r] for r in sampling_rows])
            self.logits_indices.np[: len(rows_logits)] = rows_logits
            logits_indices = self.logits_indices.copy_rows(len(rows_logits))

        self._pad(plan, num_reqs, num_tokens)
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc.copy_rows(plan.num_reqs + 1),
            seq_lens=self.seq_lens.copy_rows(plan.num_reqs),
            block_tables=self._copy_tables(plan.num_reqs, width),
            slot_mapping=self.slot_mapping.copy_rows(plan.num_tokens),
            max_query_len=int(counts.max()),
            # the decode graphs' value: eager runs of their steps choose the same splits
            max_seq_len=self.max_model_len if plan.pure_decode else int(seq_lens.max()),
            query_lens_cpu=counts.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        inputs = StepInputs(
            padded_tokens=plan.num_tokens,
            input_ids=self.input_ids.copy_rows(plan.num_tokens),
            positions=self.positions.copy_rows(plan.num_tokens),
            meta=meta,
            logits_indices=logits_indices,
            sampling_rows=sampling_rows,
            batch_rows=rows,
            token_rows=rows[owner],
            new_rows=new_rows,
        )
        if len(on_device.targets):
            self._take_from_device(inputs, on_device, previous)
        return inputs

    def _take_from_device(
        self, inputs: StepInputs, on_device: _OnDevice, previous: DeviceTokens
    ) -> None:
        """The inputs of the rows scheduled ahead: the token the step before sampled, the
        drafts proposed after it, and the positions, slots and lengths moved back by the
        drafts that step rejected (the scheduler counted them as accepted)."""
        parts = [
            on_device.targets,
            on_device.sources,
            on_device.columns,
            on_device.owners,
            on_device.request_rows,
            on_device.request_sources,
        ]
        sizes = [len(p) for p in parts]
        self.on_device.np[: sum(sizes)] = np.concatenate(parts)
        flat = self.on_device.copy_rows(sum(sizes))
        targets, sources, columns, owners, rows, row_sources = flat.split(sizes)
        token_ids = previous.token_ids.index_select(0, sources)
        if previous.drafts is not None:
            drafts = previous.drafts[sources, (columns - 1).clamp(min=0)]
            # a row with no draft there verifies token 0: accepted only where the target
            # samples 0, which is exact all the same
            token_ids = torch.where(columns > 0, drafts.clamp(min=0), token_ids)
        inputs.input_ids.index_copy_(0, targets, token_ids)
        if previous.num_rejected is None:
            return
        meta, block_size = inputs.meta, self.block_size
        positions = inputs.positions.index_select(0, targets)
        positions -= previous.num_rejected.index_select(0, sources)
        inputs.positions.index_copy_(0, targets, positions)
        blocks = meta.block_tables[owners, positions // block_size].long()
        meta.slot_mapping.index_copy_(0, targets, blocks * block_size + positions % block_size)
        moved = previous.num_rejected.index_select(0, row_sources).to(meta.seq_lens.dtype)
        meta.seq_lens.index_add_(0, rows, -moved)
        if meta.seq_lens.device.type == "cpu":  # the torch backend reads the host's lengths
            meta.seq_lens_cpu = meta.seq_lens[: len(meta.seq_lens_cpu)].tolist()

    def _fill_input_ids(
        self, scheduler_output: SchedulerOutput, ends: np.ndarray, previous: DeviceTokens | None
    ) -> _OnDevice:
        """Writes the host-known input ids; lists the ones still on the device (those of a
        request scheduled ahead of the step that samples its last token)."""
        ids = self.input_ids.np
        rows, starts, counts, sources = [], [], [], []
        for row, (s, end) in enumerate(zip(scheduler_output.scheduled, ends.tolist())):
            start = end - s.num_new_tokens
            known = start + len(s.token_ids)
            if known > start:
                ids[start:known] = s.token_ids
            if known == end:
                continue
            ids[known:end] = 0
            source = None if previous is None else previous.rows.get(s.request.request_id)
            if source is None and previous is not None and previous.lost:
                continue
            if source is None:
                raise RuntimeError(
                    f"the input token of request {s.request.request_id!r} is neither on "
                    "the host nor sampled by the previous step"
                )
            rows.append(row)
            starts.append(known)
            counts.append(end - known)
            sources.append(source)
        return _OnDevice.of(rows, starts, counts, sources)

    def _sync_row(self, request_id: str, block_ids: list[int]) -> int:
        """The request's row, with any blocks allocated since the last step appended."""
        row = self.rows.get(request_id)
        if row is None:
            row = self.rows[request_id] = self.free_rows.pop()
        known = int(self.num_blocks[row])
        if len(block_ids) > known:
            self.block_table[row, known : len(block_ids)] = block_ids[known:]
            self.num_blocks[row] = len(block_ids)
        return row

    def fill_padding(self, plan: StepPlan) -> None:
        """The device buffers of a step of padding only, writing no KV: what graphs of the
        plan's runner are captured over."""
        self.query_start_loc.np[0] = 0
        self._pad(plan, 0, 0)
        for buffer in (self.input_ids, self.positions, self.slot_mapping):
            buffer.copy_rows(plan.num_tokens)
        self.query_start_loc.copy_rows(plan.num_reqs + 1)
        self.seq_lens.copy_rows(plan.num_reqs)
        self.block_tables.copy_rows(plan.num_reqs)

    def _pad(self, plan: StepPlan, num_reqs: int, num_tokens: int) -> None:
        if plan.pure_decode:
            self._pad_decodes(num_reqs, plan.num_reqs)
        else:
            self._pad_tokens(num_tokens, plan.num_tokens)
            self._pad_empty_requests(num_reqs, plan.num_reqs, num_tokens)

    def _pad_decodes(self, num_reqs: int, pad_to: int) -> None:
        """Padding rows: one token each, writing nowhere, attending to one (ignored) slot."""
        self.input_ids.np[num_reqs:pad_to] = 0
        self.positions.np[num_reqs:pad_to] = 0
        self.slot_mapping.np[num_reqs:pad_to] = -1
        self.query_start_loc.np[num_reqs + 1 : pad_to + 1] = np.arange(num_reqs + 1, pad_to + 1)
        self.seq_lens.np[num_reqs:pad_to] = 1
        self.block_tables.np[num_reqs:pad_to, 0] = 0

    def _pad_tokens(self, start: int, end: int) -> None:
        """Padding tokens: token 0 at position 0, writing nowhere; no request's query covers
        them, so attention leaves their rows alone."""
        self.input_ids.np[start:end] = 0
        self.positions.np[start:end] = 0
        self.slot_mapping.np[start:end] = -1

    def _pad_empty_requests(self, num_reqs: int, pad_to: int, num_tokens: int) -> None:
        """Padding requests of no tokens, starting where the last real query ends: attention
        skips them, and their block tables are never read."""
        self.query_start_loc.np[num_reqs + 1 : pad_to + 1] = num_tokens
        self.seq_lens.np[num_reqs:pad_to] = 0

    def _copy_tables(self, num_rows: int, width: int) -> torch.Tensor:
        buffer = self.block_tables
        buffer.device[:num_rows, :width].copy_(buffer.host[:num_rows, :width], non_blocking=True)
        return buffer.device[:num_rows]
