"""Attacks on the IPC handle exchange: wrong-sized rows and pointers outside a peer's allocation.

* A rank whose row of handles has another length than its count says (a
  peer's misbehaviour, faked here by a handle whose wire form is 80 bytes)
  used to make gloo abort every receiver (SIGABRT: ``op.preamble.length <=
  op.nbytes``). Now every rank announces its row's length first and every rank
  raises :class:`DecodeError` naming it, before the rows travel; the group
  stays in step (a later exchange works) and no process dies.
* Offsets outside the peer's allocation (0x1002000 and 2**40 for a 16 MiB
  allocation, 2**64-1 in the wire form) used to go straight into the kernel's
  pointer table (an out-of-bounds write on a GPU; 2**64-1 a bare
  ``OverflowError``). Now :class:`HandleBook` refuses them with
  :class:`DecodeError` naming the peer, as it refuses a peer's handle equal to
  this rank's own, two ranks naming one allocation, and a rank naming an
  allocation another rank sent before. The fake backend stands in for the
  CUDA driver (which allocation is mapped where, and its size); the checks
  are the real ones.
* A rank whose backend cannot make its handle (``handle_of`` raises, as
  ``cudaIpcGetMemHandle`` does for memory it cannot export) used to leave
  before the announcement, and its peers waited in the gather until the
  group's timeout. Now it announces a rejection: it raises its own error and
  every peer raises :class:`PeerRejectedError` naming it, at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from device_comms.cuda.custom_allreduce.handles import (
    HANDLE_BYTES,
    HandleBook,
    IpcHandle,
    all_gather_handles,
    register_buffers,
)
from device_comms.errors import CollectiveMismatch, DecodeError
from tests.device_comms.cuda.custom_allreduce.fakes import (
    ALLOCATION_BYTES,
    FakeIpcBackend,
    fake_handles,
)

pytestmark = pytest.mark.timeout(120)

LOCAL_PTR = 0x5000_0000
BUFFER_BYTES = 0x1000  # what the kernels use through each rank's pointer in these tests
GROUP_TIMEOUT_S = 20  # the timeout of a group a test makes, where a hang would wait it out


class LongWireHandle(IpcHandle):
    """A handle whose wire form is 8 bytes too long (what a misbehaving peer sends)."""

    def to_bytes(self) -> bytes:
        return super().to_bytes() + bytes(8)


class NotBytesHandle(IpcHandle):
    """A handle whose wire form is not bytes at all."""

    def to_bytes(self) -> bytes:
        return list(super().to_bytes())  # type: ignore[return-value]  # the point of the test


def _outcome(fn: Any) -> dict | None:
    try:
        fn()
    except (DecodeError, CollectiveMismatch, TypeError) as e:
        return {"type": type(e).__name__, "msg": str(e), "peers": list(getattr(e, "peers", ()))}
    return None


# ---------------------------------------------------------------------- rank functions
def _row_of_another_length(rank: int, world_size: int, liar: int, kind: str) -> dict:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    mine = fake_handles(rank, 2)
    if rank == liar:
        crafted = LongWireHandle if kind == "long" else NotBytesHandle
        mine[1] = crafted(mine[1].handle, mine[1].offset)
    error = _outcome(lambda: all_gather_handles(group, mine, "attacked buffers"))
    after = all_gather_handles(group, fake_handles(rank, 1), "after the attack")
    return {"error": error, "after": [[h.to_bytes() for h in row] for row in after]}


def _offset_outside(rank: int, world_size: int, liar: int, offset: int) -> dict:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    backend = FakeIpcBackend(rank=rank)
    ptr = LOCAL_PTR + 0x1000 * rank
    if rank == liar:
        backend.offsets[ptr] = offset  # the liar claims its buffer sits there
    with HandleBook(backend, rank) as book:
        error = _outcome(lambda: register_buffers(
            group, book, backend, [(ptr, BUFFER_BYTES)], "attacked buffers", align=16))
        # The group stays in step: an honest exchange afterwards works on every rank.
        backend.offsets.clear()
        again = register_buffers(group, book, backend, [(ptr + 0x10_0000, BUFFER_BYTES)],
                                 "after the attack", align=16)
    return {"error": error, "again": again, "opened": len(backend.opened)}


def _handle_of_fails(rank: int, world_size: int, failing: int) -> dict:
    import datetime
    import time

    import torch.distributed as dist

    # A group of its own with a short timeout: what the peers would wait out otherwise.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    ptr = LOCAL_PTR + 0x1000 * rank
    backend = FakeIpcBackend(rank=rank, fail_handle_of=ptr if rank == failing else None)
    with HandleBook(backend, rank) as book:
        start = time.monotonic()
        try:
            register_buffers(group, book, backend, [(ptr, BUFFER_BYTES)], "buffers", align=16)
        except Exception as e:
            error: dict | None = {"type": type(e).__name__, "msg": str(e),
                                  "peers": list(getattr(e, "peers", ()))}
        else:
            error = None
        elapsed = time.monotonic() - start
        # Nothing was exchanged: the group is in step, and the next registration works.
        backend.fail_handle_of = None
        again = register_buffers(group, book, backend, [(ptr + 0x10_0000, BUFFER_BYTES)],
                                 "after the failure", align=16)
    return {"error": error, "elapsed": elapsed, "again": again}


def _open_fails_on_rank0(rank: int, world_size: int) -> dict:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    ptr = LOCAL_PTR + 0x1000 * rank
    peer = FakeIpcBackend(rank=1).handle_of(LOCAL_PTR + 0x1000).handle
    backend = FakeIpcBackend(rank=rank, fail_open=peer if rank == 0 else None)
    with HandleBook(backend, rank) as book:
        try:
            register_buffers(group, book, backend, [(ptr, BUFFER_BYTES)], "buffers", align=16)
        except (RuntimeError, CollectiveMismatch) as e:
            return {"type": type(e).__name__, "msg": str(e)}
    return {}


# ---------------------------------------------------------------------- wrong-sized rows
@pytest.mark.parametrize(
    "world_size, liar", [(2, 1), (3, 0), (3, 2)], ids=["ws2-rank1", "ws3-rank0", "ws3-rank2"])
def test_row_of_another_length_raises_on_every_rank(dist_pool: Any, world_size: int,
                                                    liar: int) -> None:
    """Old code: the receivers die of SIGABRT in gloo (RankDiedError here)."""
    outs = dist_pool(world_size).run(_row_of_another_length, liar, "long", timeout=60)
    expected = [[h.to_bytes() for h in fake_handles(r, 1)] for r in range(world_size)]
    for rank, out in enumerate(outs):
        err = out["error"]
        assert err is not None, f"rank {rank} raised nothing"
        assert err["type"] == "DecodeError", (rank, err)
        assert err["peers"] == [liar], (rank, err)
        assert f"rank {liar} announced 2 handles in a row of 152 bytes" in err["msg"]
        assert "attacked buffers" in err["msg"]
        assert out["after"] == expected, f"rank {rank}: the group fell out of step"


def test_unencodable_handle_is_a_rejection_on_every_peer(dist_pool: Any) -> None:
    outs = dist_pool(3).run(_row_of_another_length, 1, "not-bytes", timeout=60)
    assert outs[1]["error"]["type"] == "TypeError"
    assert "to_bytes() must return bytes" in outs[1]["error"]["msg"]
    for rank in (0, 2):
        err = outs[rank]["error"]
        assert err is not None and err["type"] == "PeerRejectedError", (rank, err)
        assert err["peers"] == [1] and "rank 1 rejected" in err["msg"]
    expected = [[h.to_bytes() for h in fake_handles(r, 1)] for r in range(3)]
    assert all(out["after"] == expected for out in outs)


# ---------------------------------------------------------------------- offsets, end to end
@pytest.mark.parametrize(
    "offset", [0x1002000, 2**40, 2**64 - 16], ids=["0x1002000", "2^40", "2^64-16"])
def test_offset_outside_allocation_raises_on_every_rank(dist_pool: Any, offset: int) -> None:
    """Three ranks; rank 2 claims its buffer at ``offset`` of a 16 MiB allocation."""
    outs = dist_pool(3).run(_offset_outside, 2, offset, timeout=60)
    for rank in (0, 1):
        err = outs[rank]["error"]
        assert err is not None and err["type"] == "DecodeError", (rank, err)
        assert err["peers"] == [2] and f"offset {offset:#x}" in err["msg"]
        assert "past the end of its allocation" in err["msg"]
    liar = outs[2]["error"]
    assert liar is not None and liar["type"] == "CollectiveMismatch", liar
    assert "refused the IPC handle of rank 2" in liar["msg"]
    for rank, out in enumerate(outs):
        assert len(out["again"]) == 1 and len(out["again"][0]) == 3, rank


def test_failed_open_on_one_rank_raises_on_every_rank(dist_pool: Any) -> None:
    outs = dist_pool(3).run(_open_fails_on_rank0, timeout=60)
    assert outs[0] == {"type": "RuntimeError", "msg": "cudaIpcOpenMemHandle failed (fake)"}
    for out in outs[1:]:
        assert out["type"] == "CollectiveMismatch" and "rank 0 could not open" in out["msg"]


@pytest.mark.parametrize("world_size, failing", [(3, 1), (2, 0)], ids=["ws3-rank1", "ws2-rank0"])
def test_failed_handle_of_is_a_rejection_on_every_peer(dist_pool: Any, world_size: int,
                                                       failing: int) -> None:
    """A rank whose backend cannot make its handle (cudaIpcGetMemHandle fails) raises its
    own error; its peers raise PeerRejectedError naming it at once. Old code: the failing
    rank left before the announcement, and its peers waited in the gather until the
    group's timeout (CommTimeout after GROUP_TIMEOUT_S here)."""
    outs = dist_pool(world_size).run(_handle_of_fails, failing, timeout=90)
    own = outs[failing]["error"]
    assert own is not None and own["type"] == "RuntimeError", own
    assert "cudaIpcGetMemHandle failed" in own["msg"]
    for rank, out in enumerate(outs):
        assert len(out["again"]) == 1 and len(out["again"][0]) == world_size, rank
        if rank == failing:
            continue
        err = out["error"]
        assert err is not None and err["type"] == "PeerRejectedError", (rank, err)
        assert err["peers"] == [failing] and f"rank {failing} rejected" in err["msg"]
        assert "could not make the IPC handle" in err["msg"], err
        assert out["elapsed"] < GROUP_TIMEOUT_S / 2, (rank, out["elapsed"])


# ---------------------------------------------------------------------- HandleBook checks
def _rows(world_size: int, offsets: dict[int, int] | None = None) -> list[IpcHandle]:
    rows = [h[0] for h in (fake_handles(r, 1) for r in range(world_size))]
    for r, off in (offsets or {}).items():
        rows[r] = IpcHandle(rows[r].handle, off)
    return rows


@pytest.mark.parametrize(
    "offset", [0x1002000, 2**40, 2**64 - 1, ALLOCATION_BYTES - BUFFER_BYTES + 16],
    ids=["0x1002000", "2^40", "2^64-1", "tail-overhang"])
def test_book_refuses_offsets_outside_the_allocation(offset: int) -> None:
    backend = FakeIpcBackend()
    with HandleBook(backend, 0) as book:
        with pytest.raises(DecodeError, match=rf"rank 2 .*offset {offset:#x}") as info:
            book.register(_rows(3, {2: offset}), LOCAL_PTR, nbytes=BUFFER_BYTES)
        assert info.value.peers == (2,)


def test_book_accepts_the_last_fitting_offset() -> None:
    with HandleBook(FakeIpcBackend(), 0) as book:
        rows = _rows(2, {1: ALLOCATION_BYTES - BUFFER_BYTES})
        ptrs = book.register(rows, LOCAL_PTR, nbytes=BUFFER_BYTES, align=16)
    assert ptrs[1] % 16 == 0


def test_max_offset_in_the_wire_form_is_a_decode_error() -> None:
    """2**64-1 parses (a u64), and the book refuses it: a ValueError, never OverflowError."""
    raw = bytes(range(HANDLE_BYTES)) + (2**64 - 1).to_bytes(8, "little")
    h = IpcHandle.from_bytes(raw)
    rows = _rows(2)
    rows[1] = h
    with HandleBook(FakeIpcBackend(), 0) as book, pytest.raises(ValueError) as info:
        book.register(rows, LOCAL_PTR, nbytes=BUFFER_BYTES)
    assert isinstance(info.value, DecodeError) and info.value.peers == (1,)


def test_from_bytes_of_another_length_is_a_decode_error() -> None:
    with pytest.raises(DecodeError, match="72 bytes"):
        IpcHandle.from_bytes(bytes(80))


def test_book_refuses_misaligned_offset() -> None:
    with HandleBook(FakeIpcBackend(), 0) as book, \
            pytest.raises(DecodeError, match="rank 1 .*not a multiple of 16"):
        book.register(_rows(2, {1: 8}), LOCAL_PTR, nbytes=BUFFER_BYTES, align=16)


def test_book_refuses_this_ranks_own_handle_from_a_peer() -> None:
    rows = _rows(3)
    rows[2] = IpcHandle(rows[1].handle, 4096)  # rank 2 sends rank 1's (this rank's) handle
    backend = FakeIpcBackend()
    with HandleBook(backend, 1) as book:
        with pytest.raises(DecodeError, match="rank 2 sent an IPC handle of an allocation of "
                                              "this rank") as info:
            book.register(rows, LOCAL_PTR)
        assert info.value.peers == (2,)
    assert backend.opened == [], "claims are checked before anything is opened"


def test_book_refuses_one_allocation_named_by_two_ranks() -> None:
    rows = _rows(4)
    rows[3] = IpcHandle(rows[1].handle, 8192)
    with HandleBook(FakeIpcBackend(), 0) as book:
        with pytest.raises(DecodeError, match="ranks 1 and 3 sent the IPC handle of one") as info:
            book.register(rows, LOCAL_PTR)
        assert info.value.peers == (1, 3)


def test_book_refuses_an_allocation_another_rank_sent_before() -> None:
    with HandleBook(FakeIpcBackend(), 0) as book:
        first = _rows(3)
        book.register(first, LOCAL_PTR)
        later = _rows(3, {1: 64, 2: 64})
        later[2] = IpcHandle(first[1].handle, 128)  # rank 2 names rank 1's allocation
        later[1] = IpcHandle(b"\x11" * HANDLE_BYTES, 0)
        with pytest.raises(DecodeError, match="rank 2 sent the IPC handle of an allocation "
                                              "that rank 1 sent before") as info:
            book.register(later, LOCAL_PTR + 64)
        assert info.value.peers == (2, 1)


def test_book_allows_a_peer_to_repeat_its_own_allocation() -> None:
    """Two captured calls on one input: the same (handle, offset) twice is legitimate."""
    backend = FakeIpcBackend()
    with HandleBook(backend, 0) as book:
        rows = _rows(3, {1: 4096, 2: 4096})
        assert book.register(rows, LOCAL_PTR, nbytes=64) == book.register(rows, LOCAL_PTR,
                                                                          nbytes=64)
        assert book.open_count == 2


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [({"nbytes": 0}, ValueError, "nbytes"), ({"nbytes": 1.5}, TypeError, "nbytes"),
     ({"align": 0}, ValueError, "align"), ({"align": True}, TypeError, "align")],
    ids=["zero-nbytes", "float-nbytes", "zero-align", "bool-align"])
def test_book_register_checks_sizes(kwargs: dict, exc: type[Exception], match: str) -> None:
    with HandleBook(FakeIpcBackend(), 0) as book, pytest.raises(exc, match=match):
        book.register(_rows(2), LOCAL_PTR, **kwargs)


def test_book_refuses_a_backend_that_reports_no_size() -> None:
    class OldBackend(FakeIpcBackend):
        def open(self, handle: bytes) -> int:  # type: ignore[override]  # the old protocol
            return super().open(handle)[0]

    with HandleBook(OldBackend(), 0) as book, pytest.raises(TypeError, match="base, size"):
        book.register(_rows(2), LOCAL_PTR)



def test_book_refuses_an_allocation_smaller_than_the_buffer() -> None:
    """A peer whose allocation the driver maps smaller than the bytes the kernels use
    (a smaller ``max_size`` there, or a lie) is refused even at offset 0."""
    rows = _rows(2, {1: 0})
    backend = FakeIpcBackend(sizes={rows[1].handle: BUFFER_BYTES // 2})
    with HandleBook(backend, 0) as book, pytest.raises(DecodeError, match="rank 1 .*0x800 bytes"):
        book.register(rows, LOCAL_PTR, nbytes=BUFFER_BYTES)


# ---------------------------------------------------------------------- the agreement step
def _agree_with_facts(rank: int, world_size: int, liar: int, facts: list[int]) -> dict | None:
    import torch
    import torch.distributed as dist

    from coordinator.parallel_state import get_world_group
    from device_comms.cuda.custom_allreduce import eligibility as elig
    from device_comms.cuda.custom_allreduce.communicator import CustomAllreduce
    from shm_broadcast.ranks.topology import in_the_same_node_as

    class Liar(CustomAllreduce):
        """Sends ``facts`` in the agreement step (the peer's misbehaviour), nothing else."""

        def _agree(self, enabled: bool) -> elig.GroupVerdict:
            rows = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
            dist.all_gather(rows, torch.tensor(facts, dtype=torch.int64), group=self.cpu_group)
            if facts == [0, 3]:  # sane: the honest rank goes on to the node check
                in_the_same_node_as(self.cpu_group, 0)
            return elig.GroupVerdict(False, "lying")

    group = get_world_group().cpu_group
    cls = Liar if rank == liar else CustomAllreduce
    return _outcome(lambda: cls(group, torch.device("cuda", 0), enabled=False))


@pytest.mark.parametrize("facts", [[0, 1 << 20], [0, -1], [7, 0]],
                         ids=["huge-device", "negative-device", "flag-7"])
def test_agreement_refuses_garbage_facts(dist_pool: Any, facts: list[int]) -> None:
    """A peer's device index and flag reach the peer-access probe only when they are sane."""
    out = dist_pool(2).run(_agree_with_facts, 1, facts, timeout=60)[0]
    assert out is not None and out["type"] == "DecodeError", out
    assert out["peers"] == [1] and f"(enabled {facts[0]}, device {facts[1]})" in out["msg"]


def test_agreement_accepts_sane_facts(dist_pool: Any) -> None:
    assert dist_pool(2).run(_agree_with_facts, 1, [0, 3], timeout=60)[0] is None
