"""asyncllm: an LLM inference engine and streaming server around one asyncio event loop."""

from asyncllm.config import EngineArgs
from asyncllm.engine.async_llm import AsyncLLM
from asyncllm.engine.llm import LLM
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
]
