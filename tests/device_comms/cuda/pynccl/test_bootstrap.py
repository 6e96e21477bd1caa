"""The NCCL unique id reaches every rank: over gloo (world and subgroups) and a
StatelessProcessGroup, on real CPU processes with the real ``ncclGetUniqueId``."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch.distributed as dist

from coordinator.testing import free_port
from device_comms.errors import CommunicatorUnavailable, NcclError


class _Spy:
    """Wraps the library; remembers what ``unique_id`` generated on this rank."""

    def __init__(self, lib: Any, fail: bool = False) -> None:
        self.lib, self.fail, self.made = lib, fail, None

    def unique_id(self) -> bytes:
        if self.fail:
            raise NcclError("ncclGetUniqueId", 2, "unhandled system error (injected)")
        self.made = self.lib.unique_id()
        return self.made


# ---------------------------------------------------------------------- rank functions
def _gloo_ids(rank: int, n: int) -> dict[str, Any]:
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id, ranks_failed
    from device_comms.cuda.pynccl.library import load_library

    spy = _Spy(load_library())
    world = exchange_unique_id(dist.group.WORLD, spy)
    made_world, spy.made = spy.made, None
    # Group rank 0 of [1..n-1] is global rank 1: the broadcast must start there.
    sub_group = dist.new_group(list(range(1, n)), backend="gloo")
    sub = exchange_unique_id(sub_group, spy) if rank >= 1 else None
    failed = ranks_failed(dist.group.WORLD, rank == n - 1)
    return {"world": world, "made_world": made_world, "sub": sub, "made_sub": spy.made,
            "failed": failed}


def _stateless_ids(rank: int, n: int, port: int) -> dict[str, Any]:
    from coordinator.stateless.stateless_group import StatelessProcessGroup
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id, ranks_failed
    from device_comms.cuda.pynccl.library import load_library

    group = StatelessProcessGroup.create("127.0.0.1", port, rank, n, timeout=60)
    try:
        spy = _Spy(load_library())
        uid = exchange_unique_id(group, spy)
        failed = ranks_failed(group, rank == 0)
        group.barrier()
    finally:
        group.close()
    return {"uid": uid, "made": spy.made, "failed": failed}


def _root_fails(rank: int, n: int) -> tuple[str, str]:
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id
    from device_comms.cuda.pynccl.library import load_library

    try:
        exchange_unique_id(dist.group.WORLD, _Spy(load_library(), fail=(rank == 0)))
    except (NcclError, CommunicatorUnavailable) as e:
        return type(e).__name__, str(e)
    return "", ""


class _WrongLengthLib:
    """A library whose id is not 128 bytes (a broken or hostile binding on rank 0)."""

    def __init__(self, made: Any) -> None:
        self.made = made

    def unique_id(self) -> Any:
        return self.made


def _root_makes(rank: int, n: int, made: Any) -> tuple[str, str]:
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id

    try:
        exchange_unique_id(dist.group.WORLD, _WrongLengthLib(made))
    except CommunicatorUnavailable as e:
        return type(e).__name__, str(e)
    return "", ""


def _root_sends_short(rank: int, n: int, sent: bytes) -> tuple[str, str]:
    """Rank 0 broadcasts ``sent`` (fewer bytes than the receivers post: gloo delivers it
    without a word); the other ranks take part in the exchange as usual."""
    import torch

    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id

    if rank == 0:
        dist.broadcast(torch.frombuffer(bytearray(sent), dtype=torch.uint8), src=0)
        return "", ""
    try:
        got = exchange_unique_id(dist.group.WORLD, None)
    except CommunicatorUnavailable as e:
        return type(e).__name__, str(e)
    return "accepted", got.hex()


def _nccl_group_rejected(rank: int, n: int) -> str:
    from device_comms.cuda.pynccl import bootstrap

    with mock.patch.object(bootstrap.dist, "get_backend", return_value="nccl"):
        try:
            bootstrap.exchange_unique_id(dist.group.WORLD, None)
        except ValueError as e:
            return str(e)
    return ""


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", [2, 3])
def test_unique_id_over_gloo(dist_pool, nccl_lib, world_size: int) -> None:
    outs = dist_pool(world_size).run(_gloo_ids)
    made = outs[0]["made_world"]
    assert isinstance(made, bytes) and len(made) == 128 and made != bytes(128)
    assert all(o["world"] == made for o in outs), "every rank gets rank 0's 128 bytes"
    assert all(o["made_world"] is None for o in outs[1:]), "only rank 0 calls ncclGetUniqueId"
    sub_made = outs[1]["made_sub"]
    assert sub_made is not None and sub_made != made
    assert [o["sub"] for o in outs[1:]] == [sub_made] * (world_size - 1)
    assert all(o["made_sub"] is None for o in outs[2:]) and outs[0]["sub"] is None
    assert all(o["failed"] == [world_size - 1] for o in outs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unique_id_over_stateless_group(dist_pool, nccl_lib, world_size: int) -> None:
    outs = dist_pool(world_size).run(_stateless_ids, free_port())
    made = outs[0]["made"]
    assert isinstance(made, bytes) and len(made) == 128
    assert [o["uid"] for o in outs] == [made] * world_size
    assert all(o["made"] is None for o in outs[1:])
    assert all(o["failed"] == [0] for o in outs)


def test_failure_on_rank0_reaches_every_rank(dist_pool, nccl_lib) -> None:
    outs = dist_pool(3).run(_root_fails)
    assert outs[0][0] == "NcclError" and "injected" in outs[0][1]
    for kind, msg in outs[1:]:
        assert kind == "CommunicatorUnavailable" and "group rank 0 could not create" in msg


@pytest.mark.parametrize("made", [b"\x01" * 200, b"\x01" * 100, "x" * 128],
                         ids=["200-bytes", "100-bytes", "str"])
def test_id_of_another_length_on_rank0_reaches_every_rank(dist_pool, made: Any) -> None:
    """Old code broadcast whatever rank 0 got: 200 bytes made gloo abort the receivers
    (SIGABRT, posted 128). Now rank 0 sends the failure marker; nobody dies."""
    outs = dist_pool(3).run(_root_makes, made, timeout=60)
    assert outs[0][0] == "CommunicatorUnavailable" and "not a 128-byte id" in outs[0][1]
    for kind, msg in outs[1:]:
        assert kind == "CommunicatorUnavailable" and "group rank 0 could not create" in msg


@pytest.mark.parametrize("sent", [b"\x01" * 100, bytes(16), b"\x02" * 128],
                         ids=["100-bytes", "16-zeros", "128-bytes-no-end-mark"])
def test_short_message_from_rank0_is_refused(dist_pool, sent: bytes) -> None:
    """Old code posted an unfilled buffer of 128 bytes and took whatever gloo left in it:
    the first bytes of the message and old memory (or zeros) after them, as an id. Now
    the receivers post a zero-filled buffer with an end mark after the id, and refuse a
    message that stopped short of it."""
    outs = dist_pool(3).run(_root_sends_short, sent, timeout=60)
    for kind, msg in outs[1:]:
        assert kind == "CommunicatorUnavailable", (kind, msg)
        assert "stopped short of its end mark" in msg


def test_nccl_process_group_is_rejected(dist_pool) -> None:
    outs = dist_pool(2).run(_nccl_group_rejected)
    for msg in outs:
        assert "must be a CPU (gloo) process group" in msg and "'nccl'" in msg


def test_bad_group_type() -> None:
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id

    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        exchange_unique_id(object(), None)


def test_received_id_is_validated() -> None:
    from device_comms.cuda.pynccl.bootstrap import exchange_unique_id

    class Group:  # a stateless group whose broadcast delivers the wrong thing
        rank, world_size = 1, 2

        def __init__(self, payload: Any) -> None:
            self.payload = payload

        def broadcast_obj(self, obj: Any, src: int) -> Any:
            return self.payload

    with pytest.raises(CommunicatorUnavailable,
                       match="expected a 128-byte NCCL unique id .* got 127"):
        exchange_unique_id(Group(b"x" * 127), None)
    with pytest.raises(CommunicatorUnavailable, match="as bytes .* got str"):
        exchange_unique_id(Group("x" * 128), None)
    with pytest.raises(CommunicatorUnavailable, match="could not create an NCCL unique id"):
        exchange_unique_id(Group(bytes(128)), None)
    assert exchange_unique_id(Group(b"\x01" * 128), None) == b"\x01" * 128
