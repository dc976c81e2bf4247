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

        # DSPARK_ATTENTION_SPLITS=0: no flash-decoding KV splits. A split row sums its keys in
        # another order than an unsplit one, and whether a row splits depends on the step it
        # rides in (its batch size, the longest context, a prefill beside it), so bf16 greedy
        # outputs of the same prompt can part at near-ties between batch compositions (e.g.
        # with and without speculation). Without splits every row is one left-to-right pass.
        return TritonAttentionBackend(max_splits=16 if env_switch("DSPARK_ATTENTION_SPLITS") else 1)
    from dspark.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()
