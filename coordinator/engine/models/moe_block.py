"""The sparse feed-forward block of a MoE decoder, its experts sharded over the EP group.

Experts are sharded contiguously over the ``P`` ranks of the expert-parallel
group (rank ``j`` holds experts ``j * E/P .. (j + 1) * E/P - 1``, whole: no
TP split). The block's input is the residual stream, replicated over the TP
ranks of a pipeline stage; per call, on every rank::

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

So each token is routed exactly once per stage (not once per TP rank), and a
rank with no tokens of its own still serves its experts: :meth:`SparseMoeBlock.idle`
takes part in the dispatch/combine with zero rows (a data-parallel replica
with no requests in a step calls it for each of its stage's sparse layers,
in layer order, so the EP group's calls stay paired).

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

from coordinator.engine.layers import tp_all_gather
from coordinator.engine.layers.weights import (
    TPGroup,
    copy_checked,
    default_weight_loader,
    set_weight_loader,
    tp_size_and_rank,
)

__all__ = ["SparseMoeBlock", "route"]


def route(x: torch.Tensor, gate: torch.Tensor, k: int, renormalise: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: ``(topk_ids, topk_weights)`` of each row of ``x`` (as HF Mixtral/Qwen2-MoE).

    Softmax over all experts in float32, the ``k`` largest, divided by their sum
    when ``renormalise``; weights returned in ``x``'s dtype.
    """
    probs = torch.softmax(F.linear(x, gate).float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Routed experts (EP-sharded) and an optional shared expert (TP-sharded).

    Args:
        config: A :class:`~coordinator.engine.models.moe_config.MoeModelConfig`.
        tp_group: Tensor-parallel group or ``None``.
        ep_group: Expert-parallel group (``coordinator.get_ep_group()``) or ``None``
            (all experts local).
        dtype: Parameter dtype.
        prefix: Parameter name prefix (``model.layers.{i}.mlp``).
    """

    def __init__(self, config: Any, tp_group: TPGroup | None, ep_group: Any | None,
                 dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        from coordinator.engine.models.llama import LlamaMLP  # llama imports layers; no cycle

        c = config
        self.tp_group, self.ep_group = tp_group, ep_group
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        ep, me = tp_size_and_rank(ep_group)
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
        """Routed experts' weighted sum for the rows ``x`` (this rank's tokens)."""
        ids, w = route(x, self.gate, self.top_k, self.renormalise)
        if self.ep_group is None or self.ep_group.world_size == 1:
            return self._local_moe(x, ids, w)
        from coordinator.moe import combine, dispatch

        inputs, routing = dispatch(x, ids, w, self.ep_group, self.num_experts)
        return combine(self._experts(inputs), routing)

    def _local_moe(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """All experts in this process; the same slot-ordered sum as ``coordinator.moe.combine``."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        ys = self._experts(list(x.index_select(0, order // k).split(counts)))
        per_slot = torch.empty(n * k, x.shape[1], dtype=x.dtype)
        per_slot[order] = torch.cat(ys) if ys else per_slot[:0]
        per_slot = per_slot.view(n, k, -1)
        out = per_slot[:, 0] * w[:, :1]
        for s in range(1, k):
            out += per_slot[:, s] * w[:, s:s + 1]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, H]``, replicated over the TP group; returns ``[T, H]``, likewise."""
        t = x.shape[0]
        if self.tp_size > 1:
            c = -(-t // self.tp_size)
            mine = self._routed(x[self.tp_rank * c:(self.tp_rank + 1) * c])
            mine = F.pad(mine, (0, 0, 0, c - mine.shape[0]))
            y = tp_all_gather(self.tp_group, mine, 0)[:t]
        else:
            y = self._routed(x)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * self.shared_expert(x)
        return y

    def idle(self) -> None:
        """Serve this rank's experts for the other EP ranks with no tokens of its own."""
        if self.ep_group is not None and self.ep_group.world_size > 1:
            self._routed(self.gate.new_zeros(0, self.gate.shape[1]))
