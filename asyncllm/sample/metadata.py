"""SamplingMetadata: the whole batch's sampling settings as device tensors, built once a step.

Everything optional stays None unless some request in the batch uses it, so a greedy or plain
temperature batch costs two small tensors. Sparse things (logit bias, banned tokens, output
token ids for the penalties) travel as flat (row, token) index pairs; the sampler scatters them
over the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncllm.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What the sampler reads from a request (asyncllm.request.Request has all of it)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    bad_words_token_ids: list[list[int]]


@dataclass
class TokenIndex:
    """Flat (row, token id) pairs with an optional value each."""

    rows: torch.Tensor  # int64 [K]
    token_ids: torch.Tensor  # int64 [K]
    values: torch.Tensor | None = None  # float32 [K]

    def keys(self, vocab_size: int) -> torch.Tensor:
        """Positions in the flattened [B, V] logits."""
        return self.rows * vocab_size + self.token_ids


@dataclass
class Penalties:
    presence: torch.Tensor  # float32 [B], 0 where off
    frequency: torch.Tensor  # float32 [B], 0 where off
    repetition: torch.Tensor  # float32 [B], 1 where off
    output_tokens: TokenIndex  # every output token of the rows with a penalty, repeats kept
    prompt_tokens: TokenIndex | None  # prompt tokens of the rows with a repetition penalty


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    generators: dict[int, torch.Generator]  # batch row -> generator of a seeded request
    top_k: torch.Tensor | None = None  # int64 [B]; 0 where off
    max_top_k: int = 0
    top_k_everywhere: bool = False  # every row has a top_k: top-p never needs a row's full mass
    top_p: torch.Tensor | None = None  # float32 [B]; 1.0 where off
    min_p: torch.Tensor | None = None  # float32 [B]; 0.0 where off
    penalties: Penalties | None = None
    logit_bias: TokenIndex | None = None
    banned: TokenIndex | None = None  # min_tokens stops and completed bad-word prefixes
    allowed: TokenIndex | None = None  # allowed_token_ids of the rows that restrict
    allowed_rows: torch.Tensor | None = None  # int64: rows that restrict to allowed tokens
    num_logprobs: tuple[int | None, ...] = ()  # per row; None where not asked
    max_num_logprobs: int | None = None

    @property
    def no_processors(self) -> bool:
        """True when the logits go to sampling unchanged (apart from temperature)."""
        return (
            self.top_k is None
            and self.top_p is None
            and self.min_p is None
            and self.penalties is None
            and self.logit_bias is None
            and self.banned is None
            and self.allowed is None
        )

    @classmethod
    def build(
        cls,
        requests: Sequence[SamplingRequest],
        generators: dict[int, torch.Generator],
        device: torch.device,
        history: TokenHistory | None = None,
    ) -> SamplingMetadata:
        """history: the runner's per-request token tensors, reused from step to step."""
        params = [r.sampling_params for r in requests]
        greedy = [p.greedy for p in params]
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        num_logprobs = tuple(p.logprobs for p in params)
        asked = [n for n in num_logprobs if n is not None]
        return cls(
            temperature=_tensor(temperature, torch.float32, device),
            greedy=_tensor(greedy, torch.bool, device),
            all_greedy=all(greedy),
            generators=generators,
            top_k=_optional([max(p.top_k, 0) for p in params], 0, torch.int64, device),
            max_top_k=max(p.top_k for p in params),
            top_k_everywhere=all(p.top_k > 0 for p in params),
            top_p=_optional([p.top_p for p in params], 1.0, torch.float32, device),
            min_p=_optional([p.min_p for p in params], 0.0, torch.float32, device),
            penalties=_penalties(requests, history or TokenHistory(), device),
            logit_bias=_logit_bias(params, device),
            banned=_token_index([_banned_tokens(r) for r in requests], device),
            allowed=_token_index([p.allowed_token_ids or [] for p in params], device),
            allowed_rows=_rows_where([p.allowed_token_ids is not None for p in params], device),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
        )


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)


def _optional(
    values: list, off: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    if all(v == off for v in values):
        return None
    return _tensor(values, dtype, device)


def _rows_where(flags: list[bool], device: torch.device) -> torch.Tensor | None:
    rows = [i for i, flag in enumerate(flags) if flag]
    return _tensor(rows, torch.int64, device) if rows else None


def _token_index(
    per_row: Sequence[Sequence[int]],
    device: torch.device,
    values: Sequence[Sequence[float]] | None = None,
) -> TokenIndex | None:
    """Flattens per-row token lists into index pairs; None when every list is empty."""
    lengths = [len(ids) for ids in per_row]
    if not any(lengths):
        return None
    rows = [row for row, n in enumerate(lengths) for _ in range(n)]
    flat = list(itertools.chain.from_iterable(per_row))
    flat_values = None
    if values is not None:
        flat_values = _tensor(list(itertools.chain.from_iterable(values)), torch.float32, device)
    return TokenIndex(
        _tensor(rows, torch.int64, device), _tensor(flat, torch.int64, device), flat_values
    )


def _penalties(
    requests: Sequence[SamplingRequest], history: TokenHistory, device: torch.device
) -> Penalties | None:
    params = [r.sampling_params for r in requests]
    if not any(p.uses_penalties for p in params):
        return None
    empty = torch.empty(0, dtype=torch.int64)
    outputs = [history.output(r) if r.sampling_params.uses_penalties else empty for r in requests]
    repeats = [p.repetition_penalty != 1.0 for p in params]
    prompts = [history.prompt(r) if rep else empty for r, rep in zip(requests, repeats)]
    prompt_tokens = None
    if any(repeats):
        prompt_tokens = _concat_rows(prompts, [len(r.prompt_token_ids) for r in requests], device)
    return Penalties(
        presence=_tensor([p.presence_penalty for p in params], torch.float32, device),
        frequency=_tensor([p.frequency_penalty for p in params], torch.float32, device),
        repetition=_tensor([p.repetition_penalty for p in params], torch.float32, device),
        output_tokens=_concat_rows(outputs, [len(r.output_token_ids) for r in requests], device),
        prompt_tokens=prompt_tokens,
    )


def _concat_rows(
    per_row: list[torch.Tensor], lengths: list[int], device: torch.device
) -> TokenIndex:
    """lengths: of the rows' full token lists; a row given an empty tensor counts 0."""
    lengths = [n if t.shape[0] else 0 for t, n in zip(per_row, lengths)]
    token_ids = torch.cat(per_row)
    if device.type == "cuda":
        token_ids = token_ids.pin_memory()
    return TokenIndex(_row_of_each(lengths, device), token_ids.to(device, non_blocking=True))


def _row_of_each(lengths: list[int], device: torch.device) -> torch.Tensor:
    """[0] * lengths[0] + [1] * lengths[1] + ..., as a cumsum of row-start marks: no sync, and
    on CPU far faster than torch.repeat_interleave."""
    total = sum(lengths)
    starts = _tensor(lengths[:-1], torch.int64, device).cumsum(0)
    marks = torch.zeros(total + 1, dtype=torch.int64, device=device)
    marks.index_add_(0, starts, torch.ones_like(starts))
    return marks[:total].cumsum(0)


class TokenHistory:
    """Each request's prompt and output token ids as int64 CPU tensors, kept between steps:
    an output tensor grows in place, so a step copies only the tokens sampled since the last.
    The penalties read these instead of converting whole Python lists every step."""

    def __init__(self) -> None:
        self._prompts: dict[str, torch.Tensor] = {}
        self._outputs: dict[str, tuple[torch.Tensor, int]] = {}  # buffer, tokens filled

    def prompt(self, request: SamplingRequest) -> torch.Tensor:
        key = request.request_id
        if key not in self._prompts:
            self._prompts[key] = torch.tensor(request.prompt_token_ids, dtype=torch.int64)
        return self._prompts[key]

    def output(self, request: SamplingRequest) -> torch.Tensor:
        ids = request.output_token_ids
        buffer, filled = self._outputs.get(request.request_id, (None, 0))
        if buffer is None or len(ids) > buffer.shape[0]:
            grown = torch.empty(max(2 * len(ids), 64), dtype=torch.int64)
            if buffer is not None:
                grown[:filled] = buffer[:filled]
            buffer = grown
        if len(ids) == filled + 1:  # the usual decode step: one new token
            buffer[filled] = ids[-1]
        elif len(ids) > filled:
            buffer[filled : len(ids)] = torch.tensor(ids[filled:], dtype=torch.int64)
        self._outputs[request.request_id] = (buffer, len(ids))
        return buffer[: len(ids)]

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._prompts.pop(request_id, None)
            self._outputs.pop(request_id, None)


def _logit_bias(params: list[SamplingParams], device: torch.device) -> TokenIndex | None:
    biases = [p.logit_bias or {} for p in params]
    return _token_index([list(b) for b in biases], device, [list(b.values()) for b in biases])


def _banned_tokens(request: SamplingRequest) -> list[int]:
    return min_tokens_stops(request) + bad_word_completions(request)


def min_tokens_stops(request: SamplingRequest) -> list[int]:
    """EOS and stop token ids, banned while fewer than min_tokens tokens are out."""
    params = request.sampling_params
    if len(request.output_token_ids) >= params.min_tokens:
        return []
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= request.eos_token_ids
    return sorted(stops)


def bad_word_completions(request: SamplingRequest) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    output = request.output_token_ids
    banned = []
    for word in request.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned
