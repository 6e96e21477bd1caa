"""IPC handles: wire format, exchange over gloo, and the book that opens them once."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from device_comms.cuda.custom_allreduce.handles import (
    HANDLE_BYTES,
    WIRE_BYTES,
    HandleBook,
    IpcBackend,
    IpcHandle,
    all_gather_handles,
)
from device_comms.errors import CollectiveMismatch, CommunicatorClosed
from tests.device_comms.cuda.custom_allreduce.fakes import FakeIpcBackend, fake_handles

LOCAL_PTR = 0x5000_0000


# ---------------------------------------------------------------------- rank functions
def _gather_and_register(rank: int, world_size: int, per_rank: int) -> dict:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    got = all_gather_handles(group, fake_handles(rank, per_rank), "test buffers")
    backend = FakeIpcBackend()
    with HandleBook(backend, rank) as book:
        ptrs = [book.register([row[i] for row in got], LOCAL_PTR + i) for i in range(per_rank)]
        opened = book.open_count
    return {
        "rows": [[h.to_bytes() for h in row] for row in got],
        "types": {type(h).__name__ for row in got for h in row},
        "ptrs": ptrs, "bases": backend.bases, "opened": backend.opened,
        "open_count": opened, "closed": backend.closed,
    }


def _mismatch(rank: int, world_size: int) -> dict:
    from coordinator.parallel_state import get_world_group

    group = get_world_group().cpu_group
    try:
        all_gather_handles(group, fake_handles(rank, rank + 1), "mismatched buffers")
    except CollectiveMismatch as e:
        error = str(e)
    else:
        error = None
    after = all_gather_handles(group, fake_handles(rank, 2), "after the mismatch")
    return {"error": error, "after": [len(row) for row in after]}


# ---------------------------------------------------------------------- wire format
@pytest.mark.parametrize(
    "offset", [0, 1, 4096, 2**63, 2**64 - 1], ids=["0", "1", "4k", "2^63", "max"]
)
def test_wire_round_trip(offset: int) -> None:
    h = IpcHandle(bytes(range(HANDLE_BYTES)), offset)
    raw = h.to_bytes()
    assert len(raw) == WIRE_BYTES == 72
    assert raw[:HANDLE_BYTES] == h.handle
    assert raw[HANDLE_BYTES:] == offset.to_bytes(8, "little")
    for form in (raw, bytearray(raw), memoryview(raw)):
        assert IpcHandle.from_bytes(form) == h


@pytest.mark.parametrize(
    "handle, offset, exc, match",
    [(b"\0" * 63, 0, ValueError, "64 bytes.*got 63"), (b"\0" * 65, 0, ValueError, "got 65"),
     (b"", 0, ValueError, "got 0"), ("x" * 64, 0, TypeError, "handle"),
     (bytearray(64), 0, TypeError, "handle"), (b"\0" * 64, -1, ValueError, "offset"),
     (b"\0" * 64, 2**64, ValueError, "offset"), (b"\0" * 64, 1.0, TypeError, "offset"),
     (b"\0" * 64, True, TypeError, "offset")],
    ids=["63-bytes", "65-bytes", "empty", "str", "bytearray", "negative-offset", "offset-2^64",
         "float-offset", "bool-offset"],
)
def test_handle_checks(handle: object, offset: object, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        IpcHandle(handle, offset)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, 64, 71, 73, 144], ids=str)
def test_from_bytes_size_checks(size: int) -> None:
    with pytest.raises(ValueError, match=f"72 bytes.*got {size}"):
        IpcHandle.from_bytes(b"\1" * size)


def test_from_bytes_type_check() -> None:
    with pytest.raises(TypeError, match="data"):
        IpcHandle.from_bytes("x" * 72)  # type: ignore[arg-type]


def test_handle_is_frozen_and_hashable() -> None:
    h = IpcHandle(b"\7" * 64, 8)
    with pytest.raises(AttributeError):
        h.offset = 9  # type: ignore[misc]
    assert {h: 1}[IpcHandle(b"\7" * 64, 8)] == 1


# ---------------------------------------------------------------------- exchange
@pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
def test_all_gather_handles(dist_pool: Any, world_size: int) -> None:
    per_rank = 3
    outs = dist_pool(world_size).run(_gather_and_register, per_rank, timeout=90)
    expected = [[h.to_bytes() for h in fake_handles(r, per_rank)] for r in range(world_size)]
    for rank, out in enumerate(outs):
        assert out["rows"] == expected, f"rank {rank}"
        assert out["types"] == {"IpcHandle"}
        peers = [h for r in range(world_size) if r != rank for h in fake_handles(r, per_rank)]
        assert sorted(out["opened"]) == sorted(h.handle for h in peers)  # each once, never own
        assert out["open_count"] == len(peers)
        assert sorted(out["closed"]) == sorted(out["bases"].values())
        for i, ptrs in enumerate(out["ptrs"]):
            for r, p in enumerate(ptrs):
                h = fake_handles(r, per_rank)[i]
                assert p == (LOCAL_PTR + i if r == rank else out["bases"][h.handle] + h.offset)


def test_all_gather_no_handles(dist_pool: Any) -> None:
    outs = dist_pool(2).run(_gather_and_register, 0, timeout=90)
    assert [o["rows"] for o in outs] == [[[], []], [[], []]]


@pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
def test_count_mismatch_raises_on_every_rank(dist_pool: Any, world_size: int) -> None:
    outs = dist_pool(world_size).run(_mismatch, timeout=90)
    for out in outs:
        msg = out["error"]
        assert msg is not None and "mismatched buffers" in msg
        for r in range(world_size):
            assert f"rank {r}: {r + 1}" in msg
        assert out["after"] == [2] * world_size  # the ranks stayed in step


def test_all_gather_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match=r"mine\[0\]"):
        all_gather_handles(None, [b"\0" * 72], "x")  # type: ignore[arg-type, list-item]
    with pytest.raises(TypeError, match="mine"):
        all_gather_handles(None, IpcHandle(b"\0" * 64, 0), "x")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- HandleBook
def _rows(world_size: int, count: int) -> list[list[IpcHandle]]:
    return [fake_handles(r, count) for r in range(world_size)]


def test_book_opens_each_handle_once_and_closes_once() -> None:
    backend = FakeIpcBackend()
    assert isinstance(backend, IpcBackend)
    rows = _rows(4, 1)
    book = HandleBook(backend, 1)
    first = book.register([row[0] for row in rows], LOCAL_PTR)
    assert first[1] == LOCAL_PTR
    for r in (0, 2, 3):
        assert first[r] == backend.bases[rows[r][0].handle] + rows[r][0].offset
    assert book.open_count == 3 and len(backend.opened) == 3
    assert rows[1][0].handle not in backend.opened  # own handle is never opened
    # Same allocations, other offsets (e.g. graph inputs): reuse the open bases.
    moved = [IpcHandle(row[0].handle, 4096 * (r + 1)) for r, row in enumerate(rows)]
    second = book.register(moved, LOCAL_PTR + 64)
    assert len(backend.opened) == 3 and book.open_count == 3
    assert second == [
        LOCAL_PTR + 64 if r == 1 else backend.bases[moved[r].handle] + 4096 * (r + 1)
        for r in range(4)
    ]
    # A new allocation of rank 2 is opened once more.
    new = list(moved)
    new[2] = IpcHandle(b"\x42" * 64, 16)
    assert book.register(new, LOCAL_PTR)[2] == backend.bases[b"\x42" * 64] + 16
    assert len(backend.opened) == 4 and book.open_count == 4
    book.close()
    assert collections.Counter(backend.closed) == collections.Counter(backend.bases.values())
    book.close()  # idempotent
    assert len(backend.closed) == 4 and book.open_count == 0 and book.closed
    with pytest.raises(CommunicatorClosed):
        book.register([row[0] for row in rows], LOCAL_PTR)


def test_book_context_manager_closes() -> None:
    backend = FakeIpcBackend()
    with HandleBook(backend, 0) as book:
        book.register([row[0] for row in _rows(2, 1)], LOCAL_PTR)
    assert book.closed and backend.closed == list(backend.bases.values())


def test_book_failed_open_keeps_earlier_ones_for_close() -> None:
    rows = _rows(4, 1)
    backend = FakeIpcBackend(fail_open=rows[3][0].handle)
    book = HandleBook(backend, 0)
    with pytest.raises(RuntimeError, match="fake"):
        book.register([row[0] for row in rows], LOCAL_PTR)
    assert book.open_count == 2
    book.close()
    assert sorted(backend.closed) == sorted(backend.bases.values())


def test_book_close_attempts_every_base_then_raises() -> None:
    rows = _rows(4, 1)
    probe = FakeIpcBackend()
    HandleBook(probe, 0).register([row[0] for row in rows], LOCAL_PTR)
    failing = sorted(probe.bases.values())[0]
    backend = FakeIpcBackend(fail_close=failing)
    book = HandleBook(backend, 0)
    book.register([row[0] for row in rows], LOCAL_PTR)
    with pytest.raises(RuntimeError, match="fake"):
        book.close()
    assert sorted(backend.closed) == sorted(backend.bases.values())
    book.close()  # already closed: nothing is closed twice
    assert len(backend.closed) == 3


@pytest.mark.parametrize(
    "args, exc, match",
    [((object(), 0), TypeError, "backend"), ((FakeIpcBackend(), "0"), TypeError, "self_rank"),
     ((FakeIpcBackend(), -1), ValueError, "self_rank")],
    ids=["not-a-backend", "str-rank", "negative-rank"],
)
def test_book_constructor_checks(args: tuple, exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        HandleBook(*args)


@pytest.mark.parametrize(
    "handles, local_ptr, exc, match",
    [(None, LOCAL_PTR, TypeError, "peer_handles"),
     ([b"\0" * 64] * 4, LOCAL_PTR, TypeError, r"peer_handles\[0\]"),
     ("abcd", LOCAL_PTR, TypeError, "peer_handles"),
     ("SHORT", LOCAL_PTR, ValueError, "one handle per rank"),
     ("ROWS", "0x10", TypeError, "local_ptr"), ("ROWS", 0, ValueError, "local_ptr")],
    ids=["none", "raw-bytes", "str", "too-few", "str-ptr", "null-ptr"],
)
def test_book_register_checks(handles: object, local_ptr: object, exc: type[Exception],
                              match: str) -> None:
    rows = [row[0] for row in _rows(4, 1)]
    named = {"ROWS": rows, "SHORT": rows[:2]}
    arg = named.get(handles, handles) if isinstance(handles, str) else handles
    book = HandleBook(FakeIpcBackend(), 2)
    with pytest.raises(exc, match=match):
        book.register(arg, local_ptr)  # type: ignore[arg-type]
