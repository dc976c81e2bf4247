"""Synthetic acceptance for benchmarks (NOT lossless; never use it to serve real traffic).

On random-weight targets drafts are never accepted, so the cost of speculation could not be
measured where verification is expensive. In synthetic mode draft j of a request is accepted
with the conditional probability `rates[j]` (given drafts 1..j-1 were), whatever its value,
drawn from the same counter-based uniforms as real verification; the token after the accepted
run is the target's argmax. Everything else (drafting, planning, the ragged verify forward) is
the real engine path, so throughput is measured honestly at a chosen acceptance profile.
"""

from __future__ import annotations

import torch

from dspark.sampling import rng


def verify_synthetic(
    target_logits: torch.Tensor,  # [N, V] ragged rows: request r owns cu[r]:cu[r+1]
    cu_num_logits: torch.Tensor,  # [R+1]
    draft_token_ids: torch.Tensor,  # [R, K]
    rates: torch.Tensor,  # [K] float: conditional acceptance probability per position
    seeds: torch.Tensor,  # [R]
    anchor_positions: torch.Tensor,  # [R]
    rounds: torch.Tensor,  # [R]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same outputs as `verify`: tokens [R, K+1] (-1 padded) and num_emitted [R]."""
    dev = target_logits.device
    drafts = draft_token_ids.to(dev, torch.int64)
    num_reqs, k = drafts.shape
    cu = cu_num_logits.to(dev, torch.int64)
    num_drafts = cu[1:] - cu[:-1] - 1  # -1: padding request
    slots = torch.arange(k, device=dev)
    u = rng.uniform(seeds.unsqueeze(1), anchor_positions.unsqueeze(1) + 1 + slots,
                    rounds.unsqueeze(1), rng.ACCEPT)  # fmt: skip
    ok = (u < rates[:k].to(dev, torch.float64)) & (slots < num_drafts.unsqueeze(1))
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    live = num_drafts >= 0
    final_row = (cu[:-1] + accepted).clamp(max=max(target_logits.shape[0] - 1, 0))
    final = target_logits[final_row].argmax(dim=-1)
    out = drafts.new_full((num_reqs, k + 1), -1)
    width = torch.arange(k + 1, device=dev)
    padded = torch.cat([drafts, drafts.new_zeros(num_reqs, 1)], dim=1)
    out = torch.where(width < accepted.unsqueeze(1), padded, out)
    out.scatter_(1, accepted.unsqueeze(1), final.unsqueeze(1))
    out = torch.where(live.unsqueeze(1), out, torch.full_like(out, -1))
    return out, torch.where(live, accepted + 1, torch.zeros_like(accepted))
