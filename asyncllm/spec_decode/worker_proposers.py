"""The proposers that run next to the target in the worker: n-gram lookup, a draft model,
EAGLE / EAGLE-3 heads, Medusa heads. Each drafts after every step and keeps its KV cache
(kv_cache, empty for Medusa and n-gram) in the target's block pool; reads_hidden and
aux_layers say which of the target's hidden states it reads. A draft model and EAGLE heads
draft with draft(TargetStep) -> per-row lists, read on the host; a proposer with
drafts_on_device (n-gram, Medusa) drafts with propose(DraftBatch) -> [R, k] device ids (-1:
none), which the next step reads where they are: a speculating request can then be scheduled
again while its step runs."""

from __future__ import annotations

import dataclasses

from torch import nn

from asyncllm.attention.backend import AttentionBackend
from asyncllm.config import EngineConfig, ModelConfig
from asyncllm.models.draft_heads import load_draft_head
from asyncllm.spec_decode.draft_model import DraftModelProposer
from asyncllm.spec_decode.eagle import EagleProposer
from asyncllm.spec_decode.medusa import MedusaProposer
from asyncllm.spec_decode.ngram import NgramProposer

WorkerProposer = DraftModelProposer | EagleProposer | MedusaProposer | NgramProposer


def load_worker_proposer(
    config: EngineConfig, target: nn.Module, backend: AttentionBackend, num_rows: int
) -> WorkerProposer | None:
    """num_rows: the input batch's, which the n-gram proposer keeps the tokens of."""
    speculative = config.speculative
    if speculative is None:
        return None
    if speculative.method == "ngram":
        return NgramProposer(speculative, num_rows, config.model.max_model_len, config.model.device)
    num_tokens = speculative.num_speculative_tokens
    if speculative.method == "draft_model":
        draft = ModelConfig.from_args(dataclasses.replace(config.args, model=speculative.model))
        if draft.hf_config.vocab_size != config.model.hf_config.vocab_size:
            raise ValueError("the draft model's vocabulary must be the target's.")
        return DraftModelProposer(draft, backend, num_tokens)
    head = load_draft_head(speculative.method, speculative.model, target, config.model, backend)
    if speculative.method == "medusa":
        return MedusaProposer(head, num_tokens, config.model)
    return EagleProposer(head, num_tokens, config.model)
