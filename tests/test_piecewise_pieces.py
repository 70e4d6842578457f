"""The pieces the piecewise CUDA graphs capture, with each layer's attention between them,
compose to exactly the model's forward pass (checked here on CPU, without graphs; on the GPU
tests/test_gpu_engine.py compares the replayed graphs with eager runs)."""

import torch

from asyncllm import LLM
from asyncllm.core.scheduler_output import ScheduledRequest, SchedulerOutput
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.cuda_graph import PiecewiseGraphs
from asyncllm.worker.step_plan import StepPlan, StepRunner


def test_pieces_and_attention_compose_to_the_forward_pass(tiny_model_dir) -> None:
    llm = LLM(model=str(tiny_model_dir), max_model_len=512, max_num_batched_tokens=256)
    runner = llm.core_client.core.executor.model_runner
    model, kv_caches = runner.model, runner.kv_caches
    plans = [StepPlan(StepRunner.PIECEWISE_GRAPHS, size, 0) for size in (64, 128)]
    pieces = PiecewiseGraphs(model, kv_caches, runner.input_batch, plans, None)
    prompt = Request("p", list(range(100, 150)), SamplingParams(), max_tokens=4)
    step = SchedulerOutput([ScheduledRequest(prompt, 50, 0, [0, 1, 2, 3])])
    with torch.inference_mode():
        inputs = runner.input_batch.prepare(step, StepPlan(StepRunner.PIECEWISE_GRAPHS, 64, 1))
        expected = model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)[:50].clone()
        for index, layer in enumerate(model.layers):
            pieces._piece(index, plans[0])
            layer.attend(pieces.query[:64], kv_caches[index], inputs.meta, out=pieces.attn_out[:64])
        pieces._piece(len(model.layers), plans[0])
    assert torch.equal(pieces.hidden[:50], expected)
