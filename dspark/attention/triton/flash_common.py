"""Triton pieces shared by the attention kernels: the online-softmax tile over a paged cache,
split partial outputs and their combine, and the key-segment fold of the paged kernel.

Scores are in log2 units (exp2 domain, `sm_scale * log2 e`), accumulators fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized

LOG2E = 1.4426950408889634
# Triton's interpreter multiplies bf16 operands as raw uint16 bits (seen in 3.9): under it,
# dot operands are upcast exactly to fp32 (the rounding of p to the value dtype is kept).
_UPCAST_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _softmax_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A fresh online softmax over BLOCK_M rows: (acc, m_i, l_i) before any key."""
    return (tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
            tl.full([BLOCK_M], -1.0e30, dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32))


@triton.jit
def _fold_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """An empty segment fold (`_fold_segment`): (acc, m_run, w_run) before any segment."""
    return (tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
            tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
            tl.zeros([BLOCK_M], dtype=tl.float32))


@triton.jit
def _row_sums(p, DOT_PRECISION: tl.constexpr):
    """Each row's sum of p [M, N] (>= 0), as a dot with ones. A dot sums its reduction dim in
    the same order whatever the tile's height and warps, where tl.sum's tree across threads
    and warps follows the layout (compiled for sm_90: fp32 tiles of 16 and 32 rows spread a
    row's 64 keys 2 and 4 to a thread; a bf16 tile's over 4 warps, or 8 with 8 warps). The
    16 columns are equal, so their max is exact."""
    ones = tl.full([p.shape[1], 16], 1.0, p.dtype)
    return tl.max(_mma(p, ones, DOT_PRECISION), axis=1)


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax update: s [M, N] scores in log2 units (-inf = masked), v [N, D].
    l sums the weights the PV dot uses (p in v's dtype), in a layout-free order (_row_sums);
    the max is exact in any order."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None]).to(v.dtype)
    l_i = l_i * alpha + _row_sums(p, DOT_PRECISION)
    acc = acc * alpha[:, None] + _mma(p, v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_tile(
    acc, m_i, l_i,
    q,  # [BLOCK_M, BLOCK_D]
    qpos,  # [BLOCK_M] int32 query positions (used when CAUSAL)
    start, kv_hi,  # key positions [start, start + BLOCK_N), those >= kv_hi masked
    k_cache_ptr, v_cache_ptr, bt_ptr, kvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    sm_scale_log2,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One KV tile of the online softmax, read through the block table."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kpos = start + offs_n
    k_ok = kpos < kv_hi
    blk = tl.load(bt_ptr + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
    in_page = (kpos % PAGE).to(tl.int64)
    kt_ptrs = k_cache_ptr + (blk * stride_kb + in_page * stride_ks + kvh * stride_kh)[None, :]
    kt = tl.load(kt_ptrs + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    s = _mma(q, kt, DOT_PRECISION) * sm_scale_log2  # [M, N]
    if CAUSAL:
        visible = (kpos[None, :] <= qpos[:, None]) & k_ok[None, :]
    else:
        visible = k_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    v_ptrs = v_cache_ptr + (blk * stride_vb + in_page * stride_vs + kvh * stride_vh)[:, None]
    v = tl.load(v_ptrs + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    return _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)


@triton.jit
def _attend_paged(
    acc, m_i, l_i, q, qpos,
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) of this request
    k_cache_ptr, v_cache_ptr, bt_ptr, kvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    sm_scale_log2,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for start in range(kv_lo, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, qpos, start, kv_hi, k_cache_ptr, v_cache_ptr, bt_ptr, kvh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, sm_scale_log2,
            CAUSAL=CAUSAL, PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            DOT_PRECISION=DOT_PRECISION,
        )
    return acc, m_i, l_i


@triton.jit
def _segment_result(acc, m_i, l_i):
    """A key segment's normalised output and base-2 log-sum-exp (-1e30: it saw no key)."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_safe[:, None], tl.where(l_i > 0.0, m_i + tl.log2(l_safe), -1.0e30)


@triton.jit
def _fold_segment(acc, m_run, w_run, o, lse):
    """Fold one segment's (o, lse) into the running (acc, m_run, w_run), segments in key order;
    the output is acc / w_run. The paged kernel folds an unsplit row's segments with this, the
    combine a split row's partials: the same operations in the same order, so a row's bits do
    not depend on whether its step split it. (Explicit fma: no contraction left to the
    compiler. An empty segment, lse = -1e30 after a real one, folds in as exactly nothing.)"""
    m_new = tl.maximum(m_run, lse)
    a = tl.exp2(m_run - m_new)
    b = tl.exp2(lse - m_new)
    return tl.fma(o, b[:, None], acc * a[:, None]), m_new, tl.fma(w_run, a, b)


@triton.jit
def _store_result(
    acc, m_i, l_i, row_tok, row_head, row_ok, split,
    out_ptr, stride_ot, stride_oh,
    part_o_ptr, part_lse_ptr, num_tokens,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Write the final output (one split) or this split's partial output and lse."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tok = row_tok.to(tl.int64)
    if NUM_SPLITS == 1:
        ptrs = out_ptr + (tok * stride_ot + row_head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (split * num_tokens + tok) * NUM_HEADS + row_head  # [S, T, H] row index
        tl.store(part_o_ptr + (row * HEAD_DIM)[:, None] + offs_d[None, :], o, mask=mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), -1.0e30)
        tl.store(part_lse_ptr + row, lse, mask=row_ok)


@triton.jit(**unspecialized("num_tokens"))
def _combine_kernel(
    part_o_ptr,  # [S, N, H, D] fp32, normalised per split
    part_lse_ptr,  # [S, N, H] fp32, base-2 log-sum-exp (LSE_EMPTY for empty splits)
    out_ptr, stride_ot, stride_oh, num_tokens,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    row = (offs_s * num_tokens + tok) * NUM_HEADS + head  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    mask = s_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(part_o_ptr + (row * HEAD_DIM)[:, None] + offs_d[None, :], mask=mask, other=0.0)
    o = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    ptrs = out_ptr + tok * stride_ot + head * stride_oh + offs_d
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _empty(shape, dtype, device) -> torch.Tensor:
    """All allocations of this package (tests swap in a NaN-filled version)."""
    return torch.empty(shape, dtype=dtype, device=device)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def combine_splits(part_o, part_lse, out3d: torch.Tensor) -> None:
    """Merge [S, N, H, D] partials into out3d [N, H, D] (last dim contiguous)."""
    num_splits, num_tokens, num_heads, head_dim = part_o.shape
    _combine_kernel[(num_tokens, num_heads)](
        part_o, part_lse, out3d, out3d.stride(0), out3d.stride(1), num_tokens,
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if head_dim * num_splits <= 512 else 2,
    )


