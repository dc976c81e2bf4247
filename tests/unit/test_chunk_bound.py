"""The exact no-trim bound of a step with prefill chunks (Planner._chunk_bound_settles): where
it says verify-all, the full search over the net objective (tau - rate * step time) verifies
every draft whatever the confidences, trim penalty, acceptance ratio and graph snapping; such
a plan neither reads the confidences nor searches."""

from __future__ import annotations

import warnings

import numpy as np

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
        if not planner._chunk_bound_settles(num_reqs, other, total, n_sampling, rate):
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
