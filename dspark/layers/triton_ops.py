"""Fused Triton kernels for the elementwise work of a decoder layer.

* `add_rms_norm`: s = x + residual, y = weight * rmsnorm(s): one program per row.
* `qk_norm_rope`: per-head RMSNorm of q and k (optional) then rotate-half RoPE with cos/sin
  from positions * inv_freq: one program per (token, block of heads); q and k in one launch.
* `silu_and_mul`: silu(gate) * up from the packed [T, 2I] gate_up projection.

They reproduce the torch code of norm.py / rotary.py / qwen3.MLP op by op (that code stays the
reference and the CPU path): arithmetic is fp32, and every intermediate that torch stores in
the activation dtype is rounded to it here too (round to nearest even); products are never
contracted into FMAs (`enable_fp_fusion=False`); exp, cos, sin and rsqrt are libdevice's
`__nv_*f` functions (those behind torch's CUDA kernels; `tl.exp` would be `ex2.approx`) and
division is IEEE (`div_rn`). What is left is the order of the fp32 sum of squares and the
mean as sum * fl32(1 / d) (torch's CUDA mean; its CPU mean divides): ulp-level in fp32, and
an occasional 1-ulp flip after rounding to bf16/fp16.

Grids depend on shapes only and nothing syncs with the host, so all of it is CUDA-graph safe.
Under `TRITON_INTERPRET=1` (CPU tests) the kernels avoid libdevice and round fp32 -> bf16 on
the bits, since the interpreter truncates that conversion (seen in Triton 3.9).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dspark.config import env_switch
from dspark.triton_jit import unspecialized

# DSPARK_FUSED_OPS=0 keeps the torch code everywhere (dispatch: norm.fused_ops).
ENABLED = env_switch("DSPARK_FUSED_OPS")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
ON_CPU = False  # tests: also dispatch CPU tensors here when INTERPRET (slow; numerics only)
_INTERPRET = tl.constexpr(INTERPRET)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# launch option: keep a * b + c as two roundings, as torch's separate kernels compute it
_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _round(x, DT: tl.constexpr):
    """fp32 x rounded to DT (nearest even) and back to fp32; the identity for fp32."""
    if DT == tl.float32:
        return x
    elif DT == tl.bfloat16 and _INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _cast(x, DT: tl.constexpr):
    """fp32 x -> DT, rounding to nearest even (for stores)."""
    return _round(x, DT).to(DT)


@triton.jit
def _rsqrt(x):
    if _INTERPRET:
        return tl.math.rsqrt(x)
    else:
        return libdevice.rsqrt(x)


@triton.jit
def _exp(x):
    if _INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _cos_sin(x):
    if _INTERPRET:
        return tl.cos(x), tl.sin(x)
    else:
        return libdevice.cos(x), libdevice.sin(x)


@triton.jit(**unspecialized("inner"))
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    inner, stride_xo, stride_xi, stride_ro, stride_ri, eps, inv_n,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0)
    outer = (row // inner).to(tl.int64)
    sub = (row % inner).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt: tl.constexpr = x_ptr.dtype.element_ty
    x_off = outer * stride_xo + sub * stride_xi
    s = tl.load(x_ptr + x_off + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_off = outer * stride_ro + sub * stride_ri
        r = tl.load(res_ptr + r_off + offs, mask=mask, other=0.0).to(tl.float32)
        s = _round(s + r, dt)  # x + residual in the input dtype
        tl.store(res_out_ptr + row.to(tl.int64) * N + offs, _cast(s, dt), mask=mask)
    var = tl.sum(s * s, axis=0) * inv_n
    y = _round(s * _rsqrt(var + eps), dt)  # normed, .to(dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out_dt: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + row.to(tl.int64) * N + offs, _cast(y * w, out_dt), mask=mask)


@triton.jit
def norm_rope_heads(
    in_ptr, out_ptr, w_ptr, h0, stride_h, stride_oh, cos, sin, eps, inv_d,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Heads [h0, h0 + BLOCK_H) of one token (in_ptr / out_ptr: its first head, heads
    stride_h / stride_oh apart): optional RMSNorm, then rotate-half RoPE."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_HALF)
    j_ok = offs_j < HALF
    mask = (offs_h < NUM_HEADS)[:, None] & j_ok[None, :]
    dt: tl.constexpr = in_ptr.dtype.element_ty
    ptrs = in_ptr + (offs_h * stride_h)[:, None] + offs_j[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)  # first half of each head
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)  # second half
    if HAS_NORM:
        var = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) * inv_d
        r = _rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
        x1 = _round(_round(x1 * r, dt) * w1, dt)
        x2 = _round(_round(x2 * r, dt) * w2, dt)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1): each product rounded
    o1 = _round(x1 * cos, dt) - _round(x2 * sin, dt)
    o2 = _round(x2 * cos, dt) + _round(x1 * sin, dt)
    out = out_ptr + (offs_h * stride_oh)[:, None] + offs_j[None, :]
    tl.store(out, _cast(o1, dt), mask=mask)
    tl.store(out + HALF, _cast(o2, dt), mask=mask)


@triton.jit
def copy_heads(in_ptr, out_ptr, h0, stride_h, stride_oh, NUM_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads [h0, h0 + BLOCK_H) of one token copied as they are (pointers as in
    norm_rope_heads): the values beside keys written by norm_rope_heads."""
    offs_h = h0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src = in_ptr + (offs_h * stride_h)[:, None] + offs_d[None, :]
    dst = out_ptr + (offs_h * stride_oh)[:, None] + offs_d[None, :]
    tl.store(dst, tl.load(src, mask=mask), mask=mask)


@triton.jit
def rope_cos_sin(pos_ptr, inv_freq_ptr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 DT: tl.constexpr):
    """cos, sin [1, BLOCK_HALF] of one position, rounded to DT as torch's cos_sin stores them."""
    offs_j = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_j, mask=offs_j < HALF, other=0.0)
    freqs = tl.load(pos_ptr).to(tl.float32) * inv_freq  # positions.float() * inv_freq
    cos, sin = _cos_sin(freqs)
    return _round(cos, DT)[None, :], _round(sin, DT)[None, :]


@triton.jit(**unspecialized("pos_ptr", "slot_ptr"))  # views into the packed step buffer
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, eps_q, eps_k, inv_d,
    v_ptr, stride_vt, stride_vh, slot_ptr, vo_ptr,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr, TO_CACHE: tl.constexpr, SENTINEL: tl.constexpr,
):
    """TO_CACHE: k's heads go to the paged cache ko_ptr at the token's slot (slot s at
    s * NUM_K * D, heads D apart), v's are copied to vo_ptr likewise, and a padding token
    (SENTINEL or a negative slot) writes neither; else k goes to the dense ko_ptr."""
    tok = tl.program_id(0)
    row = tok.to(tl.int64)
    hb = tl.program_id(1)
    dt: tl.constexpr = q_ptr.dtype.element_ty
    cos, sin = rope_cos_sin(pos_ptr + tok, inv_freq_ptr, HALF, BLOCK_HALF, dt)
    if hb < Q_BLOCKS:
        norm_rope_heads(
            q_ptr + row * stride_qt, qo_ptr + row * (NUM_Q * 2 * HALF), qw_ptr, hb * BLOCK_H,
            stride_qh, 2 * HALF, cos, sin, eps_q, inv_d, NUM_HEADS=NUM_Q, HALF=HALF,
            BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, HAS_NORM=HAS_NORM,
        )
    else:
        h0 = (hb - Q_BLOCKS) * BLOCK_H
        if TO_CACHE:
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            if (slot != SENTINEL) & (slot >= 0):
                norm_rope_heads(
                    k_ptr + row * stride_kt, ko_ptr + slot * (NUM_K * 2 * HALF), kw_ptr, h0,
                    stride_kh, 2 * HALF, cos, sin, eps_k, inv_d, NUM_HEADS=NUM_K, HALF=HALF,
                    BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, HAS_NORM=HAS_NORM,
                )
                copy_heads(v_ptr + row * stride_vt, vo_ptr + slot * (NUM_K * 2 * HALF), h0,
                           stride_vh, 2 * HALF, NUM_HEADS=NUM_K, HEAD_DIM=2 * HALF,
                           BLOCK_H=BLOCK_H, BLOCK_D=2 * BLOCK_HALF)  # values: as they are
        else:
            norm_rope_heads(
                k_ptr + row * stride_kt, ko_ptr + row * (NUM_K * 2 * HALF), kw_ptr, h0,
                stride_kh, 2 * HALF, cos, sin, eps_k, inv_d, NUM_HEADS=NUM_K, HALF=HALF,
                BLOCK_H=BLOCK_H, BLOCK_HALF=BLOCK_HALF, HAS_NORM=HAS_NORM,
            )


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    dt: tl.constexpr = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + tok * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = _round(tl.math.div_rn(g, 1.0 + _exp(-g)), dt)  # F.silu: x / (1 + exp(-x)), rounded
    tl.store(out_ptr + tok * inter + offs, _cast(act * u, dt), mask=mask)


@functools.cache
def _inv(n: int) -> float:
    """fl32(1 / n), the factor torch's CUDA mean multiplies the fp32 sum by."""
    return float(np.float32(1.0) / np.float32(n))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [N1, N2, d] view (copy only if it cannot be one) with unit stride along d."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    return t.unsqueeze(1) if t.dim() == 2 else t.flatten(0, -3)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual); x itself is the residual if None."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out, s
    x3 = _rows(x)
    r3 = x3 if residual is None else _rows(residual)
    block = triton.next_power_of_2(d)
    _add_rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3, r3, weight, out, s,
        x3.shape[1], x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), eps, _inv(d),
        N=d, BLOCK=block, HAS_RES=residual is not None,
        num_warps=min(16, max(1, block // 512)), **_NO_FMA,
    )  # fmt: skip
    return out, s


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


def qk_norm_rope(
    positions: torch.Tensor,  # [...] matching q's leading dims
    q: torch.Tensor,  # [..., H, D]
    k: torch.Tensor | None,  # [..., Hkv, D]
    inv_freq: torch.Tensor,  # [D / 2] fp32
    q_weight: torch.Tensor | None = None,  # [D] q/k RMSNorm weights (None: no norm)
    k_weight: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rotary(positions, q_norm(q), k_norm(k)) into new contiguous tensors (k may be None);
    q, k and the norm weights share one dtype."""
    head_dim = q.shape[-1]
    assert head_dim % 2 == 0 and inv_freq.dtype == torch.float32
    assert all(t is None or t.dtype == q.dtype for t in (k, q_weight, k_weight))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = None if k is None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q3 = _rows(q)
    k3 = q3[:, :0] if k is None else _rows(k)
    num_tokens = q3.shape[0]
    assert positions.numel() == num_tokens and k3.shape[0] == num_tokens
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    _launch_qk_norm_rope(positions, q3, k3, q_out, q_out if k_out is None else k_out, inv_freq,
                         q_weight, k_weight, q_eps, k_eps)  # fmt: skip
    return q_out, k_out


def qk_norm_rope_to_cache(
    positions: torch.Tensor,  # [T]
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    inv_freq: torch.Tensor,  # [D / 2] fp32
    slot_mapping: torch.Tensor,  # [T] int64; SENTINEL_SLOT or negative: padding
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D], dense
    v_cache: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    q_eps: float = 0.0,
    k_eps: float = 0.0,
) -> torch.Tensor:
    """What `qk_norm_rope` then `write_kv` do, in one launch: returns the rotated (normed) q;
    rotated (normed) keys and the values go straight into the paged cache at their slots."""
    num_tokens, num_k, head_dim = k.shape
    assert head_dim % 2 == 0 and inv_freq.dtype == torch.float32 and q.shape[0] == num_tokens
    assert all(t is None or t.dtype == q.dtype for t in (k, q_weight, k_weight))
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[2:] == (num_k, head_dim) and k_cache.dtype == k.dtype == v.dtype
    for cache in (k_cache, v_cache):  # slot s of the cache: s * Hkv * D, heads D apart
        assert cache.stride(-1) == 1 and cache.stride(2) == head_dim
        assert cache.stride(1) == num_k * head_dim and cache.stride(0) == cache.shape[1] * (
            num_k * head_dim)  # fmt: skip
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    v3 = _rows(v)
    _launch_qk_norm_rope(positions, _rows(q), _rows(k), q_out, k_cache, inv_freq, q_weight,
                         k_weight, q_eps, k_eps, (v3, slot_mapping, v_cache))  # fmt: skip
    return q_out


def _launch_qk_norm_rope(positions, q3, k3, q_out, k_dst, inv_freq, q_weight, k_weight, q_eps,
                         k_eps, to_cache=None) -> None:  # fmt: skip
    from dspark.attention.base import SENTINEL_SLOT

    num_tokens, num_q, head_dim = q3.shape
    num_k = k3.shape[1]
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    heads = triton.next_power_of_2(max(num_q, num_k, 1))
    block_h = heads if INTERPRET or not q3.is_cuda else max(1, min(heads, 512 // block_half))
    q_blocks = triton.cdiv(num_q, block_h)
    has_norm = q_weight is not None
    q_w = q_weight if has_norm else q3
    k_w = q_w if k_weight is None else k_weight  # only read with k and a norm
    v3, slots, v_dst = to_cache if to_cache is not None else (k3, positions, k_dst)  # (unread)
    _qk_norm_rope_kernel[(num_tokens, q_blocks + triton.cdiv(num_k, block_h))](
        q3, k3, q_out, k_dst, q_w, k_w,
        positions.reshape(-1).contiguous(), inv_freq.contiguous(),
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), q_eps, k_eps, _inv(head_dim),
        v3, v3.stride(0), v3.stride(1), slots, v_dst,
        NUM_Q=num_q, NUM_K=num_k, Q_BLOCKS=q_blocks, HALF=half, BLOCK_HALF=block_half,
        BLOCK_H=block_h, HAS_NORM=has_norm, TO_CACHE=to_cache is not None,
        SENTINEL=SENTINEL_SLOT,
        num_warps=4 if block_h * block_half >= 512 else (2 if block_h * block_half >= 128 else 1),
        **_NO_FMA,
    )  # fmt: skip


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up = cat(gate, up) along the last dim."""
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    x2 = gate_up.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out.numel() == 0:
        return out
    block = triton.next_power_of_2(inter)
    block = min(block, 4096) if INTERPRET or not gate_up.is_cuda else min(block, 1024)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1, **_NO_FMA
    )
    return out
