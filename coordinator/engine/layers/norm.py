"""Root-mean-square layer normalisation (replicated on every rank)."""

from __future__ import annotations

import torch
from torch import nn

from coordinator.engine.layers.weights import default_weight_loader, set_weight_loader

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32.

    The arithmetic follows Hugging Face's ``LlamaRMSNorm`` step for step
    (upcast, mean of squares, ``rsqrt``, downcast, scale) so fp32 results agree
    with it bit for bit.

    Args:
        hidden_size: Normalised feature size.
        eps: Added to the mean square.
        params_dtype: Weight dtype.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)
