"""The lagged policy's budget search on the host (numpy, no device sync): the total number of
draft tokens a step verifies, from stale confidences and the cost model (Planner.plan_cpu;
batches of at most SMALL_SLOTS draft slots search on Python floats, small_search.py).

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
"""

from __future__ import annotations

import numpy as np

from dspark.spec.cost_model import CostModel
from dspark.spec.plan_reuse import BudgetDecision
from dspark.spec.rates import prefix_survival


def stale_survivals(stale_conf, capacities: np.ndarray, prior_conf: float,
                     total: int | None = None, prior_survival=None) -> np.ndarray:
    """Sorted-descending stale survivals of every slot < capacity (float64). `total`: the
    capacities' sum when the caller knows it (when it is R times the largest, every row has
    that capacity: the usual case needs no mask). `prior_survival`: see population_prior."""
    caps = np.asarray(capacities, dtype=np.int64).reshape(-1)
    num_reqs = caps.size
    k = int(caps.max(initial=0))
    full = total is not None and total == num_reqs * k
    s = None if stale_conf is None else np.asarray(stale_conf)
    if s is not None and s.ndim == 2 and s.shape[0] >= num_reqs and s.shape[1] >= k:
        conf = s[:num_reqs, :k]  # every row known (hot path: every lagged step)
    else:  # rows or columns missing: the prior fills them (NaN: unknown)
        conf = np.full((num_reqs, k), np.nan)
        if s is not None:
            if s.ndim == 1:
                s = s[None, :]
            rows, cols = min(num_reqs, s.shape[0]), min(k, s.shape[1])
            conf[:rows, :cols] = s[:rows, :cols]
    surv = population_prior(conf, prior_conf, prior_survival)  # (a new array: sorted in place)
    flat = surv.reshape(-1) if full or num_reqs == 0 or caps.min() == k else surv[
        np.arange(k)[None, :] < caps[:, None]]  # fmt: skip
    # descending: numpy's default sort of the negated values (only the values matter: ties
    # are equal). Not kind="stable": numpy 2's SIMD quicksort is ~5x faster at 256 x 7 (12 vs
    # 63 us, development machine, numpy 2.4), where the stable sort's merging of each row's
    # descending run had been ~30% ahead of the pre-SIMD quicksort
    np.negative(flat, out=flat)
    flat.sort()
    return np.negative(flat, out=flat)


def population_prior(conf: np.ndarray, prior_conf: float, prior_survival=None) -> np.ndarray:
    """[R, K] float64 prefix survivals of stale conditional confidences. A row with unknown
    entries (NaN: a request whose first drafts have not reached the host, at the start of a
    burst most of the batch) takes the mean survivals of the known rows, the best estimate of
    what its drafts will yield. When no row is known, `prior_survival` (mean prefix survivals
    per position, at least K of them: the drafting decision's estimate of earlier steps)
    fills them, else `prior_conf`. (With a prior of 1.0 every newcomer's drafts looked
    certain, so while a burst of requests is admitted, beside prefill chunks that make each
    draft cost its full compute, the plans leaned towards verifying all of them.)
    Non-anticipating: the known rows' confidences are as stale as the rows' own would be,
    and the estimate is older still."""
    surv = prefix_survival(conf, prior_conf, np.float64)
    unknown = np.isnan(conf).any(axis=1)
    if unknown.any():
        if not unknown.all():
            surv[unknown] = surv[~unknown].mean(axis=0)
        elif prior_survival is not None and surv.size:
            surv[:] = np.asarray(prior_survival, dtype=np.float64)[: surv.shape[1]]
    return surv


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
        requests. A row with missing information (NaN entries, rows past `stale_conf.shape[0]`
        (new requests), columns past its width) takes the known rows' mean survivals
        (population_prior); with no row known (or `None`), `prior_conf` fills every slot
        (default 1.0, optimistic: verify-all, the status quo).
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
    s = stale_survivals(stale_conf, caps, prior_conf)
    cand = candidate_budgets(allowed_budgets, int(s.size))
    times = cost.step_time_lookup(num_reqs + num_other_tokens + cand, num_reqs)
    if trim_penalty_ms > 0:  # a trimmed step runs a slower path than verify-all
        times = times + penalties(cand, trim_penalty_ms)
    return best_budget(s, cand, times, num_sampling_reqs, min_predicted_gain, opportunity_rate)


def candidate_budgets(allowed_budgets: np.ndarray | None, total: int) -> np.ndarray:
    """The budgets searched: `allowed_budgets` below `total` (all of 0..total-1 when None),
    sorted, then `total` (verify-all) last."""
    if allowed_budgets is None:
        return np.arange(total + 1)
    a = np.asarray(allowed_budgets, dtype=np.int64).reshape(-1)
    a = a[(a >= 0) & (a < total)]
    if a.size > 1 and not bool((a[1:] > a[:-1]).all()):  # (budget_candidates' are sorted)
        a = np.unique(a)
    return np.append(a, total)


def penalties(cand: np.ndarray, trim_penalty_ms: float) -> np.ndarray:
    """The trim penalty of each candidate budget (none for verify-all, the last)."""
    return np.where(cand < cand[-1], trim_penalty_ms, 0.0)


def best_budget(surv: np.ndarray, cand: np.ndarray, times: np.ndarray, num_sampling_reqs: int,
                min_predicted_gain: float, opportunity_rate: float | None) -> BudgetDecision:
    """The search of plan_budget_lagged over candidate budgets `cand` (verify-all last) with
    their step times, given the sorted-descending stale survivals `surv`."""
    total = int(cand[-1])
    yield_n = np.empty(total + 1)  # expected tokens of each budget 0..total
    yield_n[0] = 0.0
    surv.cumsum(out=yield_n[1:])
    yield_n += num_sampling_reqs
    if cand.size < total + 1:  # (snapped to graph sizes; else every budget is a candidate)
        yield_n = yield_n[cand]
    theta = yield_n / times
    if opportunity_rate is None:  # the step's own tokens/ms
        i = int(theta.argmax())
        theta_best, theta_full = float(theta[i]), float(theta[-1])
        if theta_full > 0:
            gain = theta_best / theta_full - 1.0
        else:
            gain = 0.0 if theta_best <= 0 else float("inf")
        trimmed = cand[i] < total and theta_best > theta_full * (1.0 + min_predicted_gain)
    else:  # net value: the prefill's time is spent anyway
        value = yield_n - opportunity_rate * times
        i = int(value.argmax())
        theta_best, theta_full = float(theta[i]), float(theta[-1])
        gain = float(value[i] - value[-1]) / max(float(yield_n[-1]), 1e-9)
        trimmed = cand[i] < total and gain > min_predicted_gain
    trimmed = bool(trimmed)
    best = int(cand[i]) if trimmed else total
    return BudgetDecision(budget=best, max_budget=total, theta_best=theta_best,
                          theta_full=theta_full, predicted_gain=gain, trimmed=trimmed)
