"""What sampled verification reads of each target row, in one pass over the vocabulary.

For every logits row, the standard method (temperature only: no top-k / top-p / min-p) needs
two scalars: the probability of the row's draft token under softmax(logits / T) and the
argmax of the logits (greedy rows). In torch that is `processed_probs` over [N, V] fp32
(upcast, scale, softmax, a one-hot for greedy rows, a select) plus an argmax and a gather:
~8 passes over the rows. On the H200 a sampled verify step of the demo pair at 256 requests
spent 3.5 ms on the device, most of it in such full-vocabulary elementwise kernels, where
a plain step spent 0.43 ms (sixteenth session, kernel table). At a 152k vocabulary one fp32
pass over 2,048 rows is 1.25 GB.

Here each (row, chunk) program reads its bf16 columns once and keeps the running logit max
with its first index, and an online softmax (running max of x = logit / T and the sum of
exp(x - max)) together with x at the draft token; a tiny kernel combines the chunks:
p = exp(x_d - M) / sum_c s_c exp(m_c - M). Greedy rows (T <= eps) get p = [d == argmax], as
the one-hot distribution of `processed_probs`. Values agree with the torch path to fp32
rounding (the sum is accumulated in a different order); the argmax is identical (first index
on ties). Grids depend on shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized, vocab_chunks

_BLOCK = 2048  # columns per load


@triton.jit(**unspecialized("stride"))
def _chunk_kernel(logits_ptr, temp_ptr, tok_ptr, part_ptr, idx_ptr, stride, vocab, chunk,
                  num_chunks, eps, BLOCK: tl.constexpr):  # fmt: skip
    row, c = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    t = tl.where(t <= eps, 1.0, t)
    tok = tl.load(tok_ptr + row)
    start = c * chunk
    best = tl.full((), float("-inf"), tl.float32)  # logit max and its first index
    best_idx = tl.full((), 0, tl.int64) + start
    m = tl.full((), float("-inf"), tl.float32)  # running max of x = logit / T
    s = tl.full((), 0.0, tl.float32)  # sum of exp(x - m)
    xd = tl.full((), float("-inf"), tl.float32)  # x at the draft token (if in this chunk)
    base = logits_ptr + row.to(tl.int64) * stride
    for off in range(0, chunk, BLOCK):
        cols = start + off + tl.arange(0, BLOCK)
        ok = (cols < vocab) & (cols < start + chunk)
        lg = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        bm = tl.max(lg, axis=0)
        bi = tl.argmax(lg, axis=0, tie_break_left=True).to(tl.int64) + start + off
        better = bm > best  # strictly: an equal maximum further right loses
        best_idx = tl.where(better, bi, best_idx)
        best = tl.where(better, bm, best)
        x = lg / t
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # (all -inf so far: s stays 0; a finite stand-in avoids exp(-inf - -inf) = nan)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)
        m = m_new
        hit = cols == tok
        xd = tl.where(tl.sum(hit.to(tl.int32), axis=0) > 0,
                      tl.sum(tl.where(hit, x, 0.0), axis=0), xd)  # fmt: skip
    out = part_ptr + (row * num_chunks + c) * 4
    tl.store(out, best)
    tl.store(out + 1, m)
    tl.store(out + 2, s)
    tl.store(out + 3, xd)
    tl.store(idx_ptr + row * num_chunks + c, best_idx)


@triton.jit
def _combine_kernel(part_ptr, idx_ptr, temp_ptr, tok_ptr, p_ptr, arg_ptr, num_chunks, eps,
                    BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    ok = cs < num_chunks
    part = part_ptr + (row * num_chunks + cs) * 4
    best = tl.load(part, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + cs, mask=ok, other=0)
    win = tl.argmax(best, axis=0, tie_break_left=True)  # chunks are in column order
    amax = tl.sum(tl.where(cs == win, idx, 0), axis=0)
    m = tl.load(part + 1, mask=ok, other=float("-inf"))
    s = tl.load(part + 2, mask=ok, other=0.0)
    xd = tl.max(tl.load(part + 3, mask=ok, other=float("-inf")), axis=0)
    big = tl.max(m, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)  # (a row of -inf only: p = 0 below)
    total = tl.sum(s * tl.exp(m - big), axis=0)
    p = tl.where(total > 0, tl.exp(xd - big) / total, 0.0)
    tok = tl.load(tok_ptr + row)
    greedy = tl.load(temp_ptr + row) <= eps
    p = tl.where(greedy, tl.where(tok == amax, 1.0, 0.0), p)
    tl.store(p_ptr + row, p)
    tl.store(arg_ptr + row, amax)


def draft_prob_and_argmax(logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor,
                          eps: float, block: int = _BLOCK):  # fmt: skip
    """(p [N] fp32, argmax [N] int64): p[i] = softmax(logits[i] / T_i)[tokens[i]] (greedy
    rows, T_i <= eps: 1 if tokens[i] is the argmax, else 0), argmax[i] of logits[i] (first
    index on ties). logits [N, V] with unit stride along V; temperature [N] fp32; tokens [N]
    int64 in [0, V). `block`: columns per load (tests make it small to cover many chunks)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    dev = logits.device
    p = torch.empty(rows, dtype=torch.float32, device=dev)
    amax = torch.empty(rows, dtype=torch.int64, device=dev)
    if rows == 0:
        return p, amax
    block, chunk, num_chunks = vocab_chunks(rows, vocab, block)
    part = torch.empty(rows, num_chunks, 4, dtype=torch.float32, device=dev)
    idx = torch.empty(rows, num_chunks, dtype=torch.int64, device=dev)
    temperature = temperature.to(dev, torch.float32).contiguous()
    tokens = tokens.to(dev, torch.int64).contiguous()
    _chunk_kernel[(rows, num_chunks)](
        logits, temperature, tokens, part, idx, logits.stride(0), vocab, chunk, num_chunks,
        float(eps), BLOCK=block, num_warps=8 if block >= 1024 else 4,
    )  # fmt: skip
    _combine_kernel[(rows,)](part, idx, temperature, tokens, p, amax, num_chunks, float(eps),
                             BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1)  # fmt: skip
    return p, amax
