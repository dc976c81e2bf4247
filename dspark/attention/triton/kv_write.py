"""Scatter the step's K/V into the paged cache by `slot_mapping` (one program per token).

Padding tokens carry `SENTINEL_SLOT` and are skipped, so block 0 of the cache is never
touched by this kernel (the torch reference writes garbage there; nothing ever reads it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.attention.base import SENTINEL_SLOT


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr,  # [T, Hkv, D]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, Hkv, D] (slots are rows of Hkv*D)
    slot_ptr,  # [T] int64
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kc_slot, stride_kc_h,
    stride_vc_slot, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SENTINEL: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if (slot == SENTINEL) | (slot < 0):
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    tok = token.to(tl.int64)
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + slot * stride_kc_slot + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    vc = v_cache_ptr + slot * stride_vc_slot + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "blocks must be dense"
    assert v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1), "blocks must be dense"
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        SENTINEL=SENTINEL_SLOT,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
