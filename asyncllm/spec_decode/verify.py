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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.core.scheduler_output import VerifiedTokens
from asyncllm.outputs import TokenLogprobs
from asyncllm.request import Request
from asyncllm.sample.history import to_device
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
    def width(self) -> int:
        """The most positions of a row."""
        return max(self.num_drafts) + 1


@dataclass(frozen=True)
class LayoutTensors:
    """A DraftLayout on the device, sent in one non-blocking copy: a blocking one (torch.tensor
    of a list on CUDA) waits for the step's forward pass, so the host could not enqueue the
    sampling behind it."""

    owner: torch.Tensor  # [P]: each scored position's sampling row
    offset: torch.Tensor  # [P]: its index among the row's positions
    counts: torch.Tensor  # [R]
    starts: torch.Tensor  # [R]
    draft_index: torch.Tensor  # [R, width - 1]: the scored position each draft is the input of

    @classmethod
    def of(cls, layout: DraftLayout, device: torch.device) -> LayoutTensors:
        counts, starts = np.array(layout.counts), np.array(layout.starts)
        owner = np.repeat(np.arange(len(counts)), counts)
        offset = np.arange(len(owner)) - starts[owner]
        draft_index = np.full((len(counts), layout.width - 1), -1, dtype=np.int64)
        draft_rows = np.repeat(np.arange(len(counts)), layout.num_drafts)
        columns = _columns(layout.num_drafts)
        draft_index[draft_rows, columns] = starts[draft_rows] + 1 + columns
        parts = [owner, offset, counts, starts, draft_index.ravel()]
        # pinned: from pageable memory the copy would wait for the forward pass queued before it
        flat = to_device(np.concatenate(parts).astype(np.int64), device)
        owner_t, offset_t, counts_t, starts_t, index_t = flat.split([len(p) for p in parts])
        return cls(owner_t, offset_t, counts_t, starts_t, index_t.view(draft_index.shape))

    def proposed(self, scored_ids: torch.Tensor) -> torch.Tensor:
        """[R, width - 1]: each row's drafts, read from the input tokens of the scored
        positions (scored_ids [P]: a draft is the input of the position after the one it
        follows), -2 after a row's last. Drafts made on the device are known only there."""
        index = self.draft_index
        return torch.where(index >= 0, scored_ids[index.clamp(min=0)], -2)

    def positions_of(self, row_ids: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
        """Each listed row as width positions, the row's last repeated past its count (so the
        size is known on the host: no sync), which entry each came from, and whether it is a
        real position."""
        j = torch.arange(width, device=row_ids.device)
        counts = self.counts.index_select(0, row_ids)[:, None]
        positions = self.starts.index_select(0, row_ids)[:, None] + torch.minimum(j, counts - 1)
        entry = torch.arange(len(row_ids), device=row_ids.device).repeat_interleave(width)
        return positions.view(-1), entry, (j < counts).view(-1)


def _columns(num_drafts: list[int]) -> np.ndarray:
    """0 .. n - 1 for each n in num_drafts, concatenated."""
    n = np.array(num_drafts)
    firsts = np.cumsum(n) - n
    return np.arange(int(n.sum())) - np.repeat(firsts, n)


def repeat_metadata(
    meta: SamplingMetadata, layout: DraftLayout, tensors: LayoutTensors
) -> SamplingMetadata:
    """meta with each row repeated once per scored position of the row, position j's random
    draw being the row's j-th next one. Rows with penalties, bad words or min_tokens bans have
    no drafts (spec_decode.proposer.may_speculate): they keep one position each."""
    owner, width = tensors.owner, layout.width

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, owner)

    def token_index(index: TokenIndex) -> tuple[TokenIndex, torch.Tensor, torch.Tensor]:
        positions, entry, real = tensors.positions_of(index.rows, width)
        return TokenIndex(positions, index.token_ids.index_select(0, entry)), entry, real

    allowed = allowed_rows = None
    if meta.allowed is not None:  # repeated pairs only set the same mask entries again
        allowed = token_index(meta.allowed)[0]
        allowed_rows = tensors.positions_of(meta.allowed_rows, width)[0]
    edits = meta.edits
    if edits is not None:  # the repeated pairs add nothing
        index, entry, real = token_index(edits.index)
        edits = LogitEdits(index, torch.where(real, edits.values.index_select(0, entry), 0.0))
    penalties = meta.penalties
    if penalties is not None:
        penalties = dataclasses.replace(
            penalties,
            rows=tensors.starts.index_select(0, penalties.rows),
            slot=rows(penalties.slot),
            presence=rows(penalties.presence),
            frequency=rows(penalties.frequency),
            repetition=rows(penalties.repetition),
        )
    repeat = [i for i, n in enumerate(layout.counts) for _ in range(n)]
    within = [j for n in layout.counts for j in range(n)]
    random = meta.random
    keys = random.tensors
    if keys is not None:
        keys = dataclasses.replace(
            keys,
            seed=rows(keys.seed),
            seeded=rows(keys.seeded),
            num_sampled=rows(keys.num_sampled) + tensors.offset,
        )
    random = RandomKeys(
        seeds=tuple(random.seeds[i] for i in repeat),
        num_sampled=tuple(random.num_sampled[i] + j for i, j in zip(repeat, within)),
        step=random.step,
        tensors=keys,
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
        allowed_rows=allowed_rows,
        num_logprobs=tuple(meta.num_logprobs[i] for i in repeat),
        modes=rows(meta.modes),
    )


@dataclass
class DraftVerification:
    """A verify step's results on the device, then (copy_to_host) in host memory, readable
    once the step is done."""

    layout: DraftLayout
    meta: SamplingMetadata  # the repeated one: one row per scored position
    sampled: SamplerOutput  # per scored position
    num_accepted: torch.Tensor  # int64 [R]
    next_token_ids: torch.Tensor  # int64 [R]: each row's last token (the next step's input)
    # int64 [R]: drafts rejected, how far back of its scheduled start a step run ahead begins
    num_rejected: torch.Tensor
    next_scored: torch.Tensor  # int64 [R]: the scored position each row's last token is from

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


def counts_moved_on(requests: Iterable[Request], drafts: list[list[int]]) -> list[str]:
    """The requests whose sampling state restarts from the host after this verify step: those
    with drafts took an unknown number of tokens, and their count of sampled tokens is read by
    a seed's draws and by min_tokens bans (the others' state stays, which saves rebuilding the
    batch's sampling tensors every step)."""
    return [
        request.request_id
        for request, row_drafts in zip(requests, drafts)
        if row_drafts
        and (request.sampling_params.seed is not None or request.sampling_params.min_tokens > 0)
    ]


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    meta: SamplingMetadata,
    layout: DraftLayout,
    scored_ids: torch.Tensor,
) -> DraftVerification:
    """logits [P, V] at every scored position (DraftLayout's order), meta one row per sampling
    row, scored_ids [P] the input token of each scored position (a row's last token, then its
    drafts)."""
    device = logits.device
    tensors = LayoutTensors.of(layout, device)
    repeated = repeat_metadata(meta, layout, tensors)
    sampled = sampler(logits, repeated)
    by_row = torch.full((len(layout.counts), layout.width), -1, dtype=torch.int64, device=device)
    by_row[tensors.owner, tensors.offset] = sampled.sampled_token_ids
    # -2 pads the drafts and -1 the samples, so padding never agrees
    agrees = by_row[:, :-1] == tensors.proposed(scored_ids)
    num_accepted = agrees.int().cumprod(dim=1).sum(dim=1)
    next_token_ids = by_row.gather(1, num_accepted[:, None].long()).squeeze(1)
    num_rejected = tensors.counts - 1 - num_accepted
    next_scored = tensors.starts + num_accepted
    return DraftVerification(
        layout, repeated, sampled, num_accepted, next_token_ids, num_rejected, next_scored
    )
