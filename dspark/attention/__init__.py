"""Attention backends: the Triton kernels (GPU) and the torch reference (CPU, tests)."""

from __future__ import annotations

import torch

from dspark.attention.base import AttentionBackend
from dspark.config import env_switch


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from dspark.attention.triton_backend import TritonAttentionBackend

        # DSPARK_ATTENTION_SPLITS=0: no flash-decoding KV splits. Split or not, a row's keys
        # are summed in the same fixed segments in the same order (paged_attention), so the
        # switch changes speed only: few requests over long contexts decode slower without.
        return TritonAttentionBackend(max_splits=16 if env_switch("DSPARK_ATTENTION_SPLITS") else 1)
    from dspark.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
