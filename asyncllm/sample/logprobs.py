"""Logprobs on the device (the chosen token's logprob and rank, the top N) and on the host."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from asyncllm.outputs import PromptLogprobsChunk, TokenLogprobs

# prompt positions scored per lm-head call, to bound the [rows, vocab] logits
_PROMPT_ROWS_PER_CHUNK = 256


@dataclass
class LogprobsTensors:
    token_logprobs: torch.Tensor  # float32 [R]
    token_ranks: torch.Tensor  # int64 [R]
    top_ids: torch.Tensor  # int64 [R, N]
    top_logprobs: torch.Tensor  # float32 [R, N]

    @classmethod
    def gather(cls, logprobs: torch.Tensor, token_ids: torch.Tensor, n: int) -> LogprobsTensors:
        """logprobs [R, V], token_ids [R] -> their logprobs and ranks, and the top n of each row."""
        chosen = logprobs.gather(1, token_ids[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1
        top = logprobs.topk(n, dim=-1)
        return cls(chosen.squeeze(1), ranks, top.indices, top.values)

    def to_host(self) -> LogprobsTensors:
        return LogprobsTensors(*(t.cpu() for t in self._fields()))

    def rows(
        self, token_ids: Sequence[int], num_logprobs: Sequence[int | None]
    ) -> list[TokenLogprobs | None]:
        """Per row, the chosen token and its own top-n; None where n is None."""
        logprobs, ranks = self.token_logprobs.tolist(), self.token_ranks.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        rows: list[TokenLogprobs | None] = []
        for i, n in enumerate(num_logprobs):
            if n is None:
                rows.append(None)
                continue
            rows.append(
                TokenLogprobs(
                    token_ids[i], logprobs[i], ranks[i], top_ids[i][:n], top_logprobs[i][:n]
                )
            )
        return rows

    def _fields(self) -> tuple[torch.Tensor, ...]:
        return self.token_logprobs, self.token_ranks, self.top_ids, self.top_logprobs


@dataclass
class PromptSpan:
    """Prompt positions of one request whose next-token logprobs are computed this step."""

    request_id: str
    num_logprobs: int
    first_position: int  # scores prompt token first_position + 1 onwards
    flat_start: int  # row of first_position in the step's flat hidden states
    target_ids: list[int]  # the prompt tokens being scored


def prompt_span(scheduled, flat_start: int) -> PromptSpan | None:
    """The part of a scheduled chunk that scores prompt tokens, for requests asking for
    prompt_logprobs. The last prompt position predicts the first output token, not a prompt
    token, so it never counts; recomputed (preempted) positions count again and the output
    processor keeps the first copy."""
    request = scheduled.request
    n = request.sampling_params.prompt_logprobs
    if n is None:  # most requests: the check runs for each of them every step
        return None
    first = scheduled.num_computed_tokens
    end = min(first + scheduled.num_new_tokens, request.num_prompt_tokens - 1)
    if end <= first:
        return None
    targets = request.prompt_token_ids[first + 1 : end + 1]
    return PromptSpan(request.request_id, n, first, flat_start, targets)


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    spans: list[PromptSpan],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, PromptLogprobsChunk]:
    """Raw log-softmax of the model's logits at the spans' positions, a chunk of rows at a time."""
    device = hidden.device
    rows = torch.cat(
        [torch.arange(s.flat_start, s.flat_start + len(s.target_ids)) for s in spans]
    ).to(device)
    targets = torch.tensor([t for s in spans for t in s.target_ids], device=device)
    n = max(s.num_logprobs for s in spans)
    chunks = []
    for start in range(0, len(rows), _PROMPT_ROWS_PER_CHUNK):
        part = slice(start, start + _PROMPT_ROWS_PER_CHUNK)
        logits = compute_logits(hidden.index_select(0, rows[part]))
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        chunks.append(LogprobsTensors.gather(logprobs, targets[part], n).to_host())
    merged = LogprobsTensors(*(torch.cat(ts) for ts in zip(*(c._fields() for c in chunks))))
    per_row = [s.num_logprobs for s in spans for _ in s.target_ids]
    token_rows = merged.rows(targets.tolist(), per_row)
    out, offset = {}, 0
    for s in spans:
        tokens = token_rows[offset : offset + len(s.target_ids)]
        out[s.request_id] = PromptLogprobsChunk(s.first_position + 1, tokens)
        offset += len(s.target_ids)
    return out
