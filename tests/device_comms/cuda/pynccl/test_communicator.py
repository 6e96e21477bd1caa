"""PyNcclCommunicator end to end on CPU processes, NCCL replaced by a gloo stand-in.

The stand-in (:mod:`._gloo_nccl`) reads and writes memory at the raw pointers
the communicator passes, so pointer offsets, element counts, datatype and
operator codes, roots, grouping and the dtype conversions are all checked;
what only a GPU can check (streams, graph capture) is not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms.cuda.pynccl import PyNcclCommunicator
from device_comms.errors import CommunicatorClosed, CommunicatorUnavailable, NcclError
from device_comms.reduce_op import ReduceOp, reduce_local
from tests.device_comms.cuda.pynccl._gloo_nccl import GlooNccl


def _x(seed: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.int16:  # large values: sums and products wrap around
        return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randint(-4, 5, shape, generator=g, dtype=torch.int64).to(dtype)


def _all(seed: int, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    return [_x(seed, r, shape, dtype) for r in range(n)]


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    ok = got.dtype == want.dtype and got.shape == want.shape and (
        torch.equal(got, want) if not got.dtype.is_complex else torch.allclose(got, want)
    )
    assert ok, f"{what}: got {got!r}, want {want!r}"


def _comm(lib: GlooNccl | None = None) -> tuple[PyNcclCommunicator, GlooNccl]:
    lib = lib or GlooNccl()
    return PyNcclCommunicator(dist.group.WORLD, "cpu", library=lib), lib


# ---------------------------------------------------------------------- rank functions
def _reductions(rank: int, n: int) -> bytes:
    comm, lib = _comm()
    cases = [(torch.float32, ReduceOp.SUM), (torch.float32, ReduceOp.AVG),
             (torch.bfloat16, ReduceOp.MAX), (torch.int32, ReduceOp.PRODUCT),
             (torch.int16, ReduceOp.SUM), (torch.int16, ReduceOp.PRODUCT),
             (torch.bool, ReduceOp.SUM), (torch.bool, ReduceOp.MIN), (torch.bool, ReduceOp.BOR),
             (torch.complex64, ReduceOp.SUM), (torch.complex128, ReduceOp.AVG),
             (torch.float64, ReduceOp.MIN)]
    for i, (dt, op) in enumerate(cases):
        xs = _all(i, n, (3, 5), dt)
        want = reduce_local(xs, op)
        _same(comm.all_reduce(xs[rank].clone(), op=op), want, f"all_reduce {dt} {op}")
        inplace = xs[rank].clone()
        assert comm.all_reduce(inplace, inplace, op) is inplace
        _same(inplace, want, f"in-place all_reduce {dt} {op}")
        # reduce_scatter: rank i gets the i-th flat piece
        full = _all(100 + i, n, (n * 4, 3), dt)
        out = torch.empty(4, 3, dtype=dt)
        comm.reduce_scatter(out, full[rank], op)
        _same(out, reduce_local(full, op)[rank * 4:(rank + 1) * 4], f"reduce_scatter {dt} {op}")
        # reduce onto the last rank; the others pass None
        root = n - 1
        got = comm.reduce(xs[rank], torch.empty_like(xs[rank]) if rank == root else None, root, op)
        if rank == root:
            _same(got, want, f"reduce {dt} {op}")
        else:
            assert got is None
        # reduce_scatterv: uneven rows, one rank gets none
        sizes = [(r * 3 + 1) % 4 for r in range(n)]
        sizes[1] = 0
        fullv = _all(200 + i, n, (sum(sizes), 2), dt)
        outv = torch.empty(sizes[rank], 2, dtype=dt)
        comm.reduce_scatterv(outv, fullv[rank], sizes, op)
        off = sum(sizes[:rank])
        _same(outv, reduce_local(fullv, op)[off:off + sizes[rank]], f"reduce_scatterv {dt} {op}")
    assert lib.names().count("group_start") == len(cases), "one group per reduce_scatterv"
    comm.close()
    return lib.uid


def _movement(rank: int, n: int) -> None:
    comm, lib = _comm()
    for i, dt in enumerate((torch.float32, torch.bfloat16, torch.int16, torch.bool, torch.complex64,
                            torch.float8_e4m3fn, torch.uint16)):
        xs = [x.to(dt) if x.dtype != dt else x for x in _all(i, n, (2, 3), torch.float32)]
        out = torch.empty(n * 2, 3, dtype=dt)
        comm.all_gather(out, xs[rank])
        _same(out.view(torch.uint8), torch.cat(xs).view(torch.uint8), f"all_gather {dt}")
        sizes = [r % 3 for r in range(n)]  # rank 0 contributes nothing
        pieces = [x[: sizes[r]] for r, x in enumerate(xs)]
        outv = torch.empty(sum(sizes), 3, dtype=dt)
        comm.all_gatherv(outv, pieces[rank].contiguous(), sizes)
        _same(outv.view(torch.uint8), torch.cat(pieces).view(torch.uint8), f"all_gatherv {dt}")
        buf = xs[rank].clone() if rank == n - 1 else torch.zeros(2, 3).to(dt)
        assert comm.broadcast(buf, n - 1) is buf
        _same(buf.view(torch.uint8), xs[n - 1].view(torch.uint8), f"broadcast {dt}")
        g = torch.empty(n * 2, 3, dtype=dt) if rank == 1 else None
        got = comm.gather(g, xs[rank], 1)
        if rank == 1:
            _same(got.view(torch.uint8), torch.cat(xs).view(torch.uint8), f"gather {dt}")
        else:
            assert got is None
    _ring(comm, rank, n)
    comm.close()


def _ring(comm: PyNcclCommunicator, rank: int, n: int) -> None:
    """Send to the next rank, receive from the previous one, fused in one group."""
    mine = torch.full((4,), float(rank))
    got = torch.empty(4)
    with comm.grouped():
        comm.send(mine, (rank + 1) % n)
        comm.recv(got, (rank - 1) % n)
    assert got.tolist() == [float((rank - 1) % n)] * 4
    if n == 2:  # plain blocking pair
        other = 1 - rank
        if rank == 0:
            comm.send(mine, other)
        else:
            comm.recv(got, other)
            assert got.tolist() == [0.0] * 4


def _grouped_widened(rank: int, n: int) -> None:
    """An int16 all-reduce inside grouped(): the cast back waits for the group end."""
    comm, lib = _comm()
    xs = _all(7, n, (5,), torch.int16)
    out = torch.zeros(5, dtype=torch.int16)
    with comm.grouped():
        comm.all_reduce(xs[rank], out)
        assert out.tolist() == [0] * 5, "copied back before the group was launched"
    _same(out, reduce_local(xs, ReduceOp.SUM), "grouped int16 all_reduce")
    comm.close()


def _grouped_buffers_live_until_launch(rank: int, n: int) -> None:
    """NCCL may read a grouped operation's buffers only at the group's end: the
    widened copies of int16 inputs, and inputs the caller dropped, must still
    hold their values then (a freed block goes to the next allocation)."""
    comm, lib = _comm(GlooNccl(defer=True))
    xs, ys = _all(7, n, (1000,), torch.int16), _all(8, n, (1000,), torch.int16)
    with comm.grouped():
        rx = comm.all_reduce(xs[rank])
        ry = comm.all_reduce(ys[rank])
        rz = comm.all_reduce(torch.full((1000,), float(rank)))  # a temporary input
        scratch = [torch.full((1000,), -1.0) for _ in range(4)]  # may reuse freed blocks
        scratch += [torch.full((1000,), -1, dtype=torch.int32) for _ in range(4)]
        got = torch.empty(4)
        comm.broadcast(got if rank else torch.arange(4.0), 0)  # a temporary on rank 0
    _same(rx, reduce_local(xs, ReduceOp.SUM), "first grouped int16 all_reduce")
    _same(ry, reduce_local(ys, ReduceOp.SUM), "second grouped int16 all_reduce")
    _same(rz, torch.full((1000,), float(sum(range(n)))), "grouped all_reduce of a temporary")
    if rank:
        _same(got, torch.arange(4.0), "grouped broadcast from a temporary")
    assert lib.names().count("group_end") == 1 and len(scratch) == 8
    comm.close()


class _OtherDeviceStream:
    """What the communicator reads of a ``torch.cuda.Stream`` of another device (a
    process without a GPU cannot make a real one)."""

    cuda_stream = 0x1234
    device = torch.device("cuda", 1)


def _checks(rank: int, n: int) -> list[str]:
    """Bad arguments raise before anything is sent (the stand-in logs every call)."""
    comm, lib = _comm()
    before = len(lib.calls)
    x = torch.ones(4, 3)
    bad = [
        (ValueError, lambda: comm.all_reduce(x.t())),  # non-contiguous
        (ValueError, lambda: comm.all_reduce(torch.ones(3, device="meta"))),
        (TypeError, lambda: comm.all_reduce([1.0])),
        (TypeError, lambda: comm.all_reduce(x, torch.ones(4, 3, dtype=torch.float64))),
        (ValueError, lambda: comm.all_reduce(x, torch.ones(5, 3))),
        (ValueError, lambda: comm.all_reduce(x, op=ReduceOp.BXOR)),
        (ValueError, lambda: comm.all_reduce(x.int(), op=ReduceOp.BAND)),
        (TypeError, lambda: comm.all_reduce(x.bool(), op=ReduceOp.AVG)),
        (TypeError, lambda: comm.all_reduce(x.int(), op=ReduceOp.AVG)),
        (TypeError, lambda: comm.all_reduce(x.to(torch.float8_e4m3fnuz))),
        (TypeError, lambda: comm.all_reduce(x, op="median")),
        (ValueError, lambda: comm.all_gather(torch.empty(4 * n + 1, 3), x)),
        (ValueError, lambda: comm.reduce_scatter(torch.empty(1), torch.ones(n * 2 + 1))),
        (ValueError, lambda: comm.reduce(x, None, 0)) if rank == 0
        else (ValueError, lambda: comm.reduce(x, x, n)),
        (ValueError, lambda: comm.all_gatherv(torch.empty(3, 3), x, [4] * n)),
        (ValueError, lambda: comm.all_gatherv(torch.empty(4 * n, 2), x, [4] * n)),
        (ValueError, lambda: comm.all_gatherv(torch.empty(4 * n, 3), x, [4] * (n + 1))),
        (ValueError, lambda: comm.reduce_scatterv(torch.empty(1, 3), x, [1] * n)),
        (ValueError, lambda: comm.send(x, rank)),
        (ValueError, lambda: comm.recv(x, n)),
        (ValueError, lambda: comm.broadcast(x, -1)),
        (ValueError, lambda: comm.gather(None, x, rank)),
        (TypeError, lambda: comm.all_reduce(x, stream="default")),
        (ValueError, lambda: comm.all_reduce(x, stream=_OtherDeviceStream())),
    ]
    msgs = []
    for i, (exc, fn) in enumerate(bad):
        try:
            fn()
        except exc as e:
            msgs.append(str(e))
        else:
            raise AssertionError(f"bad call {i} did not raise {exc.__name__}")
    assert len(lib.calls) == before, f"a rejected call reached NCCL: {lib.calls[before:]}"
    comm.close()
    return msgs


def _states(rank: int, n: int) -> dict[str, Any]:
    comm, lib = _comm()
    x = torch.ones(2)
    out: dict[str, Any] = {}
    comm.disable()
    for name, fn in (("all_reduce", lambda: comm.all_reduce(x)),
                     ("broadcast", lambda: comm.broadcast(x, 0)),
                     ("send", lambda: comm.send(x, (rank + 1) % n)),
                     ("grouped", lambda: comm.grouped().__enter__())):
        try:
            fn()
            out[name] = "no error"
        except CommunicatorUnavailable as e:
            out[name] = str(e)
    comm.enable()
    with comm.paused():
        assert comm.disabled
    assert not comm.disabled and comm.all_reduce(x).tolist() == [float(n)] * 2
    comm.disable()
    with comm.paused():
        pass
    out["still_disabled"] = comm.disabled
    comm.enable()
    comm.check_async_error()
    lib.async_error = 6
    try:
        comm.check_async_error()
    except NcclError as e:
        out["async"] = (e.call, e.code, str(e))
    comm.close()  # the pending asynchronous error makes close() abort
    out["closed_with"] = lib.closed_with
    comm.close()  # idempotent
    try:
        comm.all_reduce(x)
    except CommunicatorClosed as e:
        out["after_close"] = str(e)
    comm2, lib2 = _comm()
    comm2.close()
    out["clean_close"] = lib2.closed_with
    comm3, lib3 = _comm()
    comm3.close(abort=True)
    out["forced_abort"] = lib3.closed_with
    with _comm()[0] as comm4:
        pass
    out["with_clean"] = comm4.lib.closed_with
    try:
        with _comm()[0] as comm5:
            raise KeyError("boom")
    except KeyError:
        out["with_error"] = comm5.lib.closed_with
    out["repr"] = repr(comm2)
    return out


def _setup_failure(rank: int, n: int) -> tuple[str, str]:
    """Rank 1 cannot set up (not a CUDA device, no injected library): every rank raises."""
    try:
        if rank == 1:
            PyNcclCommunicator(dist.group.WORLD, "cpu")
        else:
            _comm()
    except (ValueError, CommunicatorUnavailable) as e:
        return type(e).__name__, str(e)
    return "", ""


# ---------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reductions(dist_pool, world_size: int) -> None:
    uids = dist_pool(world_size).run(_reductions)
    assert len(set(uids)) == 1 and len(uids[0]) == 128, "one unique id for the whole group"


@pytest.mark.parametrize("world_size", [2, 3])
def test_data_movement(dist_pool, world_size: int) -> None:
    dist_pool(world_size).run(_movement)


def test_grouped_conversion_waits_for_the_group(dist_pool) -> None:
    dist_pool(2).run(_grouped_widened)


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_buffers_live_until_the_group_launches(dist_pool, world_size: int) -> None:
    dist_pool(world_size).run(_grouped_buffers_live_until_launch)


def test_arguments_are_checked_before_communicating(dist_pool) -> None:
    msgs = dist_pool(2).run(_checks)[0]
    assert "in_ must be contiguous" in msgs[0]
    assert "must be on this communicator's device cpu, got a tensor on meta" in msgs[1]
    assert "in_ must be a torch.Tensor, got list" in msgs[2]
    assert "out must have in_'s dtype torch.float32, got torch.float64" in msgs[3]
    assert "out must have 12 elements, got 15" in msgs[4]
    assert "ReduceOp.BXOR is not supported by NCCL" in msgs[5]
    assert "op=ReduceOp.AVG" in msgs[7] and "torch.bool" in msgs[7]
    assert "torch.float8_e4m3fnuz" in msgs[9]
    assert ("root must be a rank in [0, 2)" in msgs[13]
            or "out must be a tensor on the root rank 0" in msgs[13])
    assert "out.shape[0] must be sum(sizes) = 8, got 3" in msgs[14]
    assert "must match beyond dim 0" in msgs[15]
    assert "sizes must have 2 entries" in msgs[16]
    assert "dst=0 is this rank" in msgs[18]
    assert "stream must be a torch.cuda.Stream or None, got str" in msgs[22]
    assert "stream must be a stream of this communicator's device cpu, got one of cuda:1" \
        in msgs[23]


def test_disabled_closed_and_abort(dist_pool) -> None:
    for out in dist_pool(2).run(_states):
        for op in ("all_reduce", "broadcast", "send", "grouped"):
            assert f"{op} on PyNcclCommunicator" in out[op] and "disabled" in out[op], out[op]
        assert out["still_disabled"] is True, "paused() restores the previous state"
        call, code, msg = out["async"]
        assert (call, code) == ("ncclCommGetAsyncError", 6) and "fake NCCL error 6" in msg
        assert out["closed_with"] == "abort" and out["clean_close"] == "destroy"
        assert out["forced_abort"] == "abort" and out["with_clean"] == "destroy"
        assert out["with_error"] == "abort"
        assert "was closed" in out["after_close"]
        assert "closed" in out["repr"] and "NCCL 2.32.3" in out["repr"]


def test_setup_failure_reaches_every_rank(dist_pool) -> None:
    outs = dist_pool(3).run(_setup_failure)
    assert outs[1][0] == "ValueError"
    assert "device must be a CUDA device for NCCL, got cpu" in outs[1][1]
    for kind, msg in (outs[0], outs[2]):
        assert kind == "CommunicatorUnavailable"
        assert "group rank(s) [1] could not set up NCCL" in msg


def _no_cuda_here(rank: int, n: int, device: Any) -> tuple[str, str]:
    """Rank 0 asks for a CUDA device where CUDA cannot be used; the others set up on CPU."""
    try:
        if rank == 0:
            PyNcclCommunicator(dist.group.WORLD, device, library=GlooNccl())
        else:
            _comm()
    except CommunicatorUnavailable as e:
        return type(e).__name__, str(e)
    return "", ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process where CUDA cannot be used")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 3], ids=["cuda", "cuda-0", "index-3"])
def test_a_cuda_device_without_cuda_reaches_every_rank(dist_pool, device: Any) -> None:
    outs = dist_pool(2).run(_no_cuda_here, device, timeout=60)
    assert outs[0][0] == "CommunicatorUnavailable" and "needs CUDA" in outs[0][1], outs
    assert outs[1][0] == "CommunicatorUnavailable", outs
    # rank 0 makes the unique id: rank 1 hears of the failure there
    assert "group rank 0 could not create an NCCL unique id" in outs[1][1], outs


def test_constructor_argument_types() -> None:
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup"):
        PyNcclCommunicator(object(), "cuda:0")
