"""Where a constrained request stands in a thinking model's reasoning: its grammar holds from
the end of the reasoning on, the tokens inside <think>...</think> are free."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from asyncllm.sampling_params import ReasoningMarkers


class Phase(enum.Enum):
    ANSWER = "answer"  # the grammar holds
    MAY_OPEN = "may_open"  # the first output token: the grammar's or the start tag
    THINKING = "thinking"  # free until the end tag


def last_index(token_ids: Sequence[int], marker: tuple[int, ...]) -> int:
    """Where marker last starts in token_ids; -1 when it does not occur."""
    width = len(marker)
    for start in range(len(token_ids) - width, -1, -1):
        if tuple(token_ids[start : start + width]) == marker:
            return start
    return -1


def first_phase(markers: ReasoningMarkers | None, prompt_token_ids: Sequence[int]) -> Phase:
    """A prompt that closed the reasoning (Qwen3's template with thinking off) asks for the
    answer at once. A model whose output opens the reasoning may do so only with a start tag of
    one token (a thinking model's special token)."""
    if markers is None:
        return Phase.ANSWER
    if last_index(prompt_token_ids, markers.end) > last_index(prompt_token_ids, markers.start):
        return Phase.ANSWER
    if markers.opened_by_output:
        return Phase.MAY_OPEN if len(markers.start) == 1 else Phase.ANSWER
    return Phase.THINKING


class ReasoningTracker:
    def __init__(self, markers: ReasoningMarkers | None, prompt_token_ids: Sequence[int]) -> None:
        self.markers = markers
        self.phase = first_phase(markers, prompt_token_ids)
        self._recent: list[int] = []  # the last tokens of the reasoning, as long as the end tag

    @property
    def opening_token(self) -> int | None:
        """The start tag's token, allowed beside the grammar's first tokens."""
        return self.markers.start[0] if self.phase is Phase.MAY_OPEN else None

    def take(self, token_id: int) -> bool:
        """Moves on by one output token; whether it belongs to the answer (the grammar's)."""
        if self.phase is Phase.ANSWER:
            return True
        if self.phase is Phase.MAY_OPEN:
            opens = token_id == self.markers.start[0]
            self.phase = Phase.THINKING if opens else Phase.ANSWER
            return not opens
        end = self.markers.end
        self._recent = [*self._recent, token_id][-len(end) :]
        if tuple(self._recent) == end:
            self.phase = Phase.ANSWER
        return False
