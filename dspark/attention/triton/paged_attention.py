"""Paged attention over a ragged token stream (prefill chunks, decode and verify rows).

Grid `(T // BLOCK_Q + R + 1, Hkv, num_splits)`. Axis 0 enumerates query blocks: request r
owns the programs `[cu_q[r] // BLOCK_Q + r, cu_q[r+1] // BLOCK_Q + r + 1)`, which is at
least `ceil(len_r / BLOCK_Q)` of them for any device `cu_q` (surplus programs exit at once),
and the programs past `cu_q[R] // BLOCK_Q + R` cover the padding tail (a virtual request R
with seq_len 0, whose rows come out as zeros). A program finds its request by binary search,
so the grid depends only on CPU numbers (T, R, `max_query_len` for the block shape), never on
device lengths: no host sync, and a CUDA graph captured at one T/R replays correctly with any
device boundaries.

A program holds `BLOCK_Q` consecutive query tokens x the `GROUP` query heads of one KV head
(`BLOCK_M = BLOCK_Q * GROUP_PAD` rows), so each KV tile is loaded once for the whole group
and all tokens of a decode/verify row. It streams the request's KV through `block_tables`
in tiles of `BLOCK_N` positions (one table lookup per position, so any page size works)
with an fp32 online softmax in the exp2 domain, up to `min(seq_len, max position + 1)`.
The causal rule is the reference's: key position <= query position and < seq_len.

A step that mixes prefill chunks with decode / verify rows runs as two launches when the
prefill tile would be much taller than a decode row needs (`short_query_len`, the engine's
1 + K): a request of more than `SHORT_MAX` query tokens (its device length decides) and the
padding tail are attended by the first launch, with the prefill tile; every other request by
the second, with the decode tile and one program per request (program r is request r's: no
search). Each launch skips the other's requests, so the grids still depend on CPU numbers only
and a graph replays correctly whichever rows turn out short. (One launch gave each 1-token
decode row a 128-row tile: 503 against 303 us for a c = 256 step's layer on the H200.)

With `num_splits > 1` (flash decoding, for few programs over long contexts) axis 2 splits
each program's KV range into equal tile-aligned chunks computed on device; every split
writes a normalised partial output and its log-sum-exp (base 2), then `_combine_kernel`
merges them. Empty splits write zeros and a -1e30 sentinel, so every partial is written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dspark.attention.base import AttentionMetadata
from dspark.attention.triton.launch_config import (
    Launch,
    _launch_config,
    launch_plan,
    num_stages,
    pick_num_splits,
)
from dspark.triton_jit import unspecialized

LSE_EMPTY = -1.0e30  # log-sum-exp written by a split that saw no key
LOG2E = 1.4426950408889634
# Triton's interpreter multiplies bf16 operands as raw uint16 bits (seen in 3.9): under it,
# dot operands are upcast exactly to fp32 (the rounding of p to the value dtype is kept).
_UPCAST_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


@triton.jit
def _find_req(cu_q_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr):
    """Last r in [0, R] with cu_q[r] // BLOCK_Q + r <= pid (strictly increasing in r)."""
    lo: tl.int32 = 0
    hi = num_reqs + 1
    while lo < hi:
        mid = (lo + hi) // 2
        val = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if val <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _mma(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation."""
    if _UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """One online-softmax update: s [M, N] scores in log2 units (-inf = masked), v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_paged(
    acc, m_i, l_i,
    q,  # [BLOCK_M, BLOCK_D]
    qpos,  # [BLOCK_M] int32 query positions (used when CAUSAL)
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) of this request
    k_cache_ptr, v_cache_ptr, bt_ptr, kvh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    sm_scale_log2,
    CAUSAL: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
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
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)
    return acc, m_i, l_i


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


@triton.jit(**unspecialized("num_reqs", "num_tokens", "positions_ptr", "stride_bt"))
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_q_ptr, seq_lens_ptr, positions_ptr, block_tables_ptr,
    num_reqs, num_tokens, sm_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PASS: tl.constexpr, SHORT_MAX: tl.constexpr,  # PASS 0: every request; 1: short; 2: long
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if PASS == 1:  # the short launch: program r is request r's (a short request fits one tile)
        r = pid
        is_real = pid < num_reqs
    else:  # a binary search over cu_q (cheap: ~2% of a 256-row decode step's attention)
        r = _find_req(cu_q_ptr, pid, num_reqs, BLOCK_Q)
        is_real = r < num_reqs
    q_start = tl.load(cu_q_ptr + r)
    q_end = tl.load(cu_q_ptr + r + 1, mask=is_real, other=0)
    q_end = tl.where(is_real, q_end, num_tokens)
    if PASS == 1:
        tok0 = q_start
    else:
        tok0 = q_start + (pid - (q_start // BLOCK_Q + r)) * BLOCK_Q
    if tok0 >= q_end:
        return
    if PASS == 1:  # the other launch attends requests longer than SHORT_MAX
        if q_end - q_start > SHORT_MAX:
            return
    if PASS == 2:  # (and the padding tail, whatever its length)
        if is_real & (q_end - q_start <= SHORT_MAX):
            return
    seq_len = tl.load(seq_lens_ptr + r, mask=is_real, other=0)  # padding tail: no keys

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_tok = tok0 + offs_m // GROUP_PAD
    row_g = offs_m % GROUP_PAD
    row_head = kvh * GROUP + row_g
    row_ok = (row_tok < q_end) & (row_g < GROUP)
    qpos = tl.load(positions_ptr + row_tok, mask=row_ok, other=-1).to(tl.int32)
    q_ptrs = q_ptr + (row_tok.to(tl.int64) * stride_qt + row_head * stride_qh)[:, None]
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)

    kv_hi = tl.minimum(seq_len, tl.max(qpos, axis=0) + 1)
    chunk = tl.cdiv(tl.cdiv(kv_hi, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_hi)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_paged(
        acc, m_i, l_i, q, qpos, lo, hi,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + r.to(tl.int64) * stride_bt, kvh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, sm_scale_log2,
        CAUSAL=True, PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION=DOT_PRECISION,
    )
    _store_result(
        acc, m_i, l_i, row_tok, row_head, row_ok, split,
        out_ptr, stride_ot, stride_oh, part_o_ptr, part_lse_ptr, num_tokens,
        NUM_HEADS=NUM_HEADS, NUM_SPLITS=NUM_SPLITS, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )


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


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    num_splits: int | None = None,  # None: heuristic (the short launch never splits)
    max_splits: int = 16,
    min_chunk: int = 128,
    short_query_len: int = 0,  # the engine's decode / verify query length (0: one launch)
    block_q: int | None = None,  # test overrides of the launch config (one launch)
    block_n: int | None = None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = _empty(q.shape, q.dtype, q.device)
    if num_tokens == 0:
        return out
    if md.num_reqs == 0:
        return out.zero_()
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    if block_q or block_n:
        bq, bn, warps = _launch_config(group_pad, md.max_query_len, head_dim, q.is_cuda)
        bq, bn = block_q or bq, block_n or bn
        plan = (Launch(bq, bn, warps, 0, 0),)
    else:
        plan = launch_plan(group_pad, md.max_query_len, head_dim, q.is_cuda, short_query_len)
    for launch in plan:
        splits = 1 if launch.pass_ == 1 else num_splits
        if splits is None:
            q_tiles = triton.cdiv(max(1, md.max_query_len), launch.block_q)
            busy = md.num_reqs * num_kv_heads * q_tiles
            splits = pick_num_splits(q.device, busy, md.max_seq_len, max_splits, min_chunk)
        _launch(q, k_cache, v_cache, md, scale, out, launch, splits, group_pad)
    return out


def _launch(q, k_cache, v_cache, md: AttentionMetadata, scale: float, out: torch.Tensor,
            launch: Launch, num_splits: int, group_pad: int) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    bq = launch.block_q
    # the short launch: one program per request (the long one writes the padding tail)
    num_q_progs = md.num_reqs if launch.pass_ == 1 else num_tokens // bq + md.num_reqs + 1
    stages = num_stages(q.is_cuda, bq * group_pad, num_splits)
    if num_splits > 1:
        part_o = _empty((num_splits, num_tokens, num_heads, head_dim), torch.float32, q.device)
        part_lse = _empty((num_splits, num_tokens, num_heads), torch.float32, q.device)
    else:
        part_o = part_lse = out  # unused
    _paged_attention_kernel[(num_q_progs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        md.query_start_loc, md.seq_lens, md.positions, md.block_tables,
        md.num_reqs, num_tokens, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=bq, BLOCK_M=bq * group_pad, BLOCK_N=launch.block_n,
        # tl.dot needs a reduction dim >= 16: small heads are padded (masked) to 16
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        PASS=launch.pass_, SHORT_MAX=launch.short_max,
        num_warps=launch.warps, num_stages=stages,
    )  # fmt: skip
    if num_splits > 1:
        combine_splits(part_o, part_lse, out)
