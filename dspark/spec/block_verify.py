"""Block verification (Sun et al., ICLR 2025; research/dspark_method.md §5), vectorized.

For a request with l drafts X_1..X_l, target rows p^t_1..p^t_{l+1} and draft rows
p^d_1..p^d_l (row i of the verify batch holds p^t_{i+1}; draft slot i holds p^d_{i+1}):

    P_0 = 1,  P_i = min(P_{i-1} p^t_i(X_i) / p^d_i(X_i), 1)
    R_i = sum_x max(P_i p^t_{i+1}(x) - p^d_{i+1}(x), 0)              (i < l)
    h_i = R_i / (R_i + 1 - P_i)  (i < l),   h_l = P_l
    tau = max{i in 1..l : U_i <= h_i}  (0 if none)

then X_1..X_tau are emitted followed by a token from p^t_{l+1} if tau = l, else from
norm(max(P_tau p^t_{tau+1} - p^d_{tau+1}, 0)). Conventions: R_i + 1 - P_i = 0 only when
P_i = 1 and p^t_{i+1} = p^d_{i+1}, where h_i is set to 1 (the value cannot change tau: then
P_{i+1} = 1 surely and a later index is always selected). Greedy drafts are point masses,
p^d(x) = [x = X], so R_i = P_i (1 - p^t_{i+1}(X_{i+1})) and the residual is p^t without X.
The standard method's residual is the same formula with P = 1.

U_i is keyed by the position of X_i (anchor + i) with the BLOCK purpose tag.
"""

from __future__ import annotations

import torch

from dspark.sampling import rng


def prefix_weights(pt_draft: torch.Tensor, pd_draft: torch.Tensor) -> torch.Tensor:
    """P_0..P_K [R, K+1] float64 from p_t(X_i) and p_d(X_i) per slot ([R, K] each).

    Column i only depends on slots < i, so it is exact as soon as those slots are known.
    """
    p = torch.ones(pt_draft.shape[0], dtype=torch.float64, device=pt_draft.device)
    cols = [p]
    for i in range(pt_draft.shape[1]):
        num = p * pt_draft[:, i]
        den = pd_draft[:, i]
        # min(num / den, 1) without dividing by zero (den > num >= 0 where we divide).
        p = torch.where(num >= den, torch.ones_like(num), num / den.clamp_min(1e-300))
        cols.append(p)
    return torch.stack(cols, dim=1)


def residual_weights(
    probs: torch.Tensor,  # [c, V] float32 target probabilities of the rows
    weight: torch.Tensor,  # [c] prefix weight P of each row (1 for the standard method)
    draft: torch.Tensor,  # [c] int64 draft token predicted by the row (greedy drafts)
    draft_rows: torch.Tensor | None,  # [c, V] float32 draft distributions, None = greedy
) -> torch.Tensor:
    """Unnormalised residual max(P p_t - p_d, 0), [c, V] float32."""
    scaled = probs * weight.to(probs.dtype).unsqueeze(1)
    if draft_rows is None:
        return scaled.scatter(1, draft.unsqueeze(1), 0.0)
    return (scaled - draft_rows.to(probs.dtype)).clamp_min(0.0)


def residual_mass(
    probs: torch.Tensor,
    weight: torch.Tensor,
    draft: torch.Tensor,
    draft_rows: torch.Tensor | None,
) -> torch.Tensor:
    """R = sum_x max(P p_t(x) - p_d(x), 0) per row, [c] float64."""
    return residual_weights(probs, weight, draft, draft_rows).sum(dim=1).double()


def block_tau(
    weights: torch.Tensor,  # [R, K+1] P_0..P_K
    res_mass: torch.Tensor,  # [R, K+1] R_i at column i (valid for i < l)
    num_drafts: torch.Tensor,  # [R] l (-1 for padding requests)
    seeds: torch.Tensor,
    anchors: torch.Tensor,
    rounds: torch.Tensor,
) -> torch.Tensor:
    """tau = max{i in 1..l : U_i <= h_i} (0 if none), [R] int64."""
    num_reqs, k1 = weights.shape
    if k1 <= 1:
        return torch.zeros(num_reqs, dtype=torch.int64, device=weights.device)
    i = torch.arange(1, k1, device=weights.device)
    p = weights[:, 1:]
    r = res_mass[:, 1:]
    den = r + (1.0 - p)
    h_mid = torch.where(den > 0, r / den.clamp_min(1e-300), torch.ones_like(r)).clamp(0.0, 1.0)
    length = num_drafts.unsqueeze(1)
    h = torch.where(i == length, p, h_mid)
    u = rng.uniform(seeds.unsqueeze(1), anchors.unsqueeze(1) + i, rounds.unsqueeze(1), rng.BLOCK)
    stop = (u <= h) & (i <= length)
    return (stop.long() * i).amax(dim=1)
