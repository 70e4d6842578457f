"""The engine core's check of a constrained request's drafts (vLLM's validate_tokens): each
request that speculates keeps a grammar state here, moved on by its outputs when its drafts
are checked, and the drafts are cut to the longest prefix its grammar takes."""

from __future__ import annotations

import weakref

from asyncllm.request import Request
from asyncllm.structured_output.state import GrammarState


class DraftChecker:
    def __init__(self) -> None:
        # keyed by the request itself: a state goes when the core lets go of its request
        self._states: weakref.WeakKeyDictionary[Request, GrammarState] = weakref.WeakKeyDictionary()

    def valid_prefix(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first the grammar forbids after the request's outputs (all
        on the host: a request speculates only then) and the drafts before it; the request
        has a grammar."""
        state = self._states.get(request)
        if state is None:
            reasoning = request.sampling_params.structured_outputs.reasoning
            state = GrammarState(request.grammar, reasoning, request.prompt_token_ids)
            self._states[request] = state
        state.accept_all(request.output_token_ids[state.num_accepted :])
        return drafts[: state.num_valid(drafts)]
