"""Vocabulary-parallel token embedding and language-model head.

The vocabulary is padded up to a multiple of the tensor-parallel size and
split into equal contiguous ranges; rank ``r`` stores rows
``[r*V'/tp, (r+1)*V'/tp)`` of the ``[V', hidden]`` table (``V'`` padded, pad
rows zero).

* Embedding: each rank looks up the ids that fall in its range, writes zeros
  for the others, and an all-reduce (or a reduce-scatter over tokens, for
  sequence parallelism) adds the pieces. Exactly one rank contributes a
  non-zero row per token, so the sum is exact.
* LM head: each rank computes logits for its vocabulary range; an all-gather
  along the last dimension concatenates them in rank order, which is
  vocabulary order, and the padding columns are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.engine.layers.comm import tp_all_gather, tp_all_reduce, tp_reduce_scatter
from coordinator.engine.layers.weights import (
    TPGroup,
    check_size,
    copy_checked,
    pad_to_multiple,
    set_weight_loader,
    tp_size_and_rank,
)

__all__ = ["VocabParallelEmbedding", "ParallelLMHead"]


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across tensor-parallel ranks.

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Hidden size.
        tp_group: The tensor-parallel group, or ``None`` for one process.
        params_dtype: Parameter dtype.
        reduce_scatter: Finish with a reduce-scatter along dim 0 (each rank
            gets ``1/tp`` of the tokens; the token count must divide by the TP
            size) instead of an all-reduce.
        prefix: Parameter name prefix for error messages.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        reduce_scatter: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        check_size(num_embeddings, "num_embeddings")
        check_size(embedding_dim, "embedding_dim")
        if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
            raise TypeError(f"params_dtype must be a floating-point torch.dtype, got "
                            f"{params_dtype!r}")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_to_multiple(num_embeddings, self.tp_size)
        self.num_local = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.num_local
        self.vocab_end = self.vocab_start + self.num_local
        self.reduce_scatter = reduce_scatter
        self.prefix = prefix or type(self).__name__
        self.weight = nn.Parameter(
            torch.zeros(self.num_local, embedding_dim, dtype=params_dtype), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        """Copy this rank's vocabulary rows of the full ``[vocab, hidden]`` table."""
        name = f"{self.prefix}.weight"
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}; expected "
                f"({self.num_embeddings}, {self.embedding_dim}) (vocab_size, hidden_size)"
            )
        valid = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        with torch.no_grad():
            param.data.zero_()
        if valid:
            copy_checked(
                param.data[:valid], loaded[self.vocab_start : self.vocab_start + valid], name
            )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embed ``input_ids`` (any shape) to ``[..., embedding_dim]``."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        self._check_ids(input_ids)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter:
            return tp_reduce_scatter(self.tp_group, partial, 0)
        return tp_all_reduce(self.tp_group, partial)


    def _check_ids(self, input_ids: torch.Tensor) -> None:
        """Refuse ids outside the vocabulary, as one process's lookup does: sharded, an id
        outside every rank's range would embed as zeros. Every rank holds the same ids,
        so every rank raises. CPU ids only (on a GPU the check would synchronise the
        stream, and break graph capture), and not while torch.compile traces.

        Raises:
            IndexError: An id is negative or not below ``num_embeddings``.
        """
        if input_ids.device.type != "cpu" or not input_ids.numel():
            return
        if torch.compiler.is_compiling() or input_ids.dtype.is_floating_point:
            return
        low, high = torch.aminmax(input_ids)
        if int(low) < 0 or int(high) >= self.num_embeddings:
            raise IndexError(
                f"{self.prefix}: input_ids must lie in [0, {self.num_embeddings}) (the "
                f"vocabulary), got ids from {int(low)} to {int(high)}")


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to vocabulary logits, split like :class:`VocabParallelEmbedding`.

    The weight has the same layout as the embedding's, so a tied head can share
    the embedding's parameter (see :meth:`tie_to`).

    Args:
        num_embeddings: Vocabulary size.
        embedding_dim: Hidden size.
        bias: Whether the head has a bias (split like the weight rows).
        tp_group: The tensor-parallel group, or ``None``.
        params_dtype: Parameter dtype.
        prefix: Parameter name prefix for error messages.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_group, params_dtype, prefix=prefix)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(self.num_local, dtype=params_dtype), requires_grad=False
            )
            set_weight_loader(self.bias, self._bias_loader)
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        if tuple(loaded.shape) != (self.num_embeddings,):
            raise ValueError(
                f"checkpoint tensor for {self.prefix}.bias has shape {tuple(loaded.shape)}; "
                f"expected ({self.num_embeddings},)"
            )
        valid = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        with torch.no_grad():
            param.data.zero_()
            param.data[:valid].copy_(loaded[self.vocab_start : self.vocab_start + valid])

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share ``embedding``'s weight (tied input/output embeddings)."""
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_size) != (
            self.num_embeddings,
            self.embedding_dim,
            self.tp_size,
        ):
            raise ValueError("cannot tie an LM head to an embedding of another shape or TP size")
        self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab_size]`` for ``hidden_states`` ``[..., hidden]`` on every rank."""
        logits = F.linear(hidden_states, self.weight, self.bias)
        logits = tp_all_gather(self.tp_group, logits, -1)
        if self.num_embeddings_padded != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits
