"""The lagged planner's search on Python floats (small_search.py) gives the numpy search's
decision bit for bit: survivals, budgets, predicted rates, the trimmed flag, for the batches it
takes (at most SMALL_SLOTS draft slots), and the planner takes it exactly there."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.spec import planner as pl
from dspark.spec.budget_search import best_budget, stale_survivals
from dspark.spec.planner import Planner
from dspark.spec.small_search import SMALL_SLOTS, best_budget_small, stale_survivals_small
from tests.unit.test_planner import random_cost


def _random_batch(rng):
    """Random capacities (one row full) and stale confidences, some NaN, some out of [0, 1],
    sometimes with fewer or more rows / columns than the batch."""
    r, k = int(rng.integers(1, 17)), int(rng.integers(1, 8))
    caps = rng.integers(0, k + 1, r)
    caps[rng.integers(r)] = k
    rows, cols = r + int(rng.integers(-1, 3)), k + int(rng.integers(-1, 2))
    stale = rng.uniform(-0.2, 1.2, (max(rows, 0), max(cols, 0))).astype(np.float32)
    stale[rng.uniform(size=stale.shape) < 0.1] = np.nan
    return caps.astype(np.int64), stale


def test_survivals_equal_the_numpy_path():
    rng = np.random.default_rng(0)
    for _ in range(500):
        caps, stale = _random_batch(rng)
        prior = 1.0 if rng.uniform() < 0.5 else float(rng.uniform())
        want = stale_survivals(stale, caps, prior).tolist()
        assert stale_survivals_small(stale.tolist(), caps.tolist(), prior) == want
    caps = np.array([3, 2], dtype=np.int64)  # nothing known: the prior everywhere
    assert stale_survivals_small([], caps.tolist(), 0.5) == stale_survivals(None, caps,
                                                                             0.5).tolist()
    for _ in range(50):  # ... or the survivals surveyed in earlier steps
        caps, stale = _random_batch(rng)
        stale[:] = np.nan
        earlier = np.sort(rng.uniform(size=8))[::-1]
        want = stale_survivals(stale, caps, 1.0, None, earlier).tolist()
        assert stale_survivals_small(stale.tolist(), caps.tolist(), 1.0, earlier) == want


@pytest.mark.parametrize("rate", [None, 0.5, 3.0])
def test_best_budget_equals_the_numpy_path(rate):
    rng = np.random.default_rng(1)
    trimmed = 0
    for _ in range(400):
        caps, stale = _random_batch(rng)
        total = int(caps.sum())
        surv = stale_survivals(stale, caps, 1.0) * rng.uniform(0.2, 1.0)
        snapped = rng.uniform() < 0.5  # graph-size candidates, or every budget
        cand = np.arange(total + 1) if not snapped else np.unique(np.append(
            rng.integers(0, total + 1, int(rng.integers(1, 6))), total))  # fmt: skip
        times = np.sort(rng.uniform(0.2, 3.0, cand.size))
        if rng.uniform() < 0.3:  # a trim penalty
            times = times + np.where(cand < cand[-1], rng.uniform(0, 0.5), 0.0)
        n_sampling, guard = int(caps.size), float(rng.choice([0.0, 0.04]))
        want = best_budget(surv, cand, times, n_sampling, guard, rate)
        got = best_budget_small(surv.tolist(), cand.tolist(), times.tolist(), n_sampling, guard,
                                rate)  # fmt: skip
        assert got == want, (got, want)
        trimmed += want.trimmed
    assert trimmed > 40  # both outcomes were exercised


def _same(a, b) -> bool:
    """Two decisions equal field by field (NaN, a settled plan's rates, equal to NaN)."""
    return all(x == y or (x != x and y != y) for x, y in zip(vars(a).values(), vars(b).values()))


def _planner(cost, small: bool, monkeypatch) -> Planner:
    p = Planner("lagged", cost, reuse_clear_plans=1, reuse_trimmed_plans=1)
    if not small:  # contexts built while the limit is -1 carry no Python lists
        monkeypatch.setattr(pl, "SMALL_SLOTS", -1)
    return p


def test_the_planner_decides_the_same_on_either_path(monkeypatch):
    rng = np.random.default_rng(2)
    searched = 0
    for _ in range(150):
        cost = random_cost(rng, max_tokens=160)
        caps, stale = _random_batch(rng)
        kwargs = dict(num_other_tokens=int(rng.choice([0, 0, 5])),
                      trim_penalty_ms=float(rng.choice([0.0, 0.05])),
                      opportunity_rate=None if rng.uniform() < 0.7 else float(rng.uniform(0.5, 4)),
                      survival_scale=float(rng.choice([1.0, 0.8, 1.3])))  # fmt: skip
        numpy_p = _planner(cost, False, monkeypatch)
        want = numpy_p.plan_cpu(stale, caps, **kwargs)
        monkeypatch.undo()
        small_p = _planner(cost, True, monkeypatch)
        calls = []
        search = small_p._search_small
        small_p._search_small = lambda *a, c=calls, s=search: c.append(1) or s(*a)
        got = small_p.plan_cpu(stale, caps, **kwargs)
        assert got == want and _same(small_p.last_decision, numpy_p.last_decision)
        assert small_p.searches == numpy_p.searches
        small = int(caps.sum()) <= SMALL_SLOTS  # (else the numpy search ran)
        assert len(calls) == (small_p.searches if small else 0)
        searched += len(calls)
    assert searched > 20  # searches on Python floats were compared


def test_larger_batches_search_in_numpy():
    cost = random_cost(np.random.default_rng(4), max_tokens=600)
    p = Planner("lagged", cost, reuse_clear_plans=1, reuse_trimmed_plans=1)
    called, search = [], p._search_small
    p._search_small = lambda *a: called.append(1) or search(*a)
    for rows in (SMALL_SLOTS // 7, SMALL_SLOTS // 7 + 1):  # at most SMALL_SLOTS, then more
        caps = np.full(rows, 7, dtype=np.int64)
        stale = np.full((rows, 7), 0.3, dtype=np.float32)
        p.plan_cpu(stale, caps, opportunity_rate=2.0)  # (a rate: the bound does not settle)
    assert called == [1]  # the first batch only
