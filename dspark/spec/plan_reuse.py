"""Standing plans: the lagged planner's searched budgets, reused with the confidences unread
for the next few plans of nearby batch shapes (Planner.plan_cpu).

Lossless: a budget may come from any information older than the drafts, and the device still
allocates a reused budget over the live confidences.

- A verify-all plan whose best trim came nowhere near the guard (predicted gain under half
  of it) stands for the next `clear_plans - 1` plans. At low load, where trimming does not
  pay, the search was most of a step's planning (H200, 33.6 M pair: 11.8% of step time).
- A trimmed plan stands for the next `trimmed_plans - 1`. Its budget sums a whole batch's
  survivals, which move little from one step to the next. The search costs ~130 µs of host
  time (2-core development machine, 32 rows), and 150-310 µs in the H200 host's serving loop.
- A verify-all near the guard is one small move from trimming: it stands no longer than a
  trimmed plan would. On the H200 host (8B shape, c = 256) such plans were searched at every
  step, ~0.3 ms each.

Shapes share a standing plan when:
- their request counts are within ~6% (`nearby_rows`); at c = 256 a request finishes or
  arrives at nearly every step;
- their prefill chunks are of the same power-of-two size (`nearby_other`);
- the opportunity rate of a step with prefill chunks is within `rate_tolerance` of the rate
  its plan was searched at (`near_rate`; a fixed ~5% until the thirty-sixth session). Fixed
  5% groups (until the thirty-fourth session) split rates 0.1% apart at a group's edge. On
  the H200 (trained pair, T = 1, c = 64) 372 of 380 steps with prefill chunks searched, ~0.31
  ms each, 5.9% of the step time; by inference (the groups were not logged), a rate moving a
  few % between the rare steps of one chunk-size group crossed an edge at most of them.

The plan is carried over as the same share of the new shape's drafts (`rescaled`). Steps
with prefill chunks were most of the searches at c = 256 on the H200 (trained pair), ~0.2-0.3
ms each. A count of 1: search every plan.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np


@dataclass
class BudgetDecision:
    budget: int  # total draft tokens to verify this step
    max_budget: int  # sum of capacities (verify-all)
    theta_best: float  # predicted tokens/ms of the best candidate budget
    theta_full: float  # predicted tokens/ms of verify-all
    predicted_gain: float  # theta_best / theta_full - 1
    trimmed: bool  # budget < max_budget


def settled_decision(total: int) -> BudgetDecision:
    """The decision of a plan an exact bound settles: verify all `total` drafts, nothing
    searched (no predicted rates)."""
    return BudgetDecision(total, total, float("nan"), float("nan"), 0.0, False)


def clear_of_guard(d: BudgetDecision, guard: float) -> bool:
    """A verify-all decision whose best trim came under half the guard: far from trimming,
    it stands for the most plans (StandingPlans.put; StepPlanning's fast path)."""
    return not d.trimmed and d.predicted_gain < guard / 2


def nearby_rows(num_reqs: int) -> int:
    """The group of a request count whose plans stand for each other: exact below 16, then
    16 groups per doubling (240-255, 256-287, ...: within ~6%)."""
    shift = max(0, num_reqs.bit_length() - 4)
    return (num_reqs >> shift) << shift


def nearby_other(num_other_tokens: int) -> int:
    """The group of a prefill token count whose plans stand for each other: the same power of
    two (257-512, ...); 0 (no prefill chunk) alone."""
    return 1 << (num_other_tokens - 1).bit_length() if num_other_tokens > 0 else 0


RATE_TOLERANCE = 0.05  # |ln(rate / searched rate)|: ~5% either side, at least
RATE_REGRET = 0.25  # of the guard: what a rate's move may cost a standing plan (rate_tolerance)


def near_rate(rate: float | None, searched: float | None,
              tolerance: float = RATE_TOLERANCE) -> bool:  # fmt: skip
    """Whether a plan searched at opportunity rate `searched` (tokens/ms decoding would earn;
    None: a step without prefill chunks) stands at `rate` (`tolerance`: rate_tolerance's)."""
    if rate is None or searched is None:
        return rate is searched
    return abs(math.log(max(rate, 1e-6) / max(searched, 1e-6))) <= tolerance


def rate_tolerance(rate: float, spread_ms: float, num_sampling: int, guard: float) -> float:
    """How far (|ln|) the opportunity rate may move before a plan searched at `rate` is
    searched again. The objective of a step with prefill chunks is tau(n) - rate * T(n)
    (budget_search.py). A budget n* searched at rate r, used at r', loses at most
    |r' - r| * |T(n') - T(n*)| <= |r' - r| * spread_ms against the budget n' a search at r'
    would pick (both objectives move by the rate times their times: n* was the better one at
    r), where spread_ms = T(all) - T(0), the most the step's time can move with its budget.
    So a move of at most a share RATE_REGRET * guard * num_sampling / (r * spread_ms) of the
    rate costs at most a quarter of the guard's share of the step's sampled tokens, a smaller
    loss than the guard lets a verify-all near it leave. Where drafts beside the chunk cost
    little that is a wide band. It is never narrower than RATE_TOLERANCE, the band before
    this bound, whose loss is then at most 5% of r * spread_ms. On the H200 (trained pair,
    T = 1, c = 1-64, thirty-sixth session) 149 of 195 searches of steps with prefill chunks
    ran because the rate had moved past 5%."""
    worst = rate * max(spread_ms, 0.0)  # tokens a doubling of the rate could cost
    if worst <= 0.0:
        return math.inf
    # (ln(1 + a): a move up by a share a of the rate, and one down by less)
    return max(RATE_TOLERANCE, math.log1p(RATE_REGRET * guard * max(num_sampling, 1) / worst))


def budget_at_most(graph_sizes: tuple[int, ...] | None, num_fixed_tokens: int, want: int,
                   total: int) -> int:
    """The largest candidate budget of a shape at most `want` (the smallest candidate when
    none is), without building the candidates (CostModel.budget_candidates, then
    candidate_budgets): with captured graph sizes (sorted) those whose total
    `num_fixed_tokens + n` fills a bucket exactly, every n past the largest bucket, and
    `total`; without, every n in [0, total]. A trimmed standing plan carried to a step with
    another prefill chunk size rescales with this: building that size's whole search context
    (candidates, their step times, the bound's ends) for it cost more than the plan's other
    work (H200 host, trained pair, T = 1, c = 64: plans of steps with prefill chunks that
    searched nothing took 45-88 µs from p30 to p90, thirty-ninth session)."""
    want = min(max(int(want), 0), total)
    if not graph_sizes or want == total:
        return want
    beyond = max(graph_sizes[-1] - num_fixed_tokens + 1, 0)  # every n from here is one
    if want >= beyond:
        return want
    i = bisect.bisect_right(graph_sizes, num_fixed_tokens + want) - 1
    if i >= 0 and graph_sizes[i] >= num_fixed_tokens:
        return graph_sizes[i] - num_fixed_tokens
    # none at most `want`: the smallest, the first bucket's (below `beyond`, as all are)
    # unless it lies past verify-all
    first = graph_sizes[bisect.bisect_left(graph_sizes, num_fixed_tokens)] - num_fixed_tokens
    return min(first, total)


def rescaled(d: BudgetDecision, cand, total: int) -> BudgetDecision:
    """A standing decision carried to a nearby shape of `total` drafts: verify-all stays
    verify-all; a trimmed budget keeps its share of the drafts, rounded down to one of this
    shape's candidate budgets (those that fill a captured graph). `cand`: those budgets
    (sorted), or a callable from the share's budget to the largest candidate at most it
    (budget_at_most; called only for a trimmed budget)."""
    budget = total
    if d.trimmed:
        want = round(d.budget * total / max(d.max_budget, 1))
        budget = (int(cand(want)) if callable(cand)
                  else int(cand[max(int(np.searchsorted(cand, want, side="right")) - 1, 0)]))
    return BudgetDecision(budget, total, d.theta_best, d.theta_full, d.predicted_gain,
                          budget < total)  # fmt: skip


class StandingPlans:
    def __init__(self, clear_plans: int = 1, trimmed_plans: int = 1, guard: float = 0.04):
        self.clear_plans, self.trimmed_plans, self.guard = clear_plans, trimmed_plans, guard
        # group -> [plans it still stands for, decision, the opportunity rate it was searched
        # at, how far that rate may move (rate_tolerance)]
        self._plans: dict[tuple, list] = {}
        # why the last take found none: no plan for the group (new), its plans used up
        # (spent), or the opportunity rate moved (rate); the step log names it for a search
        self.miss = "new"

    @staticmethod
    def group(num_reqs: int, num_other_tokens: int, trim_penalty_ms: float,
              all_sampling: bool) -> tuple:  # fmt: skip
        return nearby_rows(num_reqs), nearby_other(num_other_tokens), trim_penalty_ms, all_sampling

    def take(self, group: tuple, cand, total: int,
             rate: float | None = None) -> BudgetDecision | None:  # fmt: skip
        """The group's standing decision for a shape of `total` drafts at opportunity rate
        `rate` (counted as used), or None when none stands. `cand`: as for `rescaled`."""
        standing = self._plans.get(group)
        if standing is None or standing[0] <= 0 or not near_rate(rate, *standing[2:]):
            self.miss = ("new" if standing is None else "spent" if standing[0] <= 0
                         else "rate")  # fmt: skip
            return None
        standing[0] -= 1
        d = standing[1]
        return d if d.max_budget == total else rescaled(d, cand, total)

    def plans_for(self, d: BudgetDecision) -> int:
        """How many plans (this one included) a searched decision stands for, by its kind."""
        if d.trimmed:
            return self.trimmed_plans
        if clear_of_guard(d, self.guard):
            return self.clear_plans
        return min(self.clear_plans, self.trimmed_plans)

    def put(self, group: tuple, d: BudgetDecision, rate: float | None = None,
            tolerance: float = RATE_TOLERANCE) -> None:  # fmt: skip
        """A decision searched at opportunity rate `rate`, standing for as many plans as its
        kind earns, at rates within `tolerance` of it (rate_tolerance)."""
        stands_for = self.plans_for(d)
        if stands_for > 1:
            if len(self._plans) > 4096:
                self._plans.clear()
            self._plans[group] = [stands_for - 1, d, rate, tolerance]

    def drop(self, group: tuple | None) -> None:
        self._plans.pop(group, None)

    def clear(self) -> None:
        self._plans.clear()
