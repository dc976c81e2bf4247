"""Adaptive-verification policies: how many draft tokens of each request to verify.

Notation (R requests, K draft slots): `conf[r, j]` is the conditional confidence that draft j
survives given drafts < j were accepted; `surv[r, j] = prod_{i<=j} conf[r, i]` its prefix
survival; `capacities[r] <= K` the drafts request r actually has. A plan `l_r in 0..cap_r` sends
`sum(1 + l_r) + num_other_tokens` tokens and expects `tau = num_sampling_reqs + sum survivals of
the verified slots` accepted tokens; the objective is `theta = tau / step_time`. A step that
also carries prefill chunks (`num_other_tokens > 0`) is not the unit of work: its prefill time
is spent anyway, so a draft is worth its marginal time only at the rate decoding would earn in
that time (`opportunity_rate`, tokens/ms of the best decode-only step at this batch): the
objective becomes `tau - rate * step_time`. (Its own tokens/ms would make any draft look good:
on the H200 at 128 requests, verifying every draft in 8k-token prefill steps earned 3.8 tokens
per extra ms against 14 for plain decoding.)

Losslessness needs *non-anticipation*: whether draft j is verified may only depend on
information available before draft j was sampled. The allowed policies:

* ``lagged``: budget B from *stale* confidences (an earlier step's, already on the host; global
  argmax, no early stop), then a global top-B over the *current* survivals with ties broken by
  (position, request). Slot (r, j) is admitted iff fewer than B candidates rank ahead of it;
  candidates ahead of it are other requests' slots or r's earlier slots, never r's later slots
  (their survival is <= and ties go to the earlier position).
* ``early_stop``: the paper's Algorithm 1 on current survivals: greedy admission in descending
  survival, stop at the first non-improvement. The stop happens before a later slot's
  confidence (which depends on the earlier draft token) is looked at.
* ``threshold``: verify the leading run of slots with conf >= threshold.
* ``fixed``: verify everything.

A global argmax over *current* confidences is NOT allowed (paper Appendix A; see
tests/unit/test_lossless_policies.py).

Host functions are pure numpy; device functions are sync-free torch (no .item()/.cpu()).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dspark.spec.cost_model import CostModel

logger = logging.getLogger(__name__)

POLICIES = ("lagged", "early_stop", "threshold", "fixed")


@dataclass
class BudgetDecision:
    budget: int  # total draft tokens to verify this step
    max_budget: int  # sum of capacities (verify-all)
    theta_best: float  # predicted tokens/ms of the best candidate budget
    theta_full: float  # predicted tokens/ms of verify-all
    predicted_gain: float  # theta_best / theta_full - 1
    trimmed: bool  # budget < max_budget


def _stale_survivals(stale_conf, capacities: np.ndarray, prior_conf: float) -> np.ndarray:
    """Sorted-descending stale survivals of every slot < capacity (float64)."""
    caps = np.asarray(capacities, dtype=np.int64).reshape(-1)
    num_reqs = caps.size
    k = int(caps.max(initial=0))
    s = None if stale_conf is None else np.asarray(stale_conf, dtype=np.float64)
    if s is not None and s.ndim == 2 and s.shape[0] >= num_reqs and s.shape[1] >= k:
        conf = s[:num_reqs, :k]  # every row known (hot path: every lagged step)
        if prior_conf == 1.0:  # fmin drops NaN: unknown -> 1.0, then clipped (two calls)
            conf = np.fmax(np.fmin(conf, 1.0), 0.0)
        else:
            conf = np.where(np.isnan(conf), prior_conf, conf)
    else:  # rows or columns missing: the prior fills them
        conf = np.full((num_reqs, k), np.nan)
        if s is not None:
            if s.ndim == 1:
                s = s[None, :]
            rows, cols = min(num_reqs, s.shape[0]), min(k, s.shape[1])
            conf[:rows, :cols] = s[:rows, :cols]
        conf = np.where(np.isnan(conf), prior_conf, conf)
    surv = np.cumprod(np.clip(conf, 0.0, 1.0, out=conf), axis=1)
    flat = surv.reshape(-1) if num_reqs == 0 or caps.min() == k else surv[
        np.arange(k)[None, :] < caps[:, None]]  # fmt: skip
    # descending: each row is already descending (a running product of values in [0, 1]), so
    # a stable (run-merging) sort of the negated values beats a quicksort (~30% at 256 x 7)
    np.negative(flat, out=flat)
    flat.sort(kind="stable")
    return np.negative(flat, out=flat)


def plan_budget_lagged(
    stale_conf: np.ndarray | None,
    capacities: np.ndarray,
    num_other_tokens: int,
    num_sampling_reqs: int,
    cost: CostModel,
    min_predicted_gain: float = 0.04,
    allowed_budgets: np.ndarray | None = None,
    prior_conf: float = 1.0,
    trim_penalty_ms: float = 0.0,
    opportunity_rate: float | None = None,
) -> BudgetDecision:
    """Total draft budget B from stale confidences (host, numpy, no device sync).

    stale_conf: [R, K] conditional confidences of an earlier step, rows aligned with the current
        requests. Missing information is replaced by `prior_conf` (default 1.0, optimistic: a
        request without history pushes towards verify-all, the status quo): NaN entries, rows
        past `stale_conf.shape[0]` (new requests), columns past its width, or `None` entirely.
    capacities: [R] drafts per decoding request (R = number of decoding requests; each also
        sends its anchor token).
    Objective: global argmax over n in 0..sum(cap) (or `allowed_budgets`, e.g. budgets that fill
    captured CUDA graphs) of (num_sampling_reqs + cumsum(sorted survivals)[n]) /
    step_time(R + num_other_tokens + n, R), plus `trim_penalty_ms` for every n below verify-all
    (a trimmed step cannot run as one whole-step graph). Guard: unless the best trimmed budget
    beats verify-all by more than `min_predicted_gain` (relative), verify all. With
    `opportunity_rate` (steps with prefill chunks, see the module docstring) the objective is
    `tau - opportunity_rate * step_time` and the guard compares the difference with verify-all's
    tokens.
    """
    caps = np.asarray(capacities, dtype=np.int64).reshape(-1)
    num_reqs = caps.size
    s = _stale_survivals(stale_conf, caps, prior_conf)
    total = int(s.size)
    yield_n = num_sampling_reqs + np.concatenate([[0.0], np.cumsum(s)])  # [total + 1]
    if allowed_budgets is None:
        cand = np.arange(total + 1)
    else:
        a = np.asarray(allowed_budgets, dtype=np.int64).reshape(-1)
        a = a[(a >= 0) & (a < total)]
        if a.size > 1 and not bool((a[1:] > a[:-1]).all()):  # (budget_candidates' are sorted)
            a = np.unique(a)
        cand = np.append(a, total)
    times = cost.step_time_lookup(num_reqs + num_other_tokens + cand, num_reqs)
    if trim_penalty_ms > 0:  # a trimmed step runs a slower path than verify-all
        times = times + np.where(cand < total, trim_penalty_ms, 0.0)
    theta = yield_n[cand] / times
    if opportunity_rate is None:  # the step's own tokens/ms
        i = int(np.argmax(theta))
        theta_best, theta_full = float(theta[i]), float(theta[-1])
        if theta_full > 0:
            gain = theta_best / theta_full - 1.0
        else:
            gain = 0.0 if theta_best <= 0 else float("inf")
        trimmed = cand[i] < total and theta_best > theta_full * (1.0 + min_predicted_gain)
    else:  # net value: the prefill's time is spent anyway
        value = yield_n[cand] - opportunity_rate * times
        i = int(np.argmax(value))
        theta_best, theta_full = float(theta[i]), float(theta[-1])
        gain = float(value[i] - value[-1]) / max(float(yield_n[-1]), 1e-9)
        trimmed = cand[i] < total and gain > min_predicted_gain
    trimmed = bool(trimmed)
    best = int(cand[i]) if trimmed else total
    return BudgetDecision(budget=best, max_budget=total, theta_best=theta_best,
                          theta_full=theta_full, predicted_gain=gain, trimmed=trimmed)


def decode_rates(cost: CostModel, survival: np.ndarray | None, num_reqs: int,
                 plain_fixed_ms: float | None) -> tuple[float, float]:
    """Tokens per ms of a decode-only step of `num_reqs` sampling requests: (plain decoding,
    the best verify length l = 1..K with every request verifying l drafts of the given mean
    prefix survival, its drafter paid; -inf without a survival estimate). Plain decoding
    costs `plain_fixed_ms` (the measured fixed cost of steps without speculation; the
    table's fixed term until one is measured) + the forward of one token per request."""
    fixed = cost.fixed_overhead_ms if plain_fixed_ms is None else plain_fixed_ms
    plain = num_reqs / max(fixed + cost.verify_lookup(num_reqs), 1e-6)
    if survival is None or survival.size == 0:
        return plain, float("-inf")
    lengths = np.arange(1, survival.size + 1)
    times = cost.step_time_lookup(num_reqs * (1 + lengths), num_reqs)
    return plain, float((num_reqs * (1.0 + np.cumsum(survival)) / times).max())


def decode_rate(cost: CostModel, survival: np.ndarray | None, num_reqs: int,
                plain_fixed_ms: float | None) -> float:
    """Tokens per ms of the best decode-only step (decode_rates): what a draft's marginal
    time in a step with prefill chunks must beat."""
    return max(decode_rates(cost, survival, num_reqs, plain_fixed_ms))


def prefix_survival(stale: np.ndarray, prior_conf: float = 1.0) -> np.ndarray:
    """[R, K] prefix survival of each row's drafts from stale conditional confidences
    (unknown ones: the prior)."""
    conf = np.clip(np.where(np.isnan(stale), prior_conf, stale), 0.0, 1.0)
    return np.cumprod(conf, axis=1)


def mean_survival(stale: np.ndarray | None, prior_conf: float = 1.0) -> np.ndarray | None:
    """Mean prefix survival per position over rows of stale conditional confidences (unknown
    ones: the prior)."""
    if stale is None or stale.size == 0:
        return None
    return prefix_survival(stale, prior_conf).mean(axis=0)


# ---------------------------------------------------------------------- device side
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


class Planner:
    """Policy facade used by the engine.

    plan_cpu(...)        -> budget (lagged) or None (others); host only, no device sync.
    allocate_device(...) -> lengths [R] int64 on the device of `conf`, sync-free.
    last_decision        -> the latest BudgetDecision (lagged) for metrics/logs.
    """

    def __init__(self, policy: str, cost: CostModel | None = None, *,
                 min_predicted_gain: float = 0.04, threshold: float = 0.5,
                 prior_conf: float = 1.0, snap_to_graphs: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy in ("lagged", "early_stop"):
            if cost is None:
                raise ValueError(f"policy {policy!r} needs a cost model")
            problem = cost.describe_problem()
            if problem:
                msg = f"adaptive verification ({policy}): {problem}"
                logger.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        self.policy = policy
        self.cost = cost
        self.min_predicted_gain = min_predicted_gain
        self.threshold = threshold
        self.prior_conf = prior_conf
        self.snap_to_graphs = snap_to_graphs
        self.last_decision: BudgetDecision | None = None
        self._tables: dict[tuple, torch.Tensor] = {}

    def plan_cpu(self, stale_conf, capacities: np.ndarray,
                 num_other_tokens: int = 0, num_sampling_reqs: int | None = None,
                 trim_penalty_ms: float = 0.0,
                 opportunity_rate: float | None = None) -> int | None:
        """The lagged budget. `stale_conf`: [R, K] array (see plan_budget_lagged), None, or a
        callable returning one, called only when the budget search needs it."""
        if self.policy != "lagged":
            return None
        caps = np.asarray(capacities, dtype=np.int64).reshape(-1)
        if num_sampling_reqs is None:
            num_sampling_reqs = caps.size
        total = int(caps.sum())
        if opportunity_rate is None and self._trimming_cannot_pay(caps.size, num_other_tokens,
                                                                  total, trim_penalty_ms):
            self.last_decision = BudgetDecision(total, total, float("nan"), float("nan"), 0.0,
                                                False)  # fmt: skip
            return total
        if callable(stale_conf):  # read lazily: the bound above usually makes it unneeded
            stale_conf = stale_conf()
        allowed = None
        if self.snap_to_graphs and self.cost.graph_sizes:
            allowed = self.cost.budget_candidates(caps.size + num_other_tokens, total)
        d = plan_budget_lagged(stale_conf, caps, num_other_tokens, num_sampling_reqs,
                               self.cost, self.min_predicted_gain, allowed, self.prior_conf,
                               trim_penalty_ms, opportunity_rate)  # fmt: skip
        self.last_decision = d
        return d.budget

    def _trimming_cannot_pay(self, num_reqs: int, other: int, total: int,
                             penalty_ms: float) -> bool:
        """A cheap exact bound (the common case at low load, where verification is nearly
        free): every trimmed budget n yields at most verify-all's tokens in at least the
        step time of n = 0 (+ the trim penalty), so theta(n) / theta(all) <= T(all) /
        (T(0) + penalty); when that is within the guard, no budget can be trimmed."""
        t0, t_all = self.cost.step_time_lookup(
            np.array([num_reqs + other, num_reqs + other + total]), num_reqs)  # fmt: skip
        return t_all <= (t0 + penalty_ms) * (1.0 + self.min_predicted_gain)

    def invalidate_tables(self) -> None:
        """Drop cached device step-time tables (after the cost model changed)."""
        self._tables.clear()

    def _table(self, num_tokens: int, num_reqs: int, device) -> torch.Tensor:
        key = (num_tokens, num_reqs, str(device))
        if key not in self._tables:
            if len(self._tables) > 256:
                self._tables.clear()
            self._tables[key] = self.cost.as_tensor_table(num_tokens, num_reqs, device)
        return self._tables[key]

    def allocate_device(self, conf: torch.Tensor, capacities: torch.Tensor, *,
                        budget: int | torch.Tensor | None = None, num_other_tokens: int = 0,
                        num_sampling_reqs: int | None = None) -> torch.Tensor:
        num_reqs, k = conf.shape
        if self.policy == "fixed":
            return fixed_lengths(capacities)
        if self.policy == "threshold":
            return threshold_lengths(conf, capacities, self.threshold)
        if self.policy == "early_stop":
            n_sampling = num_reqs if num_sampling_reqs is None else num_sampling_reqs
            # Round the table length up so that it is reused across steps.
            need = num_reqs + num_other_tokens + num_reqs * k
            table = self._table(1 << max(need, 1).bit_length(), num_reqs, conf.device)
            return early_stop_lengths(conf, capacities, num_other_tokens, n_sampling, table)
        if budget is None:
            d = self.last_decision
            if d is None:
                raise RuntimeError("lagged policy: call plan_cpu before allocate_device")
            if not d.trimmed:
                return fixed_lengths(capacities)
            budget = d.budget
        return allocate_top_b(conf, capacities, budget)
