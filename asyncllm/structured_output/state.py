"""Where one constrained request stands in its grammar: an xgrammar matcher moved on by the
request's tokens, beside the reasoning a thinking model keeps free of it. Drafts are walked
from the current state and rolled back after, as a verify step scores each draft position as
if the drafts before it had been accepted."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence

import xgrammar as xgr

from asyncllm.sampling_params import ReasoningMarkers
from asyncllm.structured_output.reasoning import Phase, ReasoningTracker

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(
        self,
        grammar: xgr.CompiledGrammar,
        reasoning: ReasoningMarkers | None,
        prompt_token_ids: Sequence[int],
    ) -> None:
        # rollback is unlimited in xgrammar's Earley matcher (max_rollback_tokens is deprecated)
        self.matcher = xgr.GrammarMatcher(grammar)
        self.reasoning = ReasoningTracker(reasoning, prompt_token_ids)
        self.num_accepted = 0
        self.broken = False  # took a token its grammar forbids: no longer constrained

    def accept(self, token_id: int) -> None:
        """Moves on by one of the request's own tokens."""
        if self._move(token_id) is False:
            logger.warning(
                "a constrained request took token %d, which its grammar forbids", token_id
            )
            self.broken = True

    def accept_all(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def constrains(self) -> bool:
        thinking = self.reasoning.phase is Phase.THINKING
        return not (thinking or self.broken or self.matcher.is_terminated())

    def walk(self, drafts: Sequence[int], visit: Callable[[int], None] | None = None) -> int:
        """Moves through the drafts as far as the grammar takes them, calling visit(j) in the
        state after drafts[:j] for each j reached, and returns how many it took; the state is
        as it was afterwards. A grammar that ended (took its stop token) takes no more drafts:
        the request stops there."""
        saved = copy.copy(self.reasoning), self.num_accepted
        num_matched = 0  # of the drafts, those the matcher took (not the reasoning's)
        try:
            for taken, token_id in enumerate(drafts):
                if visit is not None:
                    visit(taken)
                if self.matcher.is_terminated():
                    return taken
                moved = self._move(token_id)
                if moved is False:
                    return taken
                num_matched += bool(moved)
            if visit is not None:
                visit(len(drafts))
            return len(drafts)
        finally:
            if num_matched:
                self.matcher.rollback(num_matched)
            self.reasoning, self.num_accepted = saved

    def _move(self, token_id: int) -> bool | None:
        """Moves on by one token: None where the grammar does not judge it (inside the
        reasoning, after the grammar ended or broke), else whether the matcher took it."""
        self.num_accepted += 1
        if not self.reasoning.take(token_id):
            return None
        if self.broken or self.matcher.is_terminated():
            return None
        return self.matcher.accept_token(token_id)
