"""MoE dispatch/combine over the EP group against a single-process dense reference.

Every rank routes its own tokens; the reference, on the same rank, loops over
all experts densely (every expert applied to the rows routed to it, then the
weighted sum over the top-k slots in slot order). With experts that compute
each row on its own (element-wise), the distributed result must be bitwise
equal: the rows go through exactly the same arithmetic. With linear experts
(a matmul), the expert sees a batch of rows from every rank instead of this
rank's alone, and a matmul's blocking (hence its float rounding) depends on
the batch, so those cases compare within 1e-5 relative.

EP 2 and 4: ``tp2`` (EP = TP), ``dp2`` (EP = DP), ``tp2-dp2`` (EP 4 over TP x
DP, on shared memory, plain gloo and two simulated hosts) and ``pp2-dp2`` (two
EP groups of 2, one per pipeline stage).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.env_vars import environ

# (id, (tp, pp, dp), transport)
RUNS = [
    ("ep2-tp2-shm", (2, 1, 1), "shm"),
    ("ep2-dp2-gloo", (1, 1, 2), "gloo"),
    ("ep4-tp2-dp2-shm", (2, 1, 2), "shm"),
    ("ep4-tp2-dp2-gloo", (2, 1, 2), "gloo"),
    ("ep4-tp2-dp2-hier", (2, 1, 2), "hier"),
    ("ep2x2-pp2-dp2-shm", (1, 2, 2), "shm"),
]


def _cases(p: int) -> list[dict[str, Any]]:
    """Cases for an EP group of ``p`` ranks (the same on every rank)."""
    return [
        dict(experts=2 * p, k=2, tokens=[7, 0, 5, 3], row=(16,), dtype=torch.float32,
             route="random"),
        dict(experts=2 * p, k=1, tokens=[4, 6, 1, 2], row=(8,), dtype=torch.float32, route="hot"),
        dict(experts=8 * p, k=3, tokens=[2, 3, 0, 1], row=(8,), dtype=torch.bfloat16,
             route="random"),
        dict(experts=p, k=4, tokens=[5, 5, 5, 5], row=(2, 4), dtype=torch.float32, route="random"),
        dict(experts=4 * p, k=2, tokens=[6, 2, 9, 0], row=(12,), dtype=torch.float32,
             route="repeat", stacked=True),
        dict(experts=2 * p, k=0, tokens=[3, 1, 0, 2], row=(4,), dtype=torch.float32,
             route="random"),
        dict(experts=4 * p, k=2, tokens=[9, 4, 7, 3], row=(16,), dtype=torch.float32,
             route="random", linear=True),
    ]


# ---------------------------------------------------------------------- experts and reference
def _expert(e: int, x: torch.Tensor, linear: bool) -> torch.Tensor:
    if linear:
        g = torch.Generator().manual_seed(500 + e)
        w = torch.randn(x.shape[-1], x.shape[-1], generator=g).to(x.dtype)
        return x @ w
    return (torch.tanh(x.float() * (0.5 + 0.1 * e)) + e).to(x.dtype)


def _routing(case: dict[str, Any], seed: int,
             n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E, k = case["experts"], case["k"]
    hidden = torch.randn((n,) + case["row"], generator=g).to(case["dtype"])
    if case["route"] == "hot":  # every token to expert 0: only EP rank 0 receives anything
        ids = torch.zeros(n, k, dtype=torch.int64)
    elif case["route"] == "repeat" or k > E:  # the same expert twice for some tokens
        ids = torch.randint(0, E, (n, k), generator=g)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)]) if n else \
            torch.empty(0, k, dtype=torch.int64)
    weights = torch.rand(n, k, generator=g)
    return hidden, ids.to(torch.int32 if seed % 2 else torch.int64), weights


def reference(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: int,
              linear: bool) -> torch.Tensor:
    """Dense loop over experts, then the weighted sum over slots in slot order."""
    n, k = ids.shape
    per_slot: list[list[torch.Tensor | None]] = [[None] * k for _ in range(n)]
    for e in range(experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if not len(tok):
            continue
        y = _expert(e, hidden[tok], linear)
        for i, (t, s) in enumerate(zip(tok.tolist(), slot.tolist(), strict=False)):
            per_slot[t][s] = y[i]
    out = torch.zeros(hidden.shape, dtype=hidden.dtype)
    for t in range(n):
        acc = None
        for s in range(k):
            v = per_slot[t][s] * weights[t, s].to(hidden.dtype)  # type: ignore[operator]
            acc = v if acc is None else acc + v
        if acc is not None:
            out[t] = acc
    return out


# ---------------------------------------------------------------------- on the ranks
def _transport_env(transport: str, rank: int, world_size: int) -> dict[str, str | None]:
    """The variables that pick ``transport`` (hier: ranks [0, n/2) on one host, the
    rest on another)."""
    return {"GROUPCOORD_CPU_SHM": "0" if transport == "gloo" else "1",
            "GROUPCOORD_NODE_ID": (f"host{rank * 2 // world_size}" if transport == "hier"
                                   else None)}


def run_moe(rank: int, world_size: int, layout: tuple[int, int, int], transport: str) -> dict:
    from coordinator import parallel_state as ps

    with environ(**_transport_env(transport, rank, world_size)):
        ps.initialize_model_parallel(*layout, enable_expert_parallel=True)
        ep = ps.get_ep_group()
        out = {"mode": getattr(ep.comm, "mode", None), "cases": _run_cases(ep),
               "errors": _errors(ep)}
        ps.destroy_model_parallel()
        return out


def _run_cases(ep: Any) -> list[dict[str, Any]]:
    from coordinator import moe

    me, p = ep.rank_in_group, ep.world_size
    results = []
    for i, case in enumerate(_cases(p)):
        n = case["tokens"][me % len(case["tokens"])]
        hidden, ids, weights = _routing(case, 1000 * i + ep.rank, n)
        inputs, routing = moe.dispatch(hidden, ids, weights, ep, case["experts"])
        outs = [_expert(e, x, case.get("linear", False))
                for e, x in zip(routing.local_experts, inputs, strict=False)]
        got = moe.combine(torch.cat(outs) if case.get("stacked") else outs, routing)
        want = reference(hidden, ids, weights, case["experts"], case.get("linear", False))
        results.append({
            "exact": bool(torch.equal(got, want)) and got.dtype == want.dtype,
            "close": bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5)),
            "shape_ok": got.shape == want.shape,
            "received": [int(x.shape[0]) for x in inputs],
            "local_experts": list(routing.local_experts),
            "linear": case.get("linear", False),
        })
    return results


def _attempt(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e))


def _errors(ep: Any) -> dict[str, Any]:
    from coordinator import moe

    me, p = ep.rank_in_group, ep.world_size
    hidden, ids, w = torch.ones(3, 4), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    out = {
        "not_divisible": _attempt(lambda: moe.dispatch(hidden, ids, w, ep, p + 1)),
        "bad_id": _attempt(lambda: moe.dispatch(hidden, ids + (5 * p if me == p - 1 else 0), w,
                                                ep, 2 * p)),
        "float_ids": _attempt(lambda: moe.dispatch(hidden, ids.float() if me == 0 else ids, w,
                                                   ep, 2 * p)),
        "experts_differ": _attempt(lambda: moe.dispatch(hidden, ids, w, ep,
                                                        2 * p if me == 0 else 4 * p)),
    }
    inputs, routing = moe.dispatch(hidden, ids, w, ep, 2 * p)
    outs = [x * 2 for x in inputs]
    if me == 0:
        outs[0] = torch.ones(outs[0].shape[0] + 1, 4)
    out["bad_out"] = _attempt(lambda: moe.combine(outs, routing))
    inputs, routing = moe.dispatch(hidden, ids, w, ep, 2 * p)
    out["after"] = moe.combine([x * 2 for x in inputs], routing).tolist()
    return out


# ---------------------------------------------------------------------- in the parent
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout,transport", [(r[1], r[2]) for r in RUNS], ids=[r[0] for r in RUNS])
def test_dispatch_combine_against_dense_reference(dist_pool: Any, layout: tuple[int, int, int],
                                                  transport: str) -> None:
    tp, pp, dp = layout
    world = tp * pp * dp
    results = dist_pool(world).run(run_moe, layout, transport, timeout=160)
    p = tp * dp
    want_mode = {"shm": "shm", "gloo": "gloo", "hier": "hierarchical"}[transport]
    for rank, res in enumerate(results):
        assert res["mode"] == want_mode, (rank, res["mode"])
        for i, c in enumerate(res["cases"]):
            assert c["shape_ok"], (rank, i)
            assert c["close"] if c["linear"] else c["exact"], (rank, i, c)
    ep_rank = [(r // (tp * pp)) * tp + r % tp for r in range(world)]
    for rank, res in enumerate(results):
        hot = res["cases"][1]  # every token to expert 0: only EP rank 0 receives rows
        if ep_rank[rank]:
            assert hot["received"] == [0, 0], (rank, hot)
        assert res["cases"][0]["local_experts"] == [2 * ep_rank[rank], 2 * ep_rank[rank] + 1]
    _check_errors([r["errors"] for r in results], [ep_rank[r] for r in range(world)], p)


def _check_errors(errors: list[dict[str, Any]], ep_ranks: list[int], p: int) -> None:
    for e, me in zip(errors, ep_ranks, strict=False):
        name, msg = e["not_divisible"]  # every rank's own check fails: each raises its own
        assert name == "ValueError" and "multiple of the EP group's size" in msg, msg
        for key, culprit, own, words in (("bad_id", p - 1, "ValueError", "topk_ids must be in"),
                                         ("float_ids", 0, "TypeError", "topk_ids must hold"),
                                         ("bad_out", 0, "ValueError", "expert_out[0] must have")):
            name, msg = e[key]
            if me == culprit:
                assert name == own and words in msg, (key, name, msg)
            else:
                assert name == "PeerRejectedError" and words in msg, (key, name, msg)
        assert e["experts_differ"][0] == "CollectiveMismatch", e["experts_differ"]
        assert e["after"] == [[4.0] * 4] * 3  # both slots to expert 0 (x * 2), weights 1
