"""The expert-parallel (EP) layout: which ranks share the experts of one pipeline stage.

Ranks are laid out DP x PP x TP with TP varying fastest (global rank
``r = d * PP * TP + p * TP + t``; see :mod:`coordinator.parallel_state`). With
expert parallelism on, the experts of a mixture-of-experts layer are sharded
over every rank of one pipeline stage, that is over its DP x TP ranks. The
EP group of stage ``p`` lists them DP-major, TP-minor::

    ep_group(p) = [d * PP * TP + p * TP + t  for d in range(DP)  for t in range(TP)]
    ep_rank(r)  = d * TP + t                 for r = d * PP * TP + p * TP + t

This is vLLM's layout (``arange(world).reshape(DP, PP, TP).transpose(1, 2)
.reshape(-1, DP * TP)``). Examples (groups in stage order):

=====================  =========================================
TP, PP, DP (world)     EP groups
=====================  =========================================
2, 1, 1 (2)            [0, 1]
2, 1, 2 (4)            [0, 1, 2, 3]
1, 2, 2 (4)            [0, 2], [1, 3]
2, 2, 2 (8)            [0, 1, 4, 5], [2, 3, 6, 7]
3, 1, 2 (6)            [0, 1, 2, 3, 4, 5]
1, 2, 3 (6)            [0, 2, 4], [1, 3, 5]
=====================  =========================================

With DP = 1 the EP group has the TP group's ranks (a group of its own all the
same: its calls are numbered and signed apart from the TP group's). With
prefill context parallelism the stage's PCP ranks join too (see
:mod:`coordinator.parallel.rank_mesh`).
"""

from __future__ import annotations

from coordinator.parallel.rank_mesh import RankMesh

__all__ = ["ep_group_ranks", "ep_rank"]


def ep_group_ranks(tp: int, pp: int, dp: int, pcp: int = 1) -> list[list[int]]:
    """The EP groups (one per pipeline stage, in stage order) of a TP x PP x DP
    layout (with prefill context parallelism, DP x PCP x TP ranks per stage)."""
    return RankMesh(tp=tp, pp=pp, dp=dp, pcp=pcp).ep_groups()


def ep_rank(rank: int, tp: int, pp: int, pcp: int = 1) -> int:
    """Global ``rank``'s rank within its EP group (``(d * PCP + c) * TP + t``)."""
    d, c, t = rank // (pp * pcp * tp), rank // tp % pcp, rank % tp
    return (d * pcp + c) * tp + t
