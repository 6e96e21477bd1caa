"""The sparse feed-forward block of a MoE decoder, its experts sharded over the EP group.

Experts are sharded contiguously over the ``P`` ranks of the expert-parallel
group (rank ``j`` holds experts ``j * E/P .. (j + 1) * E/P - 1``, whole: no
TP split). The block's input is the residual stream, replicated over the TP
ranks of a pipeline stage. Two ways to reach the experts (:class:`MoeComm`);
per call, on every rank:

``all2all`` (each row travels to the ranks of its experts and back)::

    x: [T, H] (the same on every TP rank)
      |  this TP rank's token slice: rows [t * c, (t + 1) * c), c = ceil(T / tp)
      |  router (replicated): softmax -> top-k -> (renormalise)   [Mixtral, Qwen2-MoE]
      |  coordinator.moe.dispatch over EP        (rows to the ranks of their experts)
      |  local experts: down(silu(gate(rows)) * up(rows))
      |  coordinator.moe.combine over EP         (back, weighted sum in slot order)
      |  all_gather over TP                       (every TP rank has all T rows again)
      |  + sigmoid(shared_gate(x)) * shared_expert(x)  (Qwen2-MoE; TP-sharded MLP)
      v
    y: [T, H]

``allgather`` (every rank sees every row, runs only its own experts; the
seed's ``GroupCoordinator.dispatch`` / ``combine``)::

    x: [T, H]
      |  sequence parallel: this TP rank's token slice (as above); else all T rows
      |  router logits (replicated gate)
      |  ep.dispatch(rows, logits, sp)    all-gather of rows and logits: over the whole
      |                                   EP group (sp), or over ep.token_peers (the
      |                                   EP ranks at this TP position: the DP peers)
      |  route; local experts on every gathered row; weighted sum in slot order
      |                                   (a slot whose expert is elsewhere adds 0)
      |  ep.combine(partial, sp)          reduce-scatter: this rank's rows, summed
      |                                   over the ranks that gathered them
      |  sp: all_gather over TP           (the slices make all T rows again)
      |  else: all_reduce over TP         (adds the experts of the TP peers, which
      |                                   the token peers lack)
      |  + shared expert (as above)
      v
    y: [T, H]

Sequence parallelism needs TP > 1: with one TP rank the token peers are the
whole EP group and there is nothing to slice, so the two settings make the
same calls (the block runs the form without sequence parallelism).

So with sequence parallelism each token is routed once per stage (not once
per TP rank). A rank with no tokens of its own still serves its experts:
:meth:`SparseMoeBlock.idle` takes part in the dispatch/combine with zero rows
(a data-parallel replica with no requests in a step calls it for each of its
stage's sparse layers, in layer order, so the EP group's calls stay paired;
all TP ranks of an idle replica are idle together, so no TP call is owed).

Without an EP group (or with one of size 1) all experts are local and the
same routing and slot-ordered weighted sum run in-process: the unsharded
reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coordinator.engine.layers import tp_all_gather, tp_all_reduce
from coordinator.engine.layers.weights import (
    TPGroup,
    copy_checked,
    default_weight_loader,
    set_weight_loader,
    tp_size_and_rank,
)

__all__ = ["MOE_COMMS", "MoeComm", "SparseMoeBlock", "route", "select_experts"]

#: The ways a sparse block's rows reach the experts (:class:`MoeComm`).
MOE_COMMS = ("all2all", "allgather")


def route(x: torch.Tensor, gate: torch.Tensor, k: int, renormalise: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: ``(topk_ids, topk_weights)`` of each row of ``x`` (as HF Mixtral/Qwen2-MoE).

    :func:`select_experts` of the router logits ``x @ gate.T``.
    """
    return select_experts(F.linear(x, gate), k, renormalise)


def select_experts(logits: torch.Tensor, k: int, renormalise: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids, topk_weights)`` of each row of router ``logits``.

    Softmax over all experts in float32, the ``k`` largest, divided by their sum
    when ``renormalise``; weights returned in ``logits``' dtype.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(logits.dtype)


@dataclasses.dataclass(frozen=True)
class MoeComm:
    """How a :class:`SparseMoeBlock`'s rows reach the experts on other EP ranks.

    Attributes:
        kind: ``"all2all"``: each row goes to the ranks of its experts and back
            (``coordinator.moe.dispatch``/``combine``); ``"allgather"``: every
            rank gathers its token peers' rows and runs its own experts on all
            of them (``GroupCoordinator.dispatch``/``combine``).
        sequence_parallel: Each TP rank routes its own slice of the tokens
            (then an all-gather over TP; the block's own split, the residual
            stream between blocks stays whole). False (``allgather`` only): every TP
            rank routes all tokens of its replica (then an all-reduce over TP).
            No effect with one TP rank.

    Raises:
        ValueError: ``kind`` is not one of :data:`MOE_COMMS`, or
            ``sequence_parallel`` is False with ``all2all``.
        TypeError: ``sequence_parallel`` is not a bool.
    """

    kind: str = "all2all"
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if self.kind not in MOE_COMMS:
            raise ValueError(f"moe comm must be one of {', '.join(MOE_COMMS)}, got {self.kind!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got "
                            f"{type(self.sequence_parallel).__name__}")
        if self.kind == "all2all" and not self.sequence_parallel:
            raise ValueError("the all2all MoE path always gives each TP rank its own token "
                             "slice: sequence_parallel=False needs the allgather path")


class SparseMoeBlock(nn.Module):
    """Routed experts (EP-sharded) and an optional shared expert (TP-sharded).

    Args:
        config: A :class:`~coordinator.engine.models.moe_config.MoeModelConfig`.
        tp_group: Tensor-parallel group or ``None``.
        ep_group: Expert-parallel group (``coordinator.get_ep_group()``) or ``None``
            (all experts local).
        dtype: Parameter dtype.
        prefix: Parameter name prefix (``model.layers.{i}.mlp``).
        comm: How rows reach the experts of other EP ranks (default: all2all,
            sequence parallel).

    Raises:
        TypeError: ``comm`` is not a :class:`MoeComm`.
        ValueError: ``num_experts`` is not a multiple of the EP group's size
            (on either path: experts are sharded contiguously, the same number
            per rank), or ``allgather`` without sequence parallelism on an EP
            group that is not its token peers times the TP group.
    """

    def __init__(self, config: Any, tp_group: TPGroup | None, ep_group: Any,
                 dtype: torch.dtype, prefix: str, comm: MoeComm | None = None) -> None:
        super().__init__()
        from coordinator.engine.models.llama import LlamaMLP  # llama imports layers; no cycle

        comm = MoeComm() if comm is None else comm
        if not isinstance(comm, MoeComm):
            raise TypeError(f"comm must be a MoeComm, got {type(comm).__name__}")
        c = config
        self.tp_group = tp_group
        self.ep_group = ep_group
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        ep, me = tp_size_and_rank(ep_group)
        if c.num_experts % ep:  # else some experts would be held by no rank
            raise ValueError(
                f"num_experts must be a positive multiple of the EP group's size {ep} (experts "
                f"are sharded contiguously, num_experts / {ep} per rank), got {c.num_experts}")
        self.comm = comm
        #: Experts on other ranks (so rows travel); False: all experts here.
        self.sharded = ep > 1
        #: Each TP rank routes its own token slice (needs TP > 1; see the module).
        self.sequence_parallel = comm.sequence_parallel and self.tp_size > 1
        #: The allgather path on a sharded EP group (else all2all, or all local).
        self.gathers = self.sharded and comm.kind == "allgather"
        if self.gathers and self.tp_size > 1 and not self.sequence_parallel:
            peers = self.ep_group.token_peers.world_size
            if peers * self.tp_size != ep:
                raise ValueError(
                    f"allgather without sequence parallelism sums the experts of the TP peers "
                    f"with an all_reduce over TP, so the EP group ({ep} ranks) must be its "
                    f"token peers ({peers}) x the TP group ({self.tp_size})")
        self.num_experts, self.top_k = c.num_experts, c.num_experts_per_tok
        self.renormalise = c.norm_topk_prob
        self.num_local = c.num_experts // ep
        self.first_expert = me * self.num_local
        h, i = c.hidden_size, c.moe_intermediate_size
        self.inter = i
        self.gate = nn.Parameter(torch.empty(c.num_experts, h, dtype=dtype), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * i, h, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, h, i, dtype=dtype), requires_grad=False)
        set_weight_loader(self.gate, default_weight_loader)
        set_weight_loader(self.w13, self._load_w13)
        set_weight_loader(self.w2, self._load_w2)
        self.shared_expert: nn.Module | None = None
        if c.shared_expert_intermediate_size:
            shared_cfg = dataclasses.replace(c, intermediate_size=c.shared_expert_intermediate_size,
                                             mlp_bias=False)
            self.shared_expert = LlamaMLP(shared_cfg, tp_group, dtype, False,
                                          f"{prefix}.shared_expert")
            self.shared_expert_gate = nn.Parameter(torch.empty(1, h, dtype=dtype),
                                                   requires_grad=False)
            set_weight_loader(self.shared_expert_gate, default_weight_loader)
        #: Rows each local expert has processed so far (all calls), for load reports.
        self.expert_rows = torch.zeros(self.num_local, dtype=torch.long)

    # ------------------------------------------------------------------ weights
    def local_index(self, expert: int) -> int | None:
        """Index of global ``expert`` among this rank's experts, or ``None``."""
        j = expert - self.first_expert
        return j if 0 <= j < self.num_local else None

    def _local(self, expert: int) -> int:
        j = self.local_index(expert)
        if j is None:
            raise ValueError(f"expert {expert} is not on this EP rank (it holds "
                             f"{self.first_expert}..{self.first_expert + self.num_local - 1})")
        return j

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int, int]) -> None:
        expert, half = shard
        j = self._local(expert)
        copy_checked(param.data[j, half * self.inter:(half + 1) * self.inter], loaded,
                     f"expert {expert} {'up' if half else 'gate'} projection")

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> None:
        copy_checked(param.data[self._local(shard)], loaded, f"expert {shard} down projection")

    # ------------------------------------------------------------------ forward
    def _experts(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Local expert ``l`` on ``inputs[l]`` (SwiGLU)."""
        out = []
        for j, rows in enumerate(inputs):
            self.expert_rows[j] += rows.shape[0]
            gate, up = F.linear(rows, self.w13[j]).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, self.w2[j]))
        return out

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts' weighted sum for the rows ``x`` (this rank's tokens); on the
        allgather path without sequence parallelism, only the experts of this rank's
        token peers (the TP all-reduce in :meth:`forward` adds the rest)."""
        if self.gathers:
            return self._gathered(x)
        ids, w = route(x, self.gate, self.top_k, self.renormalise)
        if not self.sharded:
            return self._local_sum(x, ids, w)
        from coordinator.moe import combine, dispatch

        inputs, routing = dispatch(x, ids, w, self.ep_group, self.num_experts)
        return combine(self._experts(inputs), routing)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """The allgather path: every token peer's rows, this rank's experts, summed back."""
        sp = self.sequence_parallel
        rows, logits = self.ep_group.dispatch(x, F.linear(x, self.gate), sp)
        ids, w = select_experts(logits, self.top_k, self.renormalise)
        out: torch.Tensor = self.ep_group.combine(self._local_sum(rows, ids, w), sp)
        return out

    def _local_sum(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """This rank's experts on the rows ``x``, weighted and summed in slot order as
        ``coordinator.moe.combine`` does; a slot whose expert is on another rank adds 0
        (without EP every expert is here: the unsharded block)."""
        n, k = ids.shape
        local = ids.reshape(-1) - self.first_expert
        slots = ((local >= 0) & (local < self.num_local)).nonzero().squeeze(1)
        experts = local[slots]
        slots = slots[torch.argsort(experts, stable=True)]
        counts = torch.bincount(experts, minlength=self.num_local).tolist()
        ys = self._experts(list(x.index_select(0, slots // k).split(counts)))
        per_slot = x.new_zeros(n * k, x.shape[1])
        per_slot[slots] = torch.cat(ys) if ys else per_slot[:0]
        per_slot = per_slot.view(n, k, x.shape[1])
        out = per_slot[:, 0] * w[:, :1]
        for s in range(1, k):
            out += per_slot[:, s] * w[:, s:s + 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, H]``, replicated over the TP group; returns ``[T, H]``, likewise."""
        t = x.shape[0]
        if self.sequence_parallel:
            c = -(-t // self.tp_size)
            mine = self._routed(x[self.tp_rank * c:(self.tp_rank + 1) * c])
            mine = F.pad(mine, (0, 0, 0, c - mine.shape[0]))
            y = tp_all_gather(self.tp_group, mine, 0)[:t]
        else:
            y = self._routed(x)
            if self.gathers:  # the experts of the TP peers (none with one TP rank)
                y = tp_all_reduce(self.tp_group, y)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return y

    def idle(self) -> None:
        """Serve this rank's experts for the other EP ranks with no tokens of its own
        (all TP ranks of an idle replica are idle: no TP call is owed)."""
        if self.sharded:
            self._routed(self.gate.new_zeros(0, self.gate.shape[1]))
