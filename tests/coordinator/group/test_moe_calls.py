"""The seed's MoE calls on GroupCoordinator: dispatch / dispatch_router_logits / combine.

Every rank builds its inputs from its rank and the case (a seeded generator),
so each rank can also build every peer's inputs and hence the exact expected
result: the gathered rows are the peers' rows concatenated in rank order,
and a combine's result is the sum over the token peers of their partial rows
for this rank (each peer's partial = its gathered rows times a per-rank
factor, exact in float64).

Layouts: the EP group of ``parallel_state`` at EP = DP = 2, 3 and 4 (every
rank holds other tokens), and EP 4 over TP = 2 x DP = 2 with both
``is_sequence_parallel`` values (False gathers over the DP peers, True over
the whole EP group); on shared memory and plain gloo, and over two simulated
hosts (the hierarchical communicator) at world 4. Then layouts whose token
peers are another group: two pipeline stages, PCP with and without DP and
TP (the PCP group, the EP group itself, a group made for them).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pytest
import torch

# (id, (tp, pp, dp, pcp), transport)
RUNS = [
    ("ep2-dp2-shm", (1, 1, 2, 1), "shm"),
    ("ep2-dp2-gloo", (1, 1, 2, 1), "gloo"),
    ("ep3-dp3-shm", (1, 1, 3, 1), "shm"),
    ("ep3-dp3-gloo", (1, 1, 3, 1), "gloo"),
    ("ep4-dp4-shm", (1, 1, 4, 1), "shm"),
    ("ep4-tp2-dp2-shm", (2, 1, 2, 1), "shm"),
    ("ep4-tp2-dp2-gloo", (2, 1, 2, 1), "gloo"),
    ("ep4-tp2-dp2-hier", (2, 1, 2, 1), "hier"),
    ("ep2x2-pp2-dp2-shm", (1, 2, 2, 1), "shm"),  # two EP groups, one per stage
    ("ep4-tp2-pcp2-shm", (2, 1, 1, 2), "shm"),  # token peers: the PCP group
    ("ep4-dp2-pcp2-shm", (1, 1, 2, 2), "shm"),  # token peers: the EP group itself
    ("ep8-tp2-dp2-pcp2-shm", (2, 1, 2, 2), "shm"),  # a group of their own (slow: 8 ranks)
]

#: Row counts by rank position (uneven, with zeros).
TOKENS = [[5, 0, 3, 7], [0, 0, 2, 1], [1, 4, 0, 0], [6, 6, 6, 6]]


# ---------------------------------------------------------------------- inputs
def _inputs(case: int, global_rank: int, n: int) -> dict[str, torch.Tensor]:
    """One rank's tensors for ``case`` (any rank can rebuild any other's)."""
    g = torch.Generator().manual_seed(7919 * case + global_rank)
    return {
        "hidden": torch.randn(n, 6, generator=g, dtype=torch.float64),
        "logits": torch.randn(n, 4, generator=g).to(torch.bfloat16),
        "weights": torch.rand(n, 2, generator=g),
        "ids": torch.randint(0, 8, (n, 2), generator=g, dtype=torch.int32),
        "scale": torch.rand(n, generator=g).to(torch.float16),
        "mask": torch.rand(n, 3, 2, generator=g) > 0.5,
        "lora": torch.randint(-5, 5, (n,), generator=g, dtype=torch.int64),
    }


def _rows(case: int, group: Any) -> list[int]:
    """Every member's row count in ``case`` (by group rank)."""
    return [TOKENS[case % len(TOKENS)][r % 4] for r in range(group.world_size)]


def _gathered(case: int, group: Any, key: str) -> torch.Tensor:
    """What a dispatch over ``group`` must return for ``key``."""
    rows = _rows(case, group)
    return torch.cat([_inputs(case, g, rows[i])[key] for i, g in enumerate(group.ranks)])


# ---------------------------------------------------------------------- on the ranks
def _set_transport(transport: str, rank: int, world_size: int) -> dict[str, str | None]:
    saved = {k: os.environ.get(k) for k in ("GROUPCOORD_CPU_SHM", "GROUPCOORD_NODE_ID")}
    os.environ["GROUPCOORD_CPU_SHM"] = "0" if transport == "gloo" else "1"
    os.environ.pop("GROUPCOORD_NODE_ID", None)
    if transport == "hier":
        os.environ["GROUPCOORD_NODE_ID"] = f"host{rank * 2 // world_size}"
    return saved


def _restore(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def run_moe_calls(rank: int, world_size: int, layout: tuple[int, int, int, int],
                  transport: str) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    saved = _set_transport(transport, rank, world_size)
    tp, pp, dp, pcp = layout
    try:
        ps.initialize_model_parallel(tp, pp, dp, enable_expert_parallel=True,
                                     prefill_context_model_parallel_size=pcp)
        ep = ps.get_ep_group()
        try:
            return {"mode": getattr(ep.comm, "mode", None),
                    "peers": ep.token_peers.ranks, "ep": ep.ranks,
                    "checks": _checks(ep), "faults": _faults(ep)}
        finally:
            ps.destroy_model_parallel()
    finally:
        _restore(saved)


def _checks(ep: Any) -> dict[str, bool]:
    """Named checks, each True when it held on this rank."""
    out: dict[str, bool] = {}
    for sp in (False, True):
        group = ep if sp else ep.token_peers
        for case in range(len(TOKENS)):
            x = _inputs(case, ep.rank, _rows(case, group)[group.rank_in_group])
            tag = f"sp={sp}/case{case}"
            h, lg = ep.dispatch(x["hidden"], x["logits"], sp)
            out[f"{tag}/seed"] = (torch.equal(h, _gathered(case, group, "hidden"))
                                  and torch.equal(lg, _gathered(case, group, "logits")))
            out[f"{tag}/combine"] = _combine_ok(ep, group, h, sp, case)
            res = ep.dispatch_router_logits(x["hidden"], x["logits"], is_sequence_parallel=sp,
                                            extra_tensors=[x["scale"], x["mask"], x["lora"]])
            out[f"{tag}/extras"] = len(res) == 3 and all(
                torch.equal(t, _gathered(case, group, k))
                for t, k in zip([res[0], res[1], *res[2]],
                                ["hidden", "logits", "scale", "mask", "lora"], strict=True))
            out[f"{tag}/combine-after-extras"] = _combine_ok(ep, group, res[0], sp, case)
            routed = ep.dispatch(x["hidden"], x["weights"], x["ids"], is_sequence_parallel=sp,
                                 sizes=_rows(case, group))
            out[f"{tag}/routed"] = len(routed) == 3 and all(
                torch.equal(t, _gathered(case, group, k))
                for t, k in zip(routed, ["hidden", "weights", "ids"], strict=True))
            out[f"{tag}/combine-sizes"] = _combine_ok(ep, group, routed[0], sp, case,
                                                      sizes=_rows(case, group))
            routed_x = ep.dispatch(x["hidden"], x["weights"], x["ids"], sp, [x["lora"]])
            out[f"{tag}/routed-extras"] = (len(routed_x) == 4 and torch.equal(
                routed_x[3][0], _gathered(case, group, "lora")))
            ep.combine(routed_x[0], sp)
    # two micro-batches in flight: combines pair with dispatches first in, first out
    a = _inputs(0, ep.rank, _rows(0, ep)[ep.rank_in_group])
    b = _inputs(1, ep.rank, _rows(1, ep)[ep.rank_in_group])
    ha, _ = ep.dispatch(a["hidden"], a["logits"], True)
    hb, _ = ep.dispatch(b["hidden"], b["logits"], True)
    out["fifo"] = _combine_ok(ep, ep, ha, True, 0) and _combine_ok(ep, ep, hb, True, 1)
    return out


def _combine_ok(ep: Any, group: Any, gathered: torch.Tensor, sp: bool, case: int,
                sizes: list[int] | None = None) -> bool:
    """combine(partial) where each peer's partial is its gathered rows times its factor."""
    rows = _rows(case, group)
    got = ep.combine(gathered * (group.rank_in_group + 1), sp, sizes=sizes)
    me = group.rank_in_group
    start = sum(rows[:me])
    mine = _gathered(case, group, "hidden")[start:start + rows[me]]
    want = sum((r + 1) * mine for r in range(group.world_size))
    return got.shape == mine.shape and torch.equal(got, want)


def _attempt(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # the parent checks the type and text
        return (type(e).__name__, str(e))


def _faults(ep: Any) -> dict[str, tuple[str, str]]:
    """Mistakes made on one rank (the group's last) or on all; then a good call."""
    me, last = ep.rank_in_group, ep.world_size - 1
    x = _inputs(9, ep.rank, 3)
    out: dict[str, tuple[str, str]] = {}
    # combine with no dispatch to match, on one rank (the others pass sizes)
    out["combine-unmatched"] = _attempt(lambda: ep.combine(
        torch.ones(3 * ep.world_size, 6, dtype=torch.float64), True,
        sizes=None if me == last else [3] * ep.world_size))
    # combine whose rows do not add up to its dispatch, on one rank, with a second
    # dispatch (other row counts) in flight: every rank keeps the first record, so
    # the corrected combine pairs with the first dispatch and the next with the second
    ya = _inputs(10, ep.rank, 1 + me)
    yb = _inputs(11, ep.rank, 2 * (me + 1))
    ha, _ = ep.dispatch(ya["hidden"], ya["logits"], True)
    hb, _ = ep.dispatch(yb["hidden"], yb["logits"], True)
    out["combine-rows"] = _attempt(lambda: ep.combine(ha[1:] if me == last else ha, True))
    for key, h, y in (("retry-first", ha, ya), ("retry-second", hb, yb)):
        try:
            got = ep.combine(h, True)
            want = sum(y["hidden"] for _ in range(ep.world_size))  # in rank order, as reduced
            out[key] = ("ok", "") if torch.equal(got, want) else ("wrong", f"{got.shape}")
        except Exception as e:  # the parent names it
            out[key] = (type(e).__name__, str(e))
    # router_logits with other rows than hidden_states, on one rank
    out["dispatch-rows"] = _attempt(lambda: ep.dispatch(
        x["hidden"], x["logits"][:2] if me == last else x["logits"], True))
    # a peer whose logits have another dtype (same bytes per row: f32 x 2 vs bf16 x 4)
    other = x["logits"].float()[:, :2] if me == last else x["logits"]
    out["layout-differs"] = _attempt(lambda: ep.dispatch(x["hidden"], other, True))
    out["layout-differs-sizes"] = _attempt(lambda: ep.dispatch(
        x["hidden"], other, True, sizes=[3] * ep.world_size))
    # sizes that do not match this rank's rows, on one rank
    out["sizes-wrong"] = _attempt(lambda: ep.dispatch(
        x["hidden"], x["logits"], True, sizes=[3] * last + [4] if me == last else [3] * (last + 1)))
    out["bad-flag"] = _attempt(lambda: ep.combine(x["hidden"], "yes"))
    out["extra-not-list"] = _attempt(lambda: ep.dispatch(x["hidden"], x["logits"], True,
                                                         x["lora"]) if me == last else
                                     ep.dispatch(x["hidden"], x["logits"], True, [x["lora"]]))
    h, _ = ep.dispatch(x["hidden"], x["logits"], True)
    good = ep.combine(h, True)
    want = sum(x["hidden"] for _ in range(ep.world_size))  # in rank order, as reduced
    out["after"] = ("ok", "") if torch.equal(good, want) else ("wrong", str(good - want))
    return out


# ---------------------------------------------------------------------- in the parent
def _param(run: tuple[str, tuple[int, int, int, int], str]) -> Any:
    name, layout, transport = run
    slow = [pytest.mark.slow] if layout[0] * layout[1] * layout[2] * layout[3] > 4 else []
    return pytest.param(layout, transport, id=name, marks=slow)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,transport", [_param(r) for r in RUNS])
def test_dispatch_and_combine(dist_pool: Any, layout: tuple[int, int, int, int],
                              transport: str) -> None:
    tp, pp, dp, pcp = layout
    world = tp * pp * dp * pcp
    results = dist_pool(world).run(run_moe_calls, layout, transport, timeout=220)
    want_mode = {"shm": "shm", "gloo": "gloo", "hier": "hierarchical"}[transport]
    for rank, res in enumerate(results):
        assert res["mode"] == want_mode, (rank, res["mode"])
        assert res["peers"] == [r for r in res["ep"] if r % tp == rank % tp], res
        failed = [name for name, ok in res["checks"].items() if not ok]
        assert not failed, (rank, failed)
        _check_faults(res["faults"], res["ep"].index(rank), len(res["ep"]))


def _check_faults(f: dict[str, tuple[str, str]], me: int, p: int) -> None:
    last = p - 1
    for key, own, words in (
        ("combine-unmatched", "ValueError", "no dispatch to match"),
        ("combine-rows", "ValueError", "the dispatch it matches gathered"),
        ("dispatch-rows", "ValueError", "router_logits has 2 rows"),
        ("sizes-wrong", "ValueError", f"sizes[{last}] is 4"),
        ("extra-not-list", "TypeError", "extra_tensors must be a list"),
    ):
        name, msg = f[key]
        if me == last:
            assert name == own and words in msg, (key, name, msg)
        else:
            assert name == "PeerRejectedError" and words in msg, (key, name, msg)
    for key in ("layout-differs", "layout-differs-sizes"):
        assert f[key][0] == "CollectiveMismatch", (key, f[key])
    assert f["bad-flag"][0] == "TypeError" and "is_sequence_parallel" in f["bad-flag"][1]
    for key in ("retry-first", "retry-second", "after"):
        assert f[key] == ("ok", ""), (key, f[key])


# ---------------------------------------------------------------------- one process
SEED_METHODS = {
    "dispatch": "(self, hidden_states, router_logits, is_sequence_parallel=False, "
                "extra_tensors=None, *, sizes=None)",
    "dispatch_router_logits": "(self, hidden_states, router_logits, is_sequence_parallel=False, "
                              "extra_tensors=None, *, sizes=None)",
    "combine": "(self, hidden_states, is_sequence_parallel=False, *, sizes=None)",
    "_all_reduce_out_place": "(self, input_)",
    "_all_gather_out_place": "(self, input_, dim)",
    "_reduce_scatter_out_place": "(self, input_, dim)",
}


@pytest.mark.parametrize("name", sorted(SEED_METHODS))
def test_seed_signatures(name: str) -> None:
    from coordinator import GroupCoordinator

    sig = inspect.signature(getattr(GroupCoordinator, name))
    plain = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty)
                                    for p in sig.parameters.values()],
                        return_annotation=inspect.Signature.empty)
    assert str(plain) == SEED_METHODS[name]


def run_out_of_place(rank: int, world_size: int) -> dict[str, Any]:
    from coordinator import parallel_state as ps

    ps.initialize_model_parallel(world_size)
    tp = ps.get_tp_group()
    try:
        x = torch.arange(12.0).view(3, 4) + rank
        kept = x.clone()
        r = tp._all_reduce_out_place(x)
        g = tp._all_gather_out_place(x, 0)
        s = tp._reduce_scatter_out_place(torch.ones(world_size * 2, 3) * (rank + 1), 0)
        want_r = sum(torch.arange(12.0).view(3, 4) + q for q in range(world_size))
        return {
            "reduce": torch.equal(r, want_r) and r.data_ptr() != x.data_ptr(),
            "gather": torch.equal(g, torch.cat([torch.arange(12.0).view(3, 4) + q
                                                for q in range(world_size)])),
            "scatter": torch.equal(s, torch.full((2, 3), world_size * (world_size + 1) / 2)),
            "untouched": torch.equal(x, kept),
        }
    finally:
        ps.destroy_model_parallel()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_out_of_place_helpers(dist_pool: Any, world: int) -> None:
    for rank, res in enumerate(dist_pool(world).run(run_out_of_place, timeout=100)):
        assert all(res.values()), (rank, res)
