"""Per-request generation settings with vLLM's names, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncllm.errors import ValidationError

_GREEDY_EPS = 1e-5
_MAX_ABS_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class ReasoningMarkers:
    """A thinking model's tags in token ids, set by the server's --reasoning-parser: a constraint
    holds from the end of the reasoning on. opened_by_output: reasoning only when the output
    opens with the start tag (Qwen3); else the template opened it (DeepSeek-R1)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    opened_by_output: bool


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured_outputs: exactly one constraint on the output (json_object: any JSON
    object). json is a JSON schema, as a dict or its text."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF)
    json_object: bool = False
    reasoning: ReasoningMarkers | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(
                f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}; got "
                f"{', '.join(given) or 'none'}.",
                "structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValidationError(
                "structured_outputs.choice must be a non-empty array of strings.",
                "structured_outputs.choice",
            )

    @property
    def kind(self) -> str:
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # run this many samples, return the n most likely
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            self.logit_bias = _int_keys(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            known = {k: v for k, v in self.structured_outputs.items() if k in _CONSTRAINTS}
            self.structured_outputs = StructuredOutputsParams(**known)
        self._validate()

    def _validate(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_token_lists()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValidationError(f"{name} must be non-negative, got {value}.", name)

    def _validate_counts(self) -> None:
        if self.n < 1:
            raise ValidationError(f"n must be at least 1, got {self.n}.", "n")
        if self.best_of is not None and self.best_of < self.n:
            raise ValidationError(
                f"best_of must be at least n ({self.n}), got {self.best_of}.", "best_of"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValidationError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens"
            )
        if self.min_tokens < 0:
            raise ValidationError(
                f"min_tokens must be non-negative, got {self.min_tokens}.", "min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValidationError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
                "min_tokens",
            )

    def _validate_distribution(self) -> None:
        if self.temperature < 0.0:
            raise ValidationError(
                f"temperature must be non-negative, got {self.temperature}.", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValidationError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k < -1:
            raise ValidationError(
                f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}.", "top_k"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValidationError(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValidationError(f"seed must be in [-2^63, 2^63 - 1], got {self.seed}.", "seed")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValidationError(f"{name} must be in [-2, 2], got {value}.", name)
        if self.repetition_penalty <= 0.0:
            raise ValidationError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.",
                "repetition_penalty",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            if not -_MAX_ABS_LOGIT_BIAS <= bias <= _MAX_ABS_LOGIT_BIAS:
                raise ValidationError(
                    f"logit_bias for token {token_id} must be in [-100, 100], got {bias}.",
                    "logit_bias",
                )

    def _validate_token_lists(self) -> None:
        if any(not s for s in self.stop):
            raise ValidationError("stop must not contain empty strings.", "stop")
        if self.bad_words is not None and any(not w for w in self.bad_words):
            raise ValidationError("bad_words must not contain empty strings.", "bad_words")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValidationError("allowed_token_ids must not be empty.", "allowed_token_ids")
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(t < 0 for t in getattr(self, name) or []):
                raise ValidationError(f"{name} must hold non-negative token ids.", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """Samples the engine runs for this request: best_of when set, else n."""
        return self.best_of or self.n

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _int_keys(logit_bias: dict) -> dict[int, float]:
    """OpenAI sends logit_bias keys as strings of token ids."""
    try:
        return {int(k): float(v) for k, v in logit_bias.items()}
    except (TypeError, ValueError) as e:
        message = f"logit_bias must map token ids to numbers: {e}"
        raise ValidationError(message, "logit_bias") from e
