"""Which requests speculate: the drafts a worker's proposer made after a step are left on
the requests that may (for the next step to verify, when it is not scheduled ahead)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from asyncllm.request import Request, RequestStatus

# a request's drafts cut to those its structured-output grammar takes
DraftCut = Callable[[Request, list[int]], list[int]]


def may_speculate(request: Request) -> bool:
    """Drafts are verified with every sampling setting except those that read the tokens
    before each position (penalties, bad words, min_tokens' stop bans): requests using one
    decode a token at a time, so their outputs stay exact. A structured-output grammar masks
    each draft position with its own state's mask (structured_output.matchers)."""
    params = request.sampling_params
    return (
        request.status is RequestStatus.RUNNING
        and not request.num_output_placeholders
        and not params.uses_penalties
        and not request.bad_words_token_ids
        and request.num_output_tokens >= params.min_tokens
    )


def take_drafts(requests: Iterable[Request], drafts: Iterable[list[int]], cut: DraftCut) -> None:
    """Leaves the worker's drafts, cut, on the requests that may speculate."""
    for request, request_drafts in zip(requests, drafts):
        request.spec_token_ids = cut(request, request_drafts) if may_speculate(request) else []
