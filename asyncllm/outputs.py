"""What the engine hands back to callers, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob (the chosen token first, then the top N)
SampleLogprobs = list[dict[int, Logprob]]
# one entry per prompt token; None for the first, which nothing predicts
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # set when the request failed inside the engine
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def num_generated_tokens(self) -> int:
        """Completion tokens over all outputs, for usage accounting."""
        return sum(len(o.token_ids) for o in self.outputs)


# what the engine core reports per step, before detokenization
@dataclass
class TokenLogprobs:
    """One position: the chosen token (for a prompt, the actual next token) and the top N."""

    token_id: int
    logprob: float
    rank: int  # 1 for the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens start .. start + len(tokens) - 1 (start >= 1)."""

    start: int
    tokens: list[TokenLogprobs]
