"""Sampling reads of vocabulary rows in a few small passes, with no [rows, V] fp32 tensor.

A probabilistic draft slot: softmax((base + bias) / T), its row written out for
verification, and one token drawn by inverse CDF with the slot's uniform.

The drafter's sequential stage does this once per slot. In torch it is ~12 passes over [R, V]
fp32 (upcast, add the Markov bias, max, scale, softmax, a one-hot select for greedy rows,
the two-level inverse CDF, the copy into the probabilities buffer): at a 152k vocabulary and
256 rows, 156 MB a pass, ~13 GB for the 7 slots of one step (arithmetic, not measured). Here:
  1. (row, chunk) programs: running max of x = (base + bias) / T and sum of exp(x - max),
     the maximum of base + bias and its first index (greedy rows);
  2. (row, chunk) programs: the row's max M and sum S from the chunks' partials,
     p = exp(x - M) / S stored, the chunk's total in fp64;
  3. one program per row: the chunk where the fp64 running total first exceeds u * total,
     then the token inside it by an fp64 scan (never a zero-probability token; at the top
     edge, the chunk's last positive one). Greedy rows (T <= eps) take the argmax, and their
     stored row is one-hot there, as `processed_probs` gives.
The law is the stored row's, so verification's residual uses exactly the distribution the
token was drawn from.

`draft_prob_and_argmax` gives sampled verification's per-row scalars (the draft token's
probability and the argmax) from pass 1 alone: the torch path ran `processed_probs` over every
row, ~8 fp32 passes. On the H200 a sampled verify step of the demo pair at 256 requests
spent 3.5 ms on the device, most of it in such full-vocabulary elementwise kernels, where a
plain step spent 0.43 ms (sixteenth session, kernel table).

`sample_final` draws verification's final token of each request the same way: the target
row at each request's stop (read in place through a row index), and where a draft was
rejected the residual max(w p - q, 0) against the draft's law (or p with the draft token
removed, for point-mass drafts), p itself where that residual has no mass. `sampler.py` uses
`sample_softmax` for plain sampling too.

Against torch's softmax and `sample_from_probs` the probabilities agree to fp32 rounding
(sums in another order) and the token is the same except where u falls within rounding of a
boundary. Grids depend on shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized, vocab_chunks

_BLOCK = 2048  # columns per load


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


@triton.jit(**unspecialized("stride_base", "stride_bias"))
def _stats_kernel(base_ptr, bias_ptr, rows_ptr, temp_ptr, part_ptr, stride_base, stride_bias,
                  vocab, chunk, num_chunks, eps, HAS_BIAS: tl.constexpr,
                  HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    brow = _base_row(rows_ptr, row, HAS_ROWS)
    t = tl.load(temp_ptr + row)
    t = tl.where(t <= eps, 1.0, t)
    start = c * chunk
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
    out = part_ptr + (row * num_chunks + c) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, best)
    tl.store(out + 3, best_idx.to(tl.float32))  # (exact: vocabularies are < 2**24)


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


@triton.jit(**unspecialized("stride_base", "stride_bias", "stride_probs", "stride_q"))
def _probs_kernel(base_ptr, bias_ptr, rows_ptr, temp_ptr, part_ptr, probs_ptr, tot_ptr, q_ptr,
                  qrows_ptr, d_ptr, w_ptr, stride_base, stride_bias, stride_probs, stride_q,
                  vocab, chunk, num_chunks, eps, HAS_BIAS: tl.constexpr,
                  HAS_ROWS: tl.constexpr, STORE: tl.constexpr, RES: tl.constexpr,
                  HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    brow, t, greedy, big, total, amax, qrow, d, w = _row_setup(
        rows_ptr, temp_ptr, part_ptr, qrows_ptr, d_ptr, w_ptr, row, num_chunks, eps, HAS_ROWS,
        RES, HAS_Q, BLOCK_C)  # fmt: skip
    start = c * chunk
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
    tl.store(tot_ptr + (row * num_chunks + c) * 2, acc_p)
    tl.store(tot_ptr + (row * num_chunks + c) * 2 + 1, acc_r)


@triton.jit(**unspecialized("stride_base", "stride_bias", "stride_out", "stride_q"))
def _pick_kernel(base_ptr, bias_ptr, rows_ptr, temp_ptr, u_ptr, part_ptr, tot_ptr, out_ptr,
                 q_ptr, qrows_ptr, d_ptr, w_ptr, res_ptr, stride_base, stride_bias,
                 stride_out, stride_q, vocab, chunk, num_chunks, eps,
                 HAS_BIAS: tl.constexpr, HAS_ROWS: tl.constexpr, RES: tl.constexpr,
                 HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    brow, t, greedy, big, total, amax, qrow, d, w = _row_setup(
        rows_ptr, temp_ptr, part_ptr, qrows_ptr, d_ptr, w_ptr, row, num_chunks, eps, HAS_ROWS,
        RES, HAS_Q, BLOCK_C)  # fmt: skip
    cs = tl.arange(0, BLOCK_C)
    ok_c = cs < num_chunks
    tot_p = tl.load(tot_ptr + (row * num_chunks + cs) * 2, mask=ok_c, other=0.0)
    tot_r = tl.load(tot_ptr + (row * num_chunks + cs) * 2 + 1, mask=ok_c, other=0.0)
    use_res = False
    if RES:  # the residual where a draft was rejected and it has mass, else p
        mass = tl.sum(tot_r, axis=0)
        use_res = (tl.load(res_ptr + row) != 0) & (mass > 0) & (mass < float("inf"))
    tot = tl.where(use_res, tot_r, tot_p)
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
        cols, ok, p, r = _block_values(
            base_ptr, bias_ptr, brow, row, start + off, start + chunk, vocab, stride_base,
            stride_bias, t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, HAS_BIAS,
            RES, HAS_Q, BLOCK)  # fmt: skip
        v = tl.where(use_res, r, p)  # (as _probs_kernel computed them)
        local = before + tl.cumsum(v.to(tl.float64), axis=0)
        hit = tl.min(tl.where((local > target) & ok, cols, vocab), axis=0).to(tl.int64)
        found = tl.where((found < 0) & (hit < vocab), hit, found)
        last_pos = tl.maximum(last_pos, tl.max(tl.where(v > 0, cols, 0), axis=0).to(tl.int64))
        before += tl.sum(v.to(tl.float64), axis=0)
    tok = tl.where(found >= 0, found, last_pos)
    tl.store(out_ptr + row * stride_out, tl.where(greedy, amax, tok))


@triton.jit
def _draft_prob_kernel(logits_ptr, temp_ptr, tok_ptr, part_ptr, p_ptr, arg_ptr, stride,
                       num_chunks, eps, BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    greedy = t <= eps
    t = tl.where(greedy, 1.0, t)
    big, total, amax = _row_law(part_ptr, row, num_chunks, BLOCK_C)
    tok = tl.load(tok_ptr + row)
    xd = tl.load(logits_ptr + row.to(tl.int64) * stride + tok).to(tl.float32) / t
    p = tl.where(total > 0, tl.exp(xd - big) / total, 0.0)  # (a row of -inf only: 0)
    p = tl.where(greedy, tl.where(tok == amax, 1.0, 0.0), p)
    tl.store(p_ptr + row, p)
    tl.store(arg_ptr + row, amax)


def draft_prob_and_argmax(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor,
                          eps: float, block: int = _BLOCK):  # fmt: skip
    """What sampled verification reads of each target row: (p [N] fp32, argmax [N] int64),
    p[i] = softmax(logits[i] / T_i)[tokens[i]] (greedy rows, T_i <= eps: 1 if tokens[i] is
    the argmax, else 0), argmax[i] of logits[i] (first index on ties). Pass 1 above, then one
    program per row combines the chunks and reads the token's logit: no [N, V] probabilities.
    logits [N, V] with unit stride along V; temperature [N] fp32; tokens [N] int64 in
    [0, V). `block`: columns per load (tests make it small to cover many chunks)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    dev = logits.device
    p = torch.empty(rows, dtype=torch.float32, device=dev)
    amax = torch.empty(rows, dtype=torch.int64, device=dev)
    if rows == 0:
        return p, amax
    block, chunk, num_chunks = vocab_chunks(rows, vocab, block)
    part = torch.empty(rows, num_chunks, 4, dtype=torch.float32, device=dev)
    temperature = temperature.to(dev, torch.float32).contiguous()
    tokens = tokens.to(dev, torch.int64).contiguous()
    _stats_kernel[(rows, num_chunks)](
        logits, logits, logits, temperature, part, logits.stride(0), 0, vocab, chunk,
        num_chunks, float(eps), HAS_BIAS=False, HAS_ROWS=False, BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip
    _draft_prob_kernel[(rows,)](logits, temperature, tokens, part, p, amax, logits.stride(0),
                                num_chunks, float(eps),
                                BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1)
    return p, amax


def _launch(base, bias, rows, temperature, u, eps, tokens, probs, q, q_rows, d, w, res,
            block):  # fmt: skip
    """The three passes over `tokens.shape[0]` rows (see sample_softmax / sample_final)."""
    n, vocab = tokens.shape[0], base.shape[1]
    assert base.stride(1) == 1 and tokens.dtype == torch.int64
    if n == 0:
        return
    dev = base.device
    block, chunk, num_chunks = vocab_chunks(n, vocab, block)
    block_c = triton.next_power_of_2(num_chunks)
    part = torch.empty(n, num_chunks, 4, dtype=torch.float32, device=dev)
    tot = torch.empty(n, num_chunks, 2, dtype=torch.float64, device=dev)
    temperature = temperature.to(dev, torch.float32).contiguous()
    u = u.to(dev, torch.float64).contiguous()
    flags = dict(HAS_BIAS=bias is not None, HAS_ROWS=rows is not None)
    res_flags = dict(RES=w is not None, HAS_Q=q is not None)
    bias_t, sb = (base, 0) if bias is None else (bias, bias.stride(0))
    rows_t = base if rows is None else rows
    q_t, sq = (base, 0) if q is None else (q, q.stride(0))
    qr_t = base if q_rows is None else q_rows
    d_t = base if d is None else d
    w_t = base if w is None else w
    res_t = base if res is None else res
    warps = 8 if block >= 1024 else 4
    _stats_kernel[(n, num_chunks)](
        base, bias_t, rows_t, temperature, part, base.stride(0), sb, vocab, chunk, num_chunks,
        float(eps), **flags, BLOCK=block, num_warps=warps,
    )  # fmt: skip
    _probs_kernel[(n, num_chunks)](
        base, bias_t, rows_t, temperature, part, base if probs is None else probs, tot, q_t,
        qr_t, d_t, w_t, base.stride(0), sb, 0 if probs is None else probs.stride(0), sq, vocab,
        chunk, num_chunks, float(eps), **flags, STORE=probs is not None, **res_flags,
        BLOCK=block, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    _pick_kernel[(n,)](
        base, bias_t, rows_t, temperature, u, part, tot, tokens, q_t, qr_t, d_t, w_t, res_t,
        base.stride(0), sb, tokens.stride(0), sq, vocab, chunk, num_chunks, float(eps),
        **flags, **res_flags, BLOCK=block, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip


def sample_softmax(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                   u: torch.Tensor, eps: float, tokens: torch.Tensor,
                   probs: torch.Tensor | None = None, block: int = _BLOCK) -> None:  # fmt: skip
    """tokens[r] ~ softmax((base[r] + bias[r]) / T_r) by inverse CDF at u[r] (greedy rows,
    T_r <= eps: the first argmax); probs[r] (if given) gets that law (one-hot for greedy rows).
    base, bias, probs: [R, V] with unit stride along V (slices of [R, K, V] buffers); bias
    fp32 or base's dtype; temperature [R] fp32; u [R] fp64 in (0, 1); tokens [R] int64, any
    stride. `block`: columns per load (tests make it small to cover many chunks)."""
    rows = base.shape[0]
    assert tokens.shape == (rows,)
    if bias is not None:
        assert bias.shape == base.shape and bias.stride(1) == 1
    if probs is not None:
        assert probs.shape == base.shape and probs.stride(1) == 1
        assert probs.dtype == torch.float32
    _launch(base, bias, None, temperature, u, eps, tokens, probs, None, None, None, None, None,
            block)  # fmt: skip


def sample_final(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                 u: torch.Tensor, eps: float, tokens: torch.Tensor, rejected: torch.Tensor,
                 weight: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                 q_rows: torch.Tensor | None, block: int = _BLOCK) -> None:  # fmt: skip
    """Verification's final tokens, one per request r: from logits[rows[r]] at temperature
    T_r (greedy rows: its first argmax), by inverse CDF at u[r]. Where `rejected[r]`, from
    the residual max(weight[r] p - q[q_rows[r]], 0) instead (q None: point-mass drafts, the
    residual is weight[r] p without draft[r]), unless it has no mass. logits [N, V] and q
    [S, V] with unit stride along V; rows, q_rows, draft [R] int64; weight [R] fp32;
    rejected [R] bool; tokens [R] int64, any stride."""
    n = rows.shape[0]
    assert tokens.shape == (n,) and (q is None or q.stride(1) == 1)
    _launch(logits, None, rows.contiguous(), temperature, u, eps, tokens, None, q,
            None if q_rows is None else q_rows.contiguous(), draft.contiguous(),
            weight.to(torch.float32).contiguous(), rejected.to(torch.int8).contiguous(),
            block)  # fmt: skip
