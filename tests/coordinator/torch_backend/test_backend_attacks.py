"""Calls whose ranks disagree in what one exchange does not sign raise on every rank.

Each attack is a call that torch accepts on every rank alone but whose ranks
pass layouts that do not fit together (pieces of 2 and 3 elements against 3
and 2, another dtype on a receiving rank, split sizes that do not pair up).
Without a check the bytes would travel and land in the wrong places: a
silently wrong result. Every rank must raise a ``CollectiveMismatch`` (or a
``PeerRejectedError``) and the group must give right results afterwards.
Calls that torch allows (aliased outputs, views with an offset,
non-contiguous tensors) must give exact results.

All attacks of a world size run in one pool call (one group, reused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.coordinator.torch_backend import cases

WORLDS = (2, 3)


def _coalesced_split(pg: Any, rank: int, world: int) -> Any:
    sizes = [2, 3] if rank == 0 else [3, 2]
    ts = [torch.full((s,), float(i + 1)) for i, s in enumerate(sizes)]
    dist.all_reduce_coalesced(ts, group=pg)
    return [t.tolist() for t in ts]


def _coalesced_shape(pg: Any, rank: int, world: int) -> Any:
    ts = [torch.ones(2, 3) if rank == 0 else torch.ones(3, 2), torch.ones(4)]
    dist.all_reduce_coalesced(ts, group=pg)
    return [t.tolist() for t in ts]


def _rs_tensor_coalesced_split(pg: Any, rank: int, world: int) -> Any:
    sizes = [2, 3] if rank == 0 else [3, 2]
    outs = [torch.empty(s) for s in sizes]
    ins = [torch.arange(s * world, dtype=torch.float32) for s in sizes]
    pg.reduce_scatter_tensor_coalesced(outs, ins, dist.ReduceScatterOptions()).wait()
    return [o.tolist() for o in outs]


def _ag_tensor_coalesced_split(pg: Any, rank: int, world: int) -> Any:
    sizes = [2, 3] if rank == 0 else [3, 2]
    outs = [torch.empty(s * world) for s in sizes]
    pg.allgather_into_tensor_coalesced(outs, [torch.ones(s) for s in sizes]).wait()
    return [o.tolist() for o in outs]


def _ag_coalesced_list_split(pg: Any, rank: int, world: int) -> Any:
    sizes = [2, 3] if rank == 0 else [3, 2]
    outs = [[torch.empty(s) for s in sizes] for _ in range(world)]
    dist.all_gather_coalesced(outs, [torch.ones(s) for s in sizes], group=pg)
    return [[o.tolist() for o in row] for row in outs]


def _scatter_dtype(pg: Any, rank: int, world: int) -> Any:
    dt = torch.float32 if rank == 0 else torch.int32
    out = torch.empty(4, dtype=dt)
    src = [torch.full((4,), 1.5) for _ in range(world)] if rank == 0 else None
    dist.scatter(out, src, src=0, group=pg)
    return out.tolist()


def _scatter_numel(pg: Any, rank: int, world: int) -> Any:
    out = torch.empty(4 if rank == 0 else 5)
    src = [torch.ones(4) for _ in range(world)] if rank == 0 else None
    dist.scatter(out, src, src=0, group=pg)
    return out.tolist()


def _scatter_root_rejects(pg: Any, rank: int, world: int) -> Any:
    out = torch.empty(4)
    src = [torch.ones(4) for _ in range(world + 1)] if rank == 0 else None
    dist.scatter(out, src, src=0, group=pg)
    return out.tolist()


def _scatter_receiver_rejects(pg: Any, rank: int, world: int) -> Any:
    out = [torch.empty(4), torch.empty(4)] if rank == 1 else [torch.empty(4)]
    src = [[torch.ones(4) for _ in range(world)]] if rank == 0 else []
    # the group's own method: torch's dist.scatter would check the arguments itself
    pg.scatter(out, src, dist.ScatterOptions()).wait()
    return out[0].tolist()


def _ag_list_uneven_disagree(pg: Any, rank: int, world: int) -> Any:
    sizes = [2 + (r + rank) % 2 for r in range(world)]
    outs = [torch.empty(s) for s in sizes]
    dist.all_gather(outs, torch.ones(sizes[rank]), group=pg)
    return [o.tolist() for o in outs]


def _rs_list_uneven_disagree(pg: Any, rank: int, world: int) -> Any:
    sizes = [2 + (r + rank) % 2 for r in range(world)]
    out = torch.empty(sizes[rank])
    dist.reduce_scatter(out, [torch.ones(s) for s in sizes], group=pg)
    return out.tolist()


def _a2a_list_disagree(pg: Any, rank: int, world: int) -> Any:
    send = [1 + (rank == 1 and j == 0) for j in range(world)]  # rank 1 sends rank 0 two
    recv = [1] * world
    outs = [torch.empty(s) for s in recv]
    dist.all_to_all(outs, [torch.ones(s) for s in send], group=pg)
    return [o.tolist() for o in outs]


def _a2a_single_disagree(pg: Any, rank: int, world: int) -> Any:
    send = [1 + (rank == 1 and j == 0) for j in range(world)]
    recv = [1] * world
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.ones(sum(send)), recv, send, group=pg)
    return out.tolist()


def _a2a_single_rows(pg: Any, rank: int, world: int) -> Any:
    x = torch.ones(2 * world, 3) if rank == 0 else torch.ones(3 * world, 2)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=pg)
    return out.tolist()


def _a2a_single_dtype(pg: Any, rank: int, world: int) -> Any:
    dt = torch.float32 if rank == 0 else torch.int32  # the same element size
    out = torch.empty(world, dtype=dt)
    dist.all_to_all_single(out, torch.ones(world, dtype=dt), group=pg)
    return out.tolist()


def _ag_into_tensor_dtype(pg: Any, rank: int, world: int) -> Any:
    dt = torch.float32 if rank == 0 else torch.int32
    out = torch.empty(4 * world, dtype=dt)
    dist.all_gather_into_tensor(out, torch.ones(4, dtype=dt), group=pg)
    return out.tolist()


def _all_reduce_expanded(pg: Any, rank: int, world: int) -> Any:
    t = torch.ones(1).expand(4) if rank == 0 else torch.ones(4)  # rank 0's cannot be written
    dist.all_reduce(t, group=pg)
    return t.tolist()


def _broadcast_expanded(pg: Any, rank: int, world: int) -> Any:
    t = torch.zeros(1).expand(4) if rank == 1 else torch.ones(4)  # a receiver's
    dist.broadcast(t, 0, group=pg)
    return t.tolist()


def _reduce_expanded(pg: Any, rank: int, world: int) -> Any:
    t = torch.ones(1).expand(4) if rank == 0 else torch.ones(4)  # the root's
    dist.reduce(t, 0, group=pg)
    return t.tolist()


def _sparse_shape(pg: Any, rank: int, world: int) -> Any:
    n = 4 if rank == 0 else 5  # the dense shapes differ: gloo's sparse path would mix them
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (n,))
    dist.all_reduce(t, group=pg)
    return t.to_dense().tolist()


def _sparse_dtype(pg: Any, rank: int, world: int) -> Any:
    dt = torch.float32 if rank == 0 else torch.float64
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0], dtype=dt), (4,))
    dist.all_reduce(t, group=pg)
    return t.to_dense().tolist()


def _sparse_max(pg: Any, rank: int, world: int) -> Any:
    op = dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM  # gloo sums sparse tensors only
    t = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (4,))
    dist.all_reduce(t, op=op, group=pg)
    return t.to_dense().tolist()


def _inference(make: Callable[[], torch.Tensor], rank: int) -> torch.Tensor:
    """``make()`` on rank 0 under ``torch.inference_mode()`` (an inference tensor),
    elsewhere as it is."""
    if rank != 0:
        return make()
    with torch.inference_mode():
        return make()


def _ag_inference_out(pg: Any, rank: int, world: int) -> Any:
    out = _inference(lambda: torch.empty(4 * world), rank)  # cannot be written out here
    dist.all_gather_into_tensor(out, torch.ones(4), group=pg)
    return out.tolist()


def _rs_inference_out(pg: Any, rank: int, world: int) -> Any:
    out = _inference(lambda: torch.empty(4), rank)
    dist.reduce_scatter_tensor(out, torch.ones(4 * world), group=pg)
    return out.tolist()


def _all_reduce_inference(pg: Any, rank: int, world: int) -> Any:
    t = _inference(lambda: torch.ones(4), rank)
    dist.all_reduce(t, group=pg)
    return t.tolist()


def _broadcast_inference(pg: Any, rank: int, world: int, contiguous: bool) -> Any:
    """A receiver (rank 1) whose buffer is an inference tensor: contiguous (received
    into directly) or transposed (received into a copy, then copied back)."""
    shape = (4, 2) if contiguous else (2, 4)
    if rank == 1:
        with torch.inference_mode():
            t = torch.zeros(shape)
    else:
        t = torch.ones(shape)
    t = t if contiguous else t.t()
    dist.broadcast(t, 0, group=pg)
    return t.tolist()


def _rank0(bad: str, make: Callable[[], torch.Tensor], rank: int) -> torch.Tensor:
    """``make()``, turned into rank 0's unwritable output: ``bad`` is "expanded" (a
    stride-0 view of it) or "inference" (made under ``torch.inference_mode()``)."""
    if rank != 0:
        return make()
    if bad == "inference":
        with torch.inference_mode():
            return make()
    t = make()
    return t.reshape(-1)[:1].expand(t.numel()).view(t.shape)


def _outputs_attack(op: str, bad: str, pg: Any, rank: int, world: int) -> Any:
    """Rank 0 passes an output it cannot write (see :func:`_rank0`) to ``op``."""
    def out(n: int) -> torch.Tensor:
        return _rank0(bad, lambda: torch.zeros(n), rank)
    if op == "all_gather":
        outs = [out(2)] + [torch.zeros(2) for _ in range(world - 1)]
        dist.all_gather(outs, torch.ones(2), group=pg)
        return [o.tolist() for o in outs]
    if op == "all_gather_into_tensor":
        o = out(2 * world)
        dist.all_gather_into_tensor(o, torch.ones(2), group=pg)
    elif op == "reduce_scatter":
        o = out(2)
        dist.reduce_scatter(o, [torch.ones(2) for _ in range(world)], group=pg)
    elif op == "reduce_scatter_tensor":
        o = out(2)
        dist.reduce_scatter_tensor(o, torch.ones(2 * world), group=pg)
    elif op == "all_reduce_coalesced":
        o = out(3)
        dist.all_reduce_coalesced([torch.ones(2), o], group=pg)
    elif op == "gather":
        o = torch.ones(2)
        dist.gather(o, [out(2) for _ in range(world)] if rank == 0 else None, dst=0, group=pg)
    elif op == "scatter":
        o = out(2)
        dist.scatter(o, [torch.ones(2) for _ in range(world)] if rank == 1 else None, src=1,
                     group=pg)
    elif op == "all_to_all_single":
        o = out(world)
        dist.all_to_all_single(o, torch.ones(world), group=pg)
    elif op == "all_to_all":
        outs = [out(2)] + [torch.zeros(2) for _ in range(world - 1)]
        dist.all_to_all(outs, [torch.ones(2) for _ in range(world)], group=pg)
        return [x.tolist() for x in outs]
    else:
        raise AssertionError(op)
    return o.tolist()


_OUTPUT_OPS = ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_reduce_coalesced", "gather", "scatter", "all_to_all_single", "all_to_all")


def _meta_input(pg: Any, rank: int, world: int) -> Any:
    """Rank 0's input list holds a meta tensor (no data)."""
    ins = [torch.ones(2) for _ in range(world)]
    if rank == 0:
        ins[-1] = torch.empty(2, device="meta")
    out = torch.zeros(2)
    dist.reduce_scatter(out, ins, group=pg)
    return out.tolist()


#: calls that must raise on every rank
MISMATCHES: dict[str, Callable[[Any, int, int], Any]] = {
    "all_reduce_coalesced-split": _coalesced_split,
    "all_reduce_coalesced-shape": _coalesced_shape,
    "reduce_scatter_tensor_coalesced-split": _rs_tensor_coalesced_split,
    "all_gather_into_tensor_coalesced-split": _ag_tensor_coalesced_split,
    "all_gather_coalesced-split": _ag_coalesced_list_split,
    "scatter-dtype": _scatter_dtype,
    "scatter-numel": _scatter_numel,
    "scatter-root-rejects": _scatter_root_rejects,
    "scatter-receiver-rejects": _scatter_receiver_rejects,
    "all_gather-uneven-disagree": _ag_list_uneven_disagree,
    "reduce_scatter-uneven-disagree": _rs_list_uneven_disagree,
    "all_to_all-splits-disagree": _a2a_list_disagree,
    "all_to_all_single-splits-disagree": _a2a_single_disagree,
    "all_to_all_single-row-shape": _a2a_single_rows,
    "all_to_all_single-dtype": _a2a_single_dtype,
    "all_gather_into_tensor-dtype": _ag_into_tensor_dtype,
    "all_reduce-expanded": _all_reduce_expanded,
    "broadcast-expanded": _broadcast_expanded,
    "reduce-expanded": _reduce_expanded,
    "all_reduce-sparse-shape": _sparse_shape,
    "all_reduce-sparse-dtype": _sparse_dtype,
    "all_reduce-sparse-max": _sparse_max,
    "all_gather_into_tensor-inference-out": _ag_inference_out,
    "reduce_scatter_tensor-inference-out": _rs_inference_out,
    "all_reduce-inference-in-place": _all_reduce_inference,
    "broadcast-inference-receiver": functools.partial(_broadcast_inference, contiguous=True),
    "broadcast-inference-receiver-transposed": functools.partial(_broadcast_inference,
                                                                 contiguous=False),
    "reduce_scatter-meta-input": _meta_input,
    **{f"{op}-{bad}-out": functools.partial(_outputs_attack, op, bad)
       for op in _OUTPUT_OPS for bad in ("expanded", "inference")},
}
#: (attack, rank) whose own arguments are wrong: ValueError there, PeerRejectedError elsewhere
_OWN_FAULT = {("scatter-root-rejects", 0), ("scatter-receiver-rejects", 1),
              ("all_reduce-expanded", 0), ("broadcast-expanded", 1), ("reduce-expanded", 0),
              ("all_reduce-sparse-max", 0), ("all_gather_into_tensor-inference-out", 0),
              ("reduce_scatter_tensor-inference-out", 0), ("all_reduce-inference-in-place", 0),
              ("broadcast-inference-receiver", 1),
              ("broadcast-inference-receiver-transposed", 1), ("reduce_scatter-meta-input", 0),
              *((f"{op}-{bad}-out", 0) for op in _OUTPUT_OPS
                for bad in ("expanded", "inference"))}


def _exact(rank: int, world: int) -> dict[str, tuple[Any, Any]]:
    """Calls torch allows on aliased, offset and non-contiguous tensors: (got, want)."""
    pg = cases.group()
    n = 4
    res: dict[str, tuple[Any, Any]] = {}

    out = torch.zeros(n * world)  # the input is this rank's slice of the output
    x = out[n * rank:n * (rank + 1)]
    x.fill_(rank + 1)
    dist.all_gather_into_tensor(out, x, group=pg)
    res["all_gather_into_tensor-aliased"] = (
        out.tolist(), [float(r + 1) for r in range(world) for _ in range(n)])

    x = torch.arange(n * world, dtype=torch.float32) + rank  # the output is a slice of it
    got = x[n * rank:n * (rank + 1)]
    want = (torch.arange(n * world, dtype=torch.float32) * world + sum(range(world)))
    dist.reduce_scatter_tensor(got, x, group=pg)
    res["reduce_scatter_tensor-aliased"] = (got.tolist(), want[n * rank:n * (rank + 1)].tolist())

    base = torch.arange(10, dtype=torch.float32)
    dist.all_reduce(base[3:7], group=pg)  # a view with a storage offset
    res["all_reduce-offset-view"] = (
        base.tolist(), [0.0, 1.0, 2.0] + [v * world for v in (3.0, 4.0, 5.0, 6.0)] + [7.0, 8, 9])

    x = (torch.arange(2 * world, dtype=torch.float32) + 10 * rank).reshape(2, world).t()
    out = torch.zeros(2, world).t()  # both (world, 2), column-major
    dist.all_to_all_single(out, x, group=pg)
    res["all_to_all_single-noncontig"] = (
        out.tolist(), [[10.0 * r + rank, 10.0 * r + rank + world] for r in range(world)])

    x = torch.arange(world, dtype=torch.float32) + 10 * rank
    dist.all_to_all_single(x, x, group=pg)  # in place: the output is the input
    res["all_to_all_single-in-place"] = (x.tolist(), [10.0 * r + rank for r in range(world)])

    x = torch.full((2,), float(rank))
    outs = [torch.empty(2) for _ in range(world)]
    outs[rank] = x  # the input is one of the outputs
    dist.all_gather(outs, x, group=pg)
    res["all_gather-input-in-outputs"] = (
        [o.tolist() for o in outs], [[float(r)] * 2 for r in range(world)])

    x = torch.arange(3 * world, dtype=torch.float32).reshape(world, 3)
    out = x[rank]  # reduce_scatter into a row of its own input list
    dist.reduce_scatter(out, list(x.unbind(0)), group=pg)
    res["reduce_scatter-output-in-inputs"] = (
        out.tolist(), [float(world * (3 * rank + j)) for j in range(3)])

    src = torch.full((1,), 7.0).expand(3)  # a root reads an expanded tensor
    got = src if rank == 0 else torch.empty(3)
    dist.broadcast(got, 0, group=pg)
    res["broadcast-expanded-root"] = (got.tolist(), [7.0] * 3)

    ts = [torch.full((2, 3), 1.0).t(), torch.full((5,), 2.0)[::2]]  # non-contiguous pieces
    dist.all_reduce_coalesced(ts, group=pg)
    res["all_reduce_coalesced-noncontig"] = (
        [t.tolist() for t in ts], [[[float(world)] * 2] * 3, [2.0 * world] * 3])

    out = torch.empty(3, 2).t()  # scatter into a non-contiguous output
    src = ([torch.full((2, 3), float(r)) for r in range(world)] if rank == 0 else None)
    dist.scatter(out, src, src=0, group=pg)
    res["scatter-noncontig"] = (out.tolist(), [[float(rank)] * 3] * 2)

    # one call, ranks on different paths (plain tensors, a stacked or non-contiguous
    # output, an aliased input); repeated so the communicator's plans are in use
    for i in range(3):
        x = torch.full((2, 3), float(rank + i))
        if rank == 0:
            out = torch.empty(2 * world, 3)
        elif rank == 1:
            out = torch.empty(world, 2, 3)  # stacked: torch allows any shape of the count
        else:
            out = torch.empty(3, 2 * world).t()  # not contiguous
        dist.all_gather_into_tensor(out, x, group=pg)
        res[f"all_gather_into_tensor-mixed-outputs-{i}"] = (
            out.reshape(-1).tolist(), [float(r + i) for r in range(world) for _ in range(6)])
        x = torch.arange(4 * world, dtype=torch.float32) + i
        got = torch.empty(4) if rank != 1 else torch.empty(8)[::2]  # rank 1: not contiguous
        dist.reduce_scatter_tensor(got, x, group=pg)
        res[f"reduce_scatter_tensor-mixed-outputs-{i}"] = (
            got.tolist(), [world * (4.0 * rank + j + i) for j in range(4)])

    with torch.inference_mode():  # inference tensors are written inside inference mode
        out = torch.empty(2 * world)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), group=pg)
        t = torch.ones(3)
        dist.all_reduce(t, group=pg)
    res["inference-mode"] = ([out.tolist(), t.tolist()],
                             [[float(r) for r in range(world) for _ in range(2)],
                              [float(world)] * 3])

    # a sparse COO tensor (gloo sums those): rank r adds r + 1 at index r % 4 and 1 at 3
    t = torch.sparse_coo_tensor(torch.tensor([[rank % 4, 3]]), torch.tensor([rank + 1.0, 1.0]),
                                (4,))
    dist.all_reduce(t, group=pg)
    want = [0.0] * 4
    for r in range(world):
        want[r % 4] += r + 1.0
    want[3] += world
    res["all_reduce-sparse"] = (t.to_dense().tolist(), want)
    return res


def _attack(rank: int, world: int) -> dict[str, Any]:
    """Every mismatch: ``{name: (raised type or None, all_reduce after it right)}``."""
    pg = cases.group(timeout=10.0)
    out: dict[str, Any] = {}
    for name, call in MISMATCHES.items():
        kind: str | None
        try:
            kind, raised = None, f"returned {call(pg, rank, world)}"
        except Exception as e:
            kind, raised = type(e).__name__, str(e)[:200]
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, group=pg)
        out[name] = (kind, raised, t.tolist() == [float(sum(range(world)))] * 3)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_disagreeing_layouts_raise_on_every_rank(pools: Callable[[int], Any],
                                                 world: int) -> None:
    results = pools(world).run(_attack, timeout=90)
    bad = []
    for rank, res in enumerate(results):
        for name, (kind, text, usable) in res.items():
            want = ({"ValueError"} if (name, rank) in _OWN_FAULT
                    else {"CollectiveMismatch", "PeerRejectedError"})
            if kind not in want:
                bad.append(f"rank {rank} {name}: {kind}: {text}")
            if not usable:
                bad.append(f"rank {rank} {name}: the group gave a wrong all_reduce afterwards")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("world", WORLDS)
def test_aliased_offset_noncontiguous_are_exact(pools: Callable[[int], Any],
                                                world: int) -> None:
    results = pools(world).run(_exact, timeout=90)
    for rank, res in enumerate(results):
        for name, (got, want) in res.items():
            assert got == want, f"rank {rank} {name}: got {got}, want {want}"


def _recv_targets(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 receives rank 0's sends into targets torch allows but gloo cannot fill
    directly: refused before gloo takes the message (an expanded view, an
    inference tensor), or received through a copy (a negative view, whose raw
    elements are not its values)."""
    pg = cases.group(timeout=10.0)
    out: dict[str, Any] = {}
    if rank == 0:
        for tag in (1, 2):
            dist.send(torch.full((4,), float(tag)), 1, group=pg, tag=tag)
        dist.send(torch.tensor([5.0]), 1, group=pg, tag=3)
    elif rank == 1:
        with torch.inference_mode():
            inference = torch.zeros(4)
        for key, bad in (("expanded", torch.zeros(1).expand(4)), ("inference", inference)):
            try:
                dist.recv(bad, 0, group=pg, tag=1)
                out[key] = "returned"
            except ValueError as e:
                out[key] = "ValueError: " + str(e)
        for tag in (1, 2):  # the refused receives took no message
            got = torch.zeros(4)
            dist.recv(got, 0, group=pg, tag=tag)
            out[f"tag{tag}"] = got.tolist()
        neg = torch.tensor([1 + 2j]).conj().imag  # contiguous, is_neg()
        dist.recv(neg, 0, group=pg, tag=3)
        out["neg"] = neg.tolist()
    dist.barrier(group=pg)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_receive_targets_are_checked_or_received_through_a_copy(
        pools: Callable[[int], Any], world: int) -> None:
    got = pools(world).run(_recv_targets, timeout=90)[1]
    for key in ("expanded", "inference"):
        assert got[key].startswith("ValueError: tensors[0]"), (key, got[key])
    assert got["tag1"] == [1.0] * 4 and got["tag2"] == [2.0] * 4, got
    assert got["neg"] == [5.0], got
