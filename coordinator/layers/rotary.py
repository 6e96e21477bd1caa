"""Rotary position embeddings (RoPE) in the Llama "rotate half" layout.

Supported ``rope_type`` values: ``default``, ``linear`` (positions divided by
``factor``) and ``llama3`` (Llama 3.1 frequency-dependent scaling). The inverse
frequencies are computed exactly as Hugging Face computes them, so cosines and
sines agree with ``LlamaRotaryEmbedding``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "SUPPORTED_ROPE_TYPES", "compute_inv_freq"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def compute_inv_freq(
    head_dim: int, theta: float, rope_type: str, params: Mapping[str, Any]
) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) for one RoPE variant.

    Args:
        head_dim: Rotated features per head (even).
        theta: RoPE base.
        rope_type: One of :data:`SUPPORTED_ROPE_TYPES`.
        params: Extra parameters of the variant (``factor``; for ``llama3`` also
            ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).

    Raises:
        ValueError: Unsupported ``rope_type`` or a missing parameter.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    if rope_type == "default":
        return inv_freq

    def need(key: str) -> float:
        if key not in params:
            raise ValueError(
                f"rope_scaling of type {rope_type!r} needs {key!r}; got keys {sorted(params)}"
            )
        return float(params[key])

    if rope_type == "linear":
        return inv_freq / need("factor")
    if rope_type == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        old_ctx = need("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; "
        f"supported types: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions.

    Args:
        head_dim: Features per head.
        theta: RoPE base (``rope_theta``).
        rope_type: One of :data:`SUPPORTED_ROPE_TYPES`.
        params: Parameters of the scaled variants.
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        rope_type: str = "default",
        params: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer(
            "inv_freq", compute_inv_freq(head_dim, theta, rope_type, params or {}), persistent=False
        )

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables ``[T, head_dim]`` for ``positions`` ``[T]``."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` by ``positions`` ``[T]``."""
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
