"""A probabilistic draft slot in three small passes: softmax((base + bias) / T), its row
written out for verification, and one token drawn by inverse CDF with the slot's uniform.

The drafter's sequential stage does this once per slot. In torch it is ~12 passes over [R, V]
fp32 (upcast, add the Markov bias, max, scale, softmax, a one-hot select for greedy rows,
the two-level inverse CDF, the copy into the probabilities buffer): at a 152k vocabulary and
256 rows, 156 MB a pass, ~13 GB for the 7 slots of one step. Here:
  1. (row, chunk) programs: running max of x = (base + bias) / T and sum of exp(x - max),
     the first index of the maximum (greedy rows);
  2. (row, chunk) programs: the row's max M and sum S from the chunks' partials,
     p = exp(x - M) / S stored, the chunk's total in fp64;
  3. one program per row: the chunk where the fp64 running total first exceeds u * total,
     then the token inside it by an fp64 scan (never a zero-probability token; at the top
     edge, the chunk's last positive one). Greedy rows (T <= eps) take the argmax, and their
     stored row is one-hot there, as `processed_probs` gives.
The law is the stored row's, so verification's residual uses exactly the distribution the
token was drawn from. Against torch's softmax and `sample_from_probs` the probabilities agree
to fp32 rounding (sums in another order) and the token is the same except where u falls
within rounding of a boundary. Grids depend on shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized

_BLOCK = 2048  # columns per load
_TARGET_PROGRAMS = 528  # ~4 per SM on an H200


@triton.jit
def _x(base_ptr, bias_ptr, row, cols, ok, stride_base, stride_bias, t, HAS_BIAS: tl.constexpr):
    r = row.to(tl.int64)
    x = tl.load(base_ptr + r * stride_base + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + r * stride_bias + cols, mask=ok, other=0.0).to(tl.float32)
    return x / t


@triton.jit
def _row_law(part_ptr, row, num_chunks, BLOCK_C: tl.constexpr):
    """(max M, sum S of exp(x - M), first argmax) of a row from its chunks' partials."""
    cs = tl.arange(0, BLOCK_C)
    ok = cs < num_chunks
    part = part_ptr + (row * num_chunks + cs) * 3
    m = tl.load(part, mask=ok, other=float("-inf"))
    s = tl.load(part + 1, mask=ok, other=0.0)
    idx = tl.load(part + 2, mask=ok, other=0.0).to(tl.int64)
    big = tl.max(m, axis=0)
    amax = tl.sum(tl.where(cs == tl.argmax(m, axis=0, tie_break_left=True), idx, 0), axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)  # (a row of -inf only)
    return big, tl.sum(s * tl.exp(m - big), axis=0), amax


@triton.jit(**unspecialized("stride_base", "stride_bias"))
def _stats_kernel(base_ptr, bias_ptr, temp_ptr, part_ptr, stride_base, stride_bias, vocab, chunk,
                  num_chunks, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    t = tl.where(t <= eps, 1.0, t)
    start = c * chunk
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    best_idx = tl.full((), 0, tl.int64) + start
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        ok = (cols < vocab) & (cols < start + chunk)
        x = _x(base_ptr, bias_ptr, row, cols, ok, stride_base, stride_bias, t, HAS_BIAS)
        bm = tl.max(x, axis=0)
        bi = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start + off
        best_idx = tl.where(bm > m, bi, best_idx)  # strictly: the first maximum wins
        m_new = tl.maximum(m, bm)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)
        m = m_new
    out = part_ptr + (row * num_chunks + c) * 3
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, best_idx.to(tl.float32))  # (exact: vocabularies are < 2**24)


@triton.jit(**unspecialized("stride_base", "stride_bias", "stride_probs"))
def _probs_kernel(base_ptr, bias_ptr, temp_ptr, part_ptr, probs_ptr, tot_ptr, stride_base,
                  stride_bias, stride_probs, vocab, chunk, num_chunks, eps,
                  HAS_BIAS: tl.constexpr, STORE: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    greedy = t <= eps
    t = tl.where(greedy, 1.0, t)
    big, total, amax = _row_law(part_ptr, row, num_chunks, BLOCK_C)
    start = c * chunk
    acc = tl.full((), 0.0, tl.float64)
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        ok = (cols < vocab) & (cols < start + chunk)
        x = _x(base_ptr, bias_ptr, row, cols, ok, stride_base, stride_bias, t, HAS_BIAS)
        p = tl.exp(x - big) / total
        p = tl.where(greedy, tl.where(cols == amax, 1.0, 0.0), p)
        p = tl.where(ok, p, 0.0)
        if STORE:
            tl.store(probs_ptr + row.to(tl.int64) * stride_probs + cols, p, mask=ok)
        acc += tl.sum(p.to(tl.float64), axis=0)
    tl.store(tot_ptr + row * num_chunks + c, acc)


@triton.jit(**unspecialized("stride_base", "stride_bias", "stride_out"))
def _pick_kernel(base_ptr, bias_ptr, temp_ptr, u_ptr, part_ptr, tot_ptr, out_ptr, stride_base,
                 stride_bias, stride_out, vocab, chunk, num_chunks, eps,
                 HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    greedy = t <= eps
    t = tl.where(greedy, 1.0, t)
    big, total, amax = _row_law(part_ptr, row, num_chunks, BLOCK_C)
    cs = tl.arange(0, BLOCK_C)
    ok_c = cs < num_chunks
    tot = tl.load(tot_ptr + row * num_chunks + cs, mask=ok_c, other=0.0)
    cum = tl.cumsum(tot, axis=0)
    target = tl.load(u_ptr + row) * tl.sum(tot, axis=0)
    # the first chunk whose running total exceeds the target; at the top edge (rounding), the
    # last chunk with mass
    first = tl.min(tl.where((cum > target) & ok_c, cs, BLOCK_C), axis=0)
    last_mass = tl.max(tl.where((tot > 0) & ok_c, cs, 0), axis=0)
    c = tl.minimum(first, last_mass)
    before = tl.sum(tl.where(cs < c, tot, 0.0), axis=0)
    start = c * chunk
    found = tl.full((), -1, tl.int64)
    last_pos = tl.full((), 0, tl.int64) + start
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        ok = (cols < vocab) & (cols < start + chunk)
        x = _x(base_ptr, bias_ptr, row, cols, ok, stride_base, stride_bias, t, HAS_BIAS)
        p = tl.where(ok, tl.exp(x - big) / total, 0.0)  # (as _probs_kernel computes it)
        local = before + tl.cumsum(p.to(tl.float64), axis=0)
        hit = tl.min(tl.where((local > target) & ok, cols, vocab), axis=0).to(tl.int64)
        found = tl.where((found < 0) & (hit < vocab), hit, found)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(p > 0, cols, 0), axis=0).to(tl.int64))
        before += tl.sum(p.to(tl.float64), axis=0)
    tok = tl.where(found >= 0, found, last_pos)
    tl.store(out_ptr + row * stride_out, tl.where(greedy, amax, tok))


def sample_softmax(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                   u: torch.Tensor, eps: float, tokens: torch.Tensor,
                   probs: torch.Tensor | None = None, block: int = _BLOCK) -> None:  # fmt: skip
    """tokens[r] ~ softmax((base[r] + bias[r]) / T_r) by inverse CDF at u[r] (greedy rows,
    T_r <= eps: the first argmax); probs[r] (if given) gets that law (one-hot for greedy rows).
    base, bias, probs: [R, V] with unit stride along V (slices of [R, K, V] buffers); bias
    fp32 or base's dtype; temperature [R] fp32; u [R] fp64 in (0, 1); tokens [R] int64, any
    stride. `block`: columns per load (tests make it small to cover many chunks)."""
    rows, vocab = base.shape
    assert base.stride(1) == 1 and tokens.dtype == torch.int64 and tokens.shape == (rows,)
    if bias is not None:
        assert bias.shape == base.shape and bias.stride(1) == 1
    if probs is not None:
        assert probs.shape == base.shape and probs.stride(1) == 1
        assert probs.dtype == torch.float32
    if rows == 0:
        return
    dev = base.device
    block = min(block, triton.next_power_of_2(vocab))
    want = max(1, -(-_TARGET_PROGRAMS // rows))
    num_chunks = max(1, min(want, triton.cdiv(vocab, block), 64))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab, chunk)
    block_c = triton.next_power_of_2(num_chunks)
    part = torch.empty(rows, num_chunks, 3, dtype=torch.float32, device=dev)
    tot = torch.empty(rows, num_chunks, dtype=torch.float64, device=dev)
    temperature = temperature.to(dev, torch.float32).contiguous()
    u = u.to(dev, torch.float64).contiguous()
    bias_t = base if bias is None else bias
    sb = 0 if bias is None else bias.stride(0)
    warps = 8 if block >= 1024 else 4
    _stats_kernel[(rows, num_chunks)](
        base, bias_t, temperature, part, base.stride(0), sb, vocab, chunk, num_chunks,
        float(eps), HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    _probs_kernel[(rows, num_chunks)](
        base, bias_t, temperature, part, base if probs is None else probs, tot,
        base.stride(0), sb, 0 if probs is None else probs.stride(0), vocab, chunk, num_chunks,
        float(eps), HAS_BIAS=bias is not None, STORE=probs is not None, BLOCK=block,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    _pick_kernel[(rows,)](
        base, bias_t, temperature, u, part, tot, tokens, base.stride(0), sb, tokens.stride(0),
        vocab, chunk, num_chunks, float(eps), HAS_BIAS=bias is not None, BLOCK=block,
        BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
