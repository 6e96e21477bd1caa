"""The fast paths of repeated collectives never skip a check they need.

``CpuCommunicator.all_gather`` and ``reduce_scatter`` skip the checks of a
layout (dtype, shape, ``dim``) the engine served before
(:mod:`device_comms.cpu.repeat_calls`), ``broadcast`` those of a layout
(dtype, shape, ``src``) it sent by address before, and ``gather`` those of a
layout (dtype, shape, ``dst``, ``dim``) it took before. Each case first makes such a plan on
every rank, then calls with the same layout but a tensor that must not be
taken as it is: a lazily negated view, a transposed or strided view, one that
requires grad, a ``Parameter``, a freed storage, an ``out`` that overlaps the
input or has another dtype or strides, and ranks that disagree on the shape
or ``dim`` at the same element count. Results are compared with the result
computed locally from every rank's input; a refused call raises its error on
the rank that made it and :class:`PeerRejectedError` (or, for a disagreement,
:class:`CollectiveMismatch`) on every other, after which the group still works.

The abort cases: a communicator aborted after a plan exists raises
:class:`BrokenCommunicator` at once instead of stepping into the engine, a
call blocked in the engine on another thread raises the abort's error within
a health check, and the peers raise instead of waiting out their timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp
from device_comms.errors import (
    BrokenCommunicator,
    CollectiveMismatch,
    CommTimeout,
    GroupCoordError,
    PeerRejectedError,
)

_SHAPE = (6, 6)  # divisible by 2 and 3 along dim 0; square, so dims 0 and 1 look alike


def _x(rank: int, shape: tuple[int, ...] = _SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randn(shape, generator=g)


def _gathered(inputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat([x.detach() for x in inputs], dim)


def _scattered(inputs: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    total = torch.stack([x.detach() for x in inputs]).sum(0)
    return total.chunk(world_size, 0)[rank]


def _counts(world_size: int) -> list[int]:
    """Uneven rows of ``_SHAPE[0]`` for reduce_scatterv."""
    return [2, 4] if world_size == 2 else [1, 2, 3]


def _warm(comm: CpuCommunicator, rank: int) -> None:
    """Make the plans of every layout the cases use (the second call takes them)."""
    for _ in range(2):
        comm.all_gather(_x(rank), 0)
        comm.all_gather(_x(rank), 0, out=torch.empty(_SHAPE[0] * comm.world_size, _SHAPE[1]))
        comm.all_gather(_x(rank), 1)
        comm.reduce_scatter(_x(rank), 0)
        x = _x(rank)
        comm.all_reduce(x, out=x)
        for src in {0, comm.world_size - 1}:
            comm.broadcast(_x(rank), src=src)
            comm.gather(_x(rank), src, 0)
        comm.reduce_scatterv(_x(rank), 0, _counts(comm.world_size))


# ---------------------------------------------------------------- inputs that must be read right
def _neg_view(rank: int) -> torch.Tensor:
    mine = torch._neg_view(-_x(rank))  # values _x(rank), bytes their negation
    assert mine.is_neg() and mine.is_contiguous()  # the case exists on this torch
    return mine


def _transposed(rank: int) -> torch.Tensor:
    return _x(rank).t().contiguous().t()  # shape _SHAPE, values _x(rank), not contiguous


def _strided(rank: int) -> torch.Tensor:
    wide = torch.zeros(_SHAPE[0], 2 * _SHAPE[1])
    wide[:, ::2] = _x(rank)
    return wide[:, ::2]


def _grad(rank: int) -> torch.Tensor:
    return _x(rank).requires_grad_(True)


def _parameter(rank: int) -> torch.Tensor:
    return torch.nn.Parameter(_x(rank), requires_grad=False)


_VALUES: dict[str, Callable[[int], torch.Tensor]] = {
    "neg-view": _neg_view,
    "transposed": _transposed,
    "strided": _strided,
    "requires-grad": _grad,
    "parameter": _parameter,
}


def values_rank(rank: int, world_size: int, case: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"rep-{case}",
                           timeout=30)
    bad: list[str] = []
    try:
        _warm(comm, rank)
        inputs = [_x(r) for r in range(world_size)]
        for dim in (0, 1):
            got = comm.all_gather(_VALUES[case](rank), dim)
            if not torch.equal(got, _gathered(inputs, dim)):
                bad.append(f"all_gather dim {dim}: wrong values")
            if got.requires_grad:
                bad.append(f"all_gather dim {dim}: the result requires grad")
        out = torch.empty(_SHAPE[0] * world_size, _SHAPE[1])
        if not torch.equal(comm.all_gather(_VALUES[case](rank), 0, out=out),
                           _gathered(inputs, 0)):
            bad.append("all_gather into out: wrong values")
        got = comm.reduce_scatter(_VALUES[case](rank), 0)
        if not torch.allclose(got, _scattered(inputs, rank, world_size), rtol=1e-6, atol=1e-6):
            bad.append("reduce_scatter: wrong values")
        counts = _counts(world_size)
        got = comm.reduce_scatterv(_VALUES[case](rank), 0, counts)
        want = torch.stack([x.detach() for x in inputs]).sum(0).split(counts, 0)[rank]
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
            bad.append("reduce_scatterv: wrong values")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(_VALUES))
def test_planned_layout_reads_every_input_right(
    dist_pool: Any, case: str, world_size: int
) -> None:
    assert dist_pool(world_size).run(values_rank, case, timeout=50) == [[]] * world_size


# ---------------------------------------------------------------- calls that must be refused
def _freed(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    x = _x(rank)
    x.untyped_storage().resize_(0)
    return "all_gather", lambda comm: comm.all_gather(x, 0)


def _freed_scatter(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    x = _x(rank)
    x.untyped_storage().resize_(0)
    return "reduce_scatter", lambda comm: comm.reduce_scatter(x, 0)


def _out_overlaps(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    out = torch.empty(_SHAPE[0] * world_size, _SHAPE[1])
    x = out[: _SHAPE[0]]
    x.copy_(_x(rank))
    return "all_gather", lambda comm: comm.all_gather(x, 0, out=out)


def _out_dtype(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    out = torch.empty(_SHAPE[0] * world_size, _SHAPE[1], dtype=torch.float64)
    return "all_gather", lambda comm: comm.all_gather(_x(rank), 0, out=out)


def _out_strided(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    out = torch.empty(_SHAPE[1], _SHAPE[0] * world_size).t()  # the right shape, transposed
    return "all_gather", lambda comm: comm.all_gather(_x(rank), 0, out=out)


def _bad_op(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    return "reduce_scatter", lambda comm: comm.reduce_scatter(_x(rank), 0, op="median")


def _op_for_ints(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    return "reduce_scatter", lambda comm: comm.reduce_scatter(_x(rank), 0, op=ReduceOp.BAND)


def _out_inference(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    with torch.inference_mode():  # written outside inference mode below: torch refuses
        out = torch.empty(_SHAPE[0] * world_size, _SHAPE[1])
    return "all_gather", lambda comm: comm.all_gather(_x(rank), 0, out=out)


def _in_place_inference(rank: int,
                        world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    with torch.inference_mode():
        x = _x(rank)
    return "all_reduce", lambda comm: comm.all_reduce(x, out=x)


def _broadcast_into_inference(rank: int,
                              world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    with torch.inference_mode():  # a receiver's buffer that cannot be written out here
        buf = torch.zeros(_SHAPE)
    return "broadcast", lambda comm: comm.broadcast(buf, src=world_size - 1)


def _avg_complex32(rank: int, world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    x = torch.ones(6, dtype=torch.complex32)  # torch cannot divide complex32
    return "all_reduce", lambda comm: comm.all_reduce(x, op=ReduceOp.AVG)


def _counts_with_a_bool(rank: int,
                        world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    counts: list[Any] = _counts(world_size)
    counts[0] = bool(counts[0])  # True == 1: equal to an int where the sizes are compared
    counts[-1] += _counts(world_size)[0] - 1  # the same total
    return "reduce_scatterv", lambda comm: comm.reduce_scatterv(_x(rank), 0, counts)


def _counts_off_by_one(rank: int,
                       world_size: int) -> tuple[str, Callable[[CpuCommunicator], Any]]:
    counts = _counts(world_size)
    counts[-1] += 1
    return "reduce_scatterv", lambda comm: comm.reduce_scatterv(_x(rank), 0, counts)


_REFUSED: dict[str, tuple[Callable[[int, int], tuple[str, Callable[[CpuCommunicator], Any]]],
                          type[Exception]]] = {
    "reduce-scatterv-bool-count": (_counts_with_a_bool, TypeError),
    "reduce-scatterv-wrong-total": (_counts_off_by_one, ValueError),
    "freed-storage": (_freed, ValueError),
    "freed-storage-scatter": (_freed_scatter, ValueError),
    "out-overlaps-input": (_out_overlaps, ValueError),
    "out-dtype": (_out_dtype, TypeError),
    "out-strided": (_out_strided, ValueError),
    "op-not-a-reduce-op": (_bad_op, TypeError),
    "op-bitwise-on-floats": (_op_for_ints, TypeError),
    "out-inference-tensor": (_out_inference, ValueError),
    "in-place-inference-tensor": (_in_place_inference, ValueError),
    "broadcast-into-inference-tensor": (_broadcast_into_inference, ValueError),
    "op-avg-complex32": (_avg_complex32, TypeError),
}


def refused_rank(rank: int, world_size: int, case: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"ref-{case}",
                           timeout=30)
    bad: list[str] = []
    make, error = _REFUSED[case]
    try:
        _warm(comm, rank)
        op, call = make(rank, world_size)
        if rank != 0:  # a good call of the same op: the peers learn of rank 0's refusal
            if op == "all_gather":
                def call(comm: CpuCommunicator) -> Any:
                    return comm.all_gather(_x(rank), 0)
            elif op == "broadcast":
                def call(comm: CpuCommunicator) -> Any:
                    return comm.broadcast(_x(rank), src=world_size - 1)
            elif op == "all_reduce":
                def call(comm: CpuCommunicator) -> Any:
                    x = _x(rank)
                    return comm.all_reduce(x, out=x)
            elif op == "reduce_scatterv":
                def call(comm: CpuCommunicator) -> Any:
                    return comm.reduce_scatterv(_x(rank), 0, _counts(world_size))
            else:
                def call(comm: CpuCommunicator) -> Any:
                    return comm.reduce_scatter(_x(rank), 0)
        want = error if rank == 0 else PeerRejectedError
        try:
            call(comm)
            bad.append(f"{op}: no error (wanted {want.__name__})")
        except want:
            pass
        except Exception as e:
            bad.append(f"{op}: {type(e).__name__} (wanted {want.__name__}): {e}")
        inputs = [_x(r, seed=5) for r in range(world_size)]
        if not torch.equal(comm.all_gather(_x(rank, seed=5), 0), _gathered(inputs, 0)):
            bad.append("the group is out of step after the refusal")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_planned_layout_refuses_bad_calls(dist_pool: Any, case: str, world_size: int) -> None:
    assert dist_pool(world_size).run(refused_rank, case, timeout=50) == [[]] * world_size


# ---------------------------------------------------------------- ranks that disagree
def disagree_rank(rank: int, world_size: int, case: str) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name=f"dis-{case}",
                           timeout=30)
    bad: list[str] = []
    try:
        _warm(comm, rank)
        x = _x(rank)
        if case == "shape" and rank == 0:
            x = _x(rank, (_SHAPE[0] * 2, _SHAPE[1] // 2))  # same element count
        dim = 1 if case == "dim" and rank == 0 else 0
        for op in ("all_gather", "reduce_scatter", "broadcast", "gather", "reduce_scatterv"):
            if op == "reduce_scatterv" and case == "shape":
                continue  # rank 0's rows no longer sum to the counts: refused, not mismatched
            try:
                if op == "all_gather":
                    comm.all_gather(x, dim)
                elif op == "reduce_scatter":
                    comm.reduce_scatter(x, dim)
                elif op == "broadcast":  # "dim": rank 0 names another source (both kept)
                    comm.broadcast(x, src=comm.world_size - 1 if dim == 0 else 0)
                elif op == "gather":  # "dim": rank 0 names another root (both kept)
                    comm.gather(x, comm.world_size - 1 if dim == 0 else 0, 0)
                else:  # "dim": rank 0 passes other counts of the same total
                    counts = _counts(comm.world_size)
                    if dim == 1:
                        counts = counts[::-1]
                    comm.reduce_scatterv(x, 0, counts)
                bad.append(f"{op}: no error")
            except CollectiveMismatch:
                pass
            except Exception as e:
                bad.append(f"{op}: {type(e).__name__}: {e}")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", ["shape", "dim"])
def test_ranks_disagreeing_on_a_planned_layout_raise(
    dist_pool: Any, case: str, world_size: int
) -> None:
    assert dist_pool(world_size).run(disagree_rank, case, timeout=50) == [[]] * world_size


# ---------------------------------------------------------------- broadcast by address
def broadcast_rank(rank: int, world_size: int) -> list[str]:
    """Layouts and sources in turn: receivers get the source's values (their version
    counted, so autograd refuses a buffer it saved), the source's tensor is untouched."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="rep-bcast",
                           timeout=30)
    bad: list[str] = []
    layouts = [((6, 6), torch.float32), ((36,), torch.float32), ((6, 6), torch.bfloat16),
               ((5, 3), torch.int64), ((4096,), torch.float32)]
    try:
        for call in range(4 * len(layouts)):
            shape, dtype = layouts[call % len(layouts)]
            src = (call // len(layouts)) % world_size
            values = [_x(r, shape, call).to(dtype) for r in range(world_size)]
            buf = values[rank].clone()
            version = buf._version
            got = comm.broadcast(buf, src=src)
            if got is not buf or not torch.equal(buf, values[src]):
                bad.append(f"call {call}: {shape} {dtype} from {src}: wrong values")
            if rank != src and buf._version == version:
                bad.append(f"call {call}: the receiver's version did not move")
        w = torch.ones(6, 6, requires_grad=True)
        saved = _x(rank)
        y = (saved * w).sum()  # the product saves ``saved`` for w's gradient
        comm.broadcast(saved, src=0)
        try:
            y.backward()
            if rank != 0:
                bad.append("backward used a buffer the broadcast overwrote")
        except RuntimeError:
            if rank == 0:
                bad.append("the source's tensor counted as written")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_layouts_in_turn(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(broadcast_rank, timeout=50)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:4]}"


# ---------------------------------------------------------------- all_gather by address
def all_gather_rank(rank: int, world_size: int) -> list[str]:
    """Layouts in turn, inputs at new and reused addresses (a fresh tensor, one buffer
    rewritten, rows of a matrix): every result is the concatenation of every rank's
    current values, of the right dtype and shape, and its own memory."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="rep-gather",
                           timeout=30)
    bad: list[str] = []
    layouts = [((6, 6), 0, torch.float32), ((36,), 0, torch.float32),
               ((1, 36), 1, torch.bfloat16), ((6, 6), 1, torch.float32),
               ((5, 3), 0, torch.int8), ((7,), 0, torch.bool), ((4, 2), 0, torch.complex64),
               ((4096,), 0, torch.float16)]
    rows = torch.zeros(3, 36)
    kept: dict[str, torch.Tensor] = {}
    try:
        for call in range(6 * len(layouts)):
            shape, dim, dtype = layouts[call % len(layouts)]
            values = [_x(r, shape, call).to(dtype) for r in range(world_size)]
            form = (call // len(layouts)) % 3
            if form == 0:
                x = values[rank].clone()
            elif form == 1:  # one buffer per layout, rewritten: the same address each time
                x = kept.setdefault(f"{shape}{dtype}", torch.empty(shape, dtype=dtype))
                x.copy_(values[rank])
            elif shape == (36,) and dtype is torch.float32:  # a row of a matrix
                x = rows[call % 3]
                x.copy_(values[rank])
            else:
                x = values[rank].clone()
            got = comm.all_gather(x, dim)
            want = torch.cat(values, dim)
            if got.dtype is not dtype or got.shape != want.shape or not torch.equal(got, want):
                bad.append(f"call {call}: {shape} dim {dim} {dtype} form {form} wrong")
            x.fill_(0)
            if not torch.equal(got, want):
                bad.append(f"call {call}: the result changed with the input")
    finally:
        comm.destroy()
    return bad


def gather_rank(rank: int, world_size: int) -> list[str]:
    """gather layouts and roots in turn: the root gets the concatenation of every rank's
    current values, of the right dtype and shape; every other rank gets None."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="rep-root",
                           timeout=30)
    bad: list[str] = []
    layouts = [((6, 6), 0, torch.float32), ((36,), -1, torch.float32),
               ((1, 36), 1, torch.bfloat16), ((6, 6), 1, torch.float32), ((5, 3), 0, torch.int8)]
    try:
        for call in range(4 * len(layouts) * world_size):
            shape, dim, dtype = layouts[call % len(layouts)]
            dst = (call // len(layouts)) % world_size
            values = [_x(r, shape, call).to(dtype) for r in range(world_size)]
            got = comm.gather(values[rank].clone(), dst, dim)
            if rank != dst:
                if got is not None:
                    bad.append(f"call {call}: a result on rank {rank}, not the root {dst}")
                continue
            want = torch.cat(values, dim)
            if got is None or got.dtype is not dtype or not torch.equal(got, want):
                bad.append(f"call {call}: {shape} dim {dim} {dtype} onto {dst} wrong")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gather_layouts_and_roots_in_turn(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(gather_rank, timeout=50)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:4]}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_layouts_in_turn(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(all_gather_rank, timeout=50)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad[:4]}"


# ---------------------------------------------------------------- abort
def abort_rank(rank: int, world_size: int, blocked: bool) -> list[str]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"),
                           unique_name=f"abort-{blocked}", timeout=30)
    bad: list[str] = []
    try:
        _warm(comm, rank)
        comm.barrier()
        if rank == 0:
            raised: list[BaseException] = []
            if blocked:  # a call waits in the engine for peers that come late

                def wait_in_call() -> None:
                    try:
                        comm.all_gather(_x(rank), 0)
                    except BaseException as e:
                        raised.append(e)

                caller = threading.Thread(target=wait_in_call)
                caller.start()
                time.sleep(0.3)
            start = time.monotonic()
            comm.abort(CommTimeout("the watchdog's reason", peers=[1]))
            if blocked:
                caller.join(5)
                if caller.is_alive() or not raised:
                    bad.append("the blocked call did not end after the abort")
                elif not isinstance(raised[0], CommTimeout):
                    bad.append(f"the blocked call raised {type(raised[0]).__name__}")
            try:
                comm.all_gather(_x(rank), 0)
                bad.append("all_gather after abort: no error")
            except BrokenCommunicator:
                pass
            try:
                comm.reduce_scatter(_x(rank), 0)
                bad.append("reduce_scatter after abort: no error")
            except BrokenCommunicator:
                pass
            if time.monotonic() - start > 3:
                bad.append(f"rank 0 took {time.monotonic() - start:.1f} s")
        else:
            time.sleep(1.0)  # after rank 0's abort
            start = time.monotonic()
            try:
                for _ in range(2):  # the blocked call's step may stand; the next cannot
                    comm.all_gather(_x(rank), 0)
                bad.append("the peers' calls did not raise")
            except GroupCoordError:
                pass
            if time.monotonic() - start > 3:
                bad.append(f"a peer took {time.monotonic() - start:.1f} s to raise")
    finally:
        comm.destroy()
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("blocked", [False, True], ids=["idle", "blocked"])
def test_abort_after_a_plan(dist_pool: Any, blocked: bool, world_size: int) -> None:
    assert dist_pool(world_size).run(abort_rank, blocked, timeout=50) == [[]] * world_size

