"""A process of its own for the grammar states of constrained requests. xgrammar's accepts and
fills hold the GIL for their whole call (about 2.5-3 ms a step at batch 256 on an H200's host),
and the engine core's thread needs it for its own work meanwhile: here they run beside it.

The process hears of a request when the worker's matchers start it (its constraint, its
reasoning markers, its prompt and the outputs so far), compiles the constraint itself (a
compiled grammar does not pickle, and serializing one took 170 ms against a 15 ms compile), and
from then on takes every token the request samples. Once compiled, it fills the request's mask
rows in shared memory laid out as the worker's host bitmask, in the same rows.

Invariant: the process's state of a request has taken exactly the tokens the worker sent it, so
the worker knows its count without asking."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from multiprocessing.connection import Connection

import torch
import xgrammar as xgr

from asyncllm.sampling_params import ReasoningMarkers, StructuredOutputsParams
from asyncllm.structured_output.compiler import GrammarCompiler
from asyncllm.structured_output.masks import allow_all, fill_masks
from asyncllm.structured_output.state import GrammarState, accept_in_batch


@dataclass
class Adopt:
    """Start holding a request's state (again: a request held before starts over)."""

    request_id: str
    constraint: StructuredOutputsParams
    reasoning: ReasoningMarkers | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


# (request id, the bitmask row of its first position, its drafts): a plain tuple, pickled for
# every row of every step
RemoteRow = tuple[str, int, Sequence[int]]


@dataclass
class Step:
    """One step's work: forget, adopt, take the sampled tokens, then fill the rows' masks."""

    forget: list[str] = field(default_factory=list)
    adopt: list[Adopt] = field(default_factory=list)
    accepts: list[tuple[str, list[int]]] = field(default_factory=list)
    rows: list[RemoteRow] = field(default_factory=list)


@dataclass
class _Held:
    adopted: Adopt
    grammar: concurrent.futures.Future[xgr.CompiledGrammar]
    # the tokens taken while the grammar compiled, then the state they moved on
    waiting: list[int]
    state: GrammarState | None = None


class _HeldGrammars:
    """The process's side: requests' states by id, masks filled into the shared buffer."""

    def __init__(self, masks: torch.Tensor, compiler: GrammarCompiler, num_threads: int) -> None:
        self._masks = masks
        self._compiler = compiler
        self._batch = xgr.BatchGrammarMatcher(num_threads)
        self._held: dict[str, _Held] = {}
        self._compiling: dict[str, _Held] = {}  # of those, the ones without a state yet

    def step(self, step: Step) -> list[str]:
        """The ids whose grammar became ready in this step."""
        for request_id in step.forget:
            self._held.pop(request_id, None)
            self._compiling.pop(request_id, None)
        for adopted in step.adopt:
            grammar = self._compiler.submit(adopted.constraint)
            held = _Held(adopted, grammar, list(adopted.output_token_ids))
            self._held[adopted.request_id] = self._compiling[adopted.request_id] = held
        ready = self._start_compiled()
        moves = []
        for request_id, token_ids in step.accepts:
            held = self._held[request_id]
            if held.state is None:
                held.waiting.extend(token_ids)
            else:
                moves.append((held.state, token_ids))
        accept_in_batch(moves)
        if step.rows:
            self._fill(step.rows)
        return ready

    def _start_compiled(self) -> list[str]:
        started = []
        for request_id, held in self._compiling.items():
            # a constraint it cannot compile (the worker's did) leaves the request there
            if held.grammar.done() and held.grammar.exception() is None:
                adopted = held.adopted
                held.state = GrammarState(
                    held.grammar.result(), adopted.reasoning, adopted.prompt_token_ids
                )
                held.state.accept_all(held.waiting)
                started.append(request_id)
        for request_id in started:
            del self._compiling[request_id]
        return started

    def _fill(self, rows: list[RemoteRow]) -> None:
        states = [self._held[request_id].state for request_id, _, _ in rows]
        firsts, drafts = [first for _, first, _ in rows], [d for _, _, d in rows]
        allow_all(self._masks, firsts, [len(d) + 1 for d in drafts])
        fill_masks(self._batch, self._masks, states, firsts, drafts)


def serve(
    connection: Connection,
    masks_name: str,
    shape: tuple[int, int],
    vocabulary: Callable[[], xgr.TokenizerInfo],
    num_threads: int,
) -> None:
    """The process's loop: once the vocabulary is loaded, an empty list out; then a Step in,
    the ids ready since the last step (or the error) out; None, or the worker gone, ends it."""
    # its torch work is a few small copies a step: with torch's pool of a thread per core, its
    # step took 7.3 ms inside the engine on the H200's host, of them 2.3 in xgrammar's accepts
    # and fills, at 71 ms of CPU time; with one thread 3.3-3.5 ms at 4.2-4.4 ms of CPU time
    # (bench/results/grammar_process_trace_{child_cpu,one_thread_1,one_thread_2}_h200.json)
    torch.set_num_threads(1)
    memory = shared_memory.SharedMemory(name=masks_name)
    masks = torch.frombuffer(memory.buf, dtype=torch.int32).view(shape)
    compiler = GrammarCompiler(vocabulary)
    compiler.compile(StructuredOutputsParams(json_object=True))  # loads the vocabulary
    held = _HeldGrammars(masks, compiler, num_threads)
    connection.send([])
    with contextlib.suppress(EOFError):  # the worker has gone
        while (step := connection.recv()) is not None:
            try:
                connection.send(held.step(step))
            except Exception as e:  # the worker fails the step with it
                connection.send(RuntimeError(f"grammar process: {type(e).__name__}: {e}"))


class GrammarProcess:
    """The worker's handle on the process: send a step, later take its reply."""

    def __init__(
        self,
        vocabulary: Callable[[], xgr.TokenizerInfo],
        shape: tuple[int, int],
        num_threads: int,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # the parent holds CUDA and threads
        memory = shared_memory.SharedMemory(create=True, size=shape[0] * shape[1] * 4)
        self.masks = torch.frombuffer(memory.buf, dtype=torch.int32).view(shape)
        self._connection, child = context.Pipe()
        process = context.Process(
            target=serve,
            args=(child, memory.name, shape, vocabulary, num_threads),
            name="grammar-process",
            daemon=True,
        )
        process.start()
        child.close()
        self.pid = process.pid
        self._started = False
        self._stop = weakref.finalize(self, _stop, self._connection, process, memory)

    def started(self) -> bool:
        """Whether it has loaded the vocabulary (a few seconds: torch, the tokenizer); the
        worker sends it nothing before, so that no step waits for its start."""
        if not self._started and self._connection.poll():
            self._started = self._connection.recv() == []
        return self._started

    def send(self, step: Step) -> None:
        self._connection.send(step)

    def receive(self) -> list[str]:
        """The ids whose grammar became ready; raises the step's error."""
        reply = self._connection.recv()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def close(self) -> None:
        self._stop()


def _stop(
    connection: Connection, process: multiprocessing.Process, memory: shared_memory.SharedMemory
) -> None:
    with contextlib.suppress(OSError):  # it may have gone already
        connection.send(None)
    process.join(1)
    if process.is_alive():
        process.kill()
    connection.close()
    memory.unlink()  # the views on it go with the worker's matchers
