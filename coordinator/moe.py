"""Mixture-of-experts token dispatch and combine over an expert-parallel group.

``num_experts`` experts are sharded contiguously over the ``P`` ranks of the
EP group: rank ``j`` holds experts ``j * L .. (j + 1) * L - 1`` with
``L = num_experts / P``. Each rank routes its own tokens (``topk_ids``,
``topk_weights`` of shape ``(tokens, k)``, any ``k``)::

    hidden, topk_ids, topk_weights                      (this rank's tokens)
       |  dispatch: 1. all_gather of every rank's per-expert counts
       |            2. all_to_allv of the (token, slot) rows, sorted by expert
       v
    expert_inputs[l]: the rows for local expert l      (from every rank, in
       |                                                 rank order, then token
       |  the caller runs expert l on expert_inputs[l]   order, then slot order)
       v
    expert_out[l]
       |  combine:  all_to_allv back (the sizes of dispatch, reversed), then
       |            out[t] = sum over slots s in order of
       |                     expert_out_row(t, s) * topk_weights[t, s]
       v
    out: (tokens, *expert output row shape), in the original token order

The counts all-gather gives every rank the whole routing table (per source
rank and expert), so the all-to-alls need no size exchange of their own, and
ranks that disagree on ``num_experts`` fail that all-gather's signature on
every rank. A rank whose arguments are invalid still takes its part in the
first collective of the call as a rejection (``GroupCoordinator.reject_call``),
so its peers raise ``PeerRejectedError`` instead of waiting.

Arithmetic of the weighted sum: in the expert output's dtype, slot by slot
(``acc = y[:, 0] * w[:, 0]; acc += y[:, 1] * w[:, 1]; ...``), with the
weights cast to that dtype. A single-process reference that does the same
per token gets bitwise equal results whenever the experts compute each row
independently of the others in its batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from coordinator.group.group_coordinator import GroupCoordinator

__all__ = ["dispatch", "combine", "MoeRouting"]


@dataclasses.dataclass(frozen=True)
class MoeRouting:
    """What :func:`dispatch` returns besides the rows: how to bring them back.

    Attributes:
        group: The EP group.
        num_experts: Experts in all.
        local_experts: Global ids of this rank's experts (``L`` of them).
        expert_counts: Rows each local expert received (``L`` ints).
        num_tokens: Tokens of this rank.
        topk: Slots per token.
        order: Assignments (``token * k + slot``) in the order they were sent.
        send_sizes: Rows sent to each rank.
        recv_sizes: Rows received from each rank.
        perm: For each received row in expert order, its index in arrival order.
        topk_weights: This rank's routing weights ``(tokens, k)``.
    """

    group: GroupCoordinator
    num_experts: int
    local_experts: range
    expert_counts: list[int]
    num_tokens: int
    topk: int
    order: torch.Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    perm: torch.Tensor
    topk_weights: torch.Tensor


def dispatch(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    ep_group: GroupCoordinator,
    num_experts: int,
) -> tuple[list[torch.Tensor], MoeRouting]:
    """Send every (token, slot) row to the rank of its expert (collective over ``ep_group``).

    Args:
        hidden: This rank's tokens, ``(tokens, *row)`` (any number of tokens, also 0).
        topk_ids: Expert of each (token, slot), ``(tokens, k)``, integers in ``[0, num_experts)``.
        topk_weights: Weight of each (token, slot), ``(tokens, k)``, floating point.
        ep_group: The expert-parallel group (``coordinator.get_ep_group()``).
        num_experts: Experts in all; a multiple of the group's size.

    Returns:
        ``(expert_inputs, routing)``: ``expert_inputs[l]`` holds the rows for
        local expert ``routing.local_experts[l]`` (from every rank in rank
        order, then in token order); pass ``routing`` to :func:`combine`.

    Raises:
        TypeError: Wrong types (names the argument).
        ValueError: Wrong shapes, ids out of range, ``num_experts`` not a
            positive multiple of the group's size.
        PeerRejectedError: A peer's arguments were rejected.
        CollectiveMismatch: Ranks disagree on ``num_experts``, dtype or row shape.
    """
    if not isinstance(ep_group, GroupCoordinator):
        raise TypeError(f"ep_group must be a GroupCoordinator, got {type(ep_group).__name__}")
    try:
        _check_dispatch(hidden, topk_ids, topk_weights, ep_group.world_size, num_experts)
    except (TypeError, ValueError) as e:
        ep_group.reject_call("all_gather", e)
        raise
    p, me = ep_group.world_size, ep_group.rank_in_group
    local = num_experts // p
    n, k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)
    counts = torch.bincount(flat, minlength=num_experts)
    table = ep_group.all_gather(counts, dim=0).view(p, num_experts)  # [source, expert]
    order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
    send_sizes = counts.view(p, local).sum(1).tolist()
    mine = table[:, me * local : (me + 1) * local]  # [source, local expert]
    recv_sizes = mine.sum(1).tolist()
    rows = hidden.index_select(0, order // k) if k else hidden[:0]  # row i: assignment order[i]
    got = ep_group.all_to_allv(rows, send_sizes, recv_sizes)
    # Arrival order: source rank, then local expert, then token order. Regroup by expert.
    expert_of_row = torch.repeat_interleave(
        torch.arange(local).repeat(p), mine.reshape(-1))
    perm = torch.argsort(expert_of_row, stable=True)
    expert_counts = mine.sum(0).tolist()
    inputs = list(got[perm].split(expert_counts))
    routing = MoeRouting(
        group=ep_group, num_experts=num_experts,
        local_experts=range(me * local, (me + 1) * local), expert_counts=expert_counts,
        num_tokens=n, topk=k, order=order, send_sizes=send_sizes, recv_sizes=recv_sizes,
        perm=perm, topk_weights=topk_weights,
    )
    return inputs, routing


def combine(expert_out: Sequence[torch.Tensor] | torch.Tensor, routing: MoeRouting) -> torch.Tensor:
    """Bring expert outputs back to their tokens and sum them, weighted (collective).

    Args:
        expert_out: One tensor per local expert, ``(expert_counts[l], *out_row)``
            (rows in the order :func:`dispatch` gave them), or those tensors
            concatenated along dim 0.
        routing: What :func:`dispatch` returned with the inputs.

    Returns:
        ``(tokens, *out_row)`` in this rank's original token order:
        ``out[t] = sum_s expert_out_row(t, s) * topk_weights[t, s]``.

    Raises:
        TypeError: ``routing`` is not a :class:`MoeRouting`, or ``expert_out``
            is not tensors of one dtype.
        ValueError: ``expert_out`` has the wrong number of tensors or rows, or
            its tensors' row shapes differ.
        PeerRejectedError: A peer's ``expert_out`` was rejected.
    """
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"routing must be the MoeRouting dispatch returned, got "
                        f"{type(routing).__name__}")
    group = routing.group
    try:
        y = _stacked(expert_out, routing)
    except (TypeError, ValueError) as e:
        group.reject_call("all_to_allv", e, expert_out)
        raise
    arrived = torch.empty_like(y)
    arrived[routing.perm] = y  # back to arrival order
    back = group.all_to_allv(arrived, routing.recv_sizes, routing.send_sizes)
    n, k = routing.num_tokens, routing.topk
    if k == 0:
        return back.new_zeros((n,) + tuple(back.shape[1:]))
    per_slot = torch.empty_like(back)
    per_slot[routing.order] = back  # assignment t * k + s at row t * k + s
    per_slot = per_slot.view((n, k) + tuple(back.shape[1:]))
    w = routing.topk_weights.to(back.dtype).view((n, k) + (1,) * (back.dim() - 1))
    out = per_slot[:, 0] * w[:, 0]
    for s in range(1, k):
        out += per_slot[:, s] * w[:, s]
    return out


def _check_dispatch(
    hidden: Any, topk_ids: Any, topk_weights: Any, p: int, num_experts: Any
) -> None:
    """Raise TypeError/ValueError for one rank's dispatch arguments."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts < 1 or num_experts % p:
        raise ValueError(
            f"num_experts must be a positive multiple of the EP group's size {p} (experts "
            f"are sharded contiguously, num_experts / {p} per rank), got {num_experts}")
    for arg, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have a token dimension (dim 0), got a 0-dim tensor")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids must be (tokens, k) with tokens = hidden.shape[0] = "
                         f"{hidden.shape[0]}, got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    ids_type = topk_ids.dtype
    if ids_type.is_floating_point or ids_type.is_complex or ids_type == torch.bool:
        raise TypeError(f"topk_ids must hold integers, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(f"topk_ids must be in [0, num_experts={num_experts}), got {bad}")


def _stacked(expert_out: Sequence[torch.Tensor] | torch.Tensor,
             routing: MoeRouting) -> torch.Tensor:
    """``expert_out`` as one tensor of every local expert's rows, checked."""
    counts = routing.expert_counts
    if isinstance(expert_out, torch.Tensor):
        if expert_out.dim() == 0 or expert_out.shape[0] != sum(counts):
            raise ValueError(f"expert_out must have sum(expert_counts) = {sum(counts)} rows "
                             f"(dim 0), got shape {tuple(expert_out.shape)}")
        return expert_out.contiguous()
    if not isinstance(expert_out, (list, tuple)):
        raise TypeError(f"expert_out must be a list of tensors (one per local expert) or a "
                        f"tensor, got {type(expert_out).__name__}")
    if len(expert_out) != len(counts):
        raise ValueError(f"expert_out must have one tensor per local expert ({len(counts)}), "
                         f"got {len(expert_out)}")
    for i, t in enumerate(expert_out):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expert_out[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] != counts[i]:
            raise ValueError(f"expert_out[{i}] must have {counts[i]} rows (what expert "
                             f"{routing.local_experts[i]} received), got shape {tuple(t.shape)}")
        first = expert_out[0]
        if t.dtype != first.dtype:
            raise TypeError(f"expert_out[{i}] has dtype {t.dtype}, expert_out[0] {first.dtype}")
        if t.shape[1:] != first.shape[1:]:
            raise ValueError(f"expert_out[{i}] rows have shape {tuple(t.shape[1:])}, "
                             f"expert_out[0]'s {tuple(first.shape[1:])}")
    return torch.cat(list(expert_out))
