"""all_gatherv_rows (several tensors' rows in one exchange) on every CPU transport.

Transports as in ``test_all_to_allv``: ``shm``, ``shm-pieces`` (tiny slots: the
packed rows go through many windows), ``gloo``, ``hier`` (two simulated
nodes) and ``cuda-standin`` (:class:`CudaCommunicator`'s grouped NCCL
broadcasts over the gloo stand-in); world sizes 2, 3 and 4.

Each case is a list of tensors of mixed dtypes (bool to complex) and row
shapes (``()``, ``(3,)``, ``(2, 5)``, ``(0,)``), with row counts that differ
by rank (also zero everywhere, and large), given as ``sizes`` or not, and
non-contiguous inputs; the expected result is built from every rank's input.
Then the error paths on every rank, and the pack/unpack helpers alone.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist

from device_comms import row_gather
from tests.device_comms.general_cases import make
from tests.device_comms.transports import make_comm

LAYOUTS = [
    [(torch.float32, (3,)), (torch.bfloat16, (2, 5))],
    [(torch.int64, ()), (torch.bool, (3,)), (torch.complex64, (2,)), (torch.uint8, (0,))],
    [(torch.float16, (4, 1, 2))],
    [(torch.float64, (7,)), (torch.int32, (1,)), (torch.int8, (5,))],
]
ROWS = ["uneven", "one-empty", "all-empty", "large", "mixed"]


def row_counts(kind: str, n: int) -> list[int]:
    if kind == "uneven":
        return [3 + 2 * r for r in range(n)]
    if kind == "one-empty":
        return [0 if r == n - 1 else r + 1 for r in range(n)]
    if kind == "all-empty":
        return [0] * n
    if kind == "mixed":  # with tiny slots some ranks' rows fit one and others' do not
        return [1 if r % 2 == 0 else 250 for r in range(n)]
    return [200 + 37 * r for r in range(n)]


def cases() -> list[tuple[int, int, str, bool]]:
    """``(idx, layout index, row kind, give sizes)``, the same on every rank."""
    out = []
    for li in range(len(LAYOUTS)):
        for ki, kind in enumerate(ROWS):
            out.append((len(out), li, kind, (li + ki) % 2 == 0))
    return out


def inputs(case: tuple[int, int, str, bool], rank: int, n: int) -> list[torch.Tensor]:
    idx, li, kind, _ = case
    rows = row_counts(kind, n)[rank]
    return [make(100 * idx + j, rank, (rows, *shape), dt)
            for j, (dt, shape) in enumerate(LAYOUTS[li])]


def expected(case: tuple[int, int, str, bool], n: int) -> list[torch.Tensor]:
    per_rank = [inputs(case, q, n) for q in range(n)]
    return [torch.cat([per_rank[q][j] for q in range(n)]) for j in range(len(per_rank[0]))]


# ---------------------------------------------------------------------- on the ranks
def _comm(transport: str, rank: int, n: int, pg: Any) -> Any:
    return make_comm(transport, rank, n, pg, "rows")


def _attempt(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e))


def run_rows(rank: int, n: int, transport: str) -> dict[str, Any]:
    pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    comm = _comm(transport, rank, n, pg)
    failures = []
    for case in cases():
        ts = inputs(case, rank, n)
        if case[0] % 3 == 1:  # the same values through another layout in memory
            ts = [t.unsqueeze(-1).expand(*t.shape, 2)[..., 0] for t in ts]
        counts = row_counts(case[2], n)
        got, sizes = comm.all_gatherv_rows(ts, counts if case[3] else None)
        want = expected(case, n)
        if sizes != counts or len(got) != len(want) or not all(
                g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
                and g.is_contiguous() for g, w in zip(got, want, strict=True)):
            failures.append(f"{case}: sizes {sizes}, got {[tuple(g.shape) for g in got]}")
    out = {"failures": failures, "mode": getattr(comm, "mode", transport),
           "errors": _errors(comm, rank, n, transport)}
    if hasattr(comm, "fake"):
        out["nccl_calls"] = sorted(set(comm.fake.names()))
    comm.destroy()
    dist.destroy_process_group(pg)
    return out


def _errors(comm: Any, rank: int, n: int, transport: str) -> dict[str, Any]:
    """Error paths (the culprit is the last rank); a valid call after each."""
    last = rank == n - 1
    a, b = torch.arange(6.0).view(3, 2) + rank, torch.ones(3, 4, dtype=torch.int64)

    def good() -> list[list[Any]]:
        got, _ = comm.all_gatherv_rows([a, b])
        return [g.tolist() for g in got]

    out: dict[str, Any] = {
        "rows_differ": _attempt(lambda: comm.all_gatherv_rows([a, b[:2] if last else b])),
        "after1": good(),
        "not_list": _attempt(lambda: comm.all_gatherv_rows(a if last else [a, b])),
        "empty": _attempt(lambda: comm.all_gatherv_rows([])),
        "after2": good(),
    }
    if transport != "cuda-standin":  # with sizes given NCCL peers are not told of a
        # rejection, and NCCL-side data is not signed (see its docstring)
        out["own_size"] = _attempt(lambda: comm.all_gatherv_rows(
            [a, b], [3] * (n - 1) + [2] if last else [3] * n))
        # f32 x 2 vs i64 x 1: the same bytes per row, another layout
        out["layout_differs"] = _attempt(lambda: comm.all_gatherv_rows(
            [a, b[:, :2].to(torch.int64) if not last else a.clone()]))
        out["sizes_differ"] = _attempt(lambda: comm.all_gatherv_rows(
            [a, b], [3] * n if not last or n == 1 else [3] * (n - 2) + [4, 3]))
        # a peer's all_gather of one int64 looks like the row-count exchange: told apart
        out["other_op"] = _attempt(lambda: comm.all_gather(torch.tensor([3]), 0) if last
                                   else comm.all_gatherv_rows([a, b]))
        out["after3"] = good()
    return out


# ---------------------------------------------------------------------- in the parent
_RUNS = [(t, n) for t in ("shm", "shm-pieces", "gloo", "cuda-standin") for n in (2, 3, 4)]
_RUNS += [("hier", 3), ("hier", 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,world_size", _RUNS, ids=[f"{t}-ws{n}" for t, n in _RUNS])
def test_all_gatherv_rows(dist_pool: Any, transport: str, world_size: int) -> None:
    n = world_size
    outs = dist_pool(n).run(run_rows, transport, timeout=100)
    want_mode = {"shm": "shm", "shm-pieces": "shm", "hier": "hierarchical"}.get(transport)
    good = [[[2.0 * i + q, 2.0 * i + 1 + q] for q in range(n) for i in range(3)], [[1] * 4] * 3 * n]
    for rank, o in enumerate(outs):
        assert not o["failures"], f"rank {rank}: {o['failures'][:5]}"
        if want_mode:
            assert o["mode"] == want_mode
        e = o["errors"]
        culprit = rank == n - 1
        for key, own, words in (("rows_differ", "ValueError", "tensors[1] has 2 rows"),
                                ("own_size", "ValueError", f"sizes[{n - 1}] is 2"),
                                ("not_list", "TypeError", "must be a non-empty list")):
            if key not in e:
                continue
            if culprit:
                assert e[key][0] == own and words in e[key][1], (key, e[key])
            else:
                assert e[key][0] == "PeerRejectedError" and words in e[key][1], (key, e[key])
        # every rank rejects: each raises its own error or names a lower rejecting rank
        assert e["empty"][0] in ("TypeError", "PeerRejectedError"), e["empty"]
        assert "must be a non-empty list" in e["empty"][1], e["empty"]
        for key in ("after1", "after2", "after3"):
            if key in e:
                assert e[key] == good, (key, e[key])
        for key in ("layout_differs", "sizes_differ", "other_op"):
            if key in e:
                assert e[key][0] == "CollectiveMismatch", (key, e[key])
    if transport == "cuda-standin":  # grouped broadcasts straight into each output
        assert {"group_start", "broadcast", "group_end"} <= set(outs[0]["nccl_calls"])


# ---------------------------------------------------------------------- one process
@pytest.mark.parametrize("li", range(len(LAYOUTS)), ids=[f"layout{i}" for i in range(4)])
@pytest.mark.parametrize("rows", [0, 1, 5])
def test_pack_then_unpack_is_identity(li: int, rows: int) -> None:
    ts = [make(j, 0, (rows, *shape), dt) for j, (dt, shape) in enumerate(LAYOUTS[li])]
    packed = row_gather.pack_rows(ts)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, sum(row_gather.row_bytes(t) for t in ts))
    back = row_gather.unpack_rows(packed, ts)
    assert all(b.dtype == t.dtype and torch.equal(b, t) for b, t in zip(back, ts, strict=True))


def test_layout_key_tells_apart_equal_byte_widths() -> None:
    f32x2, i64x1 = torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.int64)
    assert row_gather.row_bytes(f32x2) == row_gather.row_bytes(i64x1)
    keys = {row_gather.layout_key(ts) for ts in ([f32x2], [i64x1], [f32x2, i64x1],
                                                  [i64x1, f32x2], [f32x2.view(3, 1, 2)])}
    assert len(keys) == 5
    assert row_gather.layout_key([f32x2]) == row_gather.layout_key([torch.ones(7, 2)])
