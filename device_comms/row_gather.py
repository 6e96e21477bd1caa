"""Gathering the rows of several tensors from every rank in one exchange.

A mixture-of-experts layer on the all-gather path moves, per step, each rank's
tokens (``hidden_states``), their router logits or routing, and maybe a few
more per-token tensors (scales, LoRA mappings) to every peer. They share the
row count (tokens) but not the dtype or row shape. Gathering them one by one
costs one exchange (and one size agreement) per tensor; this module packs
them side by side into one byte matrix, so the transport moves them as one
``all_gatherv`` of bytes::

    rank r:  hidden (n_r, 64) f32 | logits (n_r, 8) f32 | ids (n_r, 2) i64
                  \\                 |                  /
    packed:  (n_r, 256 + 32 + 16) uint8      row i = the bytes of row i of each
                  |                          tensor, in argument order
                  |  one all_gatherv of bytes, sizes n_0 .. n_{P-1}
                  v
    gathered: (sum n_r, 304) uint8  --unpack-->  hidden (N, 64), logits (N, 8), ids (N, 2)

Bytes erase the dtypes and row shapes, so the transport's own signature of
the call (dtype, row width) no longer tells apart two ranks whose tensors
differ but whose rows have the same byte width. :func:`layout_key` digests
the per-tensor layout; transports that sign their calls mix it into the
signature of the packed gather (the default transport hook ignores it, as
such transports sign nothing).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from device_comms import validation
from device_comms.errors import CollectiveMismatch

__all__ = ["check_row_tensors", "check_counts_fit", "layout_key", "pack_rows", "unpack_rows",
           "row_bytes"]


def check_row_tensors(tensors: Any, device: torch.device, arg: str = "tensors"
                      ) -> list[torch.Tensor]:
    """``tensors`` as a list of dense tensors on ``device``, each at least 1-D, sharing
    the row count (dim 0).

    Raises:
        TypeError: ``tensors`` is not a non-empty list or tuple of tensors.
        ValueError: An entry has no row dimension, is on another device (another
            index, when ``device`` has one), or its row count differs from the
            first entry's.
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{arg} must be a non-empty list of tensors, got "
                        f"{type(tensors).__name__}")
    if not tensors:
        raise TypeError(f"{arg} must be a non-empty list of tensors, got an empty "
                        f"{type(tensors).__name__}")
    out: list[torch.Tensor] = []
    for i, t in enumerate(tensors):
        x = validation.check_tensor(t, f"{arg}[{i}]", device, copied=True)
        if device.index is not None and x.device != device:
            raise ValueError(f"{arg}[{i}] is on {x.device}, the communicator on {device}")
        if x.dim() < 1:
            raise ValueError(f"{arg}[{i}] must have a row dimension (dim 0), got a 0-dim tensor")
        if out and x.shape[0] != out[0].shape[0]:
            raise ValueError(f"{arg}[{i}] has {x.shape[0]} rows (dim 0) but {arg}[0] has "
                             f"{out[0].shape[0]}; the tensors gathered together share the "
                             f"row count (one row per token)")
        out.append(x)
    return out


def check_counts_fit(counts: Sequence[int], tensors: Sequence[torch.Tensor], group: str) -> None:
    """Raise unless the gathered rows of ``counts`` (every rank's, learnt from the
    exchange) can exist: every rank reads the same counts, so every rank raises.

    Raises:
        CollectiveMismatch: The peers' row counts make a result larger than
            this host (or int64) can hold.
    """
    try:
        validation.check_fits((sum(counts), sum(row_bytes(t) for t in tensors)), torch.uint8,
                              tensors[0].device, "the gathered rows")
    except ValueError as e:
        raise CollectiveMismatch(f"group {group!r}, op all_gatherv_rows: the ranks' row "
                                 f"counts {counts} are too large: {e}", queue=group,
                                 peers=tuple(range(len(counts)))) from None


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0 entry) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def layout_key(tensors: Sequence[torch.Tensor]) -> int:
    """A deterministic 63-bit digest of the tensors' dtypes and row shapes, in order
    (the same on every rank whose tensors are laid out alike)."""
    layout = tuple((t.dtype, t.shape[1:]) for t in tensors)
    key = _LAYOUT_KEYS.get(layout)
    if key is None:
        if len(_LAYOUT_KEYS) >= _LAYOUT_KEYS_MAX:
            _LAYOUT_KEYS.clear()
        text = ";".join(f"{dtype}{tuple(row)}" for dtype, row in layout)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        key = _LAYOUT_KEYS[layout] = int.from_bytes(digest, "little") >> 1
    return key


#: layout -> key; a program's MoE layers use a handful of layouts
_LAYOUT_KEYS: dict[tuple[tuple[torch.dtype, torch.Size], ...], int] = {}
_LAYOUT_KEYS_MAX = 256


def pack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' rows side by side as one contiguous ``(rows, sum of row bytes)``
    uint8 matrix (row ``i``: row ``i`` of each tensor's bytes, in order)."""
    n = tensors[0].shape[0]
    widths = [row_bytes(t) for t in tensors]
    packed = torch.empty((n, sum(widths)), dtype=torch.uint8, device=tensors[0].device)
    at = 0
    for t, width in zip(tensors, widths, strict=True):
        if width and n:
            packed[:, at:at + width].copy_(_bytes_2d(t, n, width))
        at += width
    return packed


def unpack_rows(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Split a gathered ``(N, sum of row bytes)`` matrix into new contiguous tensors
    with ``like``'s dtypes and row shapes and ``N`` rows each."""
    n = packed.shape[0]
    out = []
    at = 0
    for t in like:
        width = row_bytes(t)
        piece = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=packed.device)
        if width and n:
            _bytes_2d(piece, n, width).copy_(packed[:, at:at + width])
        out.append(piece)
        at += width
    return out


def _bytes_2d(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Contiguous ``t`` seen as ``(rows, width)`` bytes (shares its storage)."""
    return validation.dense(t).reshape(-1).view(torch.uint8).view(rows, width)
