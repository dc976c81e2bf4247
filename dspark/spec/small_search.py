"""The lagged planner's budget search over a few draft slots, on Python floats.

In the serving loop a plan runs after the step's other host work has pushed the planner's
objects out of the caches, and there each numpy call costs 5-17 µs whatever its size: the
planner's numpy search (`budget_search.stale_survivals` + `best_budget`, ~20 calls) took
100-120 µs at 1-9 requests of 7 drafts with the caches swept first, against 20 µs in a hot loop
(development machine; 160-270 µs a search in the H200 host's serving loop, demo pair). On Python
floats the same search took 62 / 77 / 92 / 96 µs at 1 / 4 / 8 / 9 requests so (numpy: 101 /
105 / 116 / 115), and 9.5 / 17 / 27 µs hot (numpy ~20). At 16 requests (112 slots) it lost,
126 against 109 µs; hence SMALL_SLOTS (`scripts/plan_cost.py [--cold]`, "planner search").

Same numbers, not an approximation: float64 throughout and the numpy path's order of
operations (each row's running product, the known rows' mean row by row, one descending
sort of the slots, the running sum of the sorted survivals), so a budget, its predicted
rates and the trimmed flag equal the numpy path's bit for bit
(tests/unit/test_small_search.py, on random batches).
"""

from __future__ import annotations

import math

from dspark.spec.plan_reuse import BudgetDecision

SMALL_SLOTS = 64  # draft slots (capacities' sum) at most for the Python search


def stale_survivals_small(stale: list[list[float]], caps: list[int], prior_conf: float,
                          prior_survival: list[float] | None = None) -> list[float]:  # fmt: skip
    """`budget_search.stale_survivals` for rows given as Python lists: every slot < capacity's
    prefix survival, sorted descending. A row with an unknown confidence (NaN, or a row or
    column the stale copy lacks) takes the known rows' mean survivals; with no row known,
    `prior_survival` (budget_search.population_prior), else the prior fills the unknown
    confidences."""
    k = max(caps, default=0)
    rows, unknown = [], []
    for r in range(len(caps)):
        conf = stale[r][:k] if r < len(stale) else []
        missing = len(conf) < k
        if missing:
            conf = conf + [math.nan] * (k - len(conf))
        surv, p = [], 1.0
        for c in conf:
            if c != c:  # NaN: unknown (the prior, unless known rows stand in below)
                missing, c = True, prior_conf
            if c > 1.0:  # (np.fmin with 1, then np.fmax with 0)
                c = 1.0
            elif c < 0.0:
                c = 0.0
            p *= c
            surv.append(p)
        rows.append(surv)
        unknown.append(missing)
    if True in unknown:
        known = [row for row, u in zip(rows, unknown) if not u]
        if known:  # (np.mean over axis 0: row after row, then / n)
            mean = list(known[0])
            for row in known[1:]:
                mean = [m + v for m, v in zip(mean, row)]
            mean = [m / len(known) for m in mean]
            rows = [mean if u else row for row, u in zip(rows, unknown)]
        elif prior_survival is not None:
            rows = [[float(x) for x in prior_survival[:k]]] * len(rows)  # (read only below)
    flat = []
    for row, cap in zip(rows, caps):
        flat += row if cap == k else row[:cap]
    flat.sort(reverse=True)
    return flat


def best_budget_small(surv: list[float], cand: list[int], times: list[float],
                      num_sampling_reqs: int, min_predicted_gain: float,
                      opportunity_rate: float | None) -> BudgetDecision:  # fmt: skip
    """`budget_search.best_budget` on Python lists: candidate budgets `cand` (verify-all last) with
    their step times, and the sorted-descending survivals `surv`."""
    total = cand[-1]
    yields, acc = [float(num_sampling_reqs)], 0.0  # expected tokens of budgets 0..total
    for s in surv:
        acc += s
        yields.append(acc + num_sampling_reqs)
    if len(cand) < total + 1:  # (snapped to graph sizes; else every budget is a candidate)
        yields = [yields[n] for n in cand]
    y_full, t_full = yields[-1], times[-1]
    theta_full = y_full / t_full
    if opportunity_rate is None:  # the step's own tokens/ms (the first best, as argmax)
        thetas = [y / t for y, t in zip(yields, times)]
        best = max(thetas)
        best_i = thetas.index(best)
        if theta_full > 0:
            gain = best / theta_full - 1.0
        else:
            gain = 0.0 if best <= 0 else math.inf
        trimmed = cand[best_i] < total and best > theta_full * (1.0 + min_predicted_gain)
        theta_best = best
    else:  # net value: the prefill's time is spent anyway
        values = [y - opportunity_rate * t for y, t in zip(yields, times)]
        best = max(values)
        best_i = values.index(best)
        theta_best = yields[best_i] / times[best_i]
        gain = (best - values[-1]) / max(y_full, 1e-9)
        trimmed = cand[best_i] < total and gain > min_predicted_gain
    return BudgetDecision(budget=cand[best_i] if trimmed else total, max_budget=total,
                          theta_best=theta_best, theta_full=theta_full, predicted_gain=gain,
                          trimmed=bool(trimmed))  # fmt: skip
