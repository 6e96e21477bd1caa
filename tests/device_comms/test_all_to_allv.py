"""all_to_allv on every CPU transport, against a reference built from every rank's input.

Transports (each its own test id, world sizes 2, 3 and 4):

* ``shm``: the shared-memory engine with the default workspace;
* ``shm-pieces``: the same with tiny slots, so most calls take many windows;
* ``gloo``: plain :class:`TorchDistributedCommunicator` (signed envelopes);
* ``hier``: :class:`CpuCommunicator` told that ranks sit on two nodes
  (``node_id``), i.e. the hierarchical agreement then gloo (world sizes 3, 4);
* ``cuda-standin``: :class:`CudaCommunicator`'s hook over the gloo stand-in
  for NCCL (grouped send/recv at raw pointers, sizes agreed over the CPU group).

Size matrices: random, skewed like MoE routing (one hot receiver), a rank that
sends nothing and one that receives nothing, all zero, only to itself, and
large ones (many slot windows). Dtypes from bool to complex, trailing row
shapes ``()``, ``(3,)``, ``(2, 5)``, ``(0,)`` and 3-D, non-contiguous
inputs, ``recv_sizes`` given and not. Then the error paths on every rank.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.device_comms.general_cases import make
from tests.device_comms.transports import make_comm

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
TRAILING = ((), (3,), (2, 5), (0,), (4, 1, 2))


def matrix(kind: str, n: int, seed: int) -> list[list[int]]:
    """``m[i][j]``: rows rank ``i`` sends rank ``j``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randint(0, 6, (n, n), generator=g).tolist()
    if kind == "skewed":  # rank 0 is the hot expert's rank, the rest get a trickle
        m = torch.randint(0, 3, (n, n), generator=g)
        m[:, 0] = 40 + torch.randint(0, 9, (n,), generator=g)
        return m.tolist()
    if kind == "silent":  # rank n-1 sends nothing, rank 0 receives nothing
        m = torch.randint(1, 5, (n, n), generator=g)
        m[n - 1, :] = 0
        m[:, 0] = 0
        return m.tolist()
    if kind == "zero":
        return [[0] * n for _ in range(n)]
    if kind == "self":
        return [[5 if i == j else 0 for j in range(n)] for i in range(n)]
    if kind == "large":
        return [[300 + 17 * i + 5 * j for j in range(n)] for i in range(n)]
    raise ValueError(kind)


def cases(n: int) -> list[tuple[Any, ...]]:
    """``(idx, matrix kind, dtype, trailing shape, give recv_sizes)``, the same everywhere."""
    out: list[tuple[Any, ...]] = []
    kinds = ("random", "skewed", "silent", "zero", "self")
    for i, dt in enumerate(DTYPES):
        for j, kind in enumerate(kinds):
            out.append((len(out), kind, dt, TRAILING[(i + j) % len(TRAILING)], (i + j) % 2 == 0))
    for dt, tr in ((torch.float32, (64,)), (torch.bfloat16, (3, 7)), (torch.bool, ())):
        for give in (True, False):
            out.append((len(out), "large", dt, tr, give))
    return out


def inputs(case: tuple[Any, ...], rank: int, n: int) -> tuple[torch.Tensor, list[int], list[int]]:
    idx, kind, dt, tr, _ = case
    m = matrix(kind, n, idx)
    x = make(idx, rank, (sum(m[rank]),) + tuple(tr), dt)
    return x, m[rank], [m[q][rank] for q in range(n)]


def expected(case: tuple[Any, ...], rank: int, n: int) -> torch.Tensor:
    pieces = []
    for q in range(n):
        x, send, _ = inputs(case, q, n)
        pieces.append(x.split(send)[rank])
    return torch.cat(pieces)


# ---------------------------------------------------------------------- on the ranks
def _comm(transport: str, rank: int, n: int, pg: Any) -> Any:
    return make_comm(transport, rank, n, pg, "a2av")


def _attempt(fn: Any) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e), time.monotonic() - t0)


def run_cases(rank: int, n: int, transport: str) -> dict[str, Any]:
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    comm = _comm(transport, rank, n, pg)
    failures = []
    for case in cases(n):
        x, send, recv = inputs(case, rank, n)
        if case[0] % 3 == 1 and x.dim() >= 2:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
        got = comm.all_to_allv(x, send, recv if case[4] else None)
        want = expected(case, rank, n)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"{case}: got {tuple(got.shape)} {got.dtype}")
    out = {"failures": failures, "mode": getattr(comm, "mode", transport),
           "errors": _errors(comm, rank, n, transport)}
    if hasattr(comm, "fake"):
        out["nccl_calls"] = sorted(set(comm.fake.names()))
    comm.destroy()
    dist.destroy_process_group(pg)
    return out


def _errors(comm: Any, rank: int, n: int, transport: str) -> dict[str, Any]:
    """Error paths; after each, one valid call shows the communicator still works."""
    x = torch.arange(2.0 * n).view(n, 2) + 10 * rank
    ones = [1] * n
    mism = list(ones)
    if rank == 0:
        mism[n - 1] = 2
    out: dict[str, Any] = {
        "recv_mismatch": _attempt(lambda: comm.all_to_allv(x, ones, mism)),
        "after": comm.all_to_allv(x, ones).tolist(),
        "bad_sum": _attempt(lambda: comm.all_to_allv(x, [2] * n if rank == n - 1 else ones)),
        "bad_type": _attempt(lambda: comm.all_to_allv(x, "rows" if rank == 0 else ones)),
        "float_size": _attempt(lambda: comm.all_to_allv(x, [1.0] * n if rank == 0 else ones)),
        "zero_dim": _attempt(lambda: comm.all_to_allv(torch.tensor(1.0) if rank == 0 else x, ones)),
        "after2": comm.all_to_allv(x, ones, ones).tolist(),
    }
    if transport != "cuda-standin":  # NCCL-side data is not signed (see its docstring)
        out["dtype_differs"] = _attempt(
            lambda: comm.all_to_allv(x.double() if rank == 0 else x, ones))
        out["rows_differ"] = _attempt(
            lambda: comm.all_to_allv(torch.ones(n, 3) if rank == 0 else x, ones))
        out["other_op"] = _attempt(
            lambda: comm.all_reduce(x) if rank == 0 else comm.all_to_allv(x, ones))
        out["after3"] = comm.all_to_allv(x, ones).tolist()
    return out


# ---------------------------------------------------------------------- in the parent
_RUNS = [(t, n) for t in ("shm", "shm-pieces", "gloo", "cuda-standin") for n in (2, 3, 4)]
_RUNS += [("hier", 3), ("hier", 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,world_size", _RUNS, ids=[f"{t}-ws{n}" for t, n in _RUNS])
def test_all_to_allv(dist_pool: Any, transport: str, world_size: int) -> None:
    n = world_size
    outs = dist_pool(n).run(run_cases, transport, timeout=100)
    want_mode = {"shm": "shm", "shm-pieces": "shm", "hier": "hierarchical"}.get(transport)
    for rank, o in enumerate(outs):
        assert not o["failures"], f"rank {rank}: {o['failures'][:5]}"
        if want_mode:
            assert o["mode"] == want_mode
        _check_errors(o["errors"], rank, n, transport)
    if transport == "cuda-standin":  # the hook ran as grouped NCCL point-to-point
        assert {"group_start", "send", "recv", "group_end"} <= set(outs[0]["nccl_calls"])


def _check_errors(e: dict[str, Any], rank: int, n: int, transport: str) -> None:
    valid = [[float(2 * rank + 10 * q), float(2 * rank + 1 + 10 * q)] for q in range(n)]
    name, msg, elapsed = e["recv_mismatch"]
    assert name == "CollectiveMismatch" and elapsed < 5.0, (name, msg)
    assert "rank 0 expects 2 row(s) from rank" in msg, msg
    for key in ("after", "after2") + (("after3",) if "after3" in e else ()):
        assert e[key] == valid, (key, e[key])
    for key, culprit, own, words in (
        ("bad_sum", n - 1, "ValueError", "send_sizes must sum to input_.shape[0]"),
        ("bad_type", 0, "TypeError", "send_sizes must be a list"),
        ("float_size", 0, "TypeError", "send_sizes[0] must be an int"),
        ("zero_dim", 0, "ValueError", "input_ must have at least one dimension"),
    ):
        name, msg, elapsed = e[key]
        assert elapsed < 5.0, (key, elapsed)
        if rank == culprit:
            assert name == own and words in msg, (key, name, msg)
        else:  # the peers are told, name the culprit and its reason
            assert name == "PeerRejectedError", (key, name, msg)
            assert f"rank {culprit} rejected" in msg and words in msg, (key, msg)
    if transport == "cuda-standin":
        return
    for key in ("dtype_differs", "rows_differ", "other_op"):
        name, msg, elapsed = e[key]
        assert name == "CollectiveMismatch" and elapsed < 5.0, (key, name, msg)


# ---------------------------------------------------------------------- single process
def test_case_list_covers_the_edges() -> None:
    for n in (2, 3, 4):
        kinds = {c[1] for c in cases(n)}
        assert kinds == {"random", "skewed", "silent", "zero", "self", "large"}
        silent = matrix("silent", n, 0)
        assert sum(silent[n - 1]) == 0 and sum(r[0] for r in silent) == 0
        assert {c[2] for c in cases(n)} == set(DTYPES)
        assert {c[3] for c in cases(n)} >= set(TRAILING)


def test_pynccl_argument_checks_before_enqueueing() -> None:
    from device_comms.cuda.pynccl.all_to_allv import check_arguments

    cpu = torch.device("cpu")
    x, out = torch.ones(3, 2), torch.ones(4, 2)

    def call(**kw: Any) -> None:
        args = dict(out=out, in_=x, send_sizes=[1, 2], recv_sizes=[1, 3], rank=0, world_size=2,
                    device=cpu)
        args.update(kw)
        check_arguments(**args)

    call()
    with pytest.raises(TypeError, match="out must have in_'s dtype"):
        call(out=out.double())
    with pytest.raises(ValueError, match=r"in_.shape\[0\] must be sum\(send_sizes\) = 4"):
        call(send_sizes=[2, 2])
    with pytest.raises(ValueError, match=r"out.shape\[0\] must be sum\(recv_sizes\) = 5"):
        call(recv_sizes=[1, 4])
    with pytest.raises(ValueError, match=r"send_sizes\[0\] \(2\) and recv_sizes\[0\] \(1\)"):
        call(send_sizes=[2, 1], recv_sizes=[1, 3])
    with pytest.raises(ValueError, match="must match beyond dim 0"):
        call(out=torch.ones(4, 3))
    with pytest.raises(ValueError, match="recv_sizes must have 2 entries"):
        call(recv_sizes=[4])
    with pytest.raises(ValueError, match="contiguous"):
        call(in_=torch.ones(2, 3).t())


def test_size_checks_and_the_size_table_verdict() -> None:
    from coordinator import CollectiveMismatch
    from device_comms.alltoallv import SizeTable, check_sizes, record, settle_sizes
    from device_comms.errors import DecodeError

    assert check_sizes(torch.tensor([2, 0, 1]), 3, "send_sizes", total=3) == [2, 0, 1]
    assert check_sizes((1, 1), 2, "recv_sizes") == [1, 1]
    with pytest.raises(TypeError, match="send_sizes must hold integers"):
        check_sizes(torch.tensor([1.0, 2.0]), 2, "send_sizes")
    with pytest.raises(ValueError, match="send_sizes must be a list or a CPU tensor"):
        check_sizes(torch.tensor([1, 2], device="meta"), 2, "send_sizes")
    with pytest.raises(ValueError, match="must be 1-D"):
        check_sizes(torch.ones(2, 2, dtype=torch.int64), 2, "send_sizes")
    with pytest.raises(ValueError, match=r"send_sizes\[1\] must be an int >= 0, got -1"):
        check_sizes([1, -1], 2, "send_sizes")
    with pytest.raises(ValueError, match=r"must sum to input_.shape\[0\] \(4\)"):
        check_sizes([1, 2], 2, "send_sizes", total=4)
    # rank 0 sends [1, 2], rank 1 sends [3, 0]; rank 1 expects 1 row from rank 0, not 2
    rows = [record([1, 2], None).tolist(), record([3, 0], [1, 0]).tolist()]
    table = SizeTable.decode(rows, "g")
    assert table.received_by(0) == [1, 3] and table.received_by(1) == [2, 0]
    with pytest.raises(CollectiveMismatch, match="rank 1 expects 1 row.s. from rank 0, which "
                                                 "sends it 2") as err:
        settle_sizes(table, "g")
    assert list(err.value.peers) == [0, 1]
    settle_sizes(SizeTable.decode([record([1, 2], [1, 3]).tolist(),
                                   record([3, 0], [2, 0]).tolist()], "g"), "g")
    with pytest.raises(DecodeError, match="rank 1's size record is malformed"):
        SizeTable.decode([rows[0], rows[1][:-1]], "g")
    big = SizeTable.decode([record([0, 1 << 40], None).tolist(), record([1, 0], None).tolist()],
                           "g")
    with pytest.raises(DecodeError, match="rank 1 receives 4398046511104 bytes, more than this "
                                          "host's memory") as err:
        settle_sizes(big, "g", row=4)
    assert list(err.value.peers) == [0]


def hostile_record_rank(rank: int, n: int, transport: str, claim: int) -> list[str]:
    """Rank 1 (a compromised peer) publishes a size record claiming ``claim`` rows for
    rank 0; every rank must raise DecodeError before allocating, and go on."""
    from device_comms import alltoallv
    from device_comms.cpu_shm import alltoallv as shm_alltoallv
    from device_comms.torch_dist import gloo_alltoallv

    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    comm = _comm(transport, rank, n, pg)
    hostile = [0, claim] + [0] * (n - 1) + [0] * n
    shm_write = shm_alltoallv._write
    if rank == 1 and transport == "gloo":
        gloo_alltoallv.record = lambda send, recv: torch.tensor(hostile, dtype=torch.int64)
    elif rank == 1:
        def _write(slot: torch.Tensor, base: int, *rest: Any) -> None:
            shm_write(slot, base, *rest)
            if base:  # the record sits before the first window
                slot[: 8 * len(hostile)].view(torch.int64)[:] = torch.tensor(hostile)

        shm_alltoallv._write = _write
    try:
        x = torch.ones(n, 3)
        try:
            comm.all_to_allv(x, [1] * n)
            seen = ["returned"]
        except Exception as e:  # the point: which error
            seen = [type(e).__name__, str(e)]
        gloo_alltoallv.record, shm_alltoallv._write = alltoallv.record, shm_write
        got = comm.all_to_allv(torch.full((n, 3), float(rank)), [1] * n)  # the group goes on
        seen.append(str(got[:, 0].tolist()))
        return seen
    finally:
        comm.destroy()
        dist.destroy_process_group(pg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("claim", [1 << 40, (1 << 63) - 1], ids=["1T-rows", "int64-max"])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_size_record_claiming_more_than_memory_raises_before_allocating(
        dist_pool: Any, transport: str, claim: int) -> None:
    n = 2
    for rank, seen in enumerate(dist_pool(n).run(hostile_record_rank, transport, claim,
                                                  timeout=100)):
        assert seen[0] == "DecodeError", (rank, seen)
        assert "more than this host's memory" in seen[1] and "rank 1's record" in seen[1], seen
        assert seen[2] == str([float(r) for r in range(n)]), (rank, seen)
