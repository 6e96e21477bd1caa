"""The expert-parallel group: layouts at world sizes 2, 4 and 6, getters, lifecycle.

The EP group of a pipeline stage is its DP x TP ranks, ``ep_rank = dp * TP + tp``
(vLLM's layout). The expected groups are written out by hand for every layout
(and cross-checked against a derivation from rank coordinates), then compared
with what ``initialize_model_parallel(..., enable_expert_parallel=True)``
builds on real ranks, which also communicate over it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from coordinator import NotInitializedError
from coordinator import parallel_state as ps
from coordinator.group.registry import REGISTRY
from coordinator.parallel.expert_parallel import ep_group_ranks, ep_rank

# (tp, pp, dp) -> EP groups, in stage order.
EXPECTED = {
    (2, 1, 1): [[0, 1]],
    (1, 1, 2): [[0, 1]],
    (1, 2, 1): [[0], [1]],
    (2, 1, 2): [[0, 1, 2, 3]],
    (2, 2, 1): [[0, 1], [2, 3]],
    (1, 2, 2): [[0, 2], [1, 3]],
    (4, 1, 1): [[0, 1, 2, 3]],
    (3, 1, 2): [[0, 1, 2, 3, 4, 5]],
    (2, 1, 3): [[0, 1, 2, 3, 4, 5]],
    (1, 2, 3): [[0, 2, 4], [1, 3, 5]],
    (3, 2, 1): [[0, 1, 2], [3, 4, 5]],
    (2, 3, 1): [[0, 1], [2, 3], [4, 5]],
    (2, 2, 2): [[0, 1, 4, 5], [2, 3, 6, 7]],
}
# Built on real ranks (each layout costs a model-parallel setup, so a few per world size).
LAYOUTS = {
    2: [(2, 1, 1), (1, 1, 2), (1, 2, 1)],  # the last: EP groups of one rank
    4: [(2, 1, 2), (2, 2, 1), (1, 2, 2)],
    6: [(3, 1, 2), (2, 1, 3), (1, 2, 3)],
}


def _derived(tp: int, pp: int, dp: int) -> list[list[int]]:
    """Same pipeline stage -> same EP group; members ordered by (dp, tp)."""
    coord = {r: (r // (tp * pp), (r // tp) % pp, r % tp) for r in range(tp * pp * dp)}
    return [sorted((r for r, c in coord.items() if c[1] == p),
                   key=lambda r: (coord[r][0], coord[r][2]))
            for p in range(pp)]


@pytest.mark.parametrize("layout", list(EXPECTED),
                         ids=[f"tp{a}-pp{b}-dp{c}" for a, b, c in EXPECTED])
def test_formula_matches_the_written_out_groups(layout: tuple[int, int, int]) -> None:
    tp, pp, dp = layout
    assert ep_group_ranks(tp, pp, dp) == EXPECTED[layout] == _derived(tp, pp, dp)
    for group in EXPECTED[layout]:
        assert [ep_rank(r, tp, pp) for r in group] == list(range(len(group)))


@pytest.fixture
def uninitialised() -> Any:
    if dist.is_initialized() or REGISTRY.world is not None or REGISTRY.tp is not None:
        pytest.skip("this process has a distributed environment (another test set one up)")
    yield


def test_get_ep_group_before_initialisation(uninitialised: Any) -> None:
    with pytest.raises(NotInitializedError, match=r"enable_expert_parallel=True\) first"):
        ps.get_ep_group()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(6, marks=pytest.mark.slow)])
def test_ep_layouts_on_real_ranks(dist_pool: Any, world_size: int) -> None:
    results = dist_pool(world_size).run(run_layouts, LAYOUTS[world_size], timeout=220)
    for i, layout in enumerate(LAYOUTS[world_size]):
        tp, pp, dp = layout
        for rank, per_rank in enumerate(results):
            rec = per_rank[i]
            mine = next(g for g in EXPECTED[layout] if rank in g)
            assert rec["ranks"] == mine, (layout, rank, rec["ranks"])
            assert rec["rank_in_group"] == mine.index(rank) == ep_rank(rank, tp, pp)
            assert rec["world_size"] == tp * dp
            assert rec["name"].startswith("ep:")
            assert rec["sum"] == float(sum(mine))  # an all-reduce over exactly these ranks
            assert rec["a2av"] == [float(q) for q in mine]  # one row from every member
            assert rec["tp_in_ep"]  # a TP group lies inside its stage's EP group
    if world_size != 2:
        return
    lifecycle = results[0][-1]
    for key in ("after_destroy", "old_group"):
        name, msg = lifecycle[key]
        assert name == "NotInitializedError", (key, name, msg)
    name, msg = lifecycle["off"]
    assert name == "NotInitializedError" and "expert parallelism is off" in msg, msg
    name, msg = lifecycle["ensure_mismatch"]
    assert name == "ValueError" and "enable_expert_parallel=True" in msg, msg
    assert lifecycle["ensure_ok"] and lifecycle["bad_flag"][0] == "TypeError"


def _attempt(fn: Any) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except Exception as e:  # reported to the parent, which checks the type
        return (type(e).__name__, str(e))


def run_layouts(rank: int, world_size: int, layouts: list[tuple[int, int, int]]) -> list[Any]:
    out: list[Any] = []
    for tp, pp, dp in layouts:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, dp, enable_expert_parallel=True)
        ep = ps.get_ep_group()
        n = ep.world_size
        total = ep.all_reduce(torch.tensor([float(rank)])).item()
        rows = ep.all_to_allv(torch.full((n, 1), float(rank)), [1] * n).view(-1).tolist()
        if n == 1:  # a group of one answers locally, MoE included
            from coordinator import moe

            inputs, routing = moe.dispatch(torch.ones(2, 3), torch.tensor([[0], [1]]),
                                           torch.ones(2, 1), ep, 2)
            assert [x.shape[0] for x in inputs] == [1, 1]
            assert torch.equal(moe.combine([x * 3 for x in inputs], routing),
                               torch.full((2, 3), 3.0))
        out.append({"ranks": list(ep.ranks), "rank_in_group": ep.rank_in_group,
                    "world_size": n, "name": ep.unique_name, "sum": total, "a2av": rows,
                    "tp_in_ep": set(ps.get_tp_group().ranks) <= set(ep.ranks)})
    if world_size == 2:
        out.append(_lifecycle(world_size))
    ps.destroy_model_parallel()
    return out


def _lifecycle(world_size: int) -> dict[str, Any]:
    """Destroy, EP off, ensure_model_parallel_initialized, a bad flag."""
    old = ps.get_ep_group()
    ps.destroy_model_parallel()
    life = {"after_destroy": _attempt(ps.get_ep_group),
            "old_group": _attempt(lambda: old.all_reduce(torch.ones(1)))}
    ps.initialize_model_parallel(world_size)
    life["off"] = _attempt(ps.get_ep_group)
    life["ensure_mismatch"] = _attempt(
        lambda: ps.ensure_model_parallel_initialized(world_size, 1, enable_expert_parallel=True))
    ps.ensure_model_parallel_initialized(world_size, 1)  # None: no EP requirement
    ps.destroy_model_parallel()
    ps.ensure_model_parallel_initialized(world_size, 1, enable_expert_parallel=True)
    life["ensure_ok"] = ps.get_ep_group().world_size == world_size
    ps.destroy_model_parallel()
    life["bad_flag"] = _attempt(lambda: ps.initialize_model_parallel(world_size,
                                                                     enable_expert_parallel=1))
    return life


# ------------------------------------------------------------------ EPLB, ETP, engram DP
def test_eplb_and_engram_getters_before_initialisation(uninitialised: Any) -> None:
    with pytest.raises(NotInitializedError, match=r"enable_eplb=True\) first"):
        ps.get_eplb_group()
    with pytest.raises(NotInitializedError, match="engram tensor parallel"):
        ps.get_etp_group()
    assert ps.get_engram_dp_group() is None and ps.get_engram_dp_size() == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_eplb_group_holds_the_ep_ranks_in_a_group_of_its_own(dist_pool: Any,
                                                                  world_size: int) -> None:
    layouts = {2: [(2, 1, 1), (1, 2, 1)], 4: [(2, 1, 2), (1, 2, 2)]}[world_size]
    results = dist_pool(world_size).run(run_eplb, layouts, timeout=220)
    for i, layout in enumerate(layouts):
        for rank, per_rank in enumerate(results):
            rec = per_rank[i]
            mine = next(g for g in EXPECTED[layout] if rank in g)
            assert rec["ranks"] == rec["ep_ranks"] == mine, (layout, rank, rec)
            assert rec["rank_in_group"] == mine.index(rank)
            assert rec["name"].startswith("eplb:") and rec["distinct"], rec
            # a send on the EPLB group pairs with the receive there, whatever the EP
            # group does meanwhile
            assert rec["pairs"] == float(sum(mine)), rec
            assert rec["etp"] == rec["tp"] and rec["engram"] == (None, 1)
            assert rec["all_groups_has_eplb"]
    life = results[0][-1]
    assert life["after_destroy"][0] == "NotInitializedError", life
    name, msg = life["off"]
    assert name == "NotInitializedError" and "expert load balancing is off" in msg, msg
    name, msg = life["without_ep"]
    assert name == "ValueError" and "enable_expert_parallel=True" in msg, msg
    assert life["bad_flag"][0] == "TypeError" and "enable_eplb" in life["bad_flag"][1], life
    name, msg = life["ensure_mismatch"]
    assert name == "ValueError" and "enable_eplb=True" in msg, msg
    assert life["ensure_ok"], life


def run_eplb(rank: int, world_size: int, layouts: list[tuple[int, int, int]]) -> list[Any]:
    out: list[Any] = []
    for tp, pp, dp in layouts:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, dp, enable_expert_parallel=True, enable_eplb=True)
        ep, eplb = ps.get_ep_group(), ps.get_eplb_group()
        total = float(rank)
        if eplb.world_size > 1:  # a ring of sends on EPLB around an all-reduce on EP
            me, n = eplb.rank_in_group, eplb.world_size
            send = eplb.isend(torch.tensor([float(rank)]), (me + 1) % n)
            ep.all_reduce(torch.ones(1))  # an EP collective between the send and its receive
            got = eplb.recv(torch.Size([1]), torch.float32, (me - 1) % n)
            send.wait()
            total = eplb.all_reduce(torch.tensor([float(rank)])).item()
            assert got.item() == float(eplb.ranks[(me - 1) % n])
        out.append({"ranks": list(eplb.ranks), "ep_ranks": list(ep.ranks),
                    "rank_in_group": eplb.rank_in_group, "name": eplb.unique_name,
                    "distinct": eplb is not ep and eplb.cpu_group is not ep.cpu_group,
                    "pairs": total, "etp": ps.get_etp_group().unique_name,
                    "tp": ps.get_tp_group().unique_name,
                    "engram": (ps.get_engram_dp_group(), ps.get_engram_dp_size()),
                    "all_groups_has_eplb": eplb in ps.get_all_model_groups()})
    ps.destroy_model_parallel()
    life = {"after_destroy": _attempt(ps.get_eplb_group)}
    ps.initialize_model_parallel(world_size, enable_expert_parallel=True)
    life["off"] = _attempt(ps.get_eplb_group)
    life["ensure_mismatch"] = _attempt(
        lambda: ps.ensure_model_parallel_initialized(world_size, 1, enable_eplb=True))
    ps.destroy_model_parallel()
    life["without_ep"] = _attempt(lambda: ps.initialize_model_parallel(world_size,
                                                                       enable_eplb=True))
    life["bad_flag"] = _attempt(lambda: ps.initialize_model_parallel(
        world_size, enable_expert_parallel=True, enable_eplb="yes"))
    ps.ensure_model_parallel_initialized(world_size, 1, enable_expert_parallel=True,
                                         enable_eplb=True)
    life["ensure_ok"] = ps.get_eplb_group().ranks == ps.get_ep_group().ranks
    ps.destroy_model_parallel()
    out.append(life)
    return out
