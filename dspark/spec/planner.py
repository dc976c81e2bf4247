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

Host functions (here) are pure numpy; device functions (allocation.py) are sync-free torch.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from dspark.spec.allocation import (
    allocate_top_b,
    early_stop_lengths,
    fixed_lengths,
    threshold_lengths,
)
from dspark.spec.cost_model import CostModel
from dspark.spec.rates import prefix_survival

logger = logging.getLogger(__name__)

POLICIES = ("lagged", "early_stop", "threshold", "fixed")
REUSE_CLEAR_PLANS = 4  # the engine's Planner(reuse_clear_plans=...): see Planner.__init__
REUSE_TRIMMED_PLANS = 8  # ... and Planner(reuse_trimmed_plans=...): the drafting decision's
# cadence (drafting._DECIDE_EVERY), whose steps read the confidences anyway


@dataclass
class BudgetDecision:
    budget: int  # total draft tokens to verify this step
    max_budget: int  # sum of capacities (verify-all)
    theta_best: float  # predicted tokens/ms of the best candidate budget
    theta_full: float  # predicted tokens/ms of verify-all
    predicted_gain: float  # theta_best / theta_full - 1
    trimmed: bool  # budget < max_budget


def _stale_survivals(stale_conf, capacities: np.ndarray, prior_conf: float,
                     total: int | None = None) -> np.ndarray:
    """Sorted-descending stale survivals of every slot < capacity (float64). `total`: the
    capacities' sum when the caller knows it (when it is R times the largest, every row has
    that capacity: the usual case needs no mask)."""
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
    surv = prefix_survival(conf, prior_conf, np.float64)  # (a new array: sorted in place)
    flat = surv.reshape(-1) if full or num_reqs == 0 or caps.min() == k else surv[
        np.arange(k)[None, :] < caps[:, None]]  # fmt: skip
    # descending: numpy's default sort of the negated values (only the values matter: ties
    # are equal). Not kind="stable": numpy 2's SIMD quicksort is ~5x faster at 256 x 7 (12 vs
    # 63 us, development machine, numpy 2.4), where the stable sort's merging of each row's
    # descending run had been ~30% ahead of the pre-SIMD quicksort
    np.negative(flat, out=flat)
    flat.sort()
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


def _nearby_rows(num_reqs: int) -> int:
    """The group of a request count whose plans stand for each other: exact below 16, then
    16 groups per doubling (240-255, 256-287, ...: within ~6%)."""
    shift = max(0, num_reqs.bit_length() - 4)
    return (num_reqs >> shift) << shift


def _nearby_other(num_other_tokens: int) -> int:
    """The group of a prefill token count whose plans stand for each other: the same power of
    two (257-512, ...); 0 (no prefill chunk) alone."""
    return 1 << (num_other_tokens - 1).bit_length() if num_other_tokens > 0 else 0


def _rate_group(rate: float | None) -> int | None:
    """The group of an opportunity rate (tokens/ms decoding would earn) whose plans stand for
    each other: within ~5% (None: a step without prefill chunks)."""
    return None if rate is None else int(math.log(max(rate, 1e-6)) * 20.0)


def _rescaled(d: BudgetDecision, cand: np.ndarray, total: int) -> BudgetDecision:
    """A standing decision carried to a nearby shape of `total` drafts: verify-all stays
    verify-all; a trimmed budget keeps its share of the drafts, rounded down to one of this
    shape's candidate budgets (those that fill a captured graph)."""
    budget = total
    if d.trimmed:
        want = round(d.budget * total / max(d.max_budget, 1))
        budget = int(cand[max(int(np.searchsorted(cand, want, side="right")) - 1, 0)])
    return BudgetDecision(budget, total, d.theta_best, d.theta_full, d.predicted_gain,
                          budget < total)  # fmt: skip


class Planner:
    """Policy facade used by the engine.

    plan_cpu(...)        -> budget (lagged) or None (others); host only, no device sync.
    allocate_device(...) -> lengths [R] int64 on the device of `conf`, sync-free.
    last_decision        -> the latest BudgetDecision (lagged) for metrics/logs.
    """

    def __init__(self, policy: str, cost: CostModel | None = None, *,
                 min_predicted_gain: float = 0.04, threshold: float = 0.5,
                 prior_conf: float = 1.0, snap_to_graphs: bool = True,
                 reuse_clear_plans: int = 1, reuse_trimmed_plans: int = 1) -> None:
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
        self._contexts: dict[tuple, tuple] = {}  # host: per batch shape (_context)
        # A verify-all plan whose best trim came nowhere near the guard (predicted gain under
        # half of it) stands for the next `reuse_clear_plans - 1` plans of the same shape and
        # penalty, confidences unread: at low load, where trimming does not pay, the search
        # was most of a step's planning (H200, 33.6 M pair: 11.8% of step time). Lossless: a
        # budget may come from any information older than the drafts; 1: search every plan.
        # A trimmed plan likewise stands for the next `reuse_trimmed_plans - 1` of its shape:
        # its budget sums a whole batch's survivals, which move little from one step to the
        # next, while the search costs ~130 us of host time per step (2-core development
        # machine, 32 rows; ~250 us on the H200's host: 2.8% of an 8B step at c = 32). The
        # device still allocates the reused budget over the live confidences. Shapes whose
        # request counts are within ~6% share a standing plan (`_nearby_rows`), its budget
        # carried over as the same share of their drafts (`_rescaled`): at c = 256 a request
        # finishes or arrives at nearly every step.
        self.reuse_clear_plans = reuse_clear_plans
        self.reuse_trimmed_plans = reuse_trimmed_plans
        # (shape, penalty) -> [plans it still stands for, its decision]
        self._reuse: dict[tuple, list] = {}
        self.searches = 0  # plan_cpu calls that searched budgets (the scheduler's overhead by part)

    def plan_cpu(self, stale_conf, capacities: np.ndarray,
                 num_other_tokens: int = 0, num_sampling_reqs: int | None = None,
                 trim_penalty_ms: float = 0.0, opportunity_rate: float | None = None,
                 survival_scale: float = 1.0, total: int | None = None) -> int | None:
        """The lagged budget. `stale_conf`: [R, K] array (see plan_budget_lagged), None, or a
        callable returning one, called only when the budget search needs it.
        `survival_scale`: the survivals' measured calibration error (drafts accepted over
        those the confidences predicted, DraftingDecision.acceptance_ratio); the expected
        yield of each slot is its stale survival times it, at most 1 (the order, and so the
        device's top-B allocation on the live confidences, is unchanged). `total`: the
        capacities' sum when the caller knows it (the packed step's)."""
        if self.policy != "lagged":
            return None
        caps = capacities  # (the engine's: a packed step's int64 row, used as is)
        if not (isinstance(caps, np.ndarray) and caps.ndim == 1 and caps.dtype == np.int64):
            caps = np.asarray(capacities, dtype=np.int64).reshape(-1)
        if num_sampling_reqs is None:
            num_sampling_reqs = caps.size
        if total is None:
            total = int(caps.sum())
        cand, variable, ends, settled = self._context(caps.size, num_other_tokens, total)
        if opportunity_rate is None and self._bound_settles(ends, trim_penalty_ms):
            self.last_decision = settled
            return total
        # (nearby shapes share a standing plan: at high load requests finish and arrive
        # every few steps, and an exact shape would search at every one; so do steps with
        # prefill chunks of similar size at a similar opportunity rate: H200, trained pair,
        # c = 256, they were most of the searches, ~0.2-0.3 ms each)
        reuse = (_nearby_rows(caps.size), _nearby_other(num_other_tokens), trim_penalty_ms,
                 num_sampling_reqs == caps.size, _rate_group(opportunity_rate))  # fmt: skip
        standing = self._reuse.get(reuse)
        if standing is not None and standing[0] > 0:
            standing[0] -= 1
            d = standing[1]
            if d.max_budget != total:  # another shape of the group: the same share of drafts
                d = _rescaled(d, cand, total)
            self.last_decision = d
            return d.budget
        self.searches += 1
        if callable(stale_conf):  # read lazily: the bound above usually makes it unneeded
            stale_conf = stale_conf()
        surv = _stale_survivals(stale_conf, caps, self.prior_conf, total)
        if survival_scale != 1.0:
            surv = np.minimum(surv * survival_scale, 1.0)
        times = self.cost.add_fixed(variable)  # the same numbers as plan_budget_lagged's
        if trim_penalty_ms > 0:
            times = times + penalties(cand, trim_penalty_ms)
        d = best_budget(surv, cand, times, num_sampling_reqs, self.min_predicted_gain,
                        opportunity_rate)  # fmt: skip
        if d.trimmed:
            stands_for = self.reuse_trimmed_plans
        else:  # near the guard, a verify-all is one small move from trimming: it stands no
            # longer than a trimmed plan would (H200 host, 8B shape, c = 256: such plans were
            # searched at every step, ~0.3 ms each)
            clear = d.predicted_gain < self.min_predicted_gain / 2
            stands_for = (self.reuse_clear_plans if clear
                          else min(self.reuse_clear_plans, self.reuse_trimmed_plans))
        if stands_for > 1:
            if len(self._reuse) > 4096:
                self._reuse.clear()
            self._reuse[reuse] = [stands_for - 1, d]
        self.last_decision = d
        return d.budget

    def _context(self, num_reqs: int, other: int, total: int) -> tuple:
        """What a batch shape's budget search needs besides the confidences: the candidate
        budgets, their step times without the fixed term (which is learned online, so added
        per step), those of n = 0 and n = total (the bound), and the bound's decision. Cached
        per shape: at steady state the same shape repeats step after step, and building it
        costs more than the search itself."""
        key = (num_reqs, other, total, self.cost.greedy_drafts)
        ctx = self._contexts.get(key)
        if ctx is None:
            allowed = None
            if self.snap_to_graphs and self.cost.graph_sizes:
                allowed = self.cost.budget_candidates(num_reqs + other, total)
            cand = candidate_budgets(allowed, total)
            variable = self.cost.variable_lookup(num_reqs + other + cand, num_reqs)
            ends = tuple(map(float, self.cost.variable_lookup(
                np.array([num_reqs + other, num_reqs + other + total]), num_reqs)))
            # the decision of a plan the bound settles (verify-all; read, never written)
            settled = BudgetDecision(total, total, float("nan"), float("nan"), 0.0, False)
            if len(self._contexts) > 4096:
                self._contexts.clear()
            ctx = self._contexts[key] = (cand, variable, ends, settled)
        return ctx

    def _trimming_cannot_pay(self, num_reqs: int, other: int, total: int,
                             penalty_ms: float) -> bool:
        return self._bound_settles(self._context(num_reqs, other, total)[2], penalty_ms)

    def _bound_settles(self, ends: tuple[float, float], penalty_ms: float) -> bool:
        """A cheap exact bound (the common case at low load, where verification is nearly
        free): every trimmed budget n yields at most verify-all's tokens in at least the
        step time of n = 0 (+ the trim penalty), so theta(n) / theta(all) <= T(all) /
        (T(0) + penalty); when that is within the guard, no budget can be trimmed. `ends`:
        the variable step times of n = 0 and n = all (_context)."""
        t0, t_all = self.cost.add_fixed(ends[0]), self.cost.add_fixed(ends[1])
        return t_all <= (t0 + penalty_ms) * (1.0 + self.min_predicted_gain)

    def invalidate_tables(self, keep_plans: bool = False) -> None:
        """Drop what embeds the fixed term or the drafter's pricing (after either changed):
        the device step-time tables and, unless `keep_plans`, the standing plans. The shape
        contexts stay: they hold only the variable part and are keyed by the drafter's
        pricing. (The online fixed term moved on 15-40% of the steps in development-machine
        runs; dropping contexts and standing plans each time rebuilt and searched that often.)"""
        self._tables.clear()
        if not keep_plans:
            self._reuse.clear()

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
