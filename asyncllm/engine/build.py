"""The parts LLM and AsyncLLM share: config, engine core, tokenizer, input and output processing."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.engine.core import EngineCore, EngineCoreOutput
from asyncllm.engine.core_client import CoreClient, CoreProcessClient
from asyncllm.engine.input_processor import InputProcessor, load_tokenizer
from asyncllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from asyncllm.outputs import RequestOutput
from asyncllm.request import Request, RequestStatus


@dataclass
class EngineParts:
    config: EngineConfig
    core: EngineCore | CoreProcessClient
    tokenizer: PreTrainedTokenizerBase | None
    input_processor: InputProcessor
    output_processor: OutputProcessor


def build_engine(args: EngineArgs, core_process_allowed: bool = False) -> EngineParts:
    """core_process_allowed: the caller steps the core asynchronously, so the core may run in a
    process of its own (config.engine_process)."""
    config = args.create_engine_config()
    tokenizer = load_tokenizer(config.model.path)
    own_process = core_process_allowed and config.engine_process
    return EngineParts(
        config=config,
        core=CoreProcessClient(config) if own_process else EngineCore(config),
        tokenizer=tokenizer,
        input_processor=InputProcessor(config.model, tokenizer),
        output_processor=OutputProcessor(tokenizer),
    )


def add_request(
    engine: EngineParts,
    request: Request,
    prompt: str | None,
    collector: RequestOutputCollector | None = None,
    core: EngineCore | CoreClient | None = None,
) -> None:
    """Registers a processed request for output processing and hands it (or its parallel
    samples) to the engine core (or to `core`, what drives it). A request the core refuses
    (ValueError: it could never run) is forgotten again."""
    core = core or engine.core
    try:
        for engine_request in engine.output_processor.add_request(request, prompt, collector):
            core.add_request(engine_request)
    except ValueError:
        engine.output_processor.abort([request.request_id])
        raise


def process_outputs(engine: EngineParts, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
    """Detokenize a step's outputs and apply what that decides (stop strings, held-back
    parallel samples) to the engine core; returns outputs not handed to a collector."""
    if not outputs:
        return []
    processed = engine.output_processor.process(outputs)
    engine.core.finish_requests(processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED)
    for request in processed.new_requests:
        engine.core.add_request(request)
    return processed.request_outputs
