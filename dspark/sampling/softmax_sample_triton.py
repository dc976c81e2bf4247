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
token was drawn from. The passes are Triton functions (softmax_sample_passes.py); with
DSPARK_ONE_PASS_SAMPLING=1 a vocabulary up to ONE_PROGRAM_MAX_VOCAB runs all three in one
program a row (`_one_program_kernel`: one launch, the numbers of three launches with one chunk
a row), and a draft slot draws its uniform there too (`sample_draft_slot`).

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

import os

import torch
import triton
import triton.language as tl

from dspark.sampling import rng
from dspark.sampling.rng_triton import uniform_of
from dspark.sampling.softmax_sample_passes import (
    _base_row,
    _pick_pass,
    _probs_pass,
    _residual_args,
    _row_law,
    _row_setup,
    _stats_pass,
)
from dspark.triton_jit import unspecialized, vocab_chunks

_BLOCK = 2048  # columns per load


@triton.jit(**unspecialized("stride_base", "stride_bias"))
def _stats_kernel(base_ptr, bias_ptr, rows_ptr, temp_ptr, part_ptr, stride_base, stride_bias,
                  vocab, chunk, num_chunks, eps, HAS_BIAS: tl.constexpr,
                  HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    brow = _base_row(rows_ptr, row, HAS_ROWS)
    t = tl.load(temp_ptr + row)
    t = tl.where(t <= eps, 1.0, t)
    m, s, best, best_idx = _stats_pass(base_ptr, bias_ptr, brow, row, t, c * chunk, chunk,
                                       vocab, stride_base, stride_bias, HAS_BIAS, BLOCK)
    out = part_ptr + (row * num_chunks + c) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, best)
    tl.store(out + 3, best_idx.to(tl.float32))  # (exact: vocabularies are < 2**24)


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
    acc_p, acc_r = _probs_pass(
        base_ptr, bias_ptr, brow, row, c * chunk, chunk, vocab, stride_base, stride_bias, t,
        big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, probs_ptr, stride_probs,
        HAS_BIAS, STORE, RES, HAS_Q, BLOCK)  # fmt: skip
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
    tok = _pick_pass(base_ptr, bias_ptr, brow, row, c * chunk, chunk, vocab, stride_base,
                     stride_bias, t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w,
                     use_res, before, target, HAS_BIAS, RES, HAS_Q, BLOCK)  # fmt: skip
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


@triton.jit(**unspecialized("stride_base", "stride_bias", "stride_probs", "stride_out",
                            "stride_q"))  # fmt: skip
def _one_program_kernel(base_ptr, bias_ptr, rows_ptr, temp_ptr, u_ptr, probs_ptr, out_ptr,
                        q_ptr, qrows_ptr, d_ptr, w_ptr, res_ptr, seed_ptr, pos_ptr, round_ptr,
                        stride_base, stride_bias, stride_probs, stride_out, stride_q, vocab,
                        chunk, eps, pos_offset, purpose, HAS_BIAS: tl.constexpr,
                        HAS_ROWS: tl.constexpr, STORE: tl.constexpr, RES: tl.constexpr,
                        HAS_Q: tl.constexpr, KEYED: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """The three passes of one row in one program (the row one chunk): what the three kernels
    compute with one chunk a row, number for number, in one launch. KEYED: the row's uniform
    drawn here from its keys (seed, position + pos_offset, round, purpose: rng.uniform's
    bits) instead of read from u_ptr."""
    row = tl.program_id(0)
    brow = _base_row(rows_ptr, row, HAS_ROWS)
    t = tl.load(temp_ptr + row)
    greedy = t <= eps
    t = tl.where(greedy, 1.0, t)
    m, s, best, amax = _stats_pass(base_ptr, bias_ptr, brow, row, t, 0, chunk, vocab,
                                   stride_base, stride_bias, HAS_BIAS, BLOCK)  # fmt: skip
    big = tl.where(m == float("-inf"), 0.0, m)  # (as _row_law gives them from one chunk)
    total = s * tl.exp(m - big)
    qrow, d, w = _residual_args(qrows_ptr, d_ptr, w_ptr, row, RES, HAS_Q)
    acc_p, acc_r = _probs_pass(
        base_ptr, bias_ptr, brow, row, 0, chunk, vocab, stride_base, stride_bias, t, big,
        total, greedy, amax, q_ptr, qrow, stride_q, d, w, probs_ptr, stride_probs, HAS_BIAS,
        STORE, RES, HAS_Q, BLOCK)  # fmt: skip
    use_res = False
    if RES:  # (as _pick_kernel decides)
        use_res = (tl.load(res_ptr + row) != 0) & (acc_r > 0) & (acc_r < float("inf"))
    if KEYED:
        u = uniform_of(tl.load(seed_ptr + row), tl.load(pos_ptr + row) + pos_offset,
                       tl.load(round_ptr + row), purpose)  # fmt: skip
    else:
        u = tl.load(u_ptr + row)
    target = u * tl.where(use_res, acc_r, acc_p)
    tok = _pick_pass(base_ptr, bias_ptr, brow, row, 0, chunk, vocab, stride_base, stride_bias,
                     t, big, total, greedy, amax, q_ptr, qrow, stride_q, d, w, use_res,
                     tl.full((), 0.0, tl.float64), target, HAS_BIAS, RES, HAS_Q,
                     BLOCK)  # fmt: skip
    tl.store(out_ptr + row * stride_out, tl.where(greedy, amax, tok))


# DSPARK_ONE_PASS_SAMPLING=1: vocabularies up to ONE_PROGRAM_MAX_VOCAB take one launch (one
# program a row) instead of three over (row, chunk) programs. A small pair's step is bound by
# its launches (H100, demo pair, T = 1, c = 64: ~20 sampling launches of 3-4 µs a step,
# fifty-third session); not yet measured on a GPU, so off by default
ONE_PROGRAM = os.environ.get("DSPARK_ONE_PASS_SAMPLING", "0") == "1"
ONE_PROGRAM_MAX_VOCAB = 65536


def one_program(vocab: int) -> bool:
    """Whether a vocabulary this wide takes the one-program kernel (ONE_PROGRAM)."""
    return ONE_PROGRAM and vocab <= ONE_PROGRAM_MAX_VOCAB


def _launch(base, bias, rows, temperature, u, eps, tokens, probs, q, q_rows, d, w, res,
            block, mode=None, keys=None):  # fmt: skip
    """The three passes over `tokens.shape[0]` rows (see sample_softmax / sample_final).
    `mode`: "chunks" (three kernels, the rows split into chunks: vocab_chunks), "one_chunk"
    (three kernels, a chunk a row), "one_program" (one kernel, a program a row); None: by
    `one_program`. `keys` (one_program only, u None): (seeds, positions, rounds, position
    offset, purpose), each row's uniform drawn in the kernel."""
    n, vocab = tokens.shape[0], base.shape[1]
    assert base.stride(1) == 1 and tokens.dtype == torch.int64
    if n == 0:
        return
    if mode is None:
        mode = "one_program" if one_program(vocab) else "chunks"
    assert (keys is None) != (u is None) and (keys is None or mode == "one_program")
    dev = base.device
    block, chunk, num_chunks = vocab_chunks(n, vocab, block)
    if mode != "chunks":
        chunk, num_chunks = triton.cdiv(vocab, block) * block, 1
    block_c = triton.next_power_of_2(num_chunks)
    temperature = temperature.to(dev, torch.float32).contiguous()
    if u is not None:
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
    if mode == "one_program":
        seeds, positions, rounds, offset, purpose = keys or (base, base, base, 0, 0)
        _one_program_kernel[(n,)](
            base, bias_t, rows_t, temperature, base if u is None else u,
            base if probs is None else probs, tokens, q_t, qr_t, d_t, w_t, res_t, seeds,
            positions, rounds, base.stride(0), sb, 0 if probs is None else probs.stride(0),
            tokens.stride(0), sq, vocab, chunk, float(eps), offset, purpose, **flags,
            STORE=probs is not None, **res_flags, KEYED=keys is not None, BLOCK=block,
            num_warps=warps,
        )  # fmt: skip
        return
    part = torch.empty(n, num_chunks, 4, dtype=torch.float32, device=dev)
    tot = torch.empty(n, num_chunks, 2, dtype=torch.float64, device=dev)
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
                   u: torch.Tensor | None, eps: float, tokens: torch.Tensor,
                   probs: torch.Tensor | None = None, block: int = _BLOCK,
                   mode: str | None = None, keys: tuple | None = None) -> None:  # fmt: skip
    """tokens[r] ~ softmax((base[r] + bias[r]) / T_r) by inverse CDF at u[r] (greedy rows,
    T_r <= eps: the first argmax); probs[r] (if given) gets that law (one-hot for greedy rows).
    base, bias, probs: [R, V] with unit stride along V (slices of [R, K, V] buffers); bias
    fp32 or base's dtype; temperature [R] fp32; u [R] fp64 in (0, 1); tokens [R] int64, any
    stride. `block`: columns per load (tests make it small to cover many chunks); `mode`,
    `keys` (in place of u): _launch's."""
    rows = base.shape[0]
    assert tokens.shape == (rows,)
    if bias is not None:
        assert bias.shape == base.shape and bias.stride(1) == 1
    if probs is not None:
        assert probs.shape == base.shape and probs.stride(1) == 1
        assert probs.dtype == torch.float32
    _launch(base, bias, None, temperature, u, eps, tokens, probs, None, None, None, None, None,
            block, mode, keys)  # fmt: skip


def sample_draft_slot(base: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor,
                      seeds: torch.Tensor, positions: torch.Tensor, offset: int,
                      rounds: torch.Tensor, purpose: int, eps: float, tokens: torch.Tensor,
                      probs: torch.Tensor, block: int = _BLOCK) -> None:  # fmt: skip
    """sample_softmax at the uniforms rng.uniform(seeds, positions + offset, rounds, purpose)
    (seeds, positions, rounds [R] int64): drawn inside the one-program kernel where it takes
    this vocabulary (`one_program`: one launch for the slot), else computed first."""
    if not one_program(base.shape[1]):
        u = rng.uniform(seeds, positions + offset, rounds, purpose)
        sample_softmax(base, bias, temperature, u, eps, tokens, probs, block)
        return
    keys = tuple(k.to(torch.int64).contiguous() for k in (seeds, positions, rounds)) + (
        int(offset), int(purpose))  # fmt: skip
    sample_softmax(base, bias, temperature, None, eps, tokens, probs, block, "one_program", keys)


def sample_final(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
                 u: torch.Tensor, eps: float, tokens: torch.Tensor, rejected: torch.Tensor,
                 weight: torch.Tensor, draft: torch.Tensor, q: torch.Tensor | None,
                 q_rows: torch.Tensor | None, block: int = _BLOCK,
                 mode: str | None = None) -> None:  # fmt: skip
    """Verification's final tokens, one per request r: from logits[rows[r]] at temperature
    T_r (greedy rows: its first argmax), by inverse CDF at u[r]. Where `rejected[r]`, from
    the residual max(weight[r] p - q[q_rows[r]], 0) instead (q None: point-mass drafts, the
    residual is weight[r] p without draft[r]), unless it has no mass. logits [N, V] and q
    [S, V] with unit stride along V; rows, q_rows, draft [R] int64; weight [R] fp32;
    rejected [R] bool; tokens [R] int64, any stride. `mode`: _launch's."""
    n = rows.shape[0]
    assert tokens.shape == (n,) and (q is None or q.stride(1) == 1)
    _launch(logits, None, rows.contiguous(), temperature, u, eps, tokens, None, q,
            None if q_rows is None else q_rows.contiguous(), draft.contiguous(),
            weight.to(torch.float32).contiguous(), rejected.to(torch.int8).contiguous(),
            block, mode)  # fmt: skip
