"""Plain data that crosses from the scheduler to the model runner and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.outputs import PromptLogprobsChunk, TokenLogprobs
from asyncllm.request import Request

# a draft of a step scheduled while the request's step before runs: the proposer makes it on
# the device after that step, and the runner takes it from there
DRAFT_ON_DEVICE = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step, fixed when scheduled: the request itself may move on
    (take in the previous step's token) while the runner still prepares this step."""

    request: Request
    # tokens computed this step: all_token_ids[num_computed_tokens : num_computed_tokens + n]
    num_new_tokens: int
    # num_computed_tokens before this step (the request's own counter moves on at schedule time)
    num_computed_tokens: int
    # the request's whole block table after this step's allocation
    block_ids: list[int]
    # draft tokens to verify, the last of num_new_tokens (speculative decoding); all
    # DRAFT_ON_DEVICE in a step scheduled ahead of the request's step in flight
    spec_token_ids: list[int] = field(default_factory=list)
    # this step's input tokens known on the host when scheduled. Scheduled ahead of the step in
    # flight (async scheduling), the first token not here is the one that step samples, and
    # any drafts after it are on the device too; num_computed_tokens then counts that step's
    # drafts as accepted, and the runner moves the step back by those rejected
    token_ids: list[int] = field(init=False)
    # the step reaches the end of the request's tokens, so it samples the next one
    completes_prompt: bool = field(init=False)

    def __post_init__(self) -> None:
        end = self.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids)
        self.token_ids = self.request.all_token_ids[self.num_computed_tokens : end]
        if not self.drafts_on_device:
            self.token_ids += self.spec_token_ids
        self.completes_prompt = end >= self.request.num_tokens

    @property
    def drafts_on_device(self) -> bool:
        return bool(self.spec_token_ids) and self.spec_token_ids[0] == DRAFT_ON_DEVICE


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # requests preempted or finished since the last step, for the runner to forget
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # requests scheduled for the first time, and when (time.monotonic())
    first_scheduled: dict[str, float] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class VerifiedTokens:
    """A verify step's results, one entry per scheduled request: the accepted drafts and the
    token sampled after them (the bonus token when every draft was accepted). Rows without
    drafts have empty lists (their one token is in sampled_token_ids)."""

    token_ids: list[list[int]]
    num_drafts: list[int]
    # per row, the logprobs of each of its tokens, where the request asked for them
    logprobs: list[list[TokenLogprobs] | None] | None = None


@dataclass
class ModelRunnerOutput:
    # one entry per scheduled request, in the scheduled order; None where no token was sampled
    # (a prefill chunk that does not reach the end of the prompt)
    sampled_token_ids: list[int | None]
    # one entry per scheduled request, where it sampled a token and asked for logprobs
    logprobs: list[TokenLogprobs | None] | None = None
    # request id -> logprobs of the prompt tokens scored this step (prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)

    # a step that verified drafts: what each row produced
    verified: VerifiedTokens | None = None
    # drafts a proposer next to the model made after this step's tokens, per row
    draft_token_ids: list[list[int]] | None = None

    def tokens_of(self, row: int) -> list[int]:
        """Every token the row produced this step: none, one, or the accepted drafts and the
        token sampled after them."""
        if self.verified is not None and self.verified.token_ids[row]:
            return self.verified.token_ids[row]
        token_id = self.sampled_token_ids[row]
        return [] if token_id is None else [token_id]

    def logprobs_of(self, row: int) -> list[TokenLogprobs] | None:
        verified = self.verified
        if verified is not None and verified.logprobs is not None and verified.logprobs[row]:
            return verified.logprobs[row]
        entry = None if self.logprobs is None else self.logprobs[row]
        return None if entry is None else [entry]

    def set_sampled(
        self, rows: list[int], token_ids: list[int], logprobs: list[TokenLogprobs | None] | None
    ) -> None:
        """Places the sampler's per-row results at their scheduled indices."""
        for row, token_id in zip(rows, token_ids):
            self.sampled_token_ids[row] = token_id
        if logprobs is not None:
            self.logprobs = [None] * len(self.sampled_token_ids)
            for row, entry in zip(rows, logprobs):
                self.logprobs[row] = entry
