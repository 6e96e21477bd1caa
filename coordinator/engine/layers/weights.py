"""Sharding arithmetic and weight loaders for tensor-parallel layers.

A checkpoint stores every parameter whole. Each tensor-parallel rank keeps one
slice of it, and the layer that owns a parameter knows which slice: it attaches
a *weight loader* to the parameter (``param.weight_loader``), a function that
receives the full checkpoint tensor (plus a shard id for merged parameters)
and copies this rank's part into ``param``. Model loading code then only maps
checkpoint names to parameters and calls the loader; it never repeats the
sharding rules.

The helpers here are pure functions of sizes and ranks, so they are unit
tested without processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = [
    "TPGroup",
    "tp_size_and_rank",
    "divide",
    "shard_bounds",
    "pad_to_multiple",
    "set_weight_loader",
    "weight_loader_of",

    "default_weight_loader",
    "copy_checked",
    "narrow_for_rank",
]


class TPGroup(Protocol):
    """What the parallel layers need from a tensor-parallel group.

    :class:`coordinator.group.group_coordinator.GroupCoordinator` satisfies it. ``None``
    in place of a group means "one process, no communication" (the reference path).
    """

    world_size: int
    rank_in_group: int
    unique_name: str

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


def tp_size_and_rank(group: TPGroup | None) -> tuple[int, int]:
    """``(world_size, rank_in_group)`` of ``group``; ``(1, 0)`` for ``None``."""
    if group is None:
        return 1, 0
    return int(group.world_size), int(group.rank_in_group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising ``ValueError`` naming ``what`` if not exact.

    Args:
        numerator: The size to split.
        denominator: The number of parts (usually the tensor-parallel size).
        what: Description of ``numerator`` for the error message.
    """
    if denominator <= 0:
        raise ValueError(f"cannot split {what} into {denominator} parts")
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor-parallel size "
            f"({denominator}); choose a tensor-parallel size that divides it"
        )
    return numerator // denominator


def check_size(value: object, arg: str) -> int:
    """``value`` as a layer size: an int >= 1 (not a bool).

    Raises:
        TypeError: It is not an int.
        ValueError: It is below 1.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{arg} must be an int, got {type(value).__name__} ({value!r:.40})")
    if value < 1:
        raise ValueError(f"{arg} must be an int >= 1, got {value}")
    return value


def pad_to_multiple(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return -(-n // multiple) * multiple


def shard_bounds(total: int, num_shards: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of shard ``index`` when ``total`` splits into equal shards.

    ``total`` must be divisible by ``num_shards``.
    """
    size = divide(total, num_shards, "the sharded dimension")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index must be in [0, {num_shards}), got {index}")
    return index * size, (index + 1) * size


def narrow_for_rank(t: torch.Tensor, dim: int, num_shards: int, index: int) -> torch.Tensor:
    """The ``index``-th of ``num_shards`` equal slices of ``t`` along ``dim`` (a view)."""
    start, end = shard_bounds(t.shape[dim], num_shards, index)
    return t.narrow(dim, start, end - start)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """Copy ``src`` into ``dst`` (casting dtype), raising ``ValueError`` on shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"checkpoint tensor for {name} has shape {tuple(src.shape)} after sharding, "
            f"but the parameter expects {tuple(dst.shape)}; the checkpoint does not match "
            f"the model configuration"
        )
    with torch.no_grad():
        dst.copy_(src)


WeightLoader = Callable[..., None]


#: The attribute of a parameter that holds its loader (vLLM's name).
_LOADER_ATTR = "weight_loader"


def set_weight_loader(param: torch.nn.Parameter, loader: WeightLoader) -> None:
    """Attach ``loader`` to ``param`` as ``param.weight_loader``."""
    setattr(param, _LOADER_ATTR, loader)


def weight_loader_of(param: torch.nn.Parameter) -> WeightLoader:
    """The loader :func:`set_weight_loader` attached to ``param``.

    Raises:
        ValueError: ``param`` has none (the layer that owns it did not set one).
    """
    loader: WeightLoader | None = getattr(param, _LOADER_ATTR, None)
    if loader is None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has no weight loader")
    return loader


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, *_: Any) -> None:
    """Loader for replicated parameters: copy the whole tensor."""
    copy_checked(param.data, loaded, "a replicated parameter")
