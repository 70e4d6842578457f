"""The embedding and the LM head split by vocabulary: each rank holds ceil(vocab / tp) rows
(the last rank's tail padded with zeros). The embedding all-reduces (each token's row comes
from the one rank holding it, zeros from the others); the LM head all-gathers the logits, so
every rank samples the same ids from the same logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from asyncllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from asyncllm.layers.linear import (
    LoadedWeight,
    QuantizationConfig,
    copy_weight,
    loaded_shape,
    read_range,
)
from asyncllm.layers.quantization.base import UnquantizedLinearMethod


class _VocabShard(nn.Module):
    """This rank's rows [vocab_start, vocab_end) of a [num_embeddings, embedding_dim] weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings, self.embedding_dim, self.prefix = num_embeddings, embedding_dim, prefix
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, shard_id: Any = None
    ) -> None:
        if loaded_shape(loaded_weight)[0] != self.num_embeddings:
            raise ValueError(
                f"{self.prefix}: checkpoint has {loaded_shape(loaded_weight)[0]} rows, the model "
                f"{self.num_embeddings}"
            )
        rows = self.vocab_end - self.vocab_start
        copy_weight(param.data[:rows], read_range(loaded_weight, 0, self.vocab_start, rows))
        param.data[rows:].zero_()


class VocabParallelEmbedding(_VocabShard):
    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "") -> None:
        super().__init__(num_embeddings, embedding_dim, prefix)
        shape = (self.rows_per_rank, embedding_dim)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.weight.output_dim = 0
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside[:, None], 0.0)
        return tensor_model_parallel_all_reduce(rows)


class ParallelLMHead(_VocabShard):
    """hidden -> logits over the whole vocabulary; the GEMM is an unquantized linear method's
    (oneDNN-packed on CPU) unless quant_config quantizes the lm_head (--quantization int8)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        prefix: str = "",
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, prefix)
        self.input_size_per_partition = embedding_dim
        self.output_size_per_partition = self.rows_per_rank
        self.rank_bias = None
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(
            self,
            embedding_dim,
            [self.rows_per_rank],
            embedding_dim,
            num_embeddings,
            torch.get_default_dtype(),
        )
        self.weight.weight_loader = self.weight_loader

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden)
        if self.tp_size == 1:
            return logits
        logits = tensor_model_parallel_all_gather(logits)
        if logits.shape[1] == self.num_embeddings:
            return logits
        # the sampler's kernels read rows of vocabulary length
        return logits[:, : self.num_embeddings].contiguous()
