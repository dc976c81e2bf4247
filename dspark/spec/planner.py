"""Adaptive-verification policies: how many draft tokens of each request to verify (notation:
budget_search.py).

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

The lagged budget's search is host numpy (budget_search.py; small batches on Python floats:
small_search.py); device functions (allocation.py) are sync-free torch.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from dspark.spec.allocation import (
    allocate_top_b,
    early_stop_lengths,
    fixed_lengths,
    threshold_lengths,
)
from dspark.spec.budget_search import best_budget, candidate_budgets, penalties, stale_survivals
from dspark.spec.cost_model import CostModel
from dspark.spec.plan_reuse import (
    RATE_TOLERANCE,
    BudgetDecision,
    StandingPlans,
    budget_at_most,
    rate_tolerance,
    settled_decision,
)
from dspark.spec.small_search import SMALL_SLOTS, best_budget_small, stale_survivals_small

logger = logging.getLogger(__name__)

POLICIES = ("lagged", "early_stop", "threshold", "fixed")
# the engine's Planner(reuse_clear_plans=...), see plan_reuse.py: 16, not 4 (H200, trained
# pair, c = 4, T = 0: 341 of 1,455 plans searched, ~140 us each, 2.8% of the step time; a
# batch size that moves by ~6% starts a new group, and so a search, at once)
REUSE_CLEAR_PLANS = 16
REUSE_TRIMMED_PLANS = 8  # ... and Planner(reuse_trimmed_plans=...): the drafting decision's
# cadence (drafting._DECIDE_EVERY), whose steps read the confidences anyway


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
        # mean prefix survivals per position for steps none of whose rows has confidences
        # (set by the engine from the drafting decision's estimate; None: prior_conf)
        self.prior_survival: list[float] | None = None
        self.snap_to_graphs = snap_to_graphs
        self.last_decision: BudgetDecision | None = None
        # whether the latest plan_cpu (or bound_settles) settled verify-all by the cost bound
        self.last_settled = False  # (confidences unread, no search)
        self._tables: dict[tuple, torch.Tensor] = {}
        self._contexts: dict[tuple, tuple] = {}  # host: per batch shape (_context)
        # searched plans reused for nearby shapes, confidences unread (plan_reuse.py)
        self.standing = StandingPlans(reuse_clear_plans, reuse_trimmed_plans, min_predicted_gain)
        self.searches = 0  # plan_cpu calls that searched budgets (the scheduler's overhead by part)
        self._last_group: tuple | None = None  # the standing-plan group plan_cpu used last

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
        ctx, self.last_settled = None, False
        if opportunity_rate is None:  # (steps with prefill chunks: no bound, budget_search.py)
            ctx = self._context(caps.size, num_other_tokens, total)
            if self._bound_settles(ctx[2], trim_penalty_ms):
                self.last_decision, self.last_settled = ctx[3], True
                return total
        group = StandingPlans.group(caps.size, num_other_tokens, trim_penalty_ms,
                                    num_sampling_reqs == caps.size)
        self._last_group = group  # (retire_standing)
        # (a step with prefill chunks builds its chunk size's context only for a search)
        cand = ctx[0] if ctx else self._snapper(caps.size + num_other_tokens, total)
        d = self.standing.take(group, cand, total, opportunity_rate)
        if d is not None:
            self.last_decision = d
            return d.budget
        tolerance, ends = RATE_TOLERANCE, None  # (a step with prefill chunks: rate_tolerance)
        if ctx is None:
            ends = self._ends(caps.size, num_other_tokens, total)
            tolerance = rate_tolerance(opportunity_rate, ends[1] - ends[0], num_sampling_reqs,
                                       self.min_predicted_gain)  # fmt: skip
            if self._chunk_bound_settles(ends, num_sampling_reqs, opportunity_rate):
                d = settled_decision(total)  # (clear of the guard: stands the longest)
                self.standing.put(group, d, opportunity_rate, tolerance)
                self.last_decision, self.last_settled = d, True
                return total
        self.searches += 1
        cand, variable, _, _, small = ctx or self._context(caps.size, num_other_tokens, total,
                                                           ends)  # fmt: skip
        if callable(stale_conf):  # read lazily: the bound above usually makes it unneeded
            stale_conf = stale_conf()
        if small is not None and (stale_conf is None or np.ndim(stale_conf) == 2):
            d = self._search_small(stale_conf, caps, small, num_sampling_reqs, trim_penalty_ms,
                                   opportunity_rate, survival_scale)  # fmt: skip
        else:
            surv = stale_survivals(stale_conf, caps, self.prior_conf, total, self.prior_survival)
            if survival_scale != 1.0:
                surv = np.minimum(surv * survival_scale, 1.0)
            times = self.cost.add_fixed(variable)  # the same numbers as plan_budget_lagged's
            if trim_penalty_ms > 0:
                times = times + penalties(cand, trim_penalty_ms)
            d = best_budget(surv, cand, times, num_sampling_reqs, self.min_predicted_gain,
                            opportunity_rate)  # fmt: skip
        self.standing.put(group, d, opportunity_rate, tolerance)
        self.last_decision = d
        return d.budget

    def take_standing(self, num_reqs: int, num_other_tokens: int, total: int,
                      num_sampling_reqs: int, opportunity_rate: float) -> int | None:  # fmt: skip
        """A step with prefill chunks: the budget of the plan standing for its shape (what
        plan_cpu returns when one stands, no inputs read), or None (then plan_cpu plans it)."""
        group = StandingPlans.group(num_reqs, num_other_tokens, 0.0, num_sampling_reqs == num_reqs)
        self._last_group = group
        d = self.standing.take(group, self._snapper(num_reqs + num_other_tokens, total), total,
                               opportunity_rate)  # fmt: skip
        if d is None:
            return None
        self.last_decision, self.last_settled = d, False
        return d.budget

    def _search_small(self, stale_conf, caps: np.ndarray, small: tuple, num_sampling_reqs: int,
                      trim_penalty_ms: float, opportunity_rate: float | None,
                      survival_scale: float) -> BudgetDecision:  # fmt: skip
        """The search of plan_cpu on Python floats (small_search.py: the same decision, for
        a batch of at most SMALL_SLOTS draft slots)."""
        cand, variable = small
        stale = [] if stale_conf is None else np.asarray(stale_conf).tolist()
        surv = stale_survivals_small(stale, caps.tolist(), self.prior_conf, self.prior_survival)
        if survival_scale != 1.0:
            surv = [min(s * survival_scale, 1.0) for s in surv]
        times = self.cost.add_fixed_list(variable)
        if trim_penalty_ms > 0:  # (every candidate but verify-all, the last)
            times = [t + trim_penalty_ms for t in times[:-1]] + times[-1:]
        return best_budget_small(surv, cand, times, num_sampling_reqs, self.min_predicted_gain,
                                 opportunity_rate)  # fmt: skip

    def _snapper(self, num_fixed_tokens: int, total: int):
        """want -> the shape's largest candidate budget at most it (plan_reuse.budget_at_most:
        the candidates _context would build, not built)."""
        sizes = self.cost.graph_sizes if self.snap_to_graphs else None
        return lambda want: budget_at_most(sizes, num_fixed_tokens, want, total)

    def _context(self, num_reqs: int, other: int, total: int,
                 ends: tuple[float, float] | None = None) -> tuple:  # fmt: skip
        """What a batch shape's budget search needs besides the confidences: the candidate
        budgets, their step times without the fixed term (which is learned online, so added
        per step), those of n = 0 and n = total (the bound), the bound's decision, and for a
        batch of at most SMALL_SLOTS draft slots the first two as Python lists (the search on
        Python floats; else None). Cached per shape: at steady state the same shape repeats
        step after step, and building it costs more than the search itself. A step with
        prefill chunks builds its own only for a search or a trimmed plan's rescale: chunk
        sizes vary from step to step, and building one for every plan cost 190-240 against 30-55
        µs a plan with the caches cold (250 rows, development machine). `ends`: the shape's
        _ends when the caller has them."""
        key = (num_reqs, other, total, self.cost.greedy_drafts)
        ctx = self._contexts.get(key)
        if ctx is None:
            allowed = None
            if self.snap_to_graphs and self.cost.graph_sizes:
                allowed = self.cost.budget_candidates(num_reqs + other, total)
            cand = candidate_budgets(allowed, total)
            variable = self.cost.variable_lookup(num_reqs + other + cand, num_reqs)
            if ends is None:
                ends = self._ends(num_reqs, other, total)
            small = (cand.tolist(), variable.tolist()) if total <= SMALL_SLOTS else None
            if len(self._contexts) > 4096:
                self._contexts.clear()
            # (the decision of a plan the bound settles: read, never written)
            ctx = self._contexts[key] = (cand, variable, ends, settled_decision(total), small)
        return ctx

    def bound_settles(self, num_reqs: int, total: int) -> bool:
        """A decode step (no prefill chunk) whose verify-all the bound settles without a trim
        penalty: plan_cpu would return `total` for any penalty >= 0, whatever the
        confidences, so the caller skips gathering its inputs (the common step at low load).
        Records the decision as plan_cpu would."""
        _, _, ends, settled, _ = self._context(num_reqs, 0, total)
        if not self._bound_settles(ends, 0.0):
            return False
        self.last_decision, self.last_settled = settled, True
        return True

    def _chunk_bound_settles(self, ends: tuple[float, float], num_sampling: int,
                             rate: float) -> bool:  # fmt: skip
        """The exact bound of a step with prefill chunks (objective: budget_search.py): a
        budget n gains over verify-all (tau(n) - tau(all)) - rate * (T(n) - T(all)) <= rate *
        (T(all) - T(0)), as no budget yields more than verify-all nor takes less time than n =
        0 (a trim penalty only adds), and verify-all yields at least its sampling rows' tokens;
        so when rate * (T(all) - T(0)) <= guard * num_sampling no trim can clear the guard,
        whatever the confidences. T(all) - T(0) is at most the variable part's difference (the
        fixed term cancels; a floor on step times only narrows it). Where drafts beside a
        chunk cost little (a small target) this spares the search that chunk sizes and rates,
        varying from step to step, otherwise start at most such steps: 46 searches in 90 of
        them, ~0.26 ms each in the H200 host's serving loop (trained pair, T = 0, c = 16,
        thirty-first session)."""
        t0, t_all = ends  # (_ends: of the step's shape)
        return rate * (t_all - t0) <= self.min_predicted_gain * num_sampling

    def _ends(self, num_reqs: int, other: int, total: int) -> tuple[float, float]:
        """The variable step times of n = 0 and n = total drafts (the bounds' two ends)."""
        return tuple(map(float, self.cost.variable_lookup(
            np.array([num_reqs + other, num_reqs + other + total]), num_reqs)))

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

    def retire_standing(self) -> None:
        """Drop the standing plan of the last searched or reused group (its caller stands
        for it: StepPlanning's fast path)."""
        self.standing.drop(self._last_group)

    def invalidate_tables(self, keep_plans: bool = False) -> None:
        """Drop what embeds the fixed term or the drafter's pricing (after either changed):
        the device step-time tables and, unless `keep_plans`, the standing plans. The shape
        contexts stay: they hold only the variable part and are keyed by the drafter's
        pricing. (The online fixed term moved on 15-40% of the steps in development-machine
        runs; dropping contexts and standing plans each time rebuilt and searched that often.)"""
        self._tables.clear()
        if not keep_plans:
            self.standing.clear()

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
