"""Uneven all-to-all: argument checks and the size table every rank agrees on.

``all_to_allv(input_, send_sizes, recv_sizes=None)`` splits ``input_`` along
dim 0 into ``send_sizes[j]`` rows for rank ``j`` (in rank order) and returns
the rows received from every rank concatenated in rank order. Rows are
whatever ``input_.shape[1:]`` is; every rank must pass the same dtype and
trailing shape.

Every transport that signs its calls (shared memory, gloo, hierarchical)
makes each rank publish a *size record* -- its ``send_sizes`` and, when
given, its ``recv_sizes`` -- in the call's first exchange, before any data
whose placement depends on them is used. Every rank then holds the same
table of records and reaches the same verdict (:func:`settle_sizes`):

* ``recv_sizes`` given by rank ``i``: ``recv_sizes[j]`` must equal rank
  ``j``'s ``send_sizes[i]`` for every ``j``; otherwise **every** rank raises
  :class:`~device_comms.errors.CollectiveMismatch` naming the disagreeing
  pairs (no rank returns a result, and since every rank took part in the same
  exchange, the group stays usable);
* ``recv_sizes=None``: rank ``i`` receives ``send_sizes[i]`` of every rank,
  read from the table (the sizes "are exchanged first" at no extra cost).

A size record is ``2 * world_size + 1`` int64 words::

    word 0            1 when recv_sizes was given, else 0
    words 1 .. n      send_sizes[0 .. n-1]
    words n+1 .. 2n   recv_sizes[0 .. n-1] (zeros when not given)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import psutil
import torch

from device_comms import validation
from device_comms.errors import CollectiveMismatch, DecodeError

__all__ = [
    "check_sizes", "check_input", "record", "record_words", "settle_sizes", "SizeTable",
    "row_bytes", "offsets",
]


def check_sizes(sizes: Any, world_size: int, arg: str, total: int | None = None) -> list[int]:
    """``sizes`` as a list of ``world_size`` non-negative ints (optionally summing to ``total``).

    Accepts a list or tuple of ints, or a 1-D integer tensor on the CPU (a
    GPU tensor would synchronise the stream to be read, so it is refused).

    Raises:
        TypeError: Not a list/tuple/1-D integer CPU tensor, or an entry is not an int.
        ValueError: Wrong length, a negative entry, or the wrong sum.
    """
    if isinstance(sizes, torch.Tensor):
        if sizes.dtype.is_floating_point or sizes.dtype.is_complex or sizes.dtype == torch.bool:
            raise TypeError(f"{arg} must hold integers, got a tensor of {sizes.dtype}")
        if sizes.device.type != "cpu":
            raise ValueError(
                f"{arg} must be a list or a CPU tensor, got a tensor on {sizes.device}; "
                f"reading it would synchronise the device (call .tolist() where that is fine)"
            )
        if sizes.dim() != 1:
            raise ValueError(
                f"{arg} must be 1-D (one entry per rank), got shape {tuple(sizes.shape)}")
        sizes = sizes.tolist()
    out = validation.check_sizes(sizes, world_size, arg)
    if total is not None and sum(out) != total:
        raise ValueError(
            f"{arg} must sum to input_.shape[0] ({total}), got sum({out}) = {sum(out)}"
        )
    return out


def check_input(
    input_: Any, send_sizes: Any, recv_sizes: Any, world_size: int, device: torch.device
) -> tuple[torch.Tensor, list[int], list[int] | None]:
    """Check one rank's arguments of ``all_to_allv`` (before any communication).

    Returns:
        ``(input_, send_sizes, recv_sizes)`` with the sizes as lists
        (``recv_sizes`` None when not given).

    Raises:
        TypeError: ``input_`` is not a dense tensor, or bad size types.
        ValueError: ``input_`` is 0-dim, a meta tensor or on another device
            type; bad size values; ``send_sizes`` does not sum to its rows.
    """
    t = validation.check_tensor(input_, "input_", device)
    if t.dim() == 0:
        raise ValueError(
            "input_ must have at least one dimension (rows are split along dim 0), "
            "got a 0-dim tensor; reshape it to 1-D first"
        )
    send = check_sizes(send_sizes, world_size, "send_sizes", total=t.shape[0])
    recv = None if recv_sizes is None else check_sizes(recv_sizes, world_size, "recv_sizes")
    return t, send, recv


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of ``t`` (everything after dim 0)."""
    return math.prod(t.shape[1:]) * t.element_size()


def offsets(sizes: Sequence[int]) -> list[int]:
    """Prefix sums: ``offsets([2, 0, 3]) == [0, 2, 2, 5]``."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def record_words(world_size: int) -> int:
    """int64 words of one size record."""
    return 2 * world_size + 1


def record(send: Sequence[int], recv: Sequence[int] | None) -> torch.Tensor:
    """This rank's size record (see the module docstring) as an int64 tensor."""
    n = len(send)
    given = [1 if recv is not None else 0]
    words = given + list(send) + (list(recv) if recv is not None else [0] * n)
    return torch.tensor(words, dtype=torch.int64, device="cpu")


class SizeTable:
    """Every rank's size record of one call, decoded.

    Attributes:
        send: ``send[i][j]``: rows rank ``i`` sends to rank ``j``.
        recv: ``recv[i]``: rank ``i``'s ``recv_sizes``, or None when it gave none.
    """

    def __init__(self, send: list[list[int]], recv: list[list[int] | None]) -> None:
        self.send = send
        self.recv = recv

    @classmethod
    def decode(cls, rows: list[list[int]], name: str, op: str = "all_to_allv") -> SizeTable:
        """Build the table from every rank's record words (rank order).

        Raises:
            DecodeError: A record is malformed (wrong length, a flag other
                than 0/1, a negative size).
        """
        n = len(rows)
        send: list[list[int]] = []
        recv: list[list[int] | None] = []
        for i, w in enumerate(rows):
            if len(w) != 2 * n + 1 or w[0] not in (0, 1) or min(w) < 0:
                raise DecodeError(
                    f"group {name!r}, op {op}: rank {i}'s size record is malformed "
                    f"({w[:8]}...); nothing was received", queue=name, peers=(i,))
            send.append(list(w[1 : n + 1]))
            recv.append(list(w[n + 1 :]) if w[0] else None)
        return cls(send, recv)

    def received_by(self, rank: int) -> list[int]:
        """Rows ``rank`` receives from each rank (rank order)."""
        return [row[rank] for row in self.send]


def settle_sizes(table: SizeTable, name: str, op: str = "all_to_allv",
                 row: int | None = None) -> None:
    """Raise on every rank unless each given ``recv_sizes`` matches the senders and
    every rank can hold what the records say it receives.

    The table is the same on every rank, so the verdict is too.

    Args:
        row: Bytes per row (None where the caller does not know them: rows are
            then bounded as if one byte each).

    Raises:
        DecodeError: The records say some rank receives more bytes than this
            host has memory (a corrupt or hostile record: nothing is allocated).
        CollectiveMismatch: Rank ``i``'s ``recv_sizes[j]`` differs from rank
            ``j``'s ``send_sizes[i]`` for some pair (both ranks are named).
    """
    _check_receivable(table, name, op, max(row or 1, 1))
    bad: list[tuple[int, int, int, int]] = []
    for i, mine in enumerate(table.recv):
        if mine is None:
            continue
        for j, want in enumerate(mine):
            if table.send[j][i] != want:
                bad.append((i, j, want, table.send[j][i]))
    if not bad:
        return
    pairs = "; ".join(
        f"rank {i} expects {w} row(s) from rank {j}, which sends it {s}" for i, j, w, s in bad[:6]
    )
    more = f" (and {len(bad) - 6} more)" if len(bad) > 6 else ""
    culprits = sorted({r for i, j, _, _ in bad for r in (i, j)})
    raise CollectiveMismatch(
        f"group {name!r}, op {op}: recv_sizes do not match the senders' send_sizes: "
        f"{pairs}{more}. Rank i's recv_sizes[j] must equal rank j's send_sizes[i] "
        f"(or pass recv_sizes=None to have them exchanged). Nothing was received and "
        f"the group stays usable.",
        queue=name, peers=culprits,
    )


def _check_receivable(table: SizeTable, name: str, op: str, row: int) -> None:
    """DecodeError unless every rank's receive total fits in this host's memory."""
    limit = psutil.virtual_memory().total
    n = len(table.send)
    for r in range(n):
        claims = [table.send[i][r] for i in range(n)]
        total = sum(claims) * row
        if total > limit:
            worst = max(range(n), key=claims.__getitem__)
            raise DecodeError(
                f"group {name!r}, op {op}: the size records say rank {r} receives "
                f"{total} bytes, more than this host's memory ({limit}); rank {worst}'s "
                f"record sends it {claims[worst]} row(s). Nothing was received.",
                queue=name, peers=(worst,))
