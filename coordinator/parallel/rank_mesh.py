"""The rank layout of the model-parallel groups: DP x PP x PCP x TP, TP fastest.

Global rank ``r`` of a world of ``EXT * DP * PP * PCP * TP`` processes sits at
mesh coordinates ``(e, d, p, c, t)`` with::

    r = (((e * DP + d) * PP + p) * PCP + c) * TP + t

``EXT`` counts independent replicas of the whole model-parallel layout in one
world (vLLM's "external DP", e.g. several engines of an RL trainer sharing a
world); no group spans two replicas. Each parallel dimension's groups hold the
ranks that differ only in that coordinate (vLLM's layout:
``arange(world).reshape(-1, DP, PP, PCP, TP)``):

=====  ======================================  ==================================
group  varies                                  example, TP=2 PCP=2 (world 4)
=====  ======================================  ==================================
TP     ``t``                                   [0, 1], [2, 3]
PCP    ``c`` (prefill context parallel)        [0, 2], [1, 3]
PP     ``p``                                   [0], [1], [2], [3]
DP     ``d``                                   [0], [1], [2], [3]
DCP    see below                               DCP=2: [0, 2], [1, 3]
EP     ``d``, ``c`` and ``t`` (one per stage)  [0, 1, 2, 3]
=====  ======================================  ==================================

Decode context parallelism adds no processes, and follows vLLM 0.33 (its
``ParallelConfig`` check and ``initialize_model_parallel``). Without PCP it
splits each TP group into ``TP / DCP`` groups of consecutive ranks, so
``DCP`` must divide ``TP``. With PCP > 1 the DCP size must be 1, ``PCP``
(the DCP groups are the PCP groups) or ``TP * PCP`` (one DCP group per TP x
PCP block); other sizes are refused, naming the valid ones. vLLM lists the
ranks of a ``TP * PCP`` group PCP-fastest (``[0, 2, 1, 3]`` at TP = PCP = 2)
and numbers its members in that order, while its process groups (torch's
``new_group``) number them in ascending order; here a group's members are
always numbered in ascending global rank, the order every collective
concatenates in, so the DCP groups hold the same ranks as vLLM's but list
them ascending. The expert-parallel group of stage ``p`` lists its
``DP * PCP * TP`` ranks in global order (``ep_rank = (d * PCP + c) * TP + t``).
"""

from __future__ import annotations

import dataclasses
import itertools

__all__ = ["RankMesh"]


@dataclasses.dataclass(frozen=True)
class RankMesh:
    """Sizes of the parallel dimensions; each ``*_groups`` lists that dimension's
    groups (every rank in exactly one), each group in ascending rank order."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    pcp: int = 1
    dcp: int = 1
    ext: int = 1

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} size must be an int >= 1, got {value!r}")
        if self.pcp == 1 and self.tp % self.dcp:
            raise ValueError(
                f"the decode context parallel size ({self.dcp}) must divide the tensor "
                f"parallel size ({self.tp}): without prefill context parallelism, DCP "
                f"groups split each TP group")
        valid = sorted({1, self.pcp, self.tp * self.pcp})
        if self.pcp > 1 and self.dcp not in valid:
            raise ValueError(
                f"with prefill context parallelism (PCP={self.pcp}, TP={self.tp}) the decode "
                f"context parallel size must be 1, span the PCP axis or the whole TP x PCP "
                f"block: valid sizes are {valid}, got {self.dcp}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int = 1, pcp: int = 1,
                  dcp: int = 1) -> RankMesh:
        """The mesh of these sizes replicated over ``world_size`` processes.

        Raises:
            ValueError: A size is not an int >= 1, or their product does not
                divide ``world_size``.
        """
        one = cls(tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)
        if world_size % one.world_size:
            context = f" x prefill context ({pcp})" if pcp > 1 else ""
            raise ValueError(
                f"tensor ({tp}) x pipeline ({pp}){context} x data ({dp}) parallel sizes = "
                f"{one.world_size} must divide the world size {world_size} (each group of "
                f"that many ranks runs one copy of the model)")
        return dataclasses.replace(one, ext=world_size // one.world_size)

    @property
    def world_size(self) -> int:
        """Processes the layout needs (DCP adds none)."""
        return self.ext * self.dp * self.pp * self.pcp * self.tp

    def rank(self, e: int, d: int, p: int, c: int, t: int) -> int:
        """Global rank at mesh coordinates ``(e, d, p, c, t)``."""
        return (((e * self.dp + d) * self.pp + p) * self.pcp + c) * self.tp + t

    def tp_groups(self) -> list[list[int]]:
        return self._along("t")

    def pp_groups(self) -> list[list[int]]:
        return self._along("p")

    def dp_groups(self) -> list[list[int]]:
        return self._along("d")

    def pcp_groups(self) -> list[list[int]]:
        return self._along("c")

    def dcp_groups(self) -> list[list[int]]:
        """Without PCP, runs of ``DCP`` consecutive ranks of each TP group; with PCP,
        the PCP groups (``DCP = PCP``) or each whole TP x PCP block
        (``DCP = TP * PCP``); ``DCP = 1``: every rank alone."""
        if self.dcp == 1:
            return [[r] for r in range(self.world_size)]
        if self.pcp == 1:
            return [g[i:i + self.dcp] for g in self.tp_groups()
                    for i in range(0, self.tp, self.dcp)]
        if self.dcp == self.pcp:
            return self.pcp_groups()
        return [sorted(self.rank(e, d, p, c, t) for c in range(self.pcp) for t in range(self.tp))
                for e in range(self.ext) for d in range(self.dp) for p in range(self.pp)]

    def ep_groups(self) -> list[list[int]]:
        """One group per pipeline stage of each replica: its DP x PCP x TP ranks."""
        return [sorted(self.rank(e, d, p, c, t) for d, c, t in itertools.product(
            range(self.dp), range(self.pcp), range(self.tp)))
            for e in range(self.ext) for p in range(self.pp)]

    def ep_token_groups(self) -> list[list[int]]:
        """Within each EP group, the ranks that share a TP position (they vary in DP
        and PCP): the ranks holding different tokens, over which an MoE dispatch
        without sequence parallelism gathers (:mod:`coordinator.group.moe_calls`)."""
        return [sorted(self.rank(e, d, p, c, t) for d in range(self.dp) for c in range(self.pcp))
                for e in range(self.ext) for p in range(self.pp) for t in range(self.tp)]

    def _along(self, axis: str) -> list[list[int]]:
        """The groups of ranks that differ only in coordinate ``axis`` (one of
        ``"dpct"``), ordered by the other coordinates, outermost first."""
        sizes = (self.ext, self.dp, self.pp, self.pcp, self.tp)
        k = "edpct".index(axis)
        rest = (range(n) for i, n in enumerate(sizes) if i != k)
        return [[self._rank_at((*fixed[:k], i, *fixed[k:])) for i in range(sizes[k])]
                for fixed in itertools.product(*rest)]

    def _rank_at(self, coords: tuple[int, ...]) -> int:
        """:meth:`rank` of the coordinates ``(e, d, p, c, t)``."""
        e, d, p, c, t = coords
        return self.rank(e, d, p, c, t)
