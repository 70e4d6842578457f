"""What LLM and AsyncLLM share: the config, the tokenizer, input and output processing, and the
one handle on the engine core (a CoreClient)."""

from __future__ import annotations

import dataclasses

from asyncllm.config import EngineArgs
from asyncllm.core.scheduler import check_fits
from asyncllm.engine.core_client import CoreClient
from asyncllm.engine.gil import shorten_switch_interval
from asyncllm.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from asyncllm.engine.messages import CoreStep, EngineCoreRequest, EngineStats
from asyncllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from asyncllm.outputs import RequestOutput
from asyncllm.request import RequestStatus
from asyncllm.sampling_params import SamplingParams


class FrontEnd:
    def __init__(self, args: EngineArgs, core_process_allowed: bool) -> None:
        """core_process_allowed: the caller reads the core's steps asynchronously, so the core
        may run in a process of its own (config.engine_process)."""
        self.config = args.create_engine_config()
        shorten_switch_interval(self.config.model.device)  # the event loop, the core's readers
        # built here so that a bad --override-generation-config fails before the model loads
        self._default_sampling_params = SamplingParams(**self.config.model.sampling_defaults)
        self.tokenizer = load_tokenizer(self.config.model)
        self.input_processor = InputProcessor(self.config.model, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        own_process = core_process_allowed and self.config.engine_process
        self.core_client = CoreClient.create(self.config, own_process)
        self.latest_stats = EngineStats()

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (--generation-config), SamplingParams' own elsewhere."""
        return dataclasses.replace(self._default_sampling_params)

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> tuple[EngineCoreRequest, str | None]:
        """A validated request and its prompt text; raises ValueError for one that could never
        run. Nothing reaches the core yet."""
        request, text = self.input_processor.process(
            request_id, prompt, params, priority, add_special_tokens
        )
        capacity = self.core_client.capacity
        check_fits(
            len(request.prompt_token_ids),
            request.max_tokens,
            self.config.scheduler,
            capacity.num_blocks,
            capacity.block_size,
        )
        return request, text

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        collector: RequestOutputCollector | None = None,
    ) -> None:
        """Registers the request for output processing and hands it (or its parallel samples)
        to the core."""
        for engine_request in self.output_processor.add_request(request, prompt, collector):
            self.core_client.add_request(engine_request)

    def abort_request(self, request_id: str) -> None:
        """Stops a request (all its parallel samples); its blocks are freed before the next
        step."""
        engine_ids = self.output_processor.abort([request_id])
        self.core_client.finish_requests(engine_ids, RequestStatus.FINISHED_ABORTED)

    def process_step(self, step: CoreStep) -> list[RequestOutput]:
        """Detokenizes a step's outputs and tells the core which requests hit a stop string;
        returns the outputs not handed to a collector."""
        self.latest_stats = step.stats
        self.output_processor.note_first_scheduled(step.first_scheduled)
        if not step.outputs:
            return []
        processed = self.output_processor.process(step.outputs)
        self.core_client.finish_requests(
            processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED
        )
        return processed.request_outputs
