"""The verify step: the target samples at every draft position and after the last, each
position as if the drafts before it had been accepted, and the drafts are kept up to the first
it disagrees with (rejection sampling for drafts that are single tokens: accepting draft x with
probability p(x) and otherwise sampling from p without x is exactly drawing y ~ p and keeping x
when y == x). The token drawn at the first disagreement, or after the last draft, follows.

Every position of a request samples with the request's own settings, and a seeded request's
position j draws as its (num_sampled + j)-th token would without speculation, so seeded output
is the same with and without n-gram drafts. Settings that read the tokens before a position
(penalties, bad words, min_tokens bans) never meet drafts (spec_decode.proposer.may_speculate),
so their rows have one position each and keep their metadata as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from asyncllm.core.scheduler_output import VerifiedTokens
from asyncllm.outputs import TokenLogprobs
from asyncllm.sample.logprobs import LogprobsTensors
from asyncllm.sample.metadata import LogitEdits, RandomKeys, SamplingMetadata, TokenIndex
from asyncllm.sample.sampler import Sampler, SamplerOutput


@dataclass(frozen=True)
class DraftLayout:
    """Where each sampling row's positions sit among the scored ones: row r has
    1 + num_drafts[r] of them, from starts[r]."""

    num_drafts: list[int]
    starts: list[int]

    @classmethod
    def of(cls, drafts: list[list[int]]) -> DraftLayout:
        num_drafts = [len(d) for d in drafts]
        starts, total = [], 0
        for n in num_drafts:
            starts.append(total)
            total += n + 1
        return cls(num_drafts, starts)

    @property
    def counts(self) -> list[int]:
        return [n + 1 for n in self.num_drafts]

    @property
    def num_positions(self) -> int:
        return sum(self.counts)

    def owner_and_offset(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per scored position, its sampling row and its index among that row's positions."""
        counts = torch.tensor(self.counts, device=device)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        starts = torch.tensor(self.starts, device=device)
        return owner, torch.arange(len(owner), device=device) - starts[owner]


def repeat_metadata(meta: SamplingMetadata, layout: DraftLayout) -> SamplingMetadata:
    """meta with each row repeated once per scored position of the row, position j's random
    draw being the row's j-th next one."""
    device = meta.temperature.device
    owner, offset = layout.owner_and_offset(device)
    counts = torch.tensor(layout.counts, device=device)
    starts = torch.tensor(layout.starts, device=device)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, owner)

    def row_list(row_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each listed row as all its positions; and which listed entry each came from."""
        entry, j = _expand(counts.index_select(0, row_ids))
        return starts.index_select(0, row_ids.index_select(0, entry)) + j, entry

    def token_index(index: TokenIndex | None) -> tuple[TokenIndex | None, torch.Tensor | None]:
        if index is None:
            return None, None
        new_rows, entry = row_list(index.rows)
        return TokenIndex(new_rows, index.token_ids.index_select(0, entry)), entry

    allowed, _ = token_index(meta.allowed)
    edits = meta.edits
    if edits is not None:
        index, entry = token_index(edits.index)
        edits = LogitEdits(index, edits.values.index_select(0, entry))
    penalties = meta.penalties
    if penalties is not None:
        penalties = dataclasses.replace(
            penalties,
            rows=row_list(penalties.rows)[0],
            slot=rows(penalties.slot),
            presence=rows(penalties.presence),
            frequency=rows(penalties.frequency),
            repetition=rows(penalties.repetition),
        )
    repeat = [i for i, n in enumerate(layout.counts) for _ in range(n)]
    within = [j for n in layout.counts for j in range(n)]
    random = meta.random
    tensors = random.tensors
    if tensors is not None:
        tensors = dataclasses.replace(
            tensors,
            seed=rows(tensors.seed),
            seeded=rows(tensors.seeded),
            num_sampled=rows(tensors.num_sampled) + offset,
        )
    random = RandomKeys(
        seeds=tuple(random.seeds[i] for i in repeat),
        num_sampled=tuple(random.num_sampled[i] + j for i, j in zip(repeat, within)),
        step=random.step,
        tensors=tensors,
    )
    return dataclasses.replace(
        meta,
        temperature=rows(meta.temperature),
        greedy=rows(meta.greedy),
        random=random,
        top_k=rows(meta.top_k),
        top_p=rows(meta.top_p),
        min_p=rows(meta.min_p),
        penalties=penalties,
        edits=edits,
        allowed=allowed,
        allowed_rows=None if meta.allowed_rows is None else row_list(meta.allowed_rows)[0],
        num_logprobs=tuple(meta.num_logprobs[i] for i in repeat),
        modes=rows(meta.modes),
    )


def _expand(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For entries repeated counts[i] times: each copy's entry and its index among them."""
    entry = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    firsts = torch.cumsum(counts, 0) - counts
    return entry, torch.arange(len(entry), device=counts.device) - firsts.index_select(0, entry)


@dataclass
class DraftVerification:
    """A verify step's results on the device, then (copy_to_host) in host memory, readable
    once the step is done."""

    layout: DraftLayout
    meta: SamplingMetadata  # the repeated one: one row per scored position
    sampled: SamplerOutput  # per scored position
    num_accepted: torch.Tensor  # int64 [R]
    next_token_ids: torch.Tensor  # int64 [R]: each row's last token (the next step's input)

    def copy_to_host(self) -> DraftVerification:
        def copy(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to("cpu", non_blocking=True)

        logprobs = self.sampled.logprobs
        if logprobs is not None:
            logprobs = LogprobsTensors(*(copy(t) for t in logprobs._fields()))
        sampled = SamplerOutput(copy(self.sampled.sampled_token_ids), logprobs)
        return dataclasses.replace(self, sampled=sampled, num_accepted=copy(self.num_accepted))

    def results(
        self, rows: list[int], num_scheduled: int
    ) -> tuple[list[int], list[TokenLogprobs | None] | None, VerifiedTokens]:
        """(each sampling row's first token, its logprobs) and every scheduled row's tokens."""
        token_ids, logprobs = self.sampled.to_host(self.meta)
        accepted = self.num_accepted.tolist()
        verified = VerifiedTokens([[] for _ in range(num_scheduled)], [0] * num_scheduled)
        if logprobs is not None:
            verified.logprobs = [None] * num_scheduled
        for row, start, n, num_drafts in zip(
            rows, self.layout.starts, accepted, self.layout.num_drafts
        ):
            verified.token_ids[row] = token_ids[start : start + n + 1]
            verified.num_drafts[row] = num_drafts
            if logprobs is not None and logprobs[start] is not None:
                verified.logprobs[row] = logprobs[start : start + n + 1]
        firsts = [token_ids[start] for start in self.layout.starts]
        first_logprobs = None if logprobs is None else [logprobs[s] for s in self.layout.starts]
        return firsts, first_logprobs, verified


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]
) -> DraftVerification:
    """logits [P, V] at every scored position (DraftLayout's order), meta one row per sampling
    row, drafts per sampling row."""
    layout = DraftLayout.of(drafts)
    repeated = repeat_metadata(meta, layout)
    sampled = sampler(logits, repeated)
    device = logits.device
    owner, offset = layout.owner_and_offset(device)
    width = max(layout.num_drafts) + 1
    by_row = torch.full((len(drafts), width), -1, dtype=torch.int64, device=device)
    by_row[owner, offset] = sampled.sampled_token_ids
    # -2 pads the drafts and -1 the samples, so padding never agrees
    padded = [d + [-2] * (width - 1 - len(d)) for d in drafts]
    proposed = torch.tensor(padded, dtype=torch.int64).to(device, non_blocking=True)
    agrees = by_row[:, :-1] == proposed
    num_accepted = agrees.int().cumprod(dim=1).sum(dim=1)
    next_token_ids = by_row.gather(1, num_accepted[:, None].long()).squeeze(1)
    return DraftVerification(layout, repeated, sampled, num_accepted, next_token_ids)
