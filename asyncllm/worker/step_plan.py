"""The step plan: how one step runs, decided once from its scheduled requests and the sizes
CUDA graphs are captured at.

Pure-decode steps pad to a decode graph's batch size. Steps with prompt tokens pad to a token
count of the ladder: up to the backend's max_short_step_tokens a whole-step graph runs them
(their requests padded to the graph's fixed count with requests of no tokens), above it the
piecewise graphs do. Past the ladder, a step runs unpadded and eagerly. With speculation,
uniform verify steps (every request a token and its num_speculative_tokens drafts) pad to a
batch size of their own ladder, b requests of k + 1 tokens, and run whole-step graphs of that
size: a batch-1 verify step computes 5 rows, not the ladder's 64. With graphs off
(enforce_eager) steps still pad the same way, so that both modes launch the same kernels and
give bit-identical outputs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from asyncllm.core.scheduler_output import SchedulerOutput

# decode graphs past this batch size cost more memory and capture time than they save
MAX_DECODE_GRAPH_BATCH = 512


class StepRunner(enum.Enum):
    DECODE_GRAPH = "decode graph"
    SHORT_STEP_GRAPH = "short step graph"
    VERIFY_GRAPH = "verify graph"
    PIECEWISE_GRAPHS = "piecewise graphs"
    EAGER = "eager"


@dataclass(frozen=True)
class StepPlan:
    runner: StepRunner
    num_tokens: int  # rows the model computes, padding included
    num_reqs: int  # requests in the attention metadata, padding included
    # one token a request: padding requests have a token each, the metadata is the decode
    # graphs' (max_seq_len = max_model_len) and the logits of every row are computed
    pure_decode: bool = False


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (as vLLM does)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


def token_count_ladder(max_tokens: int, cap: int = 16384) -> list[int]:
    """Token counts for the graphs of steps with prompt tokens: steps of 64 up to 512, then of
    128, 256, 512 and 1024 from 512, 1024, 2048 and 4096 on, up to cap (padding under 64
    tokens, or under a quarter of the step's), and max_tokens itself when it is below cap.
    Even big steps need graphs: launched eagerly, an 8,192-token step of Qwen3-0.6B took 17-24
    ms of host time on the H200, more than its GPU time (`bench/NOTES.md`, change 26)."""
    ladder = [
        *range(64, 512, 64),
        *range(512, 1024, 128),
        *range(1024, 2048, 256),
        *range(2048, 4096, 512),
        *range(4096, cap + 1, 1024),
    ]
    sizes = [size for size in ladder if size < max_tokens and size <= cap]
    return sizes + [max_tokens] if max_tokens <= cap else sizes


def verify_batch_sizes(max_num_seqs: int, verify_len: int, max_tokens: int) -> tuple[int, ...]:
    """The decode ladder's batch sizes whose verify steps fit a whole-step graph (the prefill
    kernel's short tiles read no host metadata up to max_tokens rows)."""
    if not verify_len:
        return ()
    sizes = batch_size_ladder(max_num_seqs)
    return tuple(b for b in sizes if b * verify_len <= max_tokens)


def _fit(sizes: tuple[int, ...], n: int) -> int | None:
    return next((size for size in sizes if size >= n), None)


@dataclass(frozen=True)
class StepPlanner:
    """The sizes steps pad to (none: every step runs as scheduled, as on CPU) and whether
    graphs of them are captured."""

    decode_sizes: tuple[int, ...] = ()  # batch sizes of pure-decode steps
    token_counts: tuple[int, ...] = ()  # token counts of steps with prompt tokens
    max_short_step_tokens: int = 0  # token counts up to this are captured whole
    max_num_reqs: int = 0
    graphs: bool = False
    verify_len: int = 0  # tokens a request verifies in a step: k drafts + 1 (0: no speculation)
    verify_sizes: tuple[int, ...] = ()  # batch sizes of uniform verify steps

    @classmethod
    def from_limits(
        cls,
        max_num_seqs: int,
        max_num_tokens: int,
        max_short_step_tokens: int,
        graphs: bool,
        num_speculative_tokens: int = 0,
    ) -> StepPlanner:
        verify_len = num_speculative_tokens + 1 if num_speculative_tokens else 0
        return cls(
            decode_sizes=tuple(batch_size_ladder(min(max_num_seqs, MAX_DECODE_GRAPH_BATCH))),
            token_counts=tuple(token_count_ladder(max_num_tokens)),
            max_short_step_tokens=max_short_step_tokens,
            max_num_reqs=max_num_seqs,
            graphs=graphs,
            verify_len=verify_len,
            verify_sizes=verify_batch_sizes(
                max_num_seqs, verify_len, min(max_num_tokens, max_short_step_tokens)
            ),
        )

    def plan(self, scheduler_output: SchedulerOutput, scores_prompt: bool) -> StepPlan:
        """scores_prompt: some request asks for prompt logprobs in this step, which need the
        hidden states (the decode graphs keep only the logits)."""
        scheduled = scheduler_output.scheduled
        num_reqs, num_tokens = len(scheduled), scheduler_output.total_num_scheduled_tokens
        one_token_each = all(s.num_new_tokens == 1 for s in scheduled)
        if one_token_each and not scores_prompt:
            size = _fit(self.decode_sizes, num_reqs)
            if size is not None:
                runner = StepRunner.DECODE_GRAPH if self.graphs else StepRunner.EAGER
                return StepPlan(runner, size, size, pure_decode=True)
        if self._uniform_verify(scheduler_output) and not scores_prompt:
            size = _fit(self.verify_sizes, num_reqs)
            if size is not None:
                runner = StepRunner.VERIFY_GRAPH if self.graphs else StepRunner.EAGER
                return StepPlan(runner, size * self.verify_len, size)
        size = _fit(self.token_counts, num_tokens)
        if size is None:
            return StepPlan(StepRunner.EAGER, num_tokens, num_reqs)
        if not self.graphs:
            return StepPlan(StepRunner.EAGER, size, num_reqs)
        if size > self.max_short_step_tokens:
            return StepPlan(StepRunner.PIECEWISE_GRAPHS, size, num_reqs)
        # with no query of two tokens or more attention takes the decode kernel, which the
        # whole-step graphs do not hold (a decode step scoring prompt logprobs)
        if one_token_each:
            return StepPlan(StepRunner.EAGER, size, num_reqs)
        return self._short_step(size)

    def graph_plans(self, runner: StepRunner) -> list[StepPlan]:
        """The plans whose graphs are captured for runner, one per size."""
        if not self.graphs:
            return []
        if runner is StepRunner.DECODE_GRAPH:
            return [StepPlan(runner, size, size, pure_decode=True) for size in self.decode_sizes]
        short = [size for size in self.token_counts if size <= self.max_short_step_tokens]
        if runner is StepRunner.SHORT_STEP_GRAPH:
            return [self._short_step(size) for size in short]
        if runner is StepRunner.VERIFY_GRAPH:
            return [StepPlan(runner, b * self.verify_len, b) for b in self.verify_sizes]
        if runner is StepRunner.PIECEWISE_GRAPHS:
            # the pieces read no request metadata: their graphs hold any split into requests
            others = [size for size in self.token_counts if size not in short]
            return [StepPlan(runner, size, 0) for size in others]
        return []

    def _uniform_verify(self, scheduler_output: SchedulerOutput) -> bool:
        """Every request verifies num_speculative_tokens drafts after its last token."""
        n = self.verify_len
        return n > 0 and all(
            s.num_new_tokens == n and len(s.spec_token_ids) == n - 1
            for s in scheduler_output.scheduled
        )

    def _short_step(self, num_tokens: int) -> StepPlan:
        """A whole-step graph takes a fixed number of requests: each real one has a token."""
        num_reqs = min(num_tokens, self.max_num_reqs)
        return StepPlan(StepRunner.SHORT_STEP_GRAPH, num_tokens, num_reqs)
