"""The per-step forward context: attention metadata, backend and KV caches.

Layers read it instead of receiving metadata through model signatures. It is a context
manager that refuses nesting, so a forgotten reset cannot leak one step's metadata into the
next.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dspark.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


_CONTEXT: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _CONTEXT
    if _CONTEXT is not None:
        raise RuntimeError("forward contexts cannot be nested")
    _CONTEXT = ctx
    try:
        yield ctx
    finally:
        _CONTEXT = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context is set: call the model inside forward_context()")
    return _CONTEXT
