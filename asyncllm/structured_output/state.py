"""Where one constrained request stands in its grammar: an xgrammar matcher moved on by the
request's tokens, beside the reasoning a thinking model keeps free of it. Drafts move it on
for a while and are rolled back after, as a verify step scores each draft position as if the
drafts before it had been accepted."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

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
        # before the first draft taken since the last roll back: the reasoning, num_accepted
        self._before_drafts: tuple[ReasoningTracker, int] | None = None
        self._num_matched_drafts = 0  # of those drafts, the ones the matcher took

    def accept(self, token_id: int) -> None:
        """Moves on by one of the request's own tokens."""
        if self._move(token_id) is False:
            self._break_on(token_id)

    def _break_on(self, token_id: int) -> None:
        logger.warning("a constrained request took token %d, which its grammar forbids", token_id)
        self.broken = True

    def accept_all(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self.accept(token_id)

    @property
    def constrains(self) -> bool:
        thinking = self.reasoning.phase is Phase.THINKING
        return not (thinking or self.broken or self.matcher.is_terminated())

    def take_draft(self, token_id: int) -> bool:
        """Moves on by a draft, until roll_back_drafts(): whether the grammar takes it. A
        grammar that ended (took its stop token) takes no more drafts: the request stops
        there."""
        if self._before_drafts is None:
            self._before_drafts = copy.copy(self.reasoning), self.num_accepted
        if self.matcher.is_terminated():
            return False
        moved = self._move(token_id)
        self._num_matched_drafts += bool(moved)
        return moved is not False

    def roll_back_drafts(self) -> None:
        if self._before_drafts is None:
            return
        if self._num_matched_drafts:
            self.matcher.rollback(self._num_matched_drafts)
        self.reasoning, self.num_accepted = self._before_drafts
        self._before_drafts, self._num_matched_drafts = None, 0

    def num_valid(self, drafts: Sequence[int]) -> int:
        """How many of the drafts, in turn, the grammar takes; the state stays as it is."""
        try:
            return next((j for j, t in enumerate(drafts) if not self.take_draft(t)), len(drafts))
        finally:
            self.roll_back_drafts()

    def _move(self, token_id: int) -> bool | None:
        """Moves on by one token: None where the grammar does not judge it, else whether the
        matcher took it."""
        if not self._counts_for_grammar(token_id):
            return None
        return self.matcher.accept_token(token_id)

    def _counts_for_grammar(self, token_id: int) -> bool:
        """Counts the token in; whether the grammar judges it: not inside the reasoning, nor
        after the grammar ended or broke."""
        self.num_accepted += 1
        if not self.reasoning.take(token_id):
            return False
        return not (self.broken or self.matcher.is_terminated())


def accept_in_batch(moves: Sequence[tuple[GrammarState, Sequence[int]]]) -> None:
    """state.accept_all(token_ids) for each pair, with one xgrammar call per token position for
    all the states: a call per state and token would hand the GIL back and forth with the
    runner's thread, which launches the step meanwhile, and wait for it at every call."""
    for j in range(max((len(token_ids) for _, token_ids in moves), default=0)):
        judged = [
            (state, token_ids[j])
            for state, token_ids in moves
            if j < len(token_ids) and state._counts_for_grammar(token_ids[j])
        ]
        if not judged:
            continue
        matchers, tokens = [state.matcher for state, _ in judged], [t for _, t in judged]
        taken = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        for (state, token_id), ok in zip(judged, taken):
            if not ok:
                state._break_on(token_id)
