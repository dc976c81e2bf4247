"""The drafter's context write with every layer fused: one GEMM, one kernel.

`DSparkDrafter.write_context` projects the step's context features H_ctx [T, d] to each
layer's keys and values, norms and rotates the keys and scatters both into the layer's paged
cache: per layer a GEMM plus three small launches. Every step pays it, plain steps included
(the context is written whether or not the step drafted), and on small models those launches
cost more than their arithmetic. Here the k/v rows of every layer's packed qkv weight are
stacked once into [L * 2 * kv, d], so one GEMM makes all of them, and one Triton kernel
(`attention/triton/context_write.py`) norms, rotates and writes every layer's.

Used where the fused kernels run (CUDA, or the interpreter in tests), the model is not being
trained, and the cache is one stacked allocation (`LayerKVCaches`, what `new_kv_caches`
returns); otherwise the per-layer torch path runs. The stacked weight is a copy: it is
rebuilt whenever a source weight has changed since (in-place updates bump a tensor's version
counter), so an edited model never writes stale keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.layers.norm import fused_ops


class LayerKVCaches(list):
    """Per-layer (k, v) cache views of one stacked allocation per side ([L, blocks, page,
    Hkv, D]), kept in `k` and `v` for kernels that write every layer at once."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        super().__init__((k[i], v[i]) for i in range(k.shape[0]))
        self.k, self.v = k, v


class FusedContext:
    """The stacked k/v projection of a drafter's layers, and the fused write that uses it."""

    def __init__(self, layers):
        attn = [layer.self_attn for layer in layers]
        self._sources = [a.qkv_proj.weight for a in attn] + [a.k_norm.weight for a in attn]
        self._sources += [a.qkv_proj.bias for a in attn if a.qkv_proj.bias is not None]
        self._stamp = self._versions()
        a0 = attn[0]
        self.num_kv, self.head_dim, self.eps = a0.num_kv_heads, a0.head_dim, a0.k_norm.eps
        with torch.no_grad():
            self.weight = torch.cat([a.qkv_proj.weight[a.q_size :] for a in attn])
            self.bias = None
            if a0.qkv_proj.bias is not None:
                self.bias = torch.cat([a.qkv_proj.bias[a.q_size :] for a in attn])
            self.k_norm = torch.stack([a.k_norm.weight for a in attn])
        self.num_layers = len(attn)

    def _versions(self) -> tuple:
        # inference tensors keep no version counter (and cannot be edited outside inference
        # mode): their storage alone identifies them
        return tuple((t.data_ptr(), -1 if t.is_inference() else t._version)
                     for t in self._sources)  # fmt: skip

    def stale(self) -> bool:
        return self._versions() != self._stamp

    def write(self, h_ctx: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              caches: LayerKVCaches, inv_freq: torch.Tensor) -> None:  # fmt: skip
        from dspark.attention.triton.context_write import write_context_kv

        kv = F.linear(h_ctx, self.weight, self.bias)
        kv = kv.view(-1, self.num_layers, 2, self.num_kv, self.head_dim)
        write_context_kv(kv, positions, slot_mapping, self.k_norm, self.eps, inv_freq,
                         caches.k, caches.v)  # fmt: skip


def fused_context_for(drafter, h_ctx: torch.Tensor, caches) -> FusedContext | None:
    """The drafter's FusedContext if this write can take the fused path (built or rebuilt as
    needed), else None."""
    if not isinstance(caches, LayerKVCaches) or caches.k.dtype != h_ctx.dtype:
        return None
    attn = drafter.layers[0].self_attn
    if fused_ops(h_ctx, attn.qkv_proj.weight, attn.k_norm.weight) is None:
        return None  # CPU without the interpreter, autograd, unsupported dtype, or switched off
    fused = drafter._fused_context
    if fused is None or fused.stale():
        fused = FusedContext(drafter.layers)
        drafter._fused_context = fused
    return fused
