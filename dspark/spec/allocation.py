"""Device-side allocation: per-request verify lengths from *current* confidences, sync-free
(no .item()/.cpu()). The policies and the losslessness argument are in planner.py's docstring.
"""

from __future__ import annotations

import torch

from dspark.layers.norm import fused_ops


def _survival_ranks(conf: torch.Tensor, capacities: torch.Tensor, drop_zero: bool = False):
    """Rank of every slot in the global order (-survival, position, request); invalid slots
    (>= capacity; with `drop_zero` also zero survival) sort last with key +inf.
    Returns (ranks [K*R], valid [K*R], sorted keys [K*R]), flat index = position * R + req."""
    num_reqs, k = conf.shape
    dtype = torch.float64 if conf.dtype == torch.float64 else torch.float32
    c = torch.nan_to_num(conf.to(dtype), nan=0.0).clamp_(0.0, 1.0)
    surv = torch.cumprod(c, dim=1)  # [R, K]
    pos = torch.arange(k, device=conf.device)
    valid = pos[None, :] < capacities.to(conf.device)[:, None]  # [R, K]
    if drop_zero:
        valid = valid & (surv > 0)
    # Position-major flattening: flat index j * R + r, so a *stable* sort on -survival breaks
    # ties by position, then request.
    surv_t, valid_t = surv.t().reshape(-1), valid.t().reshape(-1)
    key = torch.where(valid_t, -surv_t, torch.full_like(surv_t, float("inf")))
    sorted_key, order = torch.sort(key, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return ranks, valid_t, sorted_key


def _lengths_from_admitted(admitted: torch.Tensor, num_reqs: int, k: int) -> torch.Tensor:
    return admitted.view(k, num_reqs).sum(dim=0, dtype=torch.int64)


def allocate_top_b(conf: torch.Tensor, capacities: torch.Tensor,
                   budget: int | torch.Tensor) -> torch.Tensor:
    """Per-request verify lengths [R] int64: global top-`budget` over current prefix survivals.

    conf [R, K] current conditional confidences (NaN -> 0); capacities [R] int; slots >= cap are
    never admitted. Ties are broken by position, then request (stable sort on a position-major
    layout), never by a later slot's value, so the result is a prefix of every request.
    Sync-free: `budget` may be a python int or a 0-dim tensor.
    """
    num_reqs, k = conf.shape
    if num_reqs == 0 or k == 0:
        return torch.zeros(num_reqs, dtype=torch.int64, device=conf.device)
    if fused_ops(conf) is not None:  # one Triton launch on CUDA (top_b_triton.py)
        from dspark.spec import top_b_triton

        return top_b_triton.allocate_top_b(conf, capacities, budget)
    ranks, valid, _ = _survival_ranks(conf, capacities)
    admitted = (ranks < budget) & valid
    return _lengths_from_admitted(admitted, num_reqs, k)


def early_stop_lengths(conf: torch.Tensor, capacities: torch.Tensor, num_other_tokens: int,
                       num_sampling_reqs: int | torch.Tensor,
                       step_time_table: torch.Tensor) -> torch.Tensor:
    """The paper's Algorithm 1 on current survivals, vectorized and sync-free.

    Admit slots greedily in descending survival (ties: position, request; zero survivals and
    slots >= cap never); stop at the first admission that does not strictly improve
    theta = tau / step_time_table[tokens]. step_time_table[n] is the step time (ms) of a forward
    with n total tokens for this batch's R (see CostModel.as_tensor_table); it must cover
    R + num_other_tokens + sum of admissible slots.
    """
    num_reqs, k = conf.shape
    if num_reqs == 0 or k == 0:
        return torch.zeros(num_reqs, dtype=torch.int64, device=conf.device)
    n_slots = num_reqs * k
    base = num_reqs + int(num_other_tokens)
    if step_time_table.numel() < base + n_slots + 1:
        raise ValueError(f"step_time_table has {step_time_table.numel()} entries, need "
                         f"{base + n_slots + 1} (R + other tokens + R*K + 1)")
    ranks, valid, sorted_key = _survival_ranks(conf, capacities, drop_zero=True)
    dtype = sorted_key.dtype
    table = step_time_table.to(device=conf.device, dtype=dtype)
    sorted_valid = torch.isfinite(sorted_key)  # valid slots sort first
    sorted_surv = torch.where(sorted_valid, -sorted_key, torch.zeros_like(sorted_key))
    tau = torch.cat([torch.zeros(1, dtype=dtype, device=conf.device),
                     torch.cumsum(sorted_surv, 0)]) + num_sampling_reqs  # [n_slots + 1]
    theta = tau / table[base: base + n_slots + 1]
    # Admission m (1-based) happens iff admissions 1..m all improved strictly on their
    # predecessor (while improving, `best` is always the previous theta).
    improve = (theta[1:] > theta[:-1]) & sorted_valid
    num_admit = torch.cumprod(improve.to(torch.int64), 0).sum()
    admitted = ranks < num_admit
    return _lengths_from_admitted(admitted, num_reqs, k)


def threshold_lengths(conf: torch.Tensor, capacities: torch.Tensor,
                      threshold: float | torch.Tensor) -> torch.Tensor:
    """Leading run of slots with conditional confidence >= threshold (scalar or [K])."""
    num_reqs, k = conf.shape
    pos = torch.arange(k, device=conf.device)
    ok = (conf >= threshold) & (pos[None, :] < capacities.to(conf.device)[:, None])
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)


def fixed_lengths(capacities: torch.Tensor) -> torch.Tensor:
    return capacities.to(torch.int64).clone()
