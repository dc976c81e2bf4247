from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then norm; returns (normed, new residual)."""
        if residual is not None:
            x = x + residual
        return self(x), x
