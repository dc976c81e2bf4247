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

Batch invariance: a row's keys are summed in fixed segments of `split_len` key positions
([0, W), [W, 2W), ...; W a multiple of BLOCK_N): an online softmax within a segment, then the
segments folded one after another in key order (`_fold_segment`). Without splits a program
folds its rows' segments itself; with `num_splits > 1` (flash decoding, for few programs over
long contexts) the programs of axis 2 take the segments in turn (split s: segments s, s + S,
...), each writing its normalised partial output and log-sum-exp (base 2) to the segment's
slot, and `_fold_partials_kernel` folds each row's segments with the same operations. So a
row's bits depend on its own keys and position only: not on the batch, the tile it rides in,
a prefill beside it, or the split count, all of which change with the step (the forty-seventh
session's H100 sweep saw 68 of 4,096 greedy outputs part from no-spec's while the chunk width
followed the step). Both launches of a step split alike and share one fold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.attention.base import AttentionMetadata
from dspark.attention.triton import launch_config
from dspark.attention.triton.flash_common import (
    LOG2E,
    _attend_paged,
    _attend_tile,
    _empty,
    _fold_segment,
    _fold_start,
    _segment_result,
    _softmax_start,
    dot_precision,
)
from dspark.attention.triton.launch_config import (
    PARTIALS_MAX_BYTES,
    SPLIT_LEN,
    Launch,
    _launch_config,
    launch_plan,
    num_stages,
    pick_num_splits,
)
from dspark.triton_jit import unspecialized


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


@triton.jit(**unspecialized("num_reqs", "num_tokens", "num_segments", "positions_ptr",
                            "stride_bt"))  # fmt: skip
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_q_ptr, seq_lens_ptr, positions_ptr, block_tables_ptr,
    num_reqs, num_tokens, num_segments, sm_scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    SPLIT_LEN: tl.constexpr, NUM_SPLITS: tl.constexpr, PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
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
    # keys [0, kv_hi), in segments of SPLIT_LEN: the segment count is capped by the partials'
    # slots (num_segments, from the CPU bound max_seq_len; a bound any real row meets)
    kv_hi = tl.minimum(seq_len, tl.max(qpos, axis=0) + 1)
    kv_hi = tl.minimum(kv_hi, num_segments * SPLIT_LEN)
    bt_ptr = block_tables_ptr + r.to(tl.int64) * stride_bt
    out_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if not PARTIALS:  # every segment here, folded at its last tile (one pipelined loop)
        acc, m_i, l_i = _softmax_start(BLOCK_M, BLOCK_D)
        o_run, m_run, w_run = _fold_start(BLOCK_M, BLOCK_D)
        for start in range(0, kv_hi, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, qpos, start, kv_hi, k_cache_ptr, v_cache_ptr, bt_ptr, kvh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                sm_scale_log2, CAUSAL=True, PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D, DOT_PRECISION=DOT_PRECISION,
            )
            if ((start + BLOCK_N) % SPLIT_LEN == 0) | (start + BLOCK_N >= kv_hi):
                o, lse = _segment_result(acc, m_i, l_i)
                o_run, m_run, w_run = _fold_segment(o_run, m_run, w_run, o, lse)
                acc, m_i, l_i = _softmax_start(BLOCK_M, BLOCK_D)
        o = o_run / tl.where(w_run > 0.0, w_run, 1.0)[:, None]  # (no key at all: zeros)
        ptrs = out_ptr + (row_tok.to(tl.int64) * stride_ot + row_head * stride_oh)[:, None]
        tl.store(ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # segments split, split + NUM_SPLITS, ...: each one's partial to its own slot
        for seg in range(split, tl.cdiv(kv_hi, SPLIT_LEN), NUM_SPLITS):
            lo = seg * SPLIT_LEN
            acc, m_i, l_i = _softmax_start(BLOCK_M, BLOCK_D)
            acc, m_i, l_i = _attend_paged(
                acc, m_i, l_i, q, qpos, lo, tl.minimum(lo + SPLIT_LEN, kv_hi), k_cache_ptr,
                v_cache_ptr, bt_ptr, kvh, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, sm_scale_log2, CAUSAL=True, PAGE=PAGE,
                HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                DOT_PRECISION=DOT_PRECISION,
            )
            o, lse = _segment_result(acc, m_i, l_i)
            row = (seg * num_tokens + row_tok.to(tl.int64)) * NUM_HEADS + row_head  # [S, T, H]
            tl.store(part_o_ptr + (row * HEAD_DIM)[:, None] + offs_d[None, :], o, mask=out_mask)
            tl.store(part_lse_ptr + row, lse, mask=row_ok)


@triton.jit(**unspecialized("num_reqs", "num_tokens", "num_segments", "positions_ptr"))
def _fold_partials_kernel(
    part_o_ptr,  # [S, T, H, D] fp32, normalised per segment
    part_lse_ptr,  # [S, T, H] fp32, base-2 log-sum-exp
    out_ptr, stride_ot, stride_oh,
    token_to_req_ptr, seq_lens_ptr, positions_ptr, num_reqs, num_tokens, num_segments,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
):
    """One (token, head) row: its segments folded in key order, as the unsplit kernel does.
    Only the segments that hold the row's keys are read (every one of them was written); a
    padding token has none and comes out as zeros."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < HEAD_DIM
    r = tl.load(token_to_req_ptr + tok)
    is_real = r < num_reqs
    seq_len = tl.load(seq_lens_ptr + r, mask=is_real, other=0)
    pos = tl.load(positions_ptr + tok, mask=is_real, other=0).to(tl.int32)
    visible = tl.maximum(tl.minimum(seq_len, pos + 1), 0)
    o_run, m_run, w_run = _fold_start(1, BLOCK_D)
    for seg in range(0, tl.minimum(tl.cdiv(visible, SPLIT_LEN), num_segments)):
        row = (seg * num_tokens + tok) * NUM_HEADS + head
        lse = tl.load(part_lse_ptr + row + tl.zeros([1], dtype=tl.int64))
        o = tl.load(part_o_ptr + row * HEAD_DIM + offs_d[None, :], mask=d_ok, other=0.0)
        o_run, m_run, w_run = _fold_segment(o_run, m_run, w_run, o, lse)
    o = o_run / tl.where(w_run > 0.0, w_run, 1.0)[:, None]
    ptrs = out_ptr + tok * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    num_splits: int | None = None,  # None: heuristic
    partials: bool | None = None,  # True: partials and the fold kernel even unsplit (else: if
    # split) -- the same bits, without the kernel's second accumulator (an option to measure)
    max_splits: int = 16,
    split_len: int = SPLIT_LEN,  # keys a segment (a multiple of every launch's BLOCK_N)
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
    assert all(split_len % launch.block_n == 0 for launch in plan), (split_len, plan)
    num_segments = triton.cdiv(max(md.max_seq_len, 1), split_len)
    if num_splits is None:  # one count for the step's launches (they share the fold)
        q_tiles = triton.cdiv(max(1, md.max_query_len), plan[0].block_q)
        busy = md.num_reqs * num_kv_heads * q_tiles
        num_splits = pick_num_splits(q.device, busy, num_segments, max_splits)
        if num_tokens * num_segments * num_heads * head_dim * 4 > PARTIALS_MAX_BYTES:
            num_splits = 1  # (a row's bits are the same either way)
    parts = None
    if num_splits > 1 or partials:  # (partials without splits: an experiment's option)
        shape = (num_segments, num_tokens, num_heads)
        parts = _empty((*shape, head_dim), torch.float32, q.device), _empty(
            shape, torch.float32, q.device)  # fmt: skip
    for launch in plan:
        _launch(q, k_cache, v_cache, md, scale, out, launch, num_splits, group_pad,
                split_len, num_segments, parts)  # fmt: skip
    if parts is not None:
        _fold_partials_kernel[(num_tokens, num_heads)](
            *parts, out, out.stride(0), out.stride(1),
            md.token_to_req, md.seq_lens, md.positions, md.num_reqs, num_tokens, num_segments,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            SPLIT_LEN=split_len, num_warps=1 if head_dim <= 128 else 2,
        )  # fmt: skip
    return out


def _launch(q, k_cache, v_cache, md: AttentionMetadata, scale: float, out: torch.Tensor,
            launch: Launch, num_splits: int, group_pad: int, split_len: int,
            num_segments: int, parts) -> None:  # fmt: skip
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    bq = launch.block_q
    # the short launch: one program per request (the long one writes the padding tail)
    num_q_progs = md.num_reqs if launch.pass_ == 1 else num_tokens // bq + md.num_reqs + 1
    stages = num_stages(q.is_cuda, bq * group_pad, num_splits)
    part_o, part_lse = parts if parts is not None else (out, out)  # (unused without splits)
    cap = launch_config.DECODE_MAXNREG if q.is_cuda and bq * group_pad <= 64 else None
    extra = {"maxnreg": cap} if cap else {}
    _paged_attention_kernel[(num_q_progs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse,
        md.query_start_loc, md.seq_lens, md.positions, md.block_tables,
        md.num_reqs, num_tokens, num_segments, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=bq, BLOCK_M=bq * group_pad, BLOCK_N=launch.block_n,
        # tl.dot needs a reduction dim >= 16: small heads are padded (masked) to 16
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
        SPLIT_LEN=split_len, NUM_SPLITS=num_splits, PARTIALS=parts is not None,
        DOT_PRECISION=dot_precision(q.dtype),
        PASS=launch.pass_, SHORT_MAX=launch.short_max,
        num_warps=launch.warps, num_stages=stages, **extra,
    )  # fmt: skip
