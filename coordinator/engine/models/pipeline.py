"""One pipeline stage's part of a step, in micro-batches whose transfers overlap compute.

A step's requests are split into contiguous micro-batches (at most
``micro_batches``, never more than there are requests); every rank computes
the same split from the same step. On one stage::

    not first stage: post irecv_tensor_dict for micro-batch 0
    for each micro-batch j:
        not first stage: wait for j's hidden states, post the receive of j + 1
        compute j                                      (TP collectives inside)
        not last stage:  isend_tensor_dict(j's output) (travels while j + 1 computes)
    wait for every send before the step returns        (its errors belong to this step)

So stage ``i`` sends micro-batch ``j`` while it computes ``j + 1``, and stage
``i + 1`` computes ``j`` while ``j + 1`` arrives. The handles come from
:mod:`coordinator.p2p.point_to_point`: sends and receives of one direction run in
issue order, so micro-batch ``j`` of one stage meets micro-batch ``j`` of the
next.

Each micro-batch runs the same layers on the same tokens as the whole batch
would, and attention is computed per request, so the results are those of
the unsplit step (up to the float rounding of batched matrix products).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from coordinator.engine.models.kv_cache import AttentionInputs

__all__ = ["split_bounds", "slice_attention", "run_stage"]

Forward = Callable[[torch.Tensor | None, AttentionInputs, torch.Tensor | None], torch.Tensor]


def split_bounds(num_requests: int, micro_batches: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` request ranges of the micro-batches, as even as possible.

    Raises:
        ValueError: ``num_requests < 0`` or ``micro_batches < 1``.
    """
    if num_requests < 0 or micro_batches < 1:
        raise ValueError(f"need num_requests >= 0 and micro_batches >= 1, got "
                         f"{num_requests} and {micro_batches}")
    m = max(1, min(micro_batches, num_requests))
    cuts = [num_requests * j // m for j in range(m + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(m)]


def slice_attention(attn: AttentionInputs, first: int, end: int) -> AttentionInputs:
    """The attention metadata of requests ``first .. end - 1`` of a step, as a step of its own."""
    qsl, csl = attn.query_start_loc, attn.context_start_loc
    t0, t1 = int(qsl[first]), int(qsl[end])
    c0, c1 = int(csl[first]), int(csl[end])
    return AttentionInputs(
        positions=attn.positions[t0:t1],
        slot_mapping=attn.slot_mapping[t0:t1],
        query_start_loc=qsl[first : end + 1] - t0,
        context_slots=attn.context_slots[c0:c1],
        context_start_loc=csl[first : end + 1] - c0,
        logits_indices=attn.logits_indices[first:end] - t0,
        seq_lens=None if attn.seq_lens is None else attn.seq_lens[t0:t1],
    )


def run_stage(
    forward: Forward,
    pp: Any,
    token_ids: Sequence[Sequence[int]],
    attn: AttentionInputs,
    first_stage: bool,
    last_stage: bool,
    micro_batches: int,
) -> torch.Tensor | None:
    """Run this stage's layers on a step, micro-batch by micro-batch (module docstring).

    Args:
        forward: ``forward(input_ids, attn, hidden_states)`` of this stage's shard.
        pp: The pipeline group (a ``GroupCoordinator``).
        token_ids: Per request, its tokens of this step.
        attn: The whole step's attention metadata.
        first_stage: Embed token ids (else receive hidden states).
        last_stage: Return the outputs (else send them on).
        micro_batches: At most this many micro-batches.

    Returns:
        On the last stage the outputs of every micro-batch concatenated in
        request order; elsewhere None.

    Raises:
        Exception: What ``forward`` or a transfer raised. The step's other
            transfers are then left as they were (a posted receive, sends not
            waited for, the next stage waiting for an output that never
            comes), so the pipeline group is out of step with its peers: treat
            the error as the end of the group (destroy and create it again),
            never run the next step on it.
    """
    bounds = split_bounds(len(token_ids), micro_batches)
    # the next micro-batch's receive is posted before this one's compute starts
    receives = [] if first_stage else [pp.irecv_tensor_dict()]
    sends, outs = [], []
    for j, (r0, r1) in enumerate(bounds):
        hidden = ids = None
        if first_stage:
            ids = torch.tensor([t for toks in token_ids[r0:r1] for t in toks], dtype=torch.long)
        else:
            hidden = _hidden_states(receives.pop().wait(), pp.rank_in_group)
            if j + 1 < len(bounds):
                receives.append(pp.irecv_tensor_dict())

        out = forward(ids, slice_attention(attn, r0, r1), hidden)
        if last_stage:
            outs.append(out)
        else:
            sends.append(pp.isend_tensor_dict({"hidden_states": out}))
    for h in sends:
        h.wait()
    return torch.cat(outs) if last_stage else None


def _hidden_states(received: Any, stage: int) -> torch.Tensor:
    if not received or "hidden_states" not in received:
        raise RuntimeError(
            f"pipeline stage {stage} expected hidden_states from the previous stage, got "
            f"{sorted(received) if received else received!r}"
        )
    hidden: torch.Tensor = received["hidden_states"]
    return hidden
