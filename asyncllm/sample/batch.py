"""SamplingBatch: the device tensors of one batch composition (the same requests in the same
order), built once and reused by every step the composition lasts.

A build gathers every per-row and per-token list on the host and sends them in one copy per
dtype; a step only computes its bans (min_tokens stops, completed bad words) on the device.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
from kernels.sampling import GREEDY, GREEDY_MASKED, MASKED, RACE, Penalties, RowKeys

_ANY_TOKEN = -2  # a bad-word prefix position that matches whatever was sampled there


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


class _Lists:
    """Named host lists of one dtype, sent to the device as views of a single copy."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype = dtype
        self.lists: dict[str, np.ndarray] = {}

    def add(self, **lists: list | np.ndarray) -> None:
        for name, values in lists.items():
            self.lists[name] = np.asarray(values, dtype=self.dtype)

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        flat = to_device(np.concatenate(list(self.lists.values())), device)
        views, start = {}, 0
        for name, values in self.lists.items():
            views[name] = flat[start : start + len(values)]
            start += len(values)
        return views


def _flatten(per_row: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The rows and entries of per-row collections, flattened."""
    rows = np.repeat(np.arange(len(per_row)), [len(entries) for entries in per_row])
    entries = np.fromiter(itertools.chain.from_iterable(per_row), dtype, count=len(rows))
    return rows, entries


@dataclass
class _Edits:
    """A batch's logit edits, of which each step computes the values: biases first, then
    min_tokens stops (banned while their row's remaining count is above the step), then the
    last tokens of bad words (banned while the output ends with the rest of the word)."""

    index: TokenIndex
    bias: torch.Tensor  # float32 [Kb]
    stop_remaining: torch.Tensor  # int64 [Ks]: min_tokens - tokens sampled at step 0
    word_slots: torch.Tensor  # int64 [Kw]: the row's slot in RecentTokens
    word_prefixes: torch.Tensor  # int64 [Kw, W], right-aligned, _ANY_TOKEN before

    def at(self, step: int, recent: RecentTokens) -> LogitEdits:
        values = [self.bias]
        if self.stop_remaining.numel():
            values.append(torch.where(self.stop_remaining > step, float("-inf"), 0.0))
        if self.word_slots.numel():
            prefixes = self.word_prefixes
            last = recent.table[self.word_slots, -prefixes.shape[1] :]
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
        floats, ints = _Lists(np.float32), _Lists(np.int64)
        seeds = _row_lists(params, num_sampled, floats, ints)
        prefix_width = _edit_lists(requests, num_sampled, recent, floats, ints)
        self.penalty_host_slots = _penalty_lists(params, self.request_ids, history, floats, ints)
        _word_lists(requests, recent, ints)
        lists = floats.upload(device) | ints.upload(device)
        self.meta = _metadata(params, RandomKeys(seeds, num_sampled, 0), fused, lists)
        self.edits = None
        if lists["edit_rows"].numel():
            self.edits = _Edits(
                TokenIndex(lists["edit_rows"], lists["edit_tokens"]),
                lists["bias"],
                lists["stop_remaining"],
                lists["word_slots"],
                lists["word_prefixes"].view(-1, prefix_width),
            )
        self.penalty_slots = lists["penalty_slots"]
        self.penalties = None
        if self.penalty_slots.numel():
            self.penalties = Penalties(
                rows=lists["penalty_rows"],
                slot=lists["slot_of_row"],
                presence=lists["presence"],
                frequency=lists["frequency"],
                repetition=lists["repetition"],
                counts=history.counts,
                seen=history.seen,
                tokens=history.tokens,
                lengths=history.lengths,
            )
        self.word_rows, self.word_slots = lists["word_rows"], lists["word_row_slots"]

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
        if self.word_rows.numel():
            self.recent.record(self.word_slots, sampled.index_select(0, self.word_rows))


def _row_lists(
    params: list[SamplingParams], num_sampled: tuple[int, ...], floats: _Lists, ints: _Lists
) -> tuple[int | None, ...]:
    """One entry per row: its settings; returns the seeds of the seeded rows that sample."""
    greedy = [p.greedy for p in params]
    seeds = tuple(
        p.seed % 2**63 if p.seed is not None and not g else None for p, g in zip(params, greedy)
    )
    allowed_rows, allowed_tokens = _flatten([p.allowed_token_ids or () for p in params], np.int64)
    floats.add(
        temperature=[1.0 if g else p.temperature for p, g in zip(params, greedy)],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
    )
    ints.add(
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
    return seeds


def _edit_lists(
    requests: Sequence[SamplingRequest],
    num_sampled: tuple[int, ...],
    recent: RecentTokens,
    floats: _Lists,
    ints: _Lists,
) -> int:
    """The (row, token) pairs of the logit edits, in _Edits' order; returns the bad-word
    prefixes' width."""
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
    floats.add(bias=bias)
    ints.add(
        edit_rows=np.concatenate([bias_rows, stop_rows, word_rows]),
        edit_tokens=np.concatenate([bias_tokens, stop_tokens_, word_ends]),
        stop_remaining=np.asarray(left)[stop_rows],
        word_slots=np.asarray(slots)[word_rows],
        word_prefixes=[t for p in prefixes for t in [_ANY_TOKEN] * (width - len(p)) + p],
    )
    return width


def _penalty_lists(
    params: list[SamplingParams],
    request_ids: tuple[str, ...],
    history: PenaltyHistory,
    floats: _Lists,
    ints: _Lists,
) -> np.ndarray:
    """The penalties per row, and the rows with one and their history slots; returns those
    slots on the host."""
    rows = [i for i, p in enumerate(params) if p.uses_penalties]
    slots = np.array([history.slots.of[request_ids[i]] for i in rows], dtype=np.int64)
    slot_of_row = np.full(len(params), -1, dtype=np.int64)
    slot_of_row[rows] = slots
    floats.add(
        presence=[p.presence_penalty for p in params],
        frequency=[p.frequency_penalty for p in params],
        repetition=[p.repetition_penalty for p in params],
    )
    ints.add(penalty_rows=rows, penalty_slots=slots, slot_of_row=slot_of_row)
    return slots


def _word_lists(requests: Sequence[SamplingRequest], recent: RecentTokens, ints: _Lists) -> None:
    """The rows with bad words and their RecentTokens slots."""
    rows = [i for i, r in enumerate(requests) if r.bad_words_token_ids]
    ints.add(word_rows=rows, word_row_slots=[recent.slots.of[requests[i].request_id] for i in rows])


def _masked(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def _metadata(
    params: list[SamplingParams],
    random: RandomKeys,
    fused: bool,
    lists: dict[str, torch.Tensor],
) -> SamplingMetadata:
    """The step-independent part of the batch's metadata."""
    num_logprobs = tuple(p.logprobs for p in params)
    asked = [n for n in num_logprobs if n is not None]
    if fused:
        random.tensors = RowKeys(lists["seed"], lists["seeded"], lists["num_sampled"], 0, 0)
    allowed = None
    if lists["restricting"].numel():
        allowed = TokenIndex(lists["allowed_rows"], lists["allowed_tokens"])
    return SamplingMetadata(
        temperature=lists["temperature"],
        greedy=lists["greedy"].bool(),
        all_greedy=all(p.greedy for p in params),
        random=random,
        top_k=lists["top_k"] if any(p.top_k > 0 for p in params) else None,
        max_top_k=max(p.top_k for p in params),
        top_k_everywhere=all(p.top_k > 0 for p in params),
        top_p=lists["top_p"] if any(p.top_p < 1.0 for p in params) else None,
        min_p=lists["min_p"] if any(p.min_p > 0.0 for p in params) else None,
        allowed=allowed,
        allowed_rows=lists["restricting"] if allowed is not None else None,
        num_logprobs=num_logprobs,
        max_num_logprobs=max(asked) if asked else None,
        modes=lists["modes"] if fused else None,
        any_masked=any(_masked(p) for p in params),
    )
