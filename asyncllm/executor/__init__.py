"""Executors run the model for the engine core (abstract.py: the interface)."""

from asyncllm.config import EngineConfig
from asyncllm.executor.abstract import Executor
from asyncllm.executor.uniproc import UniprocExecutor


def create_executor(config: EngineConfig) -> Executor:
    return UniprocExecutor(config)
