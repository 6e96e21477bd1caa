"""Byte layout shared by the kernels (``kernels.cu``) and the Python side.

Every rank owns one IPC-shareable allocation::

    [ Signal (SIGNAL_REGION bytes) | staging (max_size) | tmp (max_size) ]

* ``Signal`` holds the barrier flags peers write into and this rank's per-block
  epochs (see ``kernels.cu``); it is zeroed once, before any handle is shared.
* ``staging`` receives an eager call's input (one device copy), so peers can
  read it without the input tensor itself being shared.
* ``tmp`` holds this rank's reduced part in the two-shot kernel.

A kernel reads a ``RankTable`` entry (``TABLE_ENTRY_BYTES``) from device memory:
24 little-endian pointers, ``sig[8] | data[8] | tmp[8]``. Entry 0 of every rank
names the staging areas; each input registered after a graph capture gets an
entry naming the peers' copies of that input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_RANKS",
    "MAX_BLOCKS",
    "THREADS",
    "SIGNAL_BYTES",
    "SIGNAL_REGION",
    "TABLE_ENTRY_BYTES",
    "buffer_bytes",
    "staging_offset",
    "tmp_offset",
    "table_entry",
    "launch_blocks",
    "check_max_blocks",
]

MAX_RANKS = 8
MAX_BLOCKS = 64  # signal slots per phase: the most blocks a launch may use
THREADS = 512  # threads per block (kernels declare __launch_bounds__(512))
_PHASES = 3
SIGNAL_BYTES = _PHASES * MAX_BLOCKS * MAX_RANKS * 4 + MAX_BLOCKS * 4
SIGNAL_REGION = 8192  # SIGNAL_BYTES rounded up, so staging starts 4 KiB-aligned
TABLE_ENTRY_BYTES = 3 * MAX_RANKS * 8
PACK_BYTES = 16

assert SIGNAL_BYTES <= SIGNAL_REGION  # a layout invariant, not user input


def buffer_bytes(max_size: int) -> int:
    """Size of one rank's allocation for messages of up to ``max_size`` bytes."""
    return SIGNAL_REGION + 2 * max_size


def staging_offset() -> int:
    """Byte offset of the staging area in a rank's allocation."""
    return SIGNAL_REGION


def tmp_offset(max_size: int) -> int:
    """Byte offset of the tmp area in a rank's allocation."""
    return SIGNAL_REGION + max_size


def table_entry(sig: Sequence[int], data: Sequence[int], tmp: Sequence[int]) -> np.ndarray:
    """One ``RankTable`` as 24 uint64 (unused rank slots are 0)."""
    out = np.zeros(3 * MAX_RANKS, dtype=np.uint64)
    for k, ptrs in enumerate((sig, data, tmp)):
        out[k * MAX_RANKS : k * MAX_RANKS + len(ptrs)] = np.asarray(ptrs, dtype=np.uint64)
    return out


def launch_blocks(npacks: int, max_blocks: int) -> int:
    """Blocks for ``npacks`` 16-byte packs: one pack per thread, capped at ``max_blocks``."""
    return max(1, min(max_blocks, -(-npacks // THREADS)))


def check_max_blocks(max_blocks: Any) -> int:
    """``max_blocks`` if it is an int in ``[1, MAX_BLOCKS]`` (a launch's blocks each own
    a signal slot of a phase, and a phase has :data:`MAX_BLOCKS`).

    Raises:
        TypeError: Not an int.
        ValueError: Outside ``[1, MAX_BLOCKS]``.
    """
    if not isinstance(max_blocks, int) or isinstance(max_blocks, bool):
        raise TypeError(f"max_blocks must be an int, got {type(max_blocks).__name__}")
    if not 1 <= max_blocks <= MAX_BLOCKS:
        raise ValueError(f"max_blocks must be in [1, {MAX_BLOCKS}], got {max_blocks}")
    return max_blocks
