"""Rotary position embeddings (RoPE) in the Llama "rotate half" layout.

Supported ``rope_type`` values: ``default``, ``linear`` (positions divided by
``factor``), ``llama3`` (Llama 3.1 frequency-dependent scaling) and ``dynamic``
(dynamic NTK: once a sequence is longer than ``max_position_embeddings`` the
base grows with its length). The inverse frequencies are computed exactly as
Hugging Face computes them, so cosines and sines agree with ``LlamaRotaryEmbedding``.

Dynamic NTK is stateless here: every token of a request is rotated with the
frequencies for that request's length *after* the step (its context length),
which is what Hugging Face computes for a single sequence (prefill with the
prompt length, each decode step with the grown length; keys already cached
keep the rotation they were stored with). Hugging Face's module additionally
remembers the longest length seen across calls; that cross-request state is
deliberately not reproduced (vLLM does not reproduce it either). A prompt
prefilled in chunks is rotated chunk by chunk with the length reached so far,
so only an unchunked prefill reproduces Hugging Face's numbers exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["RotaryEmbedding", "SUPPORTED_ROPE_TYPES", "compute_inv_freq"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


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
    if rope_type in ("default", "dynamic"):  # dynamic: the base at short lengths
        return inv_freq

    def need(key: str) -> float:
        if key not in params or params[key] is None:
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
        max_position_embeddings: Length up to which ``dynamic`` keeps the
            original frequencies (required for ``dynamic``).
    """

    def __init__(
        self,
        head_dim: int,
        theta: float = 10000.0,
        rope_type: str = "default",
        params: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)
        self.dynamic = rope_type == "dynamic"
        self.factor = 1.0
        self.max_positions = 0
        if self.dynamic:
            factor = (params or {}).get("factor")
            if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
                raise ValueError(
                    f"rope_scaling of type 'dynamic' needs a numeric 'factor' >= 1, got {factor!r}"
                )
            if not isinstance(max_position_embeddings, int) or max_position_embeddings <= 0:
                raise ValueError(
                    "rope type 'dynamic' needs max_position_embeddings (a positive int), got "
                    f"{max_position_embeddings!r}"
                )
            self.factor = float(factor)
            self.max_positions = max_position_embeddings
        self.inv_freq: torch.Tensor
        self.register_buffer(
            "inv_freq", compute_inv_freq(head_dim, theta, rope_type, params or {}), persistent=False
        )

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per-token inverse frequencies ``[T, head_dim // 2]`` for dynamic NTK scaling."""
        dim = self.head_dim
        grown = seq_lens.clamp(min=self.max_positions)
        base = self.theta * ((self.factor * grown / self.max_positions) - (self.factor - 1)) ** (
            dim / (dim - 2)
        )
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        scaled = 1.0 / (base[:, None] ** exponents[None, :])
        return torch.where((seq_lens > self.max_positions)[:, None], scaled, self.inv_freq[None, :])

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_lens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` tables ``[T, head_dim]`` for ``positions`` ``[T]``.

        ``seq_lens`` ``[T]`` (the length of each token's sequence) is needed by
        ``dynamic`` scaling and ignored by the other variants.
        """
        if self.dynamic:
            if seq_lens is None:
                raise ValueError(
                    "dynamic rotary embeddings need the sequence length of every token")

            inv_freq = self._dynamic_inv_freq(seq_lens)
        else:
            inv_freq = self.inv_freq[None, :]
        freqs = positions[:, None].to(torch.float32) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        seq_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]`` by ``positions`` ``[T]``."""
        cos, sin = self.cos_sin(positions, q.dtype, seq_lens)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
