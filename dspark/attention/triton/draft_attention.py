"""The DSpark drafter's attention: block queries over paged context + their own block.

Queries `[R, G, H, D]` attend, without a causal mask, to the drafter's paged context cache at
positions `< ctx_lens[r]` and to all G keys of their own block (dense `[R, G, Hkv, D]`
tensors, never written to the cache).

Grid `(R * num_q_groups, Hkv, num_splits)`: a program holds `BLOCK_G` block queries x the
`GROUP` query heads of one KV head and streams the context KV through `block_tables` with the
same loop as the target's paged attention; split 0 also folds in the block's own keys. With
`num_splits > 1` the context range is split on device (flash decoding) and the partials are
merged by the shared combine kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.attention.triton.flash_common import (
    LOG2E,
    _attend_paged,
    _empty,
    _mma,
    _softmax_start,
    _softmax_step,
    _store_result,
    combine_splits,
    dot_precision,
)
from dspark.attention.triton.launch_config import num_stages, pick_num_splits
from dspark.triton_jit import unspecialized


@triton.jit(**unspecialized("num_tokens", "stride_bt"))
def _draft_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    ctx_lens_ptr, block_tables_ptr, sm_scale_log2, num_tokens,
    stride_qr, stride_qg, stride_qh,
    stride_kr, stride_kg, stride_kh,
    stride_vr, stride_vg, stride_vh,
    stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch,
    stride_db, stride_ds, stride_dh,
    stride_bt,
    BLOCK_LEN: tl.constexpr, NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_G: tl.constexpr, NUM_Q_GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    r = pid // NUM_Q_GROUPS
    gq0 = (pid % NUM_Q_GROUPS) * BLOCK_G

    offs_m = tl.arange(0, BLOCK_G * GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_gi = gq0 + offs_m // GROUP_PAD
    row_g = offs_m % GROUP_PAD
    row_head = kvh * GROUP + row_g
    row_ok = (row_gi < BLOCK_LEN) & (row_g < GROUP)
    r64 = r.to(tl.int64)
    q_ptrs = q_ptr + r64 * stride_qr + (row_gi * stride_qg + row_head * stride_qh)[:, None]
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    ctx_len = tl.load(ctx_lens_ptr + r)
    chunk = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, ctx_len)

    acc, m_i, l_i = _softmax_start(BLOCK_G * GROUP_PAD, BLOCK_D)
    acc, m_i, l_i = _attend_paged(
        acc, m_i, l_i, q, row_gi, lo, hi,
        k_cache_ptr, v_cache_ptr, block_tables_ptr + r64 * stride_bt, kvh,
        stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh, sm_scale_log2,
        CAUSAL=False, PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        DOT_PRECISION=DOT_PRECISION,
    )
    if split == 0:  # the block's own keys, bidirectional
        offs_n = tl.arange(0, BLOCK_KEYS)
        n_ok = offs_n < BLOCK_LEN
        kt_ptrs = k_ptr + r64 * stride_kr + (offs_n * stride_kg + kvh * stride_kh)[None, :]
        kt = tl.load(kt_ptrs + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        s = _mma(q, kt.to(q.dtype), DOT_PRECISION) * sm_scale_log2
        s = tl.where(n_ok[None, :], s, float("-inf"))
        v_ptrs = v_ptr + r64 * stride_vr + (offs_n * stride_vg + kvh * stride_vh)[:, None]
        v = tl.load(v_ptrs + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v.to(q.dtype), DOT_PRECISION)
    _store_result(
        acc, m_i, l_i, r * BLOCK_LEN + row_gi, row_head, row_ok, split,
        out_ptr, stride_ot, stride_oh, part_o_ptr, part_lse_ptr, num_tokens,
        NUM_HEADS=NUM_HEADS, NUM_SPLITS=NUM_SPLITS, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
    )


def draft_attention(
    q: torch.Tensor,  # [R, G, H, D] block queries
    k: torch.Tensor,  # [R, G, Hkv, D] block keys
    v: torch.Tensor,  # [R, G, Hkv, D] block values
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D] drafter context cache
    v_cache: torch.Tensor,
    ctx_lens: torch.Tensor,  # [R] int32
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    max_ctx_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [R, G, H, D], contiguous
    num_splits: int | None = None,
    max_splits: int = 16,
    min_chunk: int = 128,
    block_n: int | None = None,
) -> torch.Tensor:
    num_reqs, block_len, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
    assert k.shape == v.shape == (num_reqs, block_len, num_kv_heads, head_dim)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if out is None:
        out = _empty(q.shape, q.dtype, q.device)
    assert out.is_contiguous() and out.shape == q.shape
    if num_reqs == 0 or block_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # 16..128 rows per program (tl.dot needs M >= 16); queries beyond that go to more programs
    block_g = min(triton.next_power_of_2(block_len), max(1, 128 // group_pad))
    block_g = max(block_g, triton.cdiv(16, group_pad))
    num_q_groups = triton.cdiv(block_len, block_g)
    on_gpu = q.is_cuda
    bn = block_n or (16 if not on_gpu else (64 if head_dim <= 128 else 32))
    rows = block_g * group_pad
    warps = 1 if not on_gpu else (4 if rows <= 64 else 8)
    if num_splits is None:
        busy = num_reqs * num_q_groups * num_kv_heads
        num_splits = pick_num_splits(q.device, busy, max_ctx_len // min_chunk, max_splits)
    stages = num_stages(on_gpu, rows, num_splits)
    out3d = out.view(num_reqs * block_len, num_heads, head_dim)
    if num_splits > 1:
        shape = (num_splits, num_reqs * block_len, num_heads)
        part_o = _empty((*shape, head_dim), torch.float32, q.device)
        part_lse = _empty(shape, torch.float32, q.device)
    else:
        part_o = part_lse = out  # unused
    _draft_attention_kernel[(num_reqs * num_q_groups, num_kv_heads, num_splits)](
        q, k, v, k_cache, v_cache, out3d, part_o, part_lse,
        ctx_lens, block_tables, scale * LOG2E, num_reqs * block_len,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out3d.stride(0), out3d.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_LEN=block_len, NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_G=block_g, NUM_Q_GROUPS=num_q_groups,
        BLOCK_N=bn, BLOCK_KEYS=max(16, triton.next_power_of_2(block_len)),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=page,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )
    if num_splits > 1:
        combine_splits(part_o, part_lse, out3d)
    return out
