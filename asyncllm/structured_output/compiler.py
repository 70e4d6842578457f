"""Compiles constraints against the model's vocabulary in a pool of threads (xgrammar releases
the GIL), so neither the event loop nor the engine's steps wait for a compile."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path

import xgrammar as xgr

from asyncllm.sampling_params import StructuredOutputsParams
from asyncllm.structured_output.grammar import compile_structured_outputs

_COMPILE_THREADS = 4


def tokenizer_info(path: Path, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary of the model folder's tokenizer, padded to the logits' width; the grammar
    ends on the engine's EOS ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
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
