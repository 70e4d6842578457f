"""SamplingBatch: the device tensors of one batch composition (the same requests in the same
order), built once and reused by every step the composition lasts.

A build gathers every per-row and per-token list on the host, in three groups (_RowLists,
_EditLists, _PenaltyLists) that declare each list's dtype and shape, and sends them in one copy
per dtype; a step only computes its bans (min_tokens stops, completed bad words) on the device.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from asyncllm.sample.history import PenaltyHistory, RecentTokens, to_device
from asyncllm.sample.metadata import (
    LogitEdits,
    RandomKeys,
    SamplingMetadata,
    SamplingRequest,
    TokenIndex,
)
from asyncllm.sampling_params import SamplingParams
from kernels.sampling_rows import GREEDY, GREEDY_MASKED, MASKED, RACE, Penalties, RowKeys

_ANY_TOKEN = -2  # a bad-word prefix position that matches whatever was sampled there

A = TypeVar("A")  # a group's lists: host array-likes when built, device tensors once uploaded


def stop_tokens(request: SamplingRequest) -> list[int]:
    """EOS and stop token ids, banned while fewer than min_tokens tokens are out."""
    params = request.sampling_params
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= request.eos_token_ids
    return sorted(stops)


def _mode(greedy: bool, masked: bool) -> int:
    if greedy:
        return GREEDY_MASKED if masked else GREEDY
    return MASKED if masked else RACE


def _flatten(per_row: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The rows and entries of per-row collections, flattened."""
    rows = np.repeat(np.arange(len(per_row)), [len(entries) for entries in per_row])
    entries = np.fromiter(itertools.chain.from_iterable(per_row), dtype, count=len(rows))
    return rows, entries


def _list(dtype: type) -> Any:
    """A field of a group of lists, sent to the device as dtype."""
    return field(metadata={"dtype": dtype})


@dataclass
class _RowLists(Generic[A]):
    """The settings of the B rows, and the allowed tokens of the rows that restrict."""

    temperature: A = _list(np.float32)  # [B]; 1.0 on greedy rows (unused there)
    top_p: A = _list(np.float32)  # [B]
    min_p: A = _list(np.float32)  # [B]
    greedy: A = _list(np.int64)  # [B]; 0 or 1
    modes: A = _list(np.int64)  # [B]: kernels.sampling modes
    top_k: A = _list(np.int64)  # [B]; 0 where off
    seed: A = _list(np.int64)  # [B]; 0 on the rows that are not seeded
    seeded: A = _list(np.int64)  # [B]; 0 or 1
    num_sampled: A = _list(np.int64)  # [B]
    allowed_rows: A = _list(np.int64)  # [Ka]
    allowed_tokens: A = _list(np.int64)  # [Ka]
    restricting: A = _list(np.int64)  # [R]: the rows with allowed_token_ids


@dataclass
class _EditLists(Generic[A]):
    """The (row, token) pairs of the logit edits, of which each step computes the values:
    biases first, then min_tokens stops (banned while their row's remaining count is above the
    step), then the last tokens of bad words (banned while the output ends with the rest of the
    word); and the rows with bad words, whose sampled ids RecentTokens records."""

    rows: A = _list(np.int64)  # [K], K = Kb + Ks + Kw
    tokens: A = _list(np.int64)  # [K]
    bias: A = _list(np.float32)  # [Kb]
    stop_remaining: A = _list(np.int64)  # [Ks]: min_tokens - tokens sampled at step 0
    word_slots: A = _list(np.int64)  # [Kw]: the word's row's slot in RecentTokens
    word_prefixes: A = _list(np.int64)  # [Kw, W], right-aligned, _ANY_TOKEN before
    recent_rows: A = _list(np.int64)  # [Rw]: the rows with bad words
    recent_slots: A = _list(np.int64)  # [Rw]: their slots in RecentTokens


@dataclass
class _PenaltyLists(Generic[A]):
    """The penalties of the B rows, and the P rows with one."""

    presence: A = _list(np.float32)  # [B]
    frequency: A = _list(np.float32)  # [B]
    repetition: A = _list(np.float32)  # [B]
    rows: A = _list(np.int64)  # [P]
    slots: A = _list(np.int64)  # [P]: their slots in PenaltyHistory
    slot_of_row: A = _list(np.int64)  # [B]; -1 on the rows without


def _upload(groups: tuple[Any, ...], device: torch.device) -> tuple[Any, ...]:
    """The groups with their lists on the device, as views of a single copy per dtype."""
    fields = [(group, f) for group in groups for f in dataclasses.fields(group)]
    arrays = [np.asarray(getattr(group, f.name), f.metadata["dtype"]) for group, f in fields]
    views: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(a.dtype for a in arrays):
        same = [i for i, a in enumerate(arrays) if a.dtype == dtype]
        flat = to_device(np.concatenate([arrays[i].ravel() for i in same]), device)
        for i, part in zip(same, flat.split([arrays[i].size for i in same])):
            views[i] = part.view(arrays[i].shape)
    uploaded = (views[i] for i in range(len(arrays)))
    return tuple(
        dataclasses.replace(group, **{f.name: next(uploaded) for f in dataclasses.fields(group)})
        for group in groups
    )


@dataclass
class _Edits:
    """A batch's logit edits (_EditLists' order), at the pairs of index."""

    index: TokenIndex
    lists: _EditLists[torch.Tensor]

    def at(self, step: int, recent: RecentTokens) -> LogitEdits:
        lists = self.lists
        values = [lists.bias]
        if lists.stop_remaining.numel():
            values.append(torch.where(lists.stop_remaining > step, float("-inf"), 0.0))
        if lists.word_slots.numel():
            prefixes = lists.word_prefixes
            last = recent.table[lists.word_slots, -prefixes.shape[1] :]
            ended = ((last == prefixes) | (prefixes == _ANY_TOKEN)).all(dim=1)
            values.append(torch.where(ended, float("-inf"), 0.0))
        return LogitEdits(self.index, torch.cat(values) if len(values) > 1 else values[0])


class SamplingBatch:
    """The tensors of one batch composition; steps counts the steps it has sampled."""

    def __init__(
        self,
        requests: Sequence[SamplingRequest],
        num_sampled: tuple[int, ...],
        history: PenaltyHistory,
        recent: RecentTokens,
        fused: bool,
        device: torch.device,
    ) -> None:
        self.request_ids = tuple(r.request_id for r in requests)
        self.num_sampled = num_sampled
        self.steps = 0
        self.fused = fused
        self.history = history
        self.recent = recent
        params = [r.sampling_params for r in requests]
        seeds = _seeds(params)
        penalty_lists = _penalty_lists(params, self.request_ids, history)
        self.penalty_host_slots = penalty_lists.slots
        rows, edits, penalties = _upload(
            (
                _row_lists(params, num_sampled, seeds),
                _edit_lists(requests, num_sampled, recent),
                penalty_lists,
            ),
            device,
        )
        self.meta = _metadata(params, RandomKeys(seeds, num_sampled, 0), fused, rows)
        self.edits = None
        if edits.rows.numel():
            self.edits = _Edits(TokenIndex(edits.rows, edits.tokens), edits)
        self.recent_rows, self.recent_slots = edits.recent_rows, edits.recent_slots
        self.penalty_slots = penalties.slots
        self.penalties = None
        if self.penalty_slots.numel():
            self.penalties = Penalties(
                rows=penalties.rows,
                slot=penalties.slot_of_row,
                presence=penalties.presence,
                frequency=penalties.frequency,
                repetition=penalties.repetition,
                counts=history.counts,
                seen=history.seen,
                tokens=history.tokens,
                lengths=history.lengths,
            )

    def step_metadata(self) -> SamplingMetadata:
        random = dataclasses.replace(self.meta.random, step=self.steps)
        if self.fused:
            fresh_seed = int(torch.randint(2**62, ()))
            tensors = dataclasses.replace(random.tensors, step=self.steps, fresh_seed=fresh_seed)
            random = dataclasses.replace(random, tensors=tensors)
        penalties = self.penalties
        if penalties is not None:  # the tables grow, as requests come and tokens are recorded
            history = self.history
            penalties = dataclasses.replace(
                penalties,
                counts=history.counts,
                seen=history.seen,
                tokens=history.tokens,
                lengths=history.lengths,
            )
        edits = self.edits.at(self.steps, self.recent) if self.edits is not None else None
        return dataclasses.replace(self.meta, random=random, penalties=penalties, edits=edits)

    def record(self, sampled: torch.Tensor) -> None:
        """The step's sampled ids (device int64 [B]) into the histories, on the device."""
        if self.penalties is not None:
            rows = self.penalties.rows
            self.history.record(sampled, rows, self.penalty_slots, self.penalty_host_slots)
        if self.recent_rows.numel():
            self.recent.record(self.recent_slots, sampled.index_select(0, self.recent_rows))


def _seeds(params: list[SamplingParams]) -> tuple[int | None, ...]:
    """Per row: the seed of a seeded request that samples (not greedy), else None."""
    return tuple(p.seed % 2**63 if p.seed is not None and not p.greedy else None for p in params)


def _row_lists(
    params: list[SamplingParams], num_sampled: tuple[int, ...], seeds: tuple[int | None, ...]
) -> _RowLists[npt.ArrayLike]:
    greedy = [p.greedy for p in params]
    allowed_rows, allowed_tokens = _flatten([p.allowed_token_ids or () for p in params], np.int64)
    return _RowLists(
        temperature=[1.0 if g else p.temperature for p, g in zip(params, greedy)],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        greedy=greedy,
        modes=[_mode(g, _masked(p)) for p, g in zip(params, greedy)],
        top_k=[max(p.top_k, 0) for p in params],
        seed=[s or 0 for s in seeds],
        seeded=[s is not None for s in seeds],
        num_sampled=num_sampled,
        allowed_rows=allowed_rows,
        allowed_tokens=allowed_tokens,
        restricting=[i for i, p in enumerate(params) if p.allowed_token_ids is not None],
    )


def _edit_lists(
    requests: Sequence[SamplingRequest], num_sampled: tuple[int, ...], recent: RecentTokens
) -> _EditLists[npt.ArrayLike]:
    biases = [r.sampling_params.logit_bias or {} for r in requests]
    bias_rows, bias_tokens = _flatten(biases, np.int64)
    _, bias = _flatten([b.values() for b in biases], np.float32)
    left = [r.sampling_params.min_tokens - n for r, n in zip(requests, num_sampled)]
    stops = [stop_tokens(r) if n > 0 else () for r, n in zip(requests, left)]
    stop_rows, stop_tokens_ = _flatten(stops, np.int64)
    words = [r.bad_words_token_ids for r in requests]
    word_rows, word_ends = _flatten([[w[-1] for w in ws] for ws in words], np.int64)
    prefixes = [w[:-1] for ws in words for w in ws]
    width = max([1] + [len(p) for p in prefixes])
    slots = [recent.slots.of[r.request_id] if ws else -1 for r, ws in zip(requests, words)]
    recent_rows = [i for i, ws in enumerate(words) if ws]
    return _EditLists(
        rows=np.concatenate([bias_rows, stop_rows, word_rows]),
        tokens=np.concatenate([bias_tokens, stop_tokens_, word_ends]),
        bias=bias,
        stop_remaining=np.asarray(left)[stop_rows],
        word_slots=np.asarray(slots)[word_rows],
        word_prefixes=np.reshape(
            [[_ANY_TOKEN] * (width - len(p)) + p for p in prefixes], (-1, width)
        ),
        recent_rows=recent_rows,
        recent_slots=[slots[i] for i in recent_rows],
    )


def _penalty_lists(
    params: list[SamplingParams], request_ids: tuple[str, ...], history: PenaltyHistory
) -> _PenaltyLists[npt.ArrayLike]:
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    slots = np.array([history.slots.of[request_ids[i]] for i in rows], dtype=np.int64)
    slot_of_row = np.full(len(params), -1, dtype=np.int64)
    slot_of_row[rows] = slots
    return _PenaltyLists(
        presence=[p.presence_penalty for p in params],
        frequency=[p.frequency_penalty for p in params],
        repetition=[p.repetition_penalty for p in params],
        rows=rows,
        slots=slots,
        slot_of_row=slot_of_row,
    )


def _masked(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _metadata(
    params: list[SamplingParams], random: RandomKeys, fused: bool, rows: _RowLists[torch.Tensor]
) -> SamplingMetadata:
    """The step-independent part of the batch's metadata."""
    num_logprobs = tuple(p.logprobs for p in params)
    asked = [n for n in num_logprobs if n is not None]
    if fused:
        random.tensors = RowKeys(rows.seed, rows.seeded, rows.num_sampled, 0, 0)
    allowed = None
    if rows.restricting.numel():
        allowed = TokenIndex(rows.allowed_rows, rows.allowed_tokens)
    return SamplingMetadata(
        temperature=rows.temperature,
        greedy=rows.greedy.bool(),
        all_greedy=all(p.greedy for p in params),
        random=random,
        top_k=rows.top_k if any(p.top_k > 0 for p in params) else None,
        max_top_k=max(p.top_k for p in params),
        top_k_everywhere=all(p.top_k > 0 for p in params),
        top_p=rows.top_p if any(p.top_p < 1.0 for p in params) else None,
        min_p=rows.min_p if any(p.min_p > 0.0 for p in params) else None,
        allowed=allowed,
        allowed_rows=rows.restricting if allowed is not None else None,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(asked) if asked else None,
        modes=rows.modes if fused else None,
        any_masked=any(_masked(p) for p in params),
    )
