"""Tensor-parallel building blocks for decoder models.

Every layer takes the tensor-parallel group at construction (``None`` means a
single process: the unsharded reference) and carries weight loaders that cut
this rank's shard out of a full checkpoint tensor.
"""

from coordinator.engine.layers.comm import tp_all_gather, tp_all_reduce, tp_reduce_scatter
from coordinator.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from coordinator.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from coordinator.engine.layers.norm import RMSNorm
from coordinator.engine.layers.rotary import RotaryEmbedding
from coordinator.engine.layers.weights import (
    TPGroup,
    default_weight_loader,
    divide,
    pad_to_multiple,
    shard_bounds,
)

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RMSNorm",
    "RotaryEmbedding",
    "TPGroup",
    "tp_all_reduce",
    "tp_all_gather",
    "tp_reduce_scatter",
    "default_weight_loader",
    "divide",
    "pad_to_multiple",
    "shard_bounds",
]
