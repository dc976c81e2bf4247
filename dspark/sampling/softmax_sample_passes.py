"""The passes of softmax_sample_triton.py's kernels as Triton functions: what one program
does over a row or a chunk of it (the kernels there call them; the one-program kernel calls
all three in a row)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logits(base_ptr, bias_ptr, brow, row, cols, ok, stride_base, stride_bias,
            HAS_BIAS: tl.constexpr):  # fmt: skip
    """float(base) + float(bias) at `cols` of a row (-inf where masked)."""
    lg = tl.load(base_ptr + brow * stride_base + cols, mask=ok, other=float("-inf"))
    lg = lg.to(tl.float32)
    if HAS_BIAS:
        lg += tl.load(bias_ptr + row.to(tl.int64) * stride_bias + cols, mask=ok,
                      other=0.0).to(tl.float32)  # fmt: skip
    return lg


@triton.jit
def _x(base_ptr, bias_ptr, brow, row, cols, ok, stride_base, stride_bias, t,
       HAS_BIAS: tl.constexpr):  # fmt: skip
    return _logits(base_ptr, bias_ptr, brow, row, cols, ok, stride_base, stride_bias,
                   HAS_BIAS) / t


@triton.jit
def _base_row(rows_ptr, row, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:
        return tl.load(rows_ptr + row).to(tl.int64)
    else:
        return row.to(tl.int64)


@triton.jit
def _row_law(part_ptr, row, num_chunks, BLOCK_C: tl.constexpr):
    """(max M, sum S of exp(x - M), first argmax of the logits) of a row from its chunks'
    partials (_stats_kernel: max of x, sum, max of the logits and its first index)."""
    cs = tl.arange(0, BLOCK_C)
    ok = cs < num_chunks
    part = part_ptr + (row * num_chunks + cs) * 4
    m = tl.load(part, mask=ok, other=float("-inf"))
    s = tl.load(part + 1, mask=ok, other=0.0)
    best = tl.load(part + 2, mask=ok, other=float("-inf"))
    idx = tl.load(part + 3, mask=ok, other=0.0).to(tl.int64)
    big = tl.max(m, axis=0)
    win = tl.argmax(best, axis=0, tie_break_left=True)  # chunks are in column order
    amax = tl.sum(tl.where(cs == win, idx, 0), axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)  # (a row of -inf only)
    return big, tl.sum(s * tl.exp(m - big), axis=0), amax


@triton.jit
def _values(x, big, total, greedy, amax, cols, ok, q_ptr, qrow, stride_q, d, w,
            RES: tl.constexpr, HAS_Q: tl.constexpr):  # fmt: skip
    """(p, r): the law p = softmax (one-hot at the argmax for greedy rows) and, in residual
    mode, r = max(w p - q, 0) (point-mass drafts: w p without the draft token)."""
    p = tl.exp(x - big) / total
    p = tl.where(greedy, tl.where(cols == amax, 1.0, 0.0), p)
    p = tl.where(ok, p, 0.0)
    r = p
    if RES:
        if HAS_Q:
            q = tl.load(q_ptr + qrow * stride_q + cols, mask=ok, other=0.0)
            r = tl.maximum(p * w - q, 0.0)
        else:
            r = tl.where(cols == d, 0.0, p * w)
    return p, r


@triton.jit
def _stats_pass(base_ptr, bias_ptr, brow, row, t, start, chunk, vocab, stride_base,
                stride_bias, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pass 1 over the chunk [start, start + chunk) of a row: (running max m of x = logit / T,
    sum s of exp(x - m), the logits' max and its first index)."""
    m = tl.full((), float("-inf"), tl.float32)  # running max of x = logit / T
    s = tl.full((), 0.0, tl.float32)  # sum of exp(x - m)
    best = tl.full((), float("-inf"), tl.float32)  # logit max and its first index
    best_idx = tl.full((), 0, tl.int64) + start
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        ok = (cols < vocab) & (cols < start + chunk)
        lg = _logits(base_ptr, bias_ptr, brow, row, cols, ok, stride_base, stride_bias,
                     HAS_BIAS)  # fmt: skip
        bm = tl.max(lg, axis=0)
        bi = tl.argmax(lg, axis=0, tie_break_left=True).to(tl.int64) + start + off
        best_idx = tl.where(bm > best, bi, best_idx)  # strictly: the first maximum wins
        best = tl.maximum(best, bm)
        x = lg / t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # (all -inf so far: s stays 0; a finite stand-in avoids exp(-inf - -inf) = nan)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)
        m = m_new
    return m, s, best, best_idx


@triton.jit
def _block_values(base_ptr, bias_ptr, brow, row, first, end, vocab, stride_base, stride_bias,
                  t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w,
                  HAS_BIAS: tl.constexpr, RES: tl.constexpr, HAS_Q: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """(columns, their mask, p, r) of the BLOCK columns from `first` (before `end`)."""
    cols = first + tl.arange(0, BLOCK)
    ok = (cols < vocab) & (cols < end)
    x = _x(base_ptr, bias_ptr, brow, row, cols, ok, stride_base, stride_bias, t, HAS_BIAS)
    p, r = _values(x, big, total, greedy, amax, cols, ok, q_ptr, qrow, stride_q, d, w, RES,
                   HAS_Q)  # fmt: skip
    return cols, ok, p, r


@triton.jit
def _residual_args(qrows_ptr, d_ptr, w_ptr, row, RES: tl.constexpr, HAS_Q: tl.constexpr):
    qrow = tl.full((), 0, tl.int64)
    d = tl.full((), -1, tl.int64)
    w = tl.full((), 1.0, tl.float32)
    if RES:
        w = tl.load(w_ptr + row)
        if HAS_Q:
            qrow = tl.load(qrows_ptr + row).to(tl.int64)
        else:
            d = tl.load(d_ptr + row).to(tl.int64)
    return qrow, d, w


@triton.jit
def _row_setup(rows_ptr, temp_ptr, part_ptr, qrows_ptr, d_ptr, w_ptr, row, num_chunks, eps,
               HAS_ROWS: tl.constexpr, RES: tl.constexpr, HAS_Q: tl.constexpr,
               BLOCK_C: tl.constexpr):  # fmt: skip
    """What passes 2 and 3 know of a row before reading it: its logits row, temperature
    (1 for greedy rows), law (max, sum, argmax) and residual arguments."""
    brow = _base_row(rows_ptr, row, HAS_ROWS)
    t = tl.load(temp_ptr + row)
    greedy = t <= eps
    t = tl.where(greedy, 1.0, t)
    big, total, amax = _row_law(part_ptr, row, num_chunks, BLOCK_C)
    qrow, d, w = _residual_args(qrows_ptr, d_ptr, w_ptr, row, RES, HAS_Q)
    return brow, t, greedy, big, total, amax, qrow, d, w


@triton.jit
def _probs_pass(base_ptr, bias_ptr, brow, row, start, chunk, vocab, stride_base, stride_bias,
                t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, probs_ptr,
                stride_probs, HAS_BIAS: tl.constexpr, STORE: tl.constexpr,
                RES: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Pass 2 over a chunk: its law p stored (STORE), and its totals of p and of the residual r
    (fp64)."""
    acc_p = tl.full((), 0.0, tl.float64)
    acc_r = tl.full((), 0.0, tl.float64)
    for off in range(0, chunk, BLOCK):
        cols, ok, p, r = _block_values(
            base_ptr, bias_ptr, brow, row, start + off, start + chunk, vocab, stride_base,
            stride_bias, t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, HAS_BIAS,
            RES, HAS_Q, BLOCK)  # fmt: skip
        if STORE:
            tl.store(probs_ptr + row.to(tl.int64) * stride_probs + cols, p, mask=ok)
        acc_p += tl.sum(p.to(tl.float64), axis=0)
        acc_r += tl.sum(r.to(tl.float64), axis=0)
    return acc_p, acc_r


@triton.jit
def _pick_pass(base_ptr, bias_ptr, brow, row, start, chunk, vocab, stride_base, stride_bias,
               t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, use_res, before,
               target, HAS_BIAS: tl.constexpr, RES: tl.constexpr, HAS_Q: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """Pass 3 over the chosen chunk: the first column whose running total (from `before`, the
    chunks ahead of it) exceeds `target` (at the top edge, the chunk's last with mass)."""
    found = tl.full((), -1, tl.int64)
    last_pos = tl.full((), 0, tl.int64) + start
    for off in range(0, chunk, BLOCK):
        cols, ok, p, r = _block_values(
            base_ptr, bias_ptr, brow, row, start + off, start + chunk, vocab, stride_base,
            stride_bias, t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, HAS_BIAS,
            RES, HAS_Q, BLOCK)  # fmt: skip
        v = tl.where(use_res, r, p)  # (as pass 2 computed them)
        local = before + tl.cumsum(v.to(tl.float64), axis=0)
        hit = tl.min(tl.where((local > target) & ok, cols, vocab), axis=0).to(tl.int64)
        found = tl.where((found < 0) & (hit < vocab), hit, found)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(v > 0, cols, 0), axis=0).to(tl.int64))
        before += tl.sum(v.to(tl.float64), axis=0)
    return tl.where(found >= 0, found, last_pos)
