"""The parts LLM and AsyncLLM share: config, engine core, tokenizer, input and output processing."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.core import EngineCore
from asyncllm.engine.input_processor import InputProcessor, load_tokenizer
from asyncllm.engine.output_processor import OutputProcessor


@dataclass
class EngineParts:
    config: EngineConfig
    core: EngineCore
    tokenizer: PreTrainedTokenizerBase | None
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_engine(args: EngineArgs) -> EngineParts:
    config = args.create_engine_config()
    tokenizer = load_tokenizer(config.model.path)
    return EngineParts(
        config=config,
        core=EngineCore(config),
        tokenizer=tokenizer,
        input_processor=InputProcessor(config.model, tokenizer),
        output_processor=OutputProcessor(tokenizer),
    )
