"""Plain (non-speculative) token sampling, vectorized and sync-free."""

from __future__ import annotations

import torch

from dspark.layers.norm import fused_ops
from dspark.sampling import rng
from dspark.sampling.processors import GREEDY_EPS, processed_probs, sample_from_probs


def fused_sampling(logits: torch.Tensor):
    """`softmax_sample_triton` where its kernels take these logits (CUDA with fused ops on,
    rows of unit stride; tests: the interpreter), else None (the torch code)."""
    if logits.stride(-1) != 1 or fused_ops(logits) is None:
        return None
    from dspark.sampling import softmax_sample_triton

    return softmax_sample_triton


def sample_tokens(
    logits: torch.Tensor,  # [N, V]
    row: torch.Tensor,  # [N] int64: the step row owning each logits row
    next_pos: torch.Tensor,  # [N] int64: position of the token being sampled
    temperature: torch.Tensor,  # [R]
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,  # [R]
    rounds: torch.Tensor,  # [R]
    all_greedy: bool,
) -> torch.Tensor:  # [N] int64
    if all_greedy:
        return logits.argmax(dim=-1)
    kernels = fused_sampling(logits) if top_k is None and top_p is None and min_p is None else None
    if kernels is not None:  # temperature alone: one fused softmax + draw
        u = rng.uniform(seeds[row], next_pos, rounds[row], rng.SAMPLE)
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        kernels.sample_softmax(logits, None, temperature[row], u, GREEDY_EPS, out)
        return out
    probs = processed_probs(
        logits,
        temperature[row],
        None if top_k is None else top_k[row],
        None if top_p is None else top_p[row],
        None if min_p is None else min_p[row],
    )
    u = rng.uniform(seeds[row], next_pos, rounds[row], rng.SAMPLE)
    return sample_from_probs(probs, u)


def sample_step(logits: torch.Tensor, inp) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain sampling of a step without drafts (`inp`: a finalized StepInputs): one token per
    sampling row, keyed like the final token of a verification with no drafts, so the result
    equals `verify` on zero-length drafts. Returns (tokens [R, 1] with -1 for rows that do not
    sample, num_emitted [R])."""
    device = logits.device
    n = inp.num_logits
    tl = torch.arange(n, device=device)
    row = (torch.searchsorted(inp.cu_num_logits, tl, right=True) - 1).clamp(max=inp.num_reqs - 1)
    tokens = sample_tokens(
        logits, row, inp.anchor_pos[row] + 1, inp.temperature, inp.top_k, inp.top_p, inp.min_p,
        inp.seeds, inp.rounds, inp.all_greedy,
    )  # fmt: skip
    # logits rows past the last sampling row (an upper bound on their count) go to a junk row
    row = torch.where(tl < inp.cu_num_logits[-1], row, inp.num_reqs)
    out = torch.full((inp.num_reqs + 1, 1), -1, dtype=torch.int64, device=device)
    out[row, 0] = tokens
    return out[: inp.num_reqs], inp.samples.long()
