"""Hugging Face parameter names and shapes of a MoE decoder, and its seeded random weights.

The names are the checkpoint's own: Mixtral's ``block_sparse_moe.experts.{e}.w1/w2/w3``,
Qwen2-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and shared expert.
:func:`random_moe_state_dict` draws them like
:func:`~coordinator.engine.models.checkpoint.random_state_dict` (fixed order,
private generator), so every rank builds the same full weights and keeps its shard.
"""

from __future__ import annotations

import dataclasses

import torch

from coordinator.engine.models.checkpoint import hf_parameter_shapes, random_weights
from coordinator.engine.models.moe_config import MoeModelConfig

__all__ = ["moe_parameter_shapes", "random_moe_state_dict"]


def _sparse_shapes(c: MoeModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {}
    if c.model_type == "mixtral":
        out[p + "block_sparse_moe.gate.weight"] = (c.num_experts, h)
        for e in range(c.num_experts):
            q = p + f"block_sparse_moe.experts.{e}."
            out.update({q + "w1.weight": (i, h), q + "w2.weight": (h, i), q + "w3.weight": (i, h)})
        return out
    out[p + "mlp.gate.weight"] = (c.num_experts, h)
    for e in range(c.num_experts):
        q = p + f"mlp.experts.{e}."
        out.update({q + "gate_proj.weight": (i, h), q + "up_proj.weight": (i, h),
                    q + "down_proj.weight": (h, i)})
    s = c.shared_expert_intermediate_size
    if s:
        q = p + "mlp.shared_expert."
        out.update({q + "gate_proj.weight": (s, h), q + "up_proj.weight": (s, h),
                    q + "down_proj.weight": (h, s), p + "mlp.shared_expert_gate.weight": (1, h)})
    return out


def moe_parameter_shapes(config: MoeModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of every parameter of ``config``'s model, in a fixed order."""
    llama = hf_parameter_shapes(dataclasses.replace(config, mlp_bias=False))
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in llama.items():
        m = name.split(".")
        if name.endswith("self_attn.o_proj.bias") and not config.o_proj_bias:
            continue
        if ".mlp." in name and int(m[2]) in config.sparse_layers:
            if name.endswith("mlp.down_proj.weight"):  # the layer's last MLP tensor
                out.update(_sparse_shapes(config, ".".join(m[:3]) + "."))
            continue
        out[name] = shape
    return out


def random_moe_state_dict(config: MoeModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float32 weights for ``config`` from ``seed`` (scaled as the Llama ones)."""
    return random_weights(moe_parameter_shapes(config), seed)
