"""The exact no-trim bound of a step with prefill chunks (Planner._chunk_bound_settles): where
it says verify-all, the full search over the net objective (tau - rate * step time) verifies
every draft whatever the confidences, trim penalty, acceptance ratio and graph snapping; such
a plan neither reads the confidences nor searches."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dspark.spec.budget_search import plan_budget_lagged
from dspark.spec.cost_model import CostModel
from dspark.spec.planner import Planner
from tests.unit.test_planner import random_planner


def test_a_chunk_step_the_bound_settles_is_verify_all_for_any_confidences():
    rng = np.random.default_rng(11)
    settled = searched = 0
    for step in range(400):
        cost, planner, snap = random_planner(rng, 160, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128,
                                                        160])  # fmt: skip
        num_reqs = int(rng.integers(1, 7))
        caps = rng.integers(1, 8, num_reqs)
        total, other = int(caps.sum()), int(rng.integers(1, 100))
        n_sampling = int(rng.integers(0, num_reqs + 1))
        rate = float(rng.choice([0.0, rng.uniform(0, 0.5), rng.uniform(0, 50)]))
        ends = planner._ends(num_reqs, other, total)
        if not planner._chunk_bound_settles(ends, n_sampling, rate):
            searched += 1
            continue
        settled += 1
        allowed = cost.budget_candidates(num_reqs + other, total) if snap else None
        for _ in range(5):
            conf = rng.uniform(0, 1, (num_reqs, 7)) ** rng.uniform(0.2, 3)
            penalty = float(rng.choice([0.0, rng.uniform(0, 2)]))
            want = plan_budget_lagged(conf, caps, other, n_sampling, cost,
                                      planner.min_predicted_gain, allowed, 1.0, penalty, rate)
            assert want.budget == total, step
            scale = float(rng.uniform(1.0, 3.0))  # the engine's acceptance ratio (>= 1)
            assert planner.plan_cpu(conf, caps, other, n_sampling, penalty, rate, scale) == total
    assert settled > 40 and searched > 40  # both outcomes exercised


def test_a_settled_chunk_plan_reads_no_confidences_and_searches_nothing():
    # drafts beside a chunk nearly free: 1 ms + 1 us a token, decoding at 20 tokens/ms
    cheap = CostModel.from_measurements([1, 4096], [1.0, 1.0 + 4.095e-3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a flat table, on purpose)
        p = Planner("lagged", cheap, reuse_clear_plans=4)
    caps = np.full(8, 7)

    def unread():
        raise AssertionError("confidences read")

    for other in (300, 700, 1500, 3000):  # new chunk sizes, other size groups
        assert p.plan_cpu(unread, caps, other, 8, opportunity_rate=20.0) == 56
        assert p.last_settled and not p.last_decision.trimmed
    assert p.searches == 0
    # where drafts cost (1 ms + 0.1 ms a token) the same steps search, and trim weak drafts
    steep = CostModel.from_measurements([1, 4096], [1.0, 410.5])
    q = Planner("lagged", steep)
    weak = np.full((8, 7), 0.2)
    assert q.plan_cpu(weak, caps, 300, 8, opportunity_rate=20.0) < 56
    assert q.searches == 1 and not q.last_settled


def test_a_plan_standing_across_a_rate_move_loses_at_most_its_share_of_the_guard():
    """rate_tolerance: a plan of a step with prefill chunks, searched at opportunity rate r,
    stands at any rate r' within its tolerance; there it gives up at most |r' - r| * (T(all) -
    T(0)) of net value (tau - r' * step time) beyond what it gave up at r (zero for a trimmed
    plan, the search's argmax; under the guard for a verify-all), and so at most RATE_REGRET *
    guard * (sampling rows) where the band is wider than its RATE_TOLERANCE floor. Checked
    against every candidate budget at r', for random tables, shapes and confidences; and the
    band is not far wider than needed: at three times the tolerance some plan loses more."""
    from dspark.spec.budget_search import stale_survivals
    from dspark.spec.plan_reuse import RATE_REGRET, RATE_TOLERANCE

    rng = np.random.default_rng(5)
    stood = worst = 0
    for step in range(300):
        cost, planner, _ = random_planner(rng, 160, [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128,
                                                     160])  # fmt: skip
        planner.standing.clear_plans = planner.standing.trimmed_plans = 8
        num_reqs = int(rng.integers(1, 7))
        caps = rng.integers(1, 8, num_reqs)
        total, other = int(caps.sum()), int(rng.integers(1, 100))
        n_sampling = int(rng.integers(1, num_reqs + 1))
        rate = float(rng.uniform(0.05, 20))
        conf = rng.uniform(0, 1, (num_reqs, 7)) ** rng.uniform(0.2, 3)
        cand, variable, _, _, _ = planner._context(num_reqs, other, total)
        times = cost.add_fixed(variable)
        surv = stale_survivals(conf, caps, planner.prior_conf, total)
        yields = n_sampling + np.concatenate([[0.0], np.cumsum(surv)])[cand]

        def loss(budget, r, yields=yields, times=times, cand=cand):  # net value given up
            # against the best candidate at rate r
            value = yields - r * times
            return float(value.max() - value[int(np.searchsorted(cand, budget))])

        budget = planner.plan_cpu(conf, caps, other, n_sampling, opportunity_rate=rate)
        searched, at_search = planner.searches, loss(budget, rate)
        tol = planner.standing._plans[planner._last_group][3]
        t0, t_all = planner._ends(num_reqs, other, total)
        allowed = RATE_REGRET * planner.min_predicted_gain * n_sampling
        for u in (-1.0, -0.5, 0.5, 1.0):  # (an infinite band: the budget moves no time)
            moved = rate * np.exp(u * min(tol, np.log(100.0)) * (1 - 1e-9))
            assert planner.plan_cpu(conf, caps, other, n_sampling,
                                    opportunity_rate=moved) == budget  # fmt: skip
            assert planner.searches == searched, step  # (it stood: nothing searched)
            lost = loss(budget, moved) - at_search
            assert lost <= abs(moved - rate) * (t_all - t0) + 1e-9, (step, u, tol)
            if tol > RATE_TOLERANCE:
                assert lost <= allowed + 1e-9, (step, u, tol)
            stood += 1
            # three times as far: the loss measured against the same allowance
            if RATE_TOLERANCE < tol < np.inf:
                far = rate * np.exp(u * 3 * tol)
                worst = max(worst, (loss(budget, far) - at_search) / max(allowed, 1e-12))
    assert stood > 1000
    assert worst > 1.0  # a band three times as wide would exceed the allowance somewhere


def test_the_rate_tolerance_widens_where_drafts_beside_a_chunk_cost_little():
    from dspark.spec.plan_reuse import RATE_TOLERANCE, rate_tolerance

    guard = 0.04
    # 64 sampling rows, decoding at 50 tokens/ms: drafts beside the chunk add 0.05 ms (2.5
    # tokens of decoding, 4% of 64: at the guard) -> a quarter of it is a 25% move
    assert rate_tolerance(50.0, 0.0512, 64, guard) == pytest.approx(np.log(1.25))
    assert rate_tolerance(50.0, 0.5, 64, guard) == RATE_TOLERANCE  # dear drafts: the floor
    assert rate_tolerance(50.0, 0.0, 64, guard) == float("inf")  # the budget moves no time
