"""Plain data that crosses from the scheduler to the model runner and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    # tokens computed this step: all_token_ids[num_computed_tokens : num_computed_tokens + n]
    num_new_tokens: int
    # num_computed_tokens before this step (the request's own counter moves on at schedule time)
    num_computed_tokens: int
    # the request's whole block table after this step's allocation
    block_ids: list[int]

    @property
    def completes_prompt(self) -> bool:
        """True when this step reaches the end of the known tokens, so a token is sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # requests preempted or finished since the last step, for the runner to forget
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    # one entry per scheduled request, in the scheduled order; None where no token was sampled
    # (a prefill chunk that does not reach the end of the prompt)
    sampled_token_ids: list[int | None]
    # per sampled request, {token_id: logprob} of the chosen token and the top-N, or None
    logprobs: list[dict[int, float] | None] | None = None
