"""Uneven all-to-all over a ``torch.distributed`` group (gloo; NCCL for GPU tensors).

Signed (CPU tensors, :func:`signed_all_to_allv`): the call's envelope
(:mod:`device_comms.signatures.envelopes`) carries its header -- op, dtype and trailing
row shape, which every rank must share -- and this rank's size record
(:mod:`device_comms.alltoallv`), and the whole input too when record and
input fit the block. After that one all-gather every rank holds the same size
table and settles it alike: mismatched ``recv_sizes`` raise on every rank. If
every rank's input rode along, the call is done (each rank cuts its rows out
of the blocks); otherwise every rank runs gloo's ``all_to_all_single`` with
the agreed splits, so gloo never sees sizes that disagree (which would abort
the process). Whether every input rode along follows from the table, so every
rank decides alike.

Unsigned (GPU tensors, no header exchange that would synchronise the stream
or break graph capture): the size records travel over the CPU group as
msgpack (:func:`exchange_sizes`, host-side only), which also carries a
rejecting rank's reason; then the device group moves the rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from device_comms.alltoallv import (
    SizeTable,
    offsets,
    record,
    record_words,
    row_bytes,
    settle_sizes,
)
from device_comms.errors import DecodeError, PeerRejectedError
from device_comms.signatures.envelopes import BLOCK_INLINE, as_bytes
from shm_broadcast.describe import describe
from shm_broadcast.ranks.group_adapter import object_group

__all__ = ["signed_all_to_allv", "plain_all_to_allv", "exchange_sizes", "reject_exchange"]


def signed_all_to_allv(
    comm: Any,
    t: torch.Tensor,
    send: list[int],
    recv: list[int] | None,
    *,
    header: Callable[..., np.ndarray],
    call: Callable[[str, np.ndarray, torch.Tensor | None], None],
    payload: Callable[[int], torch.Tensor],
) -> torch.Tensor:
    """All-to-allv of contiguous CPU ``t`` on a :class:`TorchDistributedCommunicator`.

    ``header``, ``call`` and ``payload`` are the communicator's signed-call steps
    (:class:`~device_comms.signatures.signed_calls.SignedCalls`): a call's header, the
    exchange that agrees on it, and the bytes each rank sent along.

    Raises:
        CollectiveMismatch: Peers called something else, or the sizes disagree.
        PeerRejectedError: A peer rejected its arguments.
    """
    me = comm.rank_in_group
    rec = record(send, recv)
    rec_b = rec.view(torch.uint8)
    carried = rec_b.numel() <= BLOCK_INLINE  # the record rides in the block
    whole = carried and rec_b.numel() + t.nbytes <= BLOCK_INLINE
    sent = None
    if carried:
        sent = torch.cat([rec_b, as_bytes(t)]) if whole and t.numel() else rec_b
    call("all_to_allv", header("all_to_allv", t.dtype, None, 0, (tuple(t.shape[1:]), 0),
                               t.shape), sent)
    table = _table(comm, payload, rec, carried)
    settle_sizes(table, comm.unique_name, row=row_bytes(t))
    got = table.received_by(me)
    out = torch.empty((sum(got),) + tuple(t.shape[1:]), dtype=t.dtype, device="cpu")
    row = row_bytes(t)
    limit = BLOCK_INLINE - rec_b.numel()
    if carried and all(sum(s) * row <= limit for s in table.send):
        _from_blocks(comm, payload, t, table, got, out, rec_b.numel())
        return out
    return plain_all_to_allv(comm.device_group, t, send, got, out)


def _table(
    comm: Any, payload: Callable[[int], torch.Tensor], rec: torch.Tensor, carried: bool
) -> SizeTable:
    """Every rank's size record of the call just agreed on (``payload(rank)``: the bytes
    ``rank`` sent along)."""
    n, words = comm.world_size, rec.numel()
    if carried:
        rows = []
        for q in range(n):
            raw = payload(q)
            if raw.numel() < 8 * words:
                raise DecodeError(
                    f"group {comm.unique_name!r}, op all_to_allv: rank {q}'s block holds "
                    f"{raw.numel()} bytes, less than a size record", queue=comm.unique_name,
                    peers=(q,))
            rows.append(raw[: 8 * words].view(torch.int64).tolist())
    else:  # a record longer than a block (hundreds of ranks): one more all-gather
        everyone = torch.empty(n * words, dtype=torch.int64, device="cpu")
        dist.all_gather_into_tensor(everyone, rec, group=comm.device_group)
        rows = everyone.view(n, words).tolist()
    return SizeTable.decode(rows, comm.unique_name)


def _from_blocks(
    comm: Any, payload: Callable[[int], torch.Tensor], t: torch.Tensor, table: SizeTable,
    got: list[int], out: torch.Tensor, skip: int,
) -> None:
    """Cut this rank's rows out of every rank's block (each input rode along whole)."""
    me, row = comm.rank_in_group, row_bytes(t)
    if not row or not out.numel():
        return
    ob, roff = as_bytes(out), offsets(got)
    for q, sq in enumerate(table.send):
        nbytes = sq[me] * row
        if not nbytes:
            continue
        start = offsets(sq)[me] * row
        src = as_bytes(t) if q == me else payload(q)[skip:]
        ob[roff[q] * row : roff[q] * row + nbytes].copy_(src[start : start + nbytes])


def plain_all_to_allv(
    group: dist.ProcessGroup, t: torch.Tensor, send: list[int], got: list[int],
    out: torch.Tensor,
) -> torch.Tensor:
    """``all_to_all_single`` with splits, rows moved as bytes (any dtype); fills ``out``.

    Every rank must pass sizes that agree (``got[j]`` = rank ``j``'s ``send[me]``).
    """
    row = row_bytes(t)
    if row:
        dist.all_to_all_single(
            as_bytes(out).view(-1, row), as_bytes(t).view(-1, row),
            output_split_sizes=got, input_split_sizes=send, group=group)
    return out


def exchange_sizes(comm: Any, send: list[int], recv: list[int] | None) -> list[int]:
    """Agree on the sizes over the CPU group (unsigned transports); rows to receive.

    Raises:
        PeerRejectedError: A peer rejected its arguments (:func:`reject_exchange`).
        CollectiveMismatch: The size records disagree (every rank raises).
    """
    everyone = object_group(comm.cpu_group).all_gather(["ok", record(send, recv).tolist()])
    return _settle(comm, everyone).received_by(comm.rank_in_group)


def reject_exchange(comm: Any, reason: str) -> None:
    """Take part in :func:`exchange_sizes` as a rank that rejected its arguments."""
    everyone = object_group(comm.cpu_group).all_gather(["rejected", reason[:4000]])
    # this rank raises its own error; lower rejecters are named by their peers
    with contextlib.suppress(PeerRejectedError):
        _settle(comm, everyone)


def _settle(comm: Any, everyone: list[Any]) -> SizeTable:
    name, n = comm.unique_name, comm.world_size
    for q, item in enumerate(everyone):
        if not (type(item) is list and len(item) == 2 and type(item[0]) is str
                and item[0] in ("ok", "rejected")):
            raise DecodeError(f"group {name!r}, op all_to_allv: rank {q} sent {describe(item)}",
                              queue=name, peers=(q,))
        if item[0] == "rejected" and q != comm.rank_in_group:
            raise PeerRejectedError(name, "all_to_allv", q, str(item[1]))
    if everyone[comm.rank_in_group][0] == "rejected":
        return SizeTable([], [])
    rows = [item[1] if isinstance(item[1], list) else [] for item in everyone]
    if any(len(r) != record_words(n) or not all(type(x) is int for x in r) for r in rows):
        bad = [q for q, r in enumerate(rows) if len(r) != record_words(n)]
        raise DecodeError(f"group {name!r}, op all_to_allv: malformed size records from {bad}",
                          queue=name, peers=tuple(bad))
    table = SizeTable.decode(rows, name)
    settle_sizes(table, name)
    return table
