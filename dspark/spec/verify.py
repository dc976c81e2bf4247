"""Lossless verification of speculative drafts (DESIGN.md §3.2).

`verify` decides, for every request of a ragged verify batch at once, how many draft tokens
to accept and which final token to emit (correction or bonus), so that the emitted sequence
is distributed exactly as sampling token by token from the target's processed distribution
`processed_probs(logits, temperature, top_k, top_p, min_p)`.

Methods:
  * ``standard``: accept d_j with probability min(1, p_t(d_j)/p_d(d_j)); at the first
    rejection emit a token from norm(max(p_t - p_d, 0)); if all l drafts are accepted emit a
    bonus token from the target row l.
  * ``block`` (Sun et al. 2025, research/dspark_method.md §5): prefix weights P_i, residual
    masses R_i, stop probabilities h_i, tau = max{i : U_i <= h_i}; see `block_verify.py`.
Rows with temperature <= 1e-5 are greedy under both methods: drafts are accepted while they
equal the target argmax and the final token is the argmax of the first mismatching row (or of
the last row), exactly plain greedy decoding. Greedy drafts (``draft_probs is None``) are
point masses at the draft token.

Randomness comes only from `dspark.sampling.rng.uniform`, keyed by the request's seed, the
absolute position of the token being decided, the request's round and a purpose tag:
ACCEPT (accept test of the draft at that position), BLOCK (block uniform U_i of the draft
X_i at that position), RESIDUAL / SAMPLE (final token drawn from a residual / from the
target, at the final token's position). A request's result therefore depends on its own
inputs only. With l = 0 the final token uses the same key as plain sampling.

Layout and memory. Request r owns target rows cu[r] .. cu[r+1]-1, row j predicting the
token at anchor + j + 1. Rows are mapped to (request, local index) with a binary search over
cu, on device. Two passes, both in chunks of at most `max_chunk_rows` rows so that the
[rows, V] float32 probabilities of one chunk stay bounded (256 MiB by default):
  1. every row: p_t(d_{j+1}) and the argmax (for block also the residual mass R_j, which needs
     the prefix weight P_j of rows already seen), kept as [R, K+1] scalars;
  2. one row per request, the final row (first rejection or bonus row): the distribution
     of the emitted final token is rebuilt and sampled.
No Python loop over requests or tokens, no host synchronisation (loops are over chunks,
whose count follows from shapes, and over the K draft slots).

With temperature as the only filter (no top-k / top-p / min-p in the batch) and fused kernels
on (CUDA), no [rows, V] probabilities are made (`softmax_sample_triton`): pass 1 of the
standard method reads each row for p_t(d) and the argmax (`draft_prob_and_argmax`), and
pass 2 of both methods draws the final token from the row read in place, its residual
against the draft's law read in place (`sample_final`). Same decisions up to fp32 rounding
of the sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.sampling import rng
from dspark.sampling.processors import GREEDY_EPS, processed_probs, sample_from_probs
from dspark.sampling.sampler import fused_sampling
from dspark.spec import block_verify

METHODS = ("standard", "block")
DEFAULT_CHUNK_BYTES = 256 * 1024 * 1024  # bound on one chunk's [rows, V] float32 probs


@dataclass
class VerifyInputs:
    target_logits: torch.Tensor  # [N, V] float, ragged rows (padding rows allowed at the end)
    cu_num_logits: torch.Tensor  # [R+1] int: request r owns rows cu[r]:cu[r+1] (1 + l_r rows)
    draft_token_ids: torch.Tensor  # [R, K] int64; slots >= l_r are ignored
    draft_probs: torch.Tensor | None  # [R, K, V] float32 draft distributions; None = greedy
    # ... or [S, K, V] (a per-request buffer) with `draft_rows` [R] naming each request's row,
    # so that only the rows and entries verification reads are gathered, never [R, K, V]
    temperature: torch.Tensor  # [R] float32; <= 1e-5 means greedy
    top_k: torch.Tensor | None  # [R] int64 (0 = off)
    top_p: torch.Tensor | None  # [R] float32 (1.0 = off)
    min_p: torch.Tensor | None  # [R] float32 (0.0 = off)
    seeds: torch.Tensor  # [R] int64
    anchor_positions: torch.Tensor  # [R] int64: position of the anchor; d_j sits at anchor + j
    rounds: torch.Tensor  # [R] int64: per-request decoding round (RNG key)
    draft_rows: torch.Tensor | None = None  # [R] int64 rows of draft_probs (None: 0..R-1)


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk such that a chunk's float32 probabilities take <= 256 MiB."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * max(1, vocab_size)))


def verify(
    inp: VerifyInputs, method: str = "standard", max_chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of a ragged batch.

    Returns ``output_token_ids`` [R, K+1] int64 (accepted drafts then the final token,
    left-aligned, -1 after them) and ``num_emitted`` [R] int64 (accepted drafts + 1; 0 for
    padding requests, i.e. requests that own zero rows). Requires l_r <= K.
    """
    if method not in METHODS:
        raise ValueError(f"rejection_sample_method must be one of {METHODS}, got {method!r}")
    logits = inp.target_logits
    if logits.dim() != 2:
        raise ValueError(f"target_logits must be [N, V], got shape {tuple(logits.shape)}")
    dev = logits.device
    num_rows, vocab = logits.shape
    drafts = inp.draft_token_ids.to(dev, torch.int64)
    num_reqs, k = drafts.shape
    chunk = max_chunk_rows if max_chunk_rows is not None else default_chunk_rows(vocab)
    if chunk < 1:
        raise ValueError(f"max_chunk_rows must be >= 1, got {chunk}")
    if num_reqs == 0 or num_rows == 0:  # nothing to verify: every request is padding
        return drafts.new_full((num_reqs, k + 1), -1), drafts.new_zeros((num_reqs,))

    cu = inp.cu_num_logits.to(dev, torch.int64)
    starts = cu[:-1]
    num_drafts = cu[1:] - starts - 1  # l_r; -1 for padding requests
    live = num_drafts >= 0
    seeds = inp.seeds.to(dev, torch.int64)
    anchors = inp.anchor_positions.to(dev, torch.int64)
    rounds = inp.rounds.to(dev, torch.int64)
    greedy = inp.temperature.to(dev) <= GREEDY_EPS
    sampling = _SamplingParams(inp, dev)
    draft_probs = inp.draft_probs
    safe_drafts = drafts.clamp(0, vocab - 1)  # ignored slots may hold anything (e.g. -1)

    # p_d(d_j) per draft slot: 1 for greedy (point-mass) drafts.
    prow = torch.arange(num_reqs, device=dev) if inp.draft_rows is None else inp.draft_rows
    if draft_probs is None:
        pd_draft = torch.ones(num_reqs, k, dtype=torch.float64, device=dev)
    else:
        slots_k = torch.arange(k, device=dev)
        pd_draft = draft_probs[prow.unsqueeze(1), slots_k, safe_drafts].double()

    # ---- pass 1: per-row scalars, kept in [R+1, K+1] buffers (row R collects junk rows).
    shape = (num_reqs + 1, k + 1)
    pt_draft = torch.zeros(shape, dtype=torch.float64, device=dev)  # p_t(d_{j+1}) at row j
    argmax = torch.zeros(shape, dtype=torch.int64, device=dev)
    res_mass = torch.zeros(shape, dtype=torch.float64, device=dev)  # block: R_j at row j
    # the standard method with temperature alone reads two scalars per row: one pass over
    # each row's logits, no [rows, V] probabilities (so no chunks either)
    row_stats = (_fused_row_stats(logits)
                 if method == "standard" and sampling.temperature_only else None)  # fmt: skip
    if row_stats is not None:
        chunk = max(num_rows, 1)
    for s in range(0, num_rows, chunk):
        t = torch.arange(s, min(s + chunk, num_rows), device=dev)
        req, j, valid = _map_rows(t, cu, num_reqs, k)
        slot = j.clamp(max=max(k - 1, 0))
        has_draft = valid & (j < num_drafts[req])
        d = safe_drafts[req, slot] if k > 0 else torch.zeros_like(t)
        flat = torch.where(valid, req * (k + 1) + j, torch.full_like(t, num_reqs * (k + 1)))
        if row_stats is not None:  # (padding rows' results land in the junk row)
            pt_d, amax = row_stats(logits[s : s + t.numel()], sampling.temperature[req], d,
                                   GREEDY_EPS)  # fmt: skip
            pt_draft.view(-1).scatter_(0, flat, torch.where(has_draft, pt_d.double(), 0.0))
            argmax.view(-1).scatter_(0, flat, amax)
            continue
        rows = logits[s : s + t.numel()].masked_fill(~valid.unsqueeze(1), 0.0)  # junk padding
        probs = processed_probs(rows, *sampling.rows(req))
        pt_d = probs.gather(1, d.unsqueeze(1)).squeeze(1).double()
        pt_draft.view(-1).scatter_(0, flat, torch.where(has_draft, pt_d, 0.0))
        argmax.view(-1).scatter_(0, flat, rows.argmax(dim=-1))
        if method == "block" and k > 0:
            # P_j only uses rows before j of the same request: all in this or earlier chunks.
            weights = block_verify.prefix_weights(pt_draft[:num_reqs, :k], pd_draft)
            pw = weights[req, j]
            pd_rows = None if draft_probs is None else draft_probs[prow[req], slot].float()
            mass = block_verify.residual_mass(probs, pw, d, pd_rows)
            res_mass.view(-1).scatter_(0, flat, torch.where(has_draft, mass, 0.0))
        del probs

    pt_draft, argmax, res_mass = pt_draft[:num_reqs], argmax[:num_reqs], res_mass[:num_reqs]
    slots = torch.arange(k, device=dev)
    in_draft = slots.unsqueeze(0) < num_drafts.unsqueeze(1)  # [R, K]

    # Greedy rows: accept the longest prefix of drafts equal to the target argmax.
    match = (drafts == argmax[:, :k]) & in_draft
    n_greedy = match.long().cumprod(dim=1).sum(dim=1)

    if method == "standard":
        u = rng.uniform(
            seeds.unsqueeze(1), anchors.unsqueeze(1) + 1 + slots, rounds.unsqueeze(1), rng.ACCEPT
        )
        accept = (u * pd_draft < pt_draft[:, :k]) & in_draft
        n_sampled = accept.long().cumprod(dim=1).sum(dim=1)
        weight = torch.ones(num_reqs, k + 1, dtype=torch.float64, device=dev)
    else:
        weight = block_verify.prefix_weights(pt_draft[:, :k], pd_draft)
        n_sampled = block_verify.block_tau(weight, res_mass, num_drafts, seeds, anchors, rounds)
    n_acc = torch.where(greedy, n_greedy, n_sampled).clamp(min=0)

    # ---- pass 2: the final row of each request (residual at a rejection, else bonus).
    final = torch.empty(num_reqs, dtype=torch.int64, device=dev)
    fused_final = _fused_final(logits, draft_probs) if sampling.temperature_only else None
    if fused_final is not None:  # three passes over one row per request, read in place
        n = n_acc
        is_res = n < num_drafts
        slot = n.clamp(max=max(k - 1, 0))
        pos = anchors + n + 1
        u = torch.where(is_res, rng.uniform(seeds, pos, rounds, rng.RESIDUAL),
                        rng.uniform(seeds, pos, rounds, rng.SAMPLE))  # fmt: skip
        r = torch.arange(num_reqs, device=dev)
        q_rows = (None if draft_probs is None or k == 0
                  else prow * draft_probs.shape[1] + slot)  # fmt: skip
        fused_final(logits, (starts + n).clamp(0, max(num_rows - 1, 0)), sampling.temperature,
                    u, GREEDY_EPS, final, is_res & (k > 0), weight[r, n.clamp(max=k)],
                    safe_drafts[r, slot] if k > 0 else n, None if q_rows is None else
                    draft_probs.view(-1, vocab), q_rows)  # fmt: skip
        final = torch.where(greedy, argmax[r, n.clamp(max=k)], final)
    for s in range(0, num_reqs if fused_final is None else 0, chunk):
        e = min(s + chunk, num_reqs)
        r = torch.arange(s, e, device=dev)
        n = n_acc[r]
        is_res = n < num_drafts[r]  # a draft was rejected at slot n
        slot = n.clamp(max=max(k - 1, 0))
        row = (starts[r] + n).clamp(0, max(num_rows - 1, 0))
        rows = logits[row].masked_fill(~live[r].unsqueeze(1), 0.0)
        probs = processed_probs(rows, *sampling.rows(r))
        if k > 0:
            pw = weight[r, n.clamp(max=k)].float()
            d = safe_drafts[r, slot]
            pd_rows = None if draft_probs is None else draft_probs[prow[r], slot].float()
            residual = block_verify.residual_weights(probs, pw, d, pd_rows)
            mass = residual.sum(dim=1)
            use_res = is_res & (mass > 0) & torch.isfinite(mass)
            dist = torch.where(use_res.unsqueeze(1), residual, probs)
        else:
            dist = probs
        pos = anchors[r] + n + 1
        u_res = rng.uniform(seeds[r], pos, rounds[r], rng.RESIDUAL)
        u_bonus = rng.uniform(seeds[r], pos, rounds[r], rng.SAMPLE)
        tok = sample_from_probs(dist, torch.where(is_res, u_res, u_bonus))
        final[s:e] = torch.where(greedy[r], argmax[r, n.clamp(max=k)], tok)
        del probs, dist

    cols = torch.arange(k + 1, device=dev).unsqueeze(0)
    n2 = n_acc.unsqueeze(1)
    padded_drafts = torch.cat([drafts, drafts.new_full((num_reqs, 1), -1)], dim=1)
    out = torch.where(cols < n2, padded_drafts, torch.where(cols == n2, final.unsqueeze(1), -1))
    out = torch.where(live.unsqueeze(1), out, -1)
    num_emitted = torch.where(live, n_acc + 1, 0)
    return out, num_emitted


def _map_rows(
    t: torch.Tensor, cu: torch.Tensor, num_reqs: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global row ids -> (request, local index j, valid); invalid rows get request 0."""
    req = torch.searchsorted(cu[1:].contiguous(), t, right=True)
    in_range = req < num_reqs
    req = torch.where(in_range, req, 0)
    j = t - cu[req]
    valid = in_range & (j >= 0) & (j <= k)
    j = torch.where(valid, j, 0)
    return req, j, valid


def _fused_row_stats(logits: torch.Tensor):
    """`draft_prob_and_argmax` where the fused sampling kernels take these logits, else None."""
    kernels = fused_sampling(logits)
    return None if kernels is None else kernels.draft_prob_and_argmax


def _fused_final(logits: torch.Tensor, draft_probs: torch.Tensor | None):
    """`sample_final` where the fused sampling kernels take these logits and the drafts' laws
    can be read in place as [S * K, V] rows, else None."""
    kernels = fused_sampling(logits)
    if kernels is None or (draft_probs is not None and not draft_probs.is_contiguous()):
        return None
    return kernels.sample_final


class _SamplingParams:
    """Per-request sampling parameters, gathered per row for `processed_probs`."""

    def __init__(self, inp: VerifyInputs, dev: torch.device) -> None:
        self.temperature = inp.temperature.to(dev, torch.float32)
        self.top_k = None if inp.top_k is None else inp.top_k.to(dev, torch.int64)
        self.top_p = None if inp.top_p is None else inp.top_p.to(dev, torch.float32)
        self.min_p = None if inp.min_p is None else inp.min_p.to(dev, torch.float32)
        # no filter but the temperature: the draft probability is a softmax entry
        self.temperature_only = self.top_k is None and self.top_p is None and self.min_p is None

    def rows(self, req: torch.Tensor) -> tuple:
        def g(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[req]

        return g(self.temperature), g(self.top_k), g(self.top_p), g(self.min_p)


def verify_greedy(
    target_logits: torch.Tensor,  # [N, V] ragged rows (see VerifyInputs)
    cu_num_logits: torch.Tensor,  # [R+1]
    draft_token_ids: torch.Tensor,  # [R, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast path when every request is greedy (temperature 0): a draft is accepted iff it
    equals the target's argmax, and the emitted tokens are the target argmaxes up to and
    including the first mismatch. Same result as `verify` for greedy rows, a handful of
    kernels instead of the probability pipeline."""
    dev = target_logits.device
    num_rows = target_logits.shape[0]
    drafts = draft_token_ids.to(dev, torch.int64)
    num_reqs, k = drafts.shape
    out = drafts.new_full((num_reqs, k + 1), -1)
    if num_reqs == 0 or num_rows == 0:
        return out, drafts.new_zeros((num_reqs,))
    cu = cu_num_logits.to(dev, torch.int64)
    num_drafts = cu[1:] - cu[:-1] - 1  # l_r; -1 for padding requests
    t = torch.arange(num_rows, device=dev)
    req, j, valid = _map_rows(t, cu, num_reqs, k)
    flat = torch.where(valid, req * (k + 1) + j, torch.full_like(t, num_reqs * (k + 1)))
    argmax = torch.full(((num_reqs + 1) * (k + 1),), -1, dtype=torch.int64, device=dev)
    argmax.scatter_(0, flat, target_logits.argmax(dim=-1))
    argmax = argmax.view(num_reqs + 1, k + 1)[:num_reqs]
    slots = torch.arange(k, device=dev)
    match = (drafts == argmax[:, :k]) & (slots < num_drafts.unsqueeze(1))
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    emitted = torch.where(num_drafts >= 0, accepted + 1, torch.zeros_like(accepted))
    keep = torch.arange(k + 1, device=dev) < emitted.unsqueeze(1)
    return torch.where(keep, argmax, out), emitted


def next_anchors(anchor_pos: torch.Tensor, out: torch.Tensor, num_out: torch.Tensor,
                 anchors_out: torch.Tensor | None = None,
                 pos_out: torch.Tensor | None = None):  # fmt: skip
    """Each row's next anchor (the token it emitted last, from `verify`'s outputs) and that
    token's position. With `anchors_out` and `pos_out` (int64 [R], contiguous: the whole-step
    graphs' persistent buffers) both are written there, with no copies, the positions clamped
    at 0 (a padding row emits nothing and would sit at -1: an empty context). Six small
    kernels: every speculative engine's step runs them, plain steps included."""
    last = num_out - 1
    last.clamp_(min=0)
    if anchors_out is None:
        return out.gather(1, last.unsqueeze(1)).squeeze(1).clamp(min=0), anchor_pos + num_out
    torch.gather(out, 1, last.unsqueeze(1), out=anchors_out.unsqueeze(1))
    anchors_out.clamp_(min=0)
    torch.add(anchor_pos, num_out, out=pos_out)
    pos_out.clamp_(min=0)
    return anchors_out, pos_out
