"""Arithmetic of sharding: even splits of sizes, tensors and layers.

The helpers model code calls to size and cut its shards, under the names and
with the results vLLM's ``vllm.distributed.utils`` gives them, so layer code
written against that module runs unchanged. Bad input raises ``TypeError`` or
``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["divide", "ensure_divisibility", "split_tensor_along_last_dim", "get_pp_indices"]


def _count(value: Any, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Check that ``denominator`` divides ``numerator``.

    Raises:
        TypeError: An argument is not an int.
        ValueError: ``denominator`` is not positive or does not divide ``numerator``.
    """
    _count(numerator, "numerator", 0)
    _count(denominator, "denominator", 1)
    if numerator % denominator:
        raise ValueError(f"numerator {numerator} is not divisible by denominator {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, after :func:`ensure_divisibility`."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """Cut ``tensor`` into ``num_partitions`` equal views along its last dimension.

    Args:
        tensor: The tensor to cut (at least one dimension).
        num_partitions: Number of pieces; must divide the last dimension.
        contiguous_split_chunks: Return contiguous copies instead of views.

    Returns:
        A tuple of ``num_partitions`` tensors.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError("tensor must have at least one dimension, got a 0-d tensor")
    _count(num_partitions, "num_partitions", 1)
    last = tensor.size(-1)
    if last % num_partitions:
        raise ValueError(f"num_partitions={num_partitions} must divide the last dimension "
                         f"of tensor, got shape {tuple(tensor.shape)}")
    pieces = torch.split(tensor, last // num_partitions, dim=-1)
    if contiguous_split_chunks:
        return tuple(p.contiguous() for p in pieces)
    return pieces


def pp_layer_ranges(num_hidden_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of every pipeline stage.

    Every stage gets ``num_hidden_layers // pp_size`` layers; the remaining
    ``num_hidden_layers % pp_size`` go one each to the stages before the last,
    starting from the second-to-last (the first stage also carries the
    embedding and the last the LM head). Example: 6 layers over 4 stages are
    ``1, 2, 2, 1``. This is vLLM's default split.

    Raises:
        ValueError: Fewer layers than stages (a stage would be empty).
    """
    _count(num_hidden_layers, "num_hidden_layers", 0)
    _count(pp_size, "pp_size", 1)
    if num_hidden_layers < pp_size:
        raise ValueError(
            f"cannot split {num_hidden_layers} layers over {pp_size} pipeline stages "
            f"(num_hidden_layers={num_hidden_layers}, pp_size={pp_size}); use a "
            f"pipeline-parallel size <= num_hidden_layers")
    base, extra = divmod(num_hidden_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The ``(start, end)`` layers (end exclusive) of pipeline stage ``pp_rank``.

    See :func:`pp_layer_ranges` for the split.
    """
    _count(pp_size, "pp_size", 1)
    _count(pp_rank, "pp_rank", 0)
    if pp_rank >= pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    return pp_layer_ranges(num_hidden_layers, pp_size)[pp_rank]
