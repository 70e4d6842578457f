"""Batched sampling on the device: every request's own settings in one pass over [B, V].

Order, as in vLLM V1: allowed-token mask, banned tokens (bad words, min_tokens), logit bias,
penalties; greedy rows take the argmax there. Sampled rows go on: temperature, min-p, top-k,
top-p, then the exponential race, argmax(p / E) with E ~ Exp(1), which draws from p. A seeded
request draws its E from a generator seeded by its seed and the number of tokens it has sampled,
so its tokens depend on nothing else in the batch.

Metadata built for the fused sampler (SamplingState on CUDA) runs through the Triton kernels
of asyncllm/sample/fused.py instead; the torch ops here are the CPU path and the reference.

logprobs_mode follows vLLM: "raw_logprobs" (the default) reports log_softmax of the model's
logits before any processing; "processed_logprobs" reports the distribution actually sampled
from (after penalties, temperature and the top-k/top-p/min-p masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncllm.outputs import TokenLogprobs
from asyncllm.sample.edits import apply_token_edits
from asyncllm.sample.fused import sample_fused
from asyncllm.sample.logprobs import LogprobsTensors
from asyncllm.sample.metadata import Penalties, SamplingMetadata

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# top-p looks for its cutoff among this many of a row's largest logits before sorting them all
TOP_P_CANDIDATES = 1024


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [B]
    logprobs: LogprobsTensors | None  # when some row asked for logprobs

    def to_host(
        self, meta: SamplingMetadata
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        token_ids = self.sampled_token_ids.tolist()
        if self.logprobs is None:
            return token_ids, None
        return token_ids, self.logprobs.to_host().rows(token_ids, meta.num_logprobs)


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}."
            )
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] in the model's dtype -> sampled ids and requested logprobs. Unless
        every row just takes the argmax, they are widened to float32 and edited in place (in
        the caller's tensor if it is float32 already)."""
        if meta.all_greedy and meta.no_processors and meta.max_num_logprobs is None:
            return SamplerOutput(logits.argmax(dim=-1), None)  # bf16 to float32 is exact
        logits = logits.float().contiguous()  # the sparse updates address it as a flat vector
        if meta.fused:
            return SamplerOutput(*sample_fused(logits, meta, self.logprobs_mode))
        source = None  # the distribution logprobs are reported from
        processed = meta.max_num_logprobs is not None and self.logprobs_mode != "raw_logprobs"
        if meta.max_num_logprobs is not None and not processed:
            source = torch.log_softmax(logits, dim=-1)
        logits = apply_logits_processors(logits, meta)
        sampled = logits.argmax(dim=-1)
        if not meta.all_greedy or processed:
            logits = apply_temperature_and_masks(logits, meta)
        if processed:
            source = torch.log_softmax(logits, dim=-1)
        if not meta.all_greedy:
            generators = meta.random.generators(logits.device)
            random = sample_exponential_race(logits, generators)
            sampled = torch.where(meta.greedy, sampled, random)
        logprobs = None
        if source is not None:
            logprobs = LogprobsTensors.gather(source, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The processors that can change the argmax, so greedy rows see them too."""
    apply_token_edits(logits, meta)
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """repetition (HF: over prompt and output, divide positive logits, multiply negative ones),
    then frequency (minus penalty x count) and presence (minus penalty once) over the output.
    Works on the distinct tokens of each penalised row's history, never on the whole [B, V]."""
    rows, tokens, counts = _listed_tokens(p)
    flat = logits.view(-1)
    keys = rows * logits.shape[-1] + tokens
    values = flat.index_select(0, keys)
    # every listed token is in the prompt or the output: the repetition applies
    repetition = p.repetition.index_select(0, rows)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= p.frequency.index_select(0, rows) * counts
    values -= p.presence.index_select(0, rows) * (counts > 0)
    flat.index_copy_(0, keys, values)
    return logits


def _listed_tokens(p: Penalties) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token, output count) of every listed token of the penalised rows."""
    slots = p.slot.index_select(0, p.rows).long()
    lengths = p.lengths[slots, 0]
    listed = p.tokens[slots, : int(lengths.max())].long()
    valid = torch.arange(listed.shape[1], device=listed.device) < lengths[:, None]
    rows = p.rows[:, None].expand_as(listed)[valid]
    tokens = listed[valid]
    table_keys = slots[:, None].expand_as(listed)[valid] * p.counts.shape[1] + tokens
    return rows, tokens, p.counts.view(-1).index_select(0, table_keys)


def apply_temperature_and_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    logits = logits.div_(meta.temperature[:, None])
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(
            logits, meta.top_k, meta.top_p, meta.max_top_k, meta.top_k_everywhere
        )
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens with p < min_p * p_max, compared in log space: no softmax needed."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < floor, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    top_k_everywhere: bool = False,
) -> torch.Tensor:
    """Keeps each row's top_k tokens (0: all), then the fewest most likely of those whose mass
    reaches top_p. Both come down to a smallest kept logit per row, found among the row's
    largest logits (torch.topk) rather than a sort of the whole vocabulary; when some row's
    top-p mass reaches past those candidates, a full sort decides. Ties with the smallest kept
    logit are kept too."""
    vocab = logits.shape[-1]
    width = max_top_k if top_p is None else max(max_top_k, TOP_P_CANDIDATES)
    total = None
    if top_p is not None and not top_k_everywhere:
        total = _log_total(logits)
    cutoff = _smallest_kept_logit(logits, top_k, top_p, total, min(width, vocab))
    if cutoff is None:
        cutoff = _smallest_kept_logit(logits, top_k, top_p, total, vocab)
    return logits.masked_fill_(logits < cutoff, float("-inf"))


def _log_total(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over each row (torch.logsumexp takes several passes more on CPU)."""
    peak = logits.amax(dim=-1, keepdim=True)
    return (logits - peak).exp_().sum(dim=-1, keepdim=True).log_().add_(peak)


def _smallest_kept_logit(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    total: torch.Tensor | None,
    width: int,
) -> torch.Tensor | None:
    """[B, 1] cutoffs from the `width` largest logits; None if top-p needs more of them.
    total: each row's logsumexp, needed by top-p on rows without a top_k."""
    vocab = logits.shape[-1]
    if width < vocab:
        ordered = logits.topk(width, dim=-1).values
    else:
        ordered = logits.sort(dim=-1, descending=True).values
    cutoff = torch.full_like(ordered[:, :1], float("-inf"))
    restricted = torch.zeros_like(cutoff, dtype=torch.bool)
    if top_k is not None:
        restricted = (top_k > 0)[:, None]
        k = torch.where(restricted, top_k[:, None], width).clamp(max=width)
        cutoff = torch.where(restricted, ordered.gather(1, k - 1), cutoff)
        ordered.masked_fill_(torch.arange(width, device=logits.device) >= k, float("-inf"))
    if top_p is None:
        return cutoff
    # probabilities among the kept tokens: the top k, or the whole row
    if top_k is not None:
        kept_total = _log_total(ordered)
        total = kept_total if total is None else torch.where(restricted, kept_total, total)
    probs = (ordered - total).exp_()
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True)
    active = (top_p < 1.0)[:, None]
    if width < vocab and bool((active & ~restricted & (num_kept >= width)).any()):
        return None
    p_cutoff = ordered.gather(1, num_kept.clamp(1, width) - 1)
    return torch.where(active, torch.maximum(cutoff, p_cutoff), cutoff)


def sample_exponential_race(
    logits: torch.Tensor, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """argmax(p / E) with E = -log(U) ~ Exp(1), taken in log space as argmax(logit - log E):
    the softmax's normalizer cancels, so there is no softmax pass. Consumes the logits."""
    noise = torch.empty_like(logits).uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    # U in [0, 1): log E in (-inf, inf], so a masked token (-inf) never wins
    return logits.sub_(noise.log_().neg_().log_()).argmax(dim=-1)
