"""The ``dispatch_combine`` op of ``groupcoord bench collectives``: one MoE layer's traffic.

One mixture-of-experts layer moves each rank's tokens to the experts and their
outputs back. Three ways of doing that are timed against each other, in the
same run and interleaved in blocks like every other op of the benchmark
(:mod:`device_comms.bench.collectives`)::

    shm   the all-gather path on our communicator (what GroupCoordinator.dispatch /
          combine run; vLLM's all-gather / reduce-scatter MoE path):
            (hidden, logits), sizes = comm.all_gatherv_rows([hidden, router_logits])
            out = comm.reduce_scatterv(partial, 0, sizes)
          the row counts are exchanged inside (sizes=None); ``partial`` is this
          rank's output of its experts for every gathered token.
    a2a   the token all-to-all path on the same communicator (what
          coordinator.moe.dispatch / combine move):
            table = comm.all_gather(expert_counts, 0)    every rank's rows per expert
            got = comm.all_to_allv(rows, send, recv)     each (token, slot) row to the
                                                         rank of its expert
            back = comm.all_to_allv(got, recv, send)     the expert outputs back
    gloo  raw torch.distributed gloo doing the all-gather path by hand (gloo has no
          uneven collectives): all_gather_into_tensor of the counts, the rows
          copied into buffers padded to the largest count, one padded
          all_gather_into_tensor for hidden and one for the logits, then
          reduce_scatter_tensor of the partial laid out padded.

**Size axis.** A size is the bytes of the gathered hidden states, all ranks'
tokens together: ``tokens = size // (hidden * element size)`` (at least 1),
``hidden`` from ``--hidden`` (default 4096 elements). With ``--hidden 4096``,
8 KiB is one bfloat16 token and 2 MiB 256 of them (float32: half as many).
Router logits are ``(tokens, --experts)`` in the same dtype.

**Skew.** :func:`token_counts` splits the tokens unevenly: rank ``r`` in
proportion to ``1 / (r + 1) ** 2``, and the last rank gets none when the world
has more than two ranks (an idle data-parallel rank). Routing
(:func:`routing`) is each token's top ``--topk`` experts by its logits plus a
bias falling linearly from 0 (expert 0) to -1 (the last expert), so low
experts, and the ranks holding them, are popular; experts are sharded
contiguously over the ranks (``experts / world size`` each) as in
``coordinator.moe``. Everything is seeded by the rank, the world size and the
token count, so every rank knows every rank's inputs.

**Not timed:** the local work around the traffic that no variant shares
(running the experts, the a2a path's sort of the rows by expert and its
weighted sum). Partial outputs are computed once before timing. The gloo
variant is given every advantage a careful user could take: its buffers are
preallocated at this point's padded size, its partial is already laid out
padded (the experts ran on the pad rows too), and its gathered rows stay
padded (no copy to unpad them); per call it copies this rank's rows into the
padded inputs. Ours returns new, unpadded tensors.

**Checks** (once per point, before timing): each variant's result is compared
with the rows every rank can compute from the seeds: gathered hidden states and
logits exactly (shm, gloo), the rows an a2a rank receives exactly and the rows
it gets back equal to those it sent, the reduce-scatter results (shm, gloo)
within the tolerance the other reductions use. ``partial`` of rank ``r`` is
the gathered hidden states times ``r + 1``, so each rank's combined rows are
its own hidden states times ``1 + 2 + ... + world size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Shape", "Route", "token_counts", "routing", "point_calls"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A point's layer shape: hidden width, experts and slots per token.

    Attributes:
        hidden: Elements of a token's hidden state.
        experts: Experts in all (router logits per token); a multiple of the world size.
        topk: Experts each token is routed to (a2a rows per token).
    """

    hidden: int
    experts: int
    topk: int


@dataclasses.dataclass(frozen=True)
class Route:
    """One rank's tokens routed to the experts (what ``coordinator.moe.dispatch`` computes).

    Attributes:
        order: The (token, slot) assignments (``token * topk + slot``) sorted by
            expert, hence by destination rank.
        send: Rows sent to each rank.
        expert_counts: Rows for each expert (int64, ``experts`` of them).
    """

    order: Any
    send: list[int]
    expert_counts: Any


def token_counts(tokens: int, ws: int) -> list[int]:
    """Tokens of each rank, ``tokens`` in all: skewed (see the module docstring).

    Deterministic in ``(tokens, ws)``; the counts sum to ``tokens``.
    """
    weights = [1.0 / (r + 1) ** 2 for r in range(ws)]
    if ws > 2:
        weights[-1] = 0.0  # an idle rank
    total = sum(weights)
    exact = [tokens * w / total for w in weights]
    out = [int(e) for e in exact]
    for r in sorted(range(ws), key=lambda r: exact[r] - out[r], reverse=True)[
            : tokens - sum(out)]:
        out[r] += 1  # largest remainders
    return out


def _rank_inputs(rank: int, n: int, ws: int, tokens: int, shape: Shape,
                 dtype: Any) -> tuple[Any, Any]:
    """``(hidden (n, H), router logits (n, E))`` of ``rank``, seeded."""
    import torch

    gen = torch.Generator().manual_seed(1234 + 7919 * rank + 31 * ws + tokens)
    if dtype.is_floating_point:
        hidden = torch.randn(n, shape.hidden, generator=gen).to(dtype)
        logits = torch.randn(n, shape.experts, generator=gen).to(dtype)
    else:
        hidden = torch.randint(-100, 100, (n, shape.hidden), generator=gen, dtype=dtype)
        logits = torch.randint(-100, 100, (n, shape.experts), generator=gen, dtype=dtype)
    return hidden, logits


def routing(logits: Any, shape: Shape, ws: int) -> Route:
    """One rank's tokens routed by their router ``logits`` (see the module docstring)."""
    import torch

    e = shape.experts
    bias = -torch.arange(e, dtype=torch.float32) / e  # low experts are popular
    ids = torch.topk(logits.float() + bias, shape.topk, dim=1).indices.reshape(-1)
    expert_counts = torch.bincount(ids, minlength=e)
    send = expert_counts.view(ws, e // ws).sum(1).tolist()
    return Route(torch.argsort(ids, stable=True), [int(c) for c in send], expert_counts)


def point_calls(
    comm: Any, dtype: Any, nbytes: int, rank: int, ws: int, shape: Shape,
) -> tuple[dict[str, Callable[[], Any]], dict[str, bool], dict[str, Any]]:
    """``(calls, checks, record extras)`` of one point.

    ``calls`` and ``checks`` are keyed by variant (``shm``, ``a2a``, ``gloo``):
    the call to time and whether its result checked out on this rank. The
    extras: ``tokens``, ``token_counts``, ``hidden``, ``experts``, ``topk`` and
    ``hot_share`` (the fraction of all a2a rows that goes to the busiest receiver).
    """
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    tokens = max(1, nbytes // (shape.hidden * item))
    counts = token_counts(tokens, ws)
    inputs = [_rank_inputs(r, counts[r], ws, tokens, shape, dtype) for r in range(ws)]
    partial = torch.cat([h for h, _ in inputs]) * (rank + 1)
    want_out = inputs[rank][0].double() * (ws * (ws + 1) // 2)

    calls: dict[str, Callable[[], Any]] = {}
    checks: dict[str, bool] = {}
    calls["shm"], checks["shm"] = _shm(comm, inputs, partial, want_out, rank, ws)
    calls["a2a"], checks["a2a"], hot = _a2a(comm, inputs, rank, ws, shape)
    calls["gloo"], checks["gloo"] = _gloo(inputs, partial, want_out, rank, ws)
    extra = {
        "tokens": tokens, "token_counts": counts, "hidden": shape.hidden,
        "experts": shape.experts, "topk": shape.topk, "hot_share": hot,
    }
    return calls, checks, extra


def _shm(comm: Any, inputs: list[tuple[Any, Any]], partial: Any, want_out: Any, rank: int,
         ws: int) -> tuple[Callable[[], Any], bool]:
    """The all-gather path on our communicator: ``(call, check)``."""
    import torch

    hidden, logits = inputs[rank]

    def shm() -> Any:
        gathered, sizes = comm.all_gatherv_rows([hidden, logits])
        return gathered, sizes, comm.reduce_scatterv(partial, 0, sizes)

    (got_h, got_l), sizes, got_out = shm()
    ok = (sizes == [h.shape[0] for h, _ in inputs]
          and torch.equal(got_h, torch.cat([h for h, _ in inputs]))
          and torch.equal(got_l, torch.cat([lg for _, lg in inputs]))
          and _close(got_out, want_out, ws))
    return shm, bool(ok)


def _a2a(comm: Any, inputs: list[tuple[Any, Any]], rank: int, ws: int,
         shape: Shape) -> tuple[Callable[[], Any], bool, float]:
    """The token all-to-all path: ``(call, check, hot share)``."""
    import torch

    k, local = shape.topk, shape.experts // ws
    routes = [routing(lg, shape, ws) for _, lg in inputs]
    sent = [h.index_select(0, route.order // k)
            for (h, _), route in zip(inputs, routes, strict=True)]
    rows, send, expert_counts = sent[rank], routes[rank].send, routes[rank].expert_counts
    lo, hi = rank * local, (rank + 1) * local

    def a2a() -> Any:
        table = comm.all_gather(expert_counts, 0).view(ws, shape.experts)
        recv = table[:, lo:hi].sum(1).tolist()
        got = comm.all_to_allv(rows, send, recv)
        return recv, got, comm.all_to_allv(got, recv, send)

    recv, got, back = a2a()
    want = torch.cat([
        sent[r][sum(routes[r].send[:rank]):sum(routes[r].send[: rank + 1])] for r in range(ws)])
    ok = (recv == [routes[r].send[rank] for r in range(ws)] and torch.equal(got, want)
          and torch.equal(back, rows))
    total = sum(sum(route.send) for route in routes)
    hot = max(sum(route.send[j] for route in routes) for j in range(ws)) / max(1, total)
    return a2a, bool(ok), round(hot, 3)


def _gloo(inputs: list[tuple[Any, Any]], partial: Any, want_out: Any, rank: int,
          ws: int) -> tuple[Callable[[], Any], bool]:
    """Raw gloo doing the all-gather path with padded calls: ``(call, check)``."""
    import torch
    import torch.distributed as dist

    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    hidden, logits = inputs[rank]
    counts = [h.shape[0] for h, _ in inputs]
    n, m = hidden.shape[0], max(counts)
    starts = [sum(counts[:r]) for r in range(ws)]
    mine = torch.tensor([n], dtype=torch.int64)
    all_counts = torch.empty(ws, dtype=torch.int64)
    h_pad, l_pad = hidden.new_zeros((m, hidden.shape[1])), logits.new_zeros((m, logits.shape[1]))
    h_all = hidden.new_empty((ws * m, hidden.shape[1]))
    l_all = logits.new_empty((ws * m, logits.shape[1]))
    partial_pad = partial.new_zeros((ws * m, partial.shape[1]))
    for r in range(ws):
        partial_pad[r * m:r * m + counts[r]] = partial[starts[r]:starts[r] + counts[r]]
    out = partial.new_empty((m, partial.shape[1]))

    def gloo() -> Any:
        ag(all_counts, mine)
        pad = max(all_counts.tolist())
        h_pad[:n].copy_(hidden)
        l_pad[:n].copy_(logits)
        ag(h_all[: ws * pad], h_pad[:pad])
        ag(l_all[: ws * pad], l_pad[:pad])
        rs(out[:pad], partial_pad[: ws * pad])
        return out[:n]

    got_out = gloo().clone()

    def unpad(t: Any) -> Any:
        return torch.cat([t[r * m:r * m + counts[r]] for r in range(ws)])

    ok = (all_counts.tolist() == counts
          and torch.equal(unpad(h_all), torch.cat([h for h, _ in inputs]))
          and torch.equal(unpad(l_all), torch.cat([lg for _, lg in inputs]))
          and _close(got_out, want_out, ws))
    return gloo, bool(ok)


def _close(got: Any, want: Any, ws: int) -> bool:
    """``got`` equals ``want`` (exactly for integers; within the tolerance of the
    benchmark's other reductions for floating point)."""
    import torch

    if not got.dtype.is_floating_point:
        return bool(torch.equal(got.long(), want.long()))
    return bool(torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2 * ws))
