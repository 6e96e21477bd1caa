"""Causal attention over a paged KV cache, as one traceable custom op.

``groupcoord::paged_attention`` writes the step's new keys/values into the
cache and attends every new query token to its request's whole context. The
per-request loop depends on the step's metadata, which ``torch.compile``
cannot specialise usefully, so the loop lives inside a custom op: the
compiled model sees one opaque node per layer, with a *fake* implementation
that only states the output shape. The whole decoder then compiles into one
graph with dynamic token and request counts.

Schema::

    groupcoord::paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache,
        Tensor slot_mapping, Tensor query_start_loc, Tensor context_slots,
        Tensor context_start_loc, float scale) -> Tensor

Shapes: ``q`` ``[T, Hq, D]``; ``k``, ``v`` ``[T, Hkv, D]``; ``kv_cache``
``[2, slots, Hkv, D]``; metadata as in
:class:`~coordinator.engine.models.kv_cache.AttentionInputs`. Query head ``h`` reads
KV head ``h // (Hq / Hkv)`` (grouped-query attention, Hugging Face order).
The new tokens of a request are its last ``n`` context positions; token ``i``
of them sees context positions ``<= L - n + i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import custom_op

__all__ = ["paged_attention"]


@custom_op("groupcoord::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_slots: torch.Tensor,
    context_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Store ``k``/``v`` at ``slot_mapping`` and return causal attention of ``q`` ``[T, Hq, D]``."""
    keys, values = kv_cache[0], kv_cache[1]
    keys.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    values.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    n_rep = q.shape[1] // k.shape[1]
    qsl = query_start_loc.tolist()
    csl = context_start_loc.tolist()
    for i in range(len(qsl) - 1):
        qs, qe, cs, ce = qsl[i], qsl[i + 1], csl[i], csl[i + 1]
        nq, length = qe - qs, ce - cs
        slots = context_slots[cs:ce]
        ki = keys.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, L, D]
        vi = values.index_select(0, slots).transpose(0, 1).to(q.dtype)
        if n_rep > 1:
            ki = ki.repeat_interleave(n_rep, dim=0)
            vi = vi.repeat_interleave(n_rep, dim=0)
        qi = q[qs:qe].transpose(0, 1)  # [Hq, nq, D]
        if nq == length:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        elif nq == 1:
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale)
        else:
            qpos = torch.arange(length - nq, length).unsqueeze(1)
            mask = torch.arange(length).unsqueeze(0) <= qpos
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


@paged_attention.register_fake
def _paged_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_slots: torch.Tensor,
    context_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)
