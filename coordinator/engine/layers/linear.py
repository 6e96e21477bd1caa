"""Tensor-parallel linear layers (Megatron-style column and row parallelism).

``y = x W^T + b`` with ``W`` of shape ``[out, in]`` is split two ways:

* **Column parallel**: rank ``r`` keeps rows ``r*out/tp .. (r+1)*out/tp`` of
  ``W`` (a slice of the *outputs*). Input replicated, output sharded; an
  optional all-gather rebuilds the full output.
* **Row parallel**: rank ``r`` keeps columns ``r*in/tp ..`` of ``W`` (a slice of
  the *inputs*). Input sharded (usually the output of a column-parallel
  layer), output a partial sum that an all-reduce (or a reduce-scatter over
  tokens, for sequence parallelism) completes. The bias is added once, after
  the reduction.

A column-parallel layer followed by a row-parallel one therefore costs one
collective. :class:`MergedColumnParallelLinear` (gate and up projections) and
:class:`QKVParallelLinear` (query, key, value) fuse several column-parallel
matrices; their weight loaders take the shard id of the checkpoint tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.engine.layers.comm import tp_all_gather, tp_all_reduce, tp_reduce_scatter
from coordinator.engine.layers.weights import (
    TPGroup,
    check_size,
    copy_checked,
    divide,
    narrow_for_rank,
    set_weight_loader,
    tp_size_and_rank,
)

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
]


def _check_dim(loaded: torch.Tensor, dim: int, expected: int, name: str) -> None:
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(loaded.shape)}; expected size "
            f"{expected} in dimension {dim}. The checkpoint does not match the model config"
        )


class _ParallelLinearBase(nn.Module):
    """Holds the local weight/bias and the group; subclasses define the split."""

    def __init__(
        self,
        in_local: int,
        out_local: int,
        bias: bool,
        tp_group: TPGroup | None,
        params_dtype: torch.dtype,
        prefix: str,
    ) -> None:
        super().__init__()
        if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
            raise TypeError(f"params_dtype must be a floating-point torch.dtype, got "
                            f"{params_dtype!r}")
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        self.prefix = prefix or type(self).__name__
        self.weight = nn.Parameter(
            torch.empty(out_local, in_local, dtype=params_dtype), requires_grad=False
        )
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.zeros(out_local, dtype=params_dtype), requires_grad=False
            )
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def _pname(self, param: nn.Parameter) -> str:
        return f"{self.prefix}.{'weight' if param is self.weight else 'bias'}"

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinearBase):
    """Linear layer whose output features are split across the tensor-parallel ranks.

    Args:
        input_size: Input features (replicated on every rank).
        output_size: Total output features (divisible by the TP size).
        bias: Whether the layer has a bias.
        gather_output: All-gather the output so every rank returns all features.
        tp_group: The tensor-parallel group, or ``None`` for one process.
        params_dtype: Parameter dtype.
        prefix: Parameter name prefix, used in error messages.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
    ) -> None:
        check_size(input_size, "input_size")
        check_size(output_size, "output_size")
        tp, _ = tp_size_and_rank(tp_group)
        out_local = divide(output_size, tp, f"{prefix or 'ColumnParallelLinear'} output_size")
        super().__init__(input_size, out_local, bias, tp_group, params_dtype, prefix)
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        """Copy this rank's rows of the full ``[output_size, ...]`` tensor."""
        name = self._pname(param)
        _check_dim(loaded, 0, self.output_size, name)
        copy_checked(param.data, narrow_for_rank(loaded, 0, self.tp_size, self.tp_rank), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return tp_all_gather(self.tp_group, y, -1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices with the same input, stored as one.

    Each rank keeps, for every logical matrix ``i``, its slice of
    ``output_sizes[i]`` rows, concatenated in order. Loading takes the shard id
    ``i`` (for Llama: 0 = ``gate_proj``, 1 = ``up_proj``). With
    ``gather_output`` the output holds the matrices' full outputs one after
    the other, as the unsharded ``cat`` of the matrices gives them.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        gather_output: bool = False,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
    ) -> None:
        if not output_sizes:
            raise ValueError("output_sizes must list at least one matrix size")
        for i, size in enumerate(output_sizes):
            check_size(size, f"output_sizes[{i}]")
        tp, _ = tp_size_and_rank(tp_group)
        self.output_sizes = [int(s) for s in output_sizes]
        self.local_sizes = [
            divide(s, tp, f"{prefix or 'MergedColumnParallelLinear'} output_sizes[{i}]")
            for i, s in enumerate(self.output_sizes)
        ]
        super().__init__(
            input_size, sum(self.output_sizes), bias, gather_output, tp_group, params_dtype, prefix
        )

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        """Copy this rank's slice of matrix ``shard[0]`` into its place."""
        if (
            len(shard) != 1
            or not isinstance(shard[0], int)
            or not 0 <= shard[0] < len(self.output_sizes)
        ):
            raise ValueError(
                f"{self._pname(param)} needs a shard id in [0, {len(self.output_sizes)}), "
                f"got {shard!r}"
            )
        i = shard[0]
        name = f"{self._pname(param)}[shard {i}]"
        _check_dim(loaded, 0, self.output_sizes[i], name)
        offset = sum(self.local_sizes[:i])
        dst = param.data.narrow(0, offset, self.local_sizes[i])
        copy_checked(dst, narrow_for_rank(loaded, 0, self.tp_size, self.tp_rank), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.gather_output:
            return y
        # The gather lays the ranks' outputs side by side ([gate_0, up_0, gate_1, up_1]);
        # each matrix's columns are its ranks' slices in rank order.
        gathered = tp_all_gather(self.tp_group, y, -1)
        by_rank = gathered.reshape(*gathered.shape[:-1], self.tp_size, sum(self.local_sizes))
        return torch.cat([part.flatten(-2) for part in by_rank.split(self.local_sizes, -1)], -1)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused query/key/value projection, split over attention heads.

    Every rank keeps ``num_heads / tp`` query heads. Key/value heads are split
    the same way when there are at least ``tp`` of them; with fewer (grouped
    query attention on a wide TP group) each KV head is replicated on
    ``tp / num_kv_heads`` consecutive ranks, so every rank holds exactly the KV
    head its query heads attend to.

    Args:
        hidden_size: Input features.
        head_size: Features per head.
        total_num_heads: Query heads in the full model.
        total_num_kv_heads: Key/value heads in the full model.
        bias: Whether q/k/v have biases.
        tp_group: The tensor-parallel group, or ``None``.
        params_dtype: Parameter dtype.
        prefix: Parameter name prefix for error messages.

    Raises:
        ValueError: Heads cannot be split over the TP size.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
    ) -> None:
        for value, arg in ((hidden_size, "hidden_size"), (head_size, "head_size"),
                           (total_num_heads, "total_num_heads"),
                           (total_num_kv_heads, "total_num_kv_heads")):
            check_size(value, arg)
        if total_num_heads % total_num_kv_heads:
            raise ValueError(f"total_num_heads ({total_num_heads}) must be a multiple of "
                             f"total_num_kv_heads ({total_num_kv_heads})")
        tp, rank = tp_size_and_rank(tp_group)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            if tp % total_num_kv_heads != 0:
                raise ValueError(
                    f"num_key_value_heads ({total_num_kv_heads}) is smaller than the "
                    f"tensor-parallel "
                    f"size ({tp}) and does not divide it, so KV heads cannot be replicated evenly"
                )
            self.num_kv_heads = 1
            self.kv_replicas = tp // total_num_kv_heads
        self.kv_shard_index = rank // self.kv_replicas
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total_out = (total_num_heads + 2 * total_num_kv_heads) * head_size
        out_local = self.q_size + 2 * self.kv_size
        _ParallelLinearBase.__init__(
            self, hidden_size, out_local, bias, tp_group, params_dtype, prefix
        )
        self.input_size, self.output_size = hidden_size, total_out
        self.gather_output = False

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        """Copy this rank's heads of the full ``q``, ``k`` or ``v`` tensor (``shard[0]``)."""
        sid = shard[0] if len(shard) == 1 else None
        if sid not in ("q", "k", "v"):
            raise ValueError(
                f"{self._pname(param)} needs a shard id 'q', 'k' or 'v', got {shard!r}"
            )
        name = f"{self._pname(param)}[{sid}]"
        hd = self.head_size
        if sid == "q":
            _check_dim(loaded, 0, self.total_num_heads * hd, name)
            src = loaded.narrow(0, self.tp_rank * self.q_size, self.q_size)
            offset, size = 0, self.q_size
        else:
            _check_dim(loaded, 0, self.total_num_kv_heads * hd, name)
            src = loaded.narrow(0, self.kv_shard_index * self.kv_size, self.kv_size)
            offset = self.q_size + (0 if sid == "k" else self.kv_size)
            size = self.kv_size
        copy_checked(param.data.narrow(0, offset, size), src, name)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split this layer's output into local ``q``, ``k``, ``v``."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(_ParallelLinearBase):
    """Linear layer whose input features are split across the tensor-parallel ranks.

    Args:
        input_size: Total input features (divisible by the TP size).
        output_size: Output features.
        bias: Whether the layer has a bias (replicated, added after the reduction).
        input_is_parallel: The input is already this rank's slice (else it is
            split here).
        reduce_results: Complete the partial sums across ranks. With ``False``
            the caller reduces; the bias is then added on rank 0 only.
        reduce_scatter: Complete the sums with a reduce-scatter along dim 0
            (tokens) instead of an all-reduce: each rank gets ``1/tp`` of the
            rows (sequence parallelism). The row count must divide by the TP size.
        tp_group: The tensor-parallel group, or ``None``.
        params_dtype: Parameter dtype.
        prefix: Parameter name prefix for error messages.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        reduce_scatter: bool = False,
        tp_group: TPGroup | None = None,
        params_dtype: torch.dtype = torch.float32,
        prefix: str = "",
    ) -> None:
        check_size(input_size, "input_size")
        check_size(output_size, "output_size")
        tp, _ = tp_size_and_rank(tp_group)
        in_local = divide(input_size, tp, f"{prefix or 'RowParallelLinear'} input_size")
        super().__init__(in_local, output_size, bias, tp_group, params_dtype, prefix)
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.reduce_scatter = reduce_scatter

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        """Copy this rank's input columns of the weight; the bias is copied whole."""
        name = self._pname(param)
        if param is self.bias:
            copy_checked(param.data, loaded, name)
            return
        _check_dim(loaded, 1, self.input_size, name)
        copy_checked(param.data, narrow_for_rank(loaded, 1, self.tp_size, self.tp_rank), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = narrow_for_rank(x, -1 % x.dim(), self.tp_size, self.tp_rank)
        y = F.linear(x, self.weight)
        if not self.reduce_results:
            if self.bias is not None and self.tp_rank == 0:
                y = y + self.bias
            return y
        if self.reduce_scatter:
            y = tp_reduce_scatter(self.tp_group, y, 0)
        else:
            y = tp_all_reduce(self.tp_group, y)
        return y + self.bias if self.bias is not None else y
