"""Attention backends: the Triton kernels (GPU) and the torch reference (CPU, tests)."""

from __future__ import annotations

import torch

from dspark.attention.base import AttentionBackend


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from dspark.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from dspark.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
