"""The DSpark drafter's context K/V of every layer in one launch.

After one GEMM has projected the step's context features to every layer's keys and values
(`kv` [T, L, 2, Hkv, D]), one program per (token, layer, block of heads) applies the layer's
per-head key RMSNorm (k_norm) and rotate-half RoPE to the keys and scatters keys and values
into that layer's paged cache at the token's slot. It replaces, per layer, a norm, a RoPE and
a KV-write launch (3L launches, 15 for a 5-layer drafter) that every step pays, plain steps
included, since the context is written whether or not the step drafted.

Numerics are those of `triton_ops.qk_norm_rope` (the torch reference's roundings op by op).
Padding tokens (SENTINEL_SLOT or a negative slot) write nothing. Grids depend on shapes only
and nothing syncs with the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.attention.base import SENTINEL_SLOT
from dspark.layers.triton_ops import (
    _NO_FMA,
    _inv,
    copy_heads,
    norm_rope_heads,
    rope_cos_sin,
)
from dspark.triton_jit import unspecialized


@triton.jit(**unspecialized("pos_ptr", "slot_ptr"))  # views into the packed step buffer
def _context_kv_kernel(
    kv_ptr,  # [T, L, 2, Hkv, D] contiguous
    pos_ptr, slot_ptr,  # [T] int64
    kw_ptr,  # [L, D] k_norm weights
    inv_freq_ptr,  # [D / 2] fp32
    k_cache_ptr, v_cache_ptr,  # [L, blocks, page, Hkv, D] contiguous: slot s of layer l at
    stride_layer, eps, inv_d,  # l * stride_layer + s * Hkv * D
    NUM_LAYERS: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, SENTINEL: tl.constexpr,
):
    tok = tl.program_id(0)
    layer = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if (slot == SENTINEL) | (slot < 0):
        return
    head: tl.constexpr = 2 * HALF
    row = tok.to(tl.int64) * (NUM_LAYERS * 2 * NUM_KV * head) + layer * (2 * NUM_KV * head)
    cache_row = layer.to(tl.int64) * stride_layer + slot * (NUM_KV * head)
    dt: tl.constexpr = kv_ptr.dtype.element_ty
    cos, sin = rope_cos_sin(pos_ptr + tok, inv_freq_ptr, HALF, BLOCK_HALF, dt)
    norm_rope_heads(
        kv_ptr + row, k_cache_ptr + cache_row, kw_ptr + layer * head, h0, head, head, cos, sin,
        eps, inv_d, NUM_HEADS=NUM_KV, HALF=HALF, BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF,
        HAS_NORM=True,
    )  # fmt: skip
    copy_heads(kv_ptr + row + NUM_KV * head, v_cache_ptr + cache_row, h0, head, head,
               NUM_HEADS=NUM_KV, HEAD_DIM=head, BLOCK_H=BLOCK_H, BLOCK_D=2 * BLOCK_HALF)


def write_context_kv(
    kv: torch.Tensor,  # [T, L, 2, Hkv, D]: every layer's projected keys and values
    positions: torch.Tensor,  # [T] int64
    slot_mapping: torch.Tensor,  # [T] int64
    k_norm_weight: torch.Tensor,  # [L, D]
    eps: float,
    inv_freq: torch.Tensor,  # [D / 2] fp32
    k_cache: torch.Tensor,  # [L, blocks, page, Hkv, D]
    v_cache: torch.Tensor,
) -> None:
    num_tokens, num_layers, two, num_kv, head_dim = kv.shape
    assert two == 2 and head_dim % 2 == 0 and inv_freq.dtype == torch.float32
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] == num_layers
    assert k_cache.shape[3:] == (num_kv, head_dim) and k_cache.dtype == kv.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and kv.is_contiguous()
    assert k_norm_weight.shape == (num_layers, head_dim) and k_norm_weight.dtype == kv.dtype
    if num_tokens == 0:
        return
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = triton.next_power_of_2(num_kv)
    block_h = heads if not kv.is_cuda else max(1, min(heads, 512 // block_half))
    grid = (num_tokens, num_layers, triton.cdiv(num_kv, block_h))
    _context_kv_kernel[grid](
        kv, positions, slot_mapping, k_norm_weight.contiguous(), inv_freq.contiguous(),
        k_cache, v_cache, k_cache.stride(0), eps, _inv(head_dim),
        NUM_LAYERS=num_layers, NUM_KV=num_kv, HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, SENTINEL=SENTINEL_SLOT,
        num_warps=4 if block_h * block_half >= 512 else (2 if block_h * block_half >= 128 else 1),
        **_NO_FMA,
    )  # fmt: skip
