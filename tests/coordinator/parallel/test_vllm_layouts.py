"""Our group tables against vLLM 0.33's, over a sweep of (TP, PP, DP, PCP, DCP) layouts.

vLLM's formula, restated from its ``initialize_model_parallel``: the world is
``arange(world).reshape(-1, DP, PP, PCP, TP)`` and each kind of group is a
transpose and a reshape of it:

* TP: ``view(-1, TP)``; PCP: ``transpose(3, 4).reshape(-1, PCP)``;
  PP: ``transpose(2, 4).reshape(-1, PP)``; DP: ``transpose(1, 4).reshape(-1, DP)``;
  EP: ``transpose(1, 2).reshape(-1, DP * PCP * TP)``;
* DCP: ``reshape(-1, 1)`` when DCP = 1, else ``transpose(-1, -2).reshape(-1, DCP)``
  (PCP fastest, then TP).

and the refusals of its ``ParallelConfig``: without PCP, DCP must divide TP;
with PCP > 1, DCP must be 1, PCP or TP x PCP.

Our groups must hold the same ranks. One difference is by design: vLLM lists
a DCP group spanning TP x PCP PCP-fastest (``[0, 2, 1, 3]`` at TP = PCP = 2)
while torch numbers a process group's members in ascending order; ours lists
every group ascending (see :mod:`coordinator.parallel.rank_mesh`). Every
other vLLM group is ascending already and must equal ours exactly.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from coordinator.parallel.rank_mesh import RankMesh

KINDS = ("tp", "pp", "dp", "pcp", "dcp", "ep")


def vllm_groups(world: int, tp: int, pp: int, dp: int, pcp: int, dcp: int
                ) -> dict[str, list[list[int]]]:
    """vLLM 0.33's group tables (its formula, restated)."""
    ranks = torch.arange(world).reshape(-1, dp, pp, pcp, tp)
    dcp_ranks = ranks.transpose(-1, -2) if dcp > 1 else ranks
    tables = {
        "tp": ranks.view(-1, tp),
        "dcp": dcp_ranks.reshape(-1, dcp),
        "pcp": ranks.transpose(3, 4).reshape(-1, pcp),
        "pp": ranks.transpose(2, 4).reshape(-1, pp),
        "dp": ranks.transpose(1, 4).reshape(-1, dp),
        "ep": ranks.transpose(1, 2).reshape(-1, dp * pcp * tp),
    }
    return {k: [g.tolist() for g in v.unbind(0)] for k, v in tables.items()}


def vllm_accepts(tp: int, pcp: int, dcp: int) -> bool:
    """vLLM's ``ParallelConfig`` check of the context-parallel sizes."""
    if pcp == 1:
        return tp % dcp == 0
    return dcp in (1, pcp, tp * pcp)


# (tp, pcp, dcp): every DCP size up to TP x PCP, valid or not
SWEEP = [(tp, pcp, dcp) for tp in (1, 2, 3, 4) for pcp in (1, 2, 3)
         for dcp in range(1, tp * pcp + 1)]


@pytest.mark.parametrize("tp,pcp,dcp", SWEEP, ids=[f"tp{a}-pcp{b}-dcp{c}" for a, b, c in SWEEP])
def test_tables_equal_vllms(tp: int, pcp: int, dcp: int) -> None:
    for pp, dp, ext in itertools.product((1, 2), (1, 2, 3), (1, 2)):
        world = ext * dp * pp * pcp * tp
        if not vllm_accepts(tp, pcp, dcp):
            valid = "must divide" if pcp == 1 else f"valid sizes are {sorted({1, pcp, tp * pcp})}"
            with pytest.raises(ValueError, match=valid.replace("[", r"\[").replace("]", r"\]")):
                RankMesh.for_world(world, tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)
            continue
        mesh = RankMesh.for_world(world, tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)
        theirs = vllm_groups(world, tp, pp, dp, pcp, dcp)
        layout = (tp, pp, dp, pcp, dcp, ext)
        for kind in KINDS:
            ours = getattr(mesh, f"{kind}_groups")()
            assert all(g == sorted(g) for g in ours), (layout, kind, ours)
            assert sorted(ours) == sorted(sorted(g) for g in theirs[kind]), (layout, kind)
            for g in theirs[kind]:
                if g == sorted(g):
                    assert g in ours, (layout, kind, g)


def test_the_one_listing_difference() -> None:
    """TP = PCP = 2, DCP = 4: vLLM lists [0, 2, 1, 3], ours [0, 1, 2, 3] (the same ranks)."""
    assert vllm_groups(4, 2, 1, 1, 2, 4)["dcp"] == [[0, 2, 1, 3]]
    assert RankMesh(tp=2, pcp=2, dcp=4).dcp_groups() == [[0, 1, 2, 3]]
    # DCP = PCP spans the PCP axis, where it used to split TP groups
    assert vllm_groups(4, 2, 1, 1, 2, 2)["dcp"] == [[0, 2], [1, 3]]
    assert RankMesh(tp=2, pcp=2, dcp=2).dcp_groups() == [[0, 2], [1, 3]]
