"""Two ranks: the one-step all_reduce into the peer's slot (``SmallAllReduce._into_peer``)
and the pipelined reduce-scatter + all-gather (``PairAllReduce.all_reduce``).

Every dtype, odd sizes and piece counts (one piece, several, a last half piece,
halves that are not whole cache lines); results bitwise equal on both ranks
(every element is reduced by one rank) and bitwise equal to the reference
reduction in rank order -- except the sign of a zero that MAX/MIN pick from
+0.0 and -0.0: torch's vectorised and scalar kernels choose different operands
when they compare equal, and which elements take which path depends on how a
kernel is split among threads (a 16-core host splits the engine's half pieces
and the reference differently); and no result aliases the workspace.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import CpuCommunicator, ReduceOp, reduce_local
from device_comms.cpu_shm.engine import PAIR_ONE_STEP_MAX_BYTES
from device_comms.cpu_shm.engine_threads import GRAIN
from device_comms.errors import CollectiveMismatch, PeerDiedError
from shm_broadcast.ranks.launcher import spawn_group

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int8, torch.bool, torch.complex64)


def _ops(dtype: torch.dtype) -> tuple[ReduceOp, ...]:
    if dtype == torch.bool or dtype.is_complex:
        return (ReduceOp.SUM,)
    if dtype.is_floating_point:
        return (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN)
    return (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.BXOR)


def _input(seed: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        x = torch.randn(n, generator=g)
        x[::5] = 0.0 if rank == 0 else -0.0  # +0 on rank 0, -0 on rank 1: order-sensitive
        return x.to(dtype)
    return torch.randint(-3, 4, (n,), generator=g, dtype=dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``torch.equal`` calls +0.0 and -0.0 equal)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def pair_rank(rank: int, world_size: int, piece: int) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="pair",
                           workspace_bytes=256 << 10, oneshot_bytes=1 << 30)
    eng = comm._engine
    assert eng is not None
    if piece:
        eng.pair.piece_bytes = eng.pair.torch_piece_bytes = piece
    # torch's reductions too into the peer's slot from 4 KiB (by default only from 64 KiB,
    # past this workspace's slots), so that every dtype below takes that scheme
    eng.small.into_peer_torch_min_bytes = 4 << 10
    lo, hi = eng.ws.slot_address(0, 0), eng.ws.slot_address(1, 1) + eng.ws.slot_bytes
    # One step into the peer's slot (>= 4 KiB and within a 64 KiB slot for 2- and 4-byte types),
    # then pieces (beyond the slot or the torch grain).
    lengths = [9001, 16000, 16400, GRAIN + 1, GRAIN + 333, (eng.ws.slot_bytes // 2) + 1,
               3 * eng.ws.slot_bytes // 4 + 17, 2 * eng.ws.slot_bytes + 5]
    cases = [(d, n, op) for d in _DTYPES for n in lengths for op in _ops(d)]
    got = []
    for i, (dtype, n, op) in enumerate(cases):
        got.append(comm.all_reduce(_input(i, rank, n, dtype), op))
    aliased = [i for i, g in enumerate(got) if lo <= g.data_ptr() < hi]
    comm.destroy()
    bad = []
    for i, ((dtype, n, op), g) in enumerate(zip(cases, got, strict=True)):
        want = reduce_local([_input(i, r, n, dtype) for r in range(world_size)], op)
        if op in (ReduceOp.MAX, ReduceOp.MIN) and dtype.is_floating_point:
            same = torch.equal(g, want)  # values; the sign of a zero may differ (see above)
        else:
            same = _same_bits(g, want)
        if not same:
            bad.append(f"{dtype} n={n} {op.name}")
    return {"bad": bad, "aliased": aliased, "n": len(cases),
            "digests": [hashlib.sha256(g.reshape(-1).view(torch.uint8).numpy()).hexdigest()
                        for g in got]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("piece", [0, 4096, 12288 + 64, pytest.param(200, marks=pytest.mark.slow)],
                         ids=["default", "4KiB", "odd", "tiny"])  # tiny: many steps, 13 s
def test_pair_all_reduce_matches_reference(dist_pool: Any, piece: int) -> None:
    outs = dist_pool(2).run(pair_rank, piece, timeout=100)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: {o['bad'][:5]} of {o['n']}"
        assert o["aliased"] == [], "results must not be views of the workspace"
    assert outs[0]["digests"] == outs[1]["digests"], "both ranks must get the same bits"


def _stress_case(i: int, seed: int) -> tuple[str, torch.dtype, int]:
    pick = random.Random(seed * 100_003 + i)  # the same sequence on both ranks
    kind = pick.choice(["new", "in place", "mixed", "all_gather", "broadcast", "reduce_scatter"])
    dtype = pick.choice([torch.float32, torch.bfloat16, torch.int64])
    n = pick.choice([100, 9000, 12_000, 20_000, 40_000, 70_002])  # every all_reduce scheme
    return kind, dtype, n


def stress_rank(rank: int, world_size: int, seed: int, calls: int) -> dict[str, Any]:
    """Random collectives on one engine with random delays around every step."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="pairstress",
                           workspace_bytes=256 << 10)
    sync = comm._engine.sync
    real_step, jitter = sync.step, random.Random(seed * 31 + rank)

    def uneven_step(*args: Any, **kw: Any) -> int:
        if jitter.random() < 0.3:
            time.sleep(jitter.random() * 3e-4)
        parity = real_step(*args, **kw)
        if jitter.random() < 0.3:  # one rank lingers after the step, the other runs ahead
            time.sleep(jitter.random() * 3e-4)
        return parity

    sync.step = uneven_step  # type: ignore[method-assign]
    bad: list[str] = []
    try:
        for i in range(calls):
            kind, dtype, n = _stress_case(i, seed)
            xs = [_input(i, r, n, dtype) for r in range(world_size)]
            x = xs[rank].clone()
            if kind == "all_gather":
                got, want = comm.all_gather(x, 0), torch.cat(xs)
            elif kind == "broadcast":
                got, want = comm.broadcast(x, i % 2), xs[i % 2]
            elif kind == "reduce_scatter":
                got = comm.reduce_scatter(x, 0)
                want = reduce_local(xs, ReduceOp.SUM).chunk(world_size)[rank]
            else:
                into = x if kind == "in place" or (kind == "mixed" and rank == i % 2) else None
                got, want = comm.all_reduce(x, out=into), reduce_local(xs, ReduceOp.SUM)
            if not _same_bits(got, want):
                bad.append(f"call {i}: {kind} {dtype} n={n}")
    finally:
        comm.destroy()
    return {"bad": bad}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2])
def test_uneven_ranks_never_see_a_reused_slot(dist_pool: Any, seed: int) -> None:
    """Double buffering under skew: a rank delayed before or after any step
    must never read a slot its peer already rewrote, nor write one still read."""
    outs = dist_pool(2).run(stress_rank, seed, 120, timeout=110)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: {o['bad'][:5]}"


def killed_mid_call(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 SIGKILLs itself after the third step of a 4 MiB pipelined all_reduce."""
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="pairkill")
    x = torch.ones(1 << 20)  # 4 MiB: four 1 MiB pieces, five steps
    comm.all_reduce(x)
    if rank == 1:
        sync, real_step, seen = comm._engine.sync, comm._engine.sync.step, [0]

        def step_then_die(*args: Any, **kw: Any) -> int:
            parity = real_step(*args, **kw)
            seen[0] += 1
            if seen[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return parity

        sync.step = step_then_die  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
        return {"error": None}
    except PeerDiedError as e:
        return {"error": str(e), "elapsed": time.monotonic() - t0}
    finally:
        comm.destroy()


@pytest.mark.timeout(90)
def test_peer_killed_inside_the_pipeline_is_reported() -> None:
    outs = spawn_group(killed_mid_call, 2, (), timeout=80)
    assert outs[1].exitcode == -9
    res = outs[0].result
    assert outs[0].ok and res["error"] is not None, "rank 0 did not notice the dead peer"
    assert res["elapsed"] < 2.0 and "rank 1" in res["error"] and "all_reduce" in res["error"], res


def mismatched_large(rank: int, world_size: int) -> dict[str, Any]:
    comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"), unique_name="pairmis")
    try:
        try:  # both above the one-step limit: the pipelined scheme on both ranks
            comm.all_reduce(torch.ones(300_000 + rank))
            err = None
        except CollectiveMismatch as e:
            err = str(e)
        after = comm.all_reduce(torch.full((600_000,), float(rank)))
    finally:
        comm.destroy()
    return {"err": err, "after": float(after[-1])}


@pytest.mark.timeout(60)
def test_mismatched_sizes_raise_on_both_ranks_and_the_group_goes_on(dist_pool: Any) -> None:
    for rank, o in enumerate(dist_pool(2).run(mismatched_large, timeout=50)):
        assert o["err"] is not None and "all_reduce" in o["err"], (rank, o)
        assert o["after"] == 1.0


def one_step_range_rank(rank: int, world_size: int, threads: tuple[int, int]) -> dict[str, Any]:
    """Past the torch grain and up to ``PAIR_ONE_STEP_MAX_BYTES``: one step into the
    peer's slot when both ranks' engines run one thread, the pipelined scheme when
    either runs more (the ranks must agree, or their steps would not pair up)."""
    saved = os.environ.get("GROUPCOORD_CPU_SHM_THREADS")
    os.environ["GROUPCOORD_CPU_SHM_THREADS"] = str(threads[rank])
    try:
        comm = CpuCommunicator(dist.group.WORLD, torch.device("cpu"),
                               unique_name=f"pairone{threads[0]}{threads[1]}")
    finally:
        if saved is None:
            del os.environ["GROUPCOORD_CPU_SHM_THREADS"]
        else:
            os.environ["GROUPCOORD_CPU_SHM_THREADS"] = saved
    eng = comm._engine
    assert eng is not None and eng.threads == threads[rank]
    torch_threads = torch.get_num_threads()
    bad, routes = [], []
    cases = [(dtype, n, op, into)
             for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool)
             for n in (GRAIN + 1, 50_001, PAIR_ONE_STEP_MAX_BYTES // dtype.itemsize,
                       PAIR_ONE_STEP_MAX_BYTES // dtype.itemsize + 1)
             for op in _ops(dtype)[:2]
             for into in ("new", "in place", "other")]
    try:
        for i, (dtype, n, op, into) in enumerate(cases):
            xs = [_input(i, r, n, dtype) for r in range(world_size)]
            x = xs[rank].clone()
            out = {"new": None, "in place": x, "other": torch.empty_like(x)}[into]
            got = comm.all_reduce(x, op, out=out)
            last = eng.small.last
            routes.append(last.op is op and last.dtype is dtype and last.shape == x.shape)
            want = reduce_local(xs, op)
            if not _same_bits(got, want) or (out is not None and got is not out):
                bad.append(f"{dtype} n={n} {op.name} {into}")
            if torch.get_num_threads() != torch_threads:
                bad.append(f"{dtype} n={n} {op.name} {into}: torch threads "
                           f"{torch.get_num_threads()}, was {torch_threads}")
            eng.small.close()  # the next case's route shows in a fresh entry
    finally:
        comm.destroy()
    return {"bad": bad, "one_step": routes,
            "fits": [n * dtype.itemsize <= PAIR_ONE_STEP_MAX_BYTES for dtype, n, _, _ in cases]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("threads", [(1, 1), (2, 2), (1, 2)],
                         ids=["one-thread", "two-threads", "mixed"])
def test_two_ranks_one_step_range_follows_the_threads(dist_pool: Any,
                                                      threads: tuple[int, int]) -> None:
    outs = dist_pool(2).run(one_step_range_rank, threads, timeout=110)
    one_step = threads == (1, 1)
    for rank, o in enumerate(outs):
        assert o["bad"] == [], f"rank {rank}: {o['bad'][:5]}"
        want = [one_step and fits for fits in o["fits"]]
        wrong = [i for i, (got, w) in enumerate(zip(o["one_step"], want, strict=True)) if got != w]
        assert wrong == [], (rank, wrong)
