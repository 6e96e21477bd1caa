"""Arithmetic of sharding: even splits of sizes, tensors and layers.

The helpers model code calls to size and cut its shards, under the names and
with the results vLLM's ``vllm.distributed.utils`` gives them, so layer code
written against that module runs unchanged. Bad input raises ``TypeError`` or
``ValueError`` naming the argument.
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections.abc import Sequence
from typing import Any

import torch

from shm_broadcast.checks import check_int

__all__ = ["divide", "ensure_divisibility", "split_tensor_along_last_dim", "get_pp_indices"]


def _count(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int (any integer type but bool), at least ``minimum``."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):  # check_int names what came
            value = operator.index(value)
    return check_int(value, name, minimum=minimum)


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Check that ``denominator`` divides ``numerator`` (a size: ``>= 0``).

    Raises:
        TypeError: An argument is not an int.
        ValueError: ``denominator`` is not positive or does not divide ``numerator``.
    """
    _divisible(numerator, denominator)


def _divisible(numerator: Any, denominator: Any) -> tuple[int, int]:
    num = _count(numerator, "numerator", 0)
    den = _count(denominator, "denominator", 1)
    if num % den:
        raise ValueError(f"numerator {num} is not divisible by denominator {den}")
    return num, den


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, after :func:`ensure_divisibility`."""
    num, den = _divisible(numerator, denominator)
    return num // den


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
    parts = _count(num_partitions, "num_partitions", 1)
    if tensor.size(-1) % parts:
        raise ValueError(f"num_partitions={parts} must divide the last dimension "
                         f"of tensor, got shape {tuple(tensor.shape)}")
    pieces = torch.tensor_split(tensor, parts, dim=-1)  # ``parts`` pieces, even if empty
    if contiguous_split_chunks:
        return tuple(p.contiguous() for p in pieces)
    return pieces


def pp_layer_ranges(num_hidden_layers: int, pp_size: int,
                    allow_empty: bool = False) -> list[tuple[int, int]]:
    """``[start, end)`` layer ranges of every pipeline stage.

    Every stage gets ``num_hidden_layers // pp_size`` layers; the remaining
    ``num_hidden_layers % pp_size`` go one each to the stages before the last,
    starting from the second-to-last (the first stage also carries the
    embedding and the last the LM head). Example: 6 layers over 4 stages are
    ``1, 2, 2, 1``. This is vLLM's default split; as in vLLM, the environment
    variable ``VLLM_PP_LAYER_PARTITION`` (:data:`PARTITION_VAR`), when set,
    gives the layers of each stage instead (``"5,3"``: five layers on the
    first stage, three on the second).

    Args:
        num_hidden_layers: Layers of the model.
        pp_size: Pipeline stages.
        allow_empty: Give stages no layers when there are fewer layers than
            stages (as vLLM does), instead of raising.

    Raises:
        ValueError: Fewer layers than stages, unless ``allow_empty``; or
            ``VLLM_PP_LAYER_PARTITION`` is not ``pp_size`` non-negative
            integers that sum to ``num_hidden_layers``.
    """
    num_hidden_layers = _count(num_hidden_layers, "num_hidden_layers", 0)
    pp_size = _count(pp_size, "pp_size", 1)
    given = _partition_from_env(num_hidden_layers, pp_size)
    if given is not None:
        return _ranges(given)
    if num_hidden_layers < pp_size and not allow_empty:
        raise ValueError(
            f"cannot split {num_hidden_layers} layers over {pp_size} pipeline stages "
            f"(num_hidden_layers={num_hidden_layers}, pp_size={pp_size}); use a "
            f"pipeline-parallel size <= num_hidden_layers")
    base, extra = divmod(num_hidden_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(2, extra + 2):  # extra < pp_size: index -pp_size at most
        sizes[-i] += 1
    return _ranges(sizes)


#: The environment variable that overrides the layer split (vLLM's name).
PARTITION_VAR = "VLLM_PP_LAYER_PARTITION"


def _partition_from_env(num_hidden_layers: int, pp_size: int) -> list[int] | None:
    """The layers per stage that :data:`PARTITION_VAR` gives; None when it is unset
    or empty.

    Raises:
        ValueError: The value is not ``pp_size`` comma-separated non-negative
            integers summing to ``num_hidden_layers`` (names the variable).
    """
    raw = os.environ.get(PARTITION_VAR, "").strip()
    if not raw:
        return None
    try:
        sizes = [int(part) for part in raw.split(",")]
    except ValueError:
        raise ValueError(f"{PARTITION_VAR} must be comma-separated layer counts such as "
                         f"'5,3', got {raw!r}") from None
    if len(sizes) != pp_size or any(n < 0 for n in sizes) or sum(sizes) != num_hidden_layers:
        raise ValueError(
            f"{PARTITION_VAR}={raw!r} must give {pp_size} non-negative layer counts (one "
            f"per pipeline stage) summing to num_hidden_layers={num_hidden_layers}, got "
            f"{len(sizes)} summing to {sum(sizes)}")
    return sizes


def _ranges(sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive runs of ``sizes`` layers."""
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


def get_pp_indices(num_hidden_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The ``(start, end)`` layers (end exclusive) of pipeline stage ``pp_rank``.

    See :func:`pp_layer_ranges` for the split; with fewer layers than stages
    the last stages get none (``start == end``), as in vLLM.
    """
    pp_size = _count(pp_size, "pp_size", 1)
    pp_rank = _count(pp_rank, "pp_rank", 0)
    if pp_rank >= pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    return pp_layer_ranges(num_hidden_layers, pp_size, allow_empty=True)[pp_rank]
