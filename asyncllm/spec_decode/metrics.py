"""Counters of drafts and accepted tokens, as vLLM's spec_decode_* metrics report them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from asyncllm.core.scheduler_output import VerifiedTokens


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verify steps of one request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # per draft position: how many drafts had their token there accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, verified: VerifiedTokens) -> None:
        for tokens, num_drafts in zip(verified.token_ids, verified.num_drafts):
            if not num_drafts or not tokens:
                continue
            num_accepted = len(tokens) - 1
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            per_pos = self.num_accepted_tokens_per_pos
            per_pos.extend([0] * (num_drafts - len(per_pos)))
            for pos in range(num_accepted):
                per_pos[pos] += 1

    def snapshot(self) -> SpecDecodingStats:
        return dataclasses.replace(
            self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos)
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step gives a request, the sampled one included (vLLM's figure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
