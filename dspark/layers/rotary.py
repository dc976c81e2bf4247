"""Rotary position embeddings (rotate-half layout), incl. Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from dspark.layers.norm import RMSNorm, fused_ops


def rope_inv_freq(head_dim: int, rope: dict, device=None) -> torch.Tensor:
    theta = float(rope.get("rope_theta", 10000.0))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope["factor"])
    if rope_type == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_ctx = float(rope["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """RoPE on [..., H, D] heads; positions [...] match the leading dims. On CUDA the fused
    Triton kernel computes the same values (incl. the roundings to the activation dtype)."""

    def __init__(self, head_dim: int, rope: dict):
        super().__init__()
        self.head_dim = head_dim
        # a target built on the meta device (target.py) recomputes this buffer afterwards: its
        # placeholder is computed on the CPU, since these ops on meta tensors would import
        # torch's Python meta kernels (~2 s of an engine's start-up)
        default = torch.empty(0).device
        if default.type == "meta":
            inv_freq = rope_inv_freq(head_dim, rope, device="cpu").to(default)
        else:
            inv_freq = rope_inv_freq(head_dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _fused(self, *tensors: torch.Tensor):
        """The fused-kernel module if it takes these tensors (same dtype, even head_dim)."""
        x = tensors[0]
        if x.dim() < 3 or x.shape[-1] % 2 or any(t.dtype != x.dtype for t in tensors):
            return None
        return fused_ops(*tensors)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q [T, H, D], k [T, Hkv, D], positions [T] (any leading shape matching q[..., 0, 0])
        ops = self._fused(q, k)
        if ops is not None:
            return ops.qk_norm_rope(positions, q, k, self.inv_freq.float())
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def norm_forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm, k_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """self(positions, q_norm(q), k_norm(k)) (per-head q/k norm then RoPE): one kernel."""
        ops = self._fused(q, k, q_norm.weight, k_norm.weight)
        if ops is not None:
            return ops.qk_norm_rope(
                positions, q, k, self.inv_freq.float(), q_norm.weight, k_norm.weight,
                q_norm.eps, k_norm.eps,
            )  # fmt: skip
        return self(positions, q_norm(q), k_norm(k))

    def forward_to_cache(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
    ) -> torch.Tensor | None:
        """norm_forward (or forward, without norms) with k and v stored straight into the
        paged cache at slot_mapping, in one kernel; returns q. None: the fused kernel does
        not take these tensors (the caller rotates and writes apart)."""
        weights = () if q_norm is None else (q_norm.weight, k_norm.weight)
        ops = self._fused(q, k, v, k_cache, v_cache, *weights)
        if ops is None:
            return None
        if q_norm is None:
            return ops.qk_norm_rope_to_cache(positions, q, k, v, self.inv_freq.float(),
                                             slot_mapping, k_cache, v_cache)  # fmt: skip
        return ops.qk_norm_rope_to_cache(
            positions, q, k, v, self.inv_freq.float(), slot_mapping, k_cache, v_cache,
            q_norm.weight, k_norm.weight, q_norm.eps, k_norm.eps,
        )  # fmt: skip

    def apply_one(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ops = self._fused(x)
        if ops is not None:
            return ops.qk_norm_rope(positions, x, None, self.inv_freq.float())[0]
        cos, sin = self.cos_sin(positions, x.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return x * cos + _rotate_half(x) * sin
