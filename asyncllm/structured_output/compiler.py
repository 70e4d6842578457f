"""Compiles constraints against the model's vocabulary in a pool of threads (xgrammar releases
the GIL), so neither the event loop nor the engine's steps wait for a compile."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable
from pathlib import Path

import xgrammar as xgr

from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured_output.grammar import compile_structured_outputs

_COMPILE_THREADS = 4


def tokenizer_info(path: Path, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary of the model folder's tokenizer, at most `vocab_size` (the logits' width)
    ids; the grammar ends on the engine's EOS ids. Not padded to the logits' width: xgrammar
    counts every padding id as a special token and scans the list of them at every accepted
    token (102,784 ids for SmolLM2's tokenizer under Qwen3's logits: 12-16 us an accept on the
    CPU here, 1.6 unpadded); the sampler forbids the logits past the grammar's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.get_vocab().values()
    own_size = max(len(ids), max(ids) + 1, max(stop_token_ids, default=-1) + 1)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=min(own_size, vocab_size), stop_token_ids=sorted(stop_token_ids)
    )


def model_vocabulary(model) -> Callable[[], xgr.TokenizerInfo]:
    """tokenizer_info of a ModelConfig's tokenizer, to load where and when it is needed (a
    picklable call: the grammar process loads it too)."""
    return functools.partial(
        tokenizer_info, model.path, model.hf_config.vocab_size, list(model.eos_token_ids)
    )


class GrammarCompiler:
    """Compiled grammars are cached by xgrammar's compiler (keyed by the constraint's text), so
    parallel samples and repeated schemas compile once. The vocabulary is read on the first
    compile, in the pool: an engine that never constrains never loads it."""

    def __init__(self, vocabulary: Callable[[], xgr.TokenizerInfo]) -> None:
        self._vocabulary = vocabulary
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS, "grammar-compile")

    def submit(
        self, params: StructuredOutputsParams
    ) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        return self._pool.submit(self.compile, params)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return compile_structured_outputs(self._xgrammar_compiler(), params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._vocabulary(), cache_enabled=True)
            return self._compiler
