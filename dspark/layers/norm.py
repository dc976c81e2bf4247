from __future__ import annotations

import sys

import torch
from torch import nn

_OPS_MODULE = "dspark.layers.triton_ops"
_ops = None  # that module once imported (False: no triton here)


def fused_ops(*tensors: torch.Tensor):
    """`dspark.layers.triton_ops` if its fused kernels should take these tensors, else None.

    They take CUDA tensors of fp32/bf16/fp16 when no autograd is needed (the kernels have no
    backward) and DSPARK_FUSED_OPS is not 0; the torch code stays the reference and CPU path.
    The module (and triton) is imported on the first CUDA call only, so CPU runs never import
    triton before a test can set TRITON_INTERPRET; tests route CPU tensors through the
    interpreter with `triton_ops.ON_CPU = True`.
    """
    global _ops
    if tensors[0].is_cuda:
        if _ops is None:
            try:
                from dspark.layers import triton_ops as _ops
            except ImportError:  # pragma: no cover - no triton on this platform
                _ops = False
        ops = _ops
    else:
        ops = sys.modules.get(_OPS_MODULE)
        if ops is None or not (ops.ON_CPU and ops.INTERPRET):
            return None
    if not ops or not ops.ENABLED or any(t.dtype not in ops.DTYPES for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return ops


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, weight applied in the input dtype (as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops(x, self.weight)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then norm; returns (normed, new residual)."""
        if residual is None:
            return self(x), x
        ops = fused_ops(x, residual, self.weight)
        if ops is not None and residual.shape == x.shape and residual.dtype == x.dtype:
            return ops.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return self(x), x
