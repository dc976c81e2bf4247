import itertools
import warnings

import numpy as np
import pytest
import torch

from dspark.spec.budget_search import plan_budget_lagged
from dspark.spec.cost_model import CostModel
from dspark.spec.planner import (
    Planner,
    allocate_top_b,
    early_stop_lengths,
    fixed_lengths,
    threshold_lengths,
)


def random_cost(rng, max_tokens=64):
    """Random monotone cost table: fixed + draft(R) + a verify curve that is flat, steep, or
    a staircase (strictly increasing so that optima are unique)."""
    n = np.arange(1, max_tokens + 1)
    kind = rng.integers(3)
    if kind == 0:  # flat-ish then linear
        verify = rng.uniform(1, 5) + rng.uniform(0, 0.5) * np.maximum(0, n - rng.integers(1, 20))
    elif kind == 1:  # random increments
        verify = np.cumsum(rng.exponential(rng.uniform(0.01, 1.0), n.size))
    else:  # staircase with small slope inside the stairs
        verify = 2.0 * (n // rng.integers(2, 6)) + 1e-3 * n
    verify = verify + 1e-6 * n  # strictly increasing
    return CostModel.from_measurements(n, verify, draft_reqs=[1, 8],
                                       draft_times_ms=[rng.uniform(0, 2), rng.uniform(2, 4)],
                                       fixed_ms=rng.uniform(0, 2))


def random_planner(rng, max_tokens: int, graph_sizes: list[int]):
    """A lagged planner over random_cost with a random fixed term, snapping to `graph_sizes`
    half of the time: (cost, planner, snap)."""
    cost = random_cost(rng, max_tokens=max_tokens)
    cost.fixed_overhead_ms = float(rng.choice([0.0, rng.uniform(0, 20)]))
    snap = bool(rng.integers(2))
    if snap:
        cost.graph_sizes = graph_sizes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (flat random tables)
        planner = Planner("lagged", cost, snap_to_graphs=snap)
    return cost, planner, snap


def brute_force_plan(conf, caps, other, n_sampling, cost, min_gain, allowed=None):
    """Exhaustive search over every plan l (not just top-n sets), then the guard."""
    num_reqs = len(caps)
    surv = np.cumprod(conf, axis=1)
    total = int(sum(caps))
    best_theta, best_n, theta_full = -1.0, None, None
    for plan in itertools.product(*[range(c + 1) for c in caps]):
        n = sum(plan)
        if allowed is not None and n not in allowed and n != total:
            continue
        tau = n_sampling + sum(surv[r, :plan[r]].sum() for r in range(num_reqs))
        theta = tau / float(cost.step_time_ms(num_reqs + other + n, num_reqs))
        if n == total:
            theta_full = theta
        if theta > best_theta:
            best_theta, best_n = theta, n
    if best_n < total and best_theta > theta_full * (1 + min_gain):
        return best_n, best_theta
    return total, best_theta


def test_lagged_budget_matches_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    trimmed = full = 0
    for _ in range(250):
        num_reqs, k = rng.integers(1, 5), rng.integers(1, 4)
        conf = rng.uniform(0, 1, (num_reqs, k)) ** rng.uniform(0.2, 2)
        caps = rng.integers(0, k + 1, num_reqs)
        other, n_sampling = int(rng.integers(0, 4)), int(num_reqs)
        cost = random_cost(rng)
        gain = float(rng.choice([0.0, 0.04]))
        allowed = None
        if rng.random() < 0.3:
            allowed = set(rng.choice(int(caps.sum()) + 1, 3).tolist())
        given = None
        if allowed is not None:  # any order, repeats allowed
            given = np.array(sorted(allowed) if rng.random() < 0.5 else list(allowed) * 2)
            rng.shuffle(given)
        d = plan_budget_lagged(conf, caps, other, n_sampling, cost, gain, given)
        want_b, want_theta = brute_force_plan(conf, caps, other, n_sampling, cost, gain,
                                              allowed)
        assert d.budget == want_b
        assert d.theta_best == pytest.approx(want_theta, rel=1e-9)
        assert d.max_budget == caps.sum() and d.trimmed == (d.budget < caps.sum())
        # The device allocation of that budget on the same confidences realises theta_best.
        if d.trimmed:
            lengths = allocate_top_b(torch.as_tensor(conf), torch.as_tensor(caps), d.budget)
            surv = np.cumprod(conf, axis=1)
            tau = n_sampling + sum(surv[r, :lengths[r]].sum() for r in range(num_reqs))
            t = cost.step_time_ms(num_reqs + other + d.budget, num_reqs)
            assert tau / t == pytest.approx(d.theta_best, rel=1e-9)
        trimmed += d.trimmed
        full += not d.trimmed
    assert trimmed > 20 and full > 20  # both outcomes exercised


def guard_cost(step2_ms):
    return CostModel.from_measurements([1, 2], [1.0, step2_ms])


def test_min_predicted_gain_guard():
    conf, caps = np.array([[0.5]]), np.array([1])
    # Trimming to 0 gains 1.53 / 1.5 - 1 = 2% < 4%: verify all.
    d = plan_budget_lagged(conf, caps, 0, 1, guard_cost(1.53))
    assert d.budget == 1 and not d.trimmed
    assert d.predicted_gain == pytest.approx(0.02, abs=1e-9)
    # With a 1% guard the same plan trims.
    d = plan_budget_lagged(conf, caps, 0, 1, guard_cost(1.53), min_predicted_gain=0.01)
    assert d.budget == 0 and d.trimmed
    # A large predicted gain trims under the default guard.
    d = plan_budget_lagged(conf, caps, 0, 1, guard_cost(3.0))
    assert d.budget == 0 and d.trimmed and d.predicted_gain == pytest.approx(1.0)


def test_lagged_prior_for_missing_and_nan_rows():
    cost = CostModel.from_measurements([1, 64], [10.0, 73.0])  # 9 ms + 1 ms per token
    caps = np.array([2, 2, 2])
    # No history at all: prior 1.0 makes every draft look certain (verify-all direction) ...
    assert plan_budget_lagged(None, caps, 0, 3, cost).budget == 6
    # ... while a zero prior trims everything.
    assert plan_budget_lagged(None, caps, 0, 3, cost, prior_conf=0.0).budget == 0
    all_nan = np.full((3, 2), np.nan)
    assert plan_budget_lagged(all_nan, caps, 0, 3, cost, min_predicted_gain=0.0).budget == 6
    # Row 0 known, rows 1-2 missing (NaN / absent): they take the known rows' mean survivals,
    # whatever the prior (a burst's newcomers look like the batch, not like certain drafts)
    for known, budget in ((0.0, 0), (1.0, 6)):
        stale = np.array([[known, known], [np.nan, np.nan]])
        for prior in (0.0, 1.0):
            d = plan_budget_lagged(stale, caps, 0, 3, cost, prior_conf=prior,
                                   min_predicted_gain=0.0)  # fmt: skip
            assert d.budget == budget, (known, prior)


def test_unknown_rows_take_the_known_rows_mean_survivals():
    """population_prior: the mean of the known rows' prefix survivals (not the survivals of
    their mean confidences), per position; a row with any NaN is unknown."""
    from dspark.spec.budget_search import population_prior

    conf = np.array([[0.9, 0.9, 0.5], [0.1, 0.5, 1.0], [np.nan] * 3, [0.8, np.nan, 0.2]])
    surv = population_prior(conf, 1.0)
    known = np.array([[0.9, 0.81, 0.405], [0.1, 0.05, 0.05]])
    np.testing.assert_allclose(surv[:2], known)
    np.testing.assert_allclose(surv[2], known.mean(axis=0))
    np.testing.assert_allclose(surv[3], known.mean(axis=0))
    # none known: the prior, clipped to [0, 1]
    np.testing.assert_allclose(population_prior(np.full((2, 2), np.nan), 0.5),
                               [[0.5, 0.25]] * 2)  # fmt: skip
    # ... or, given, the survivals surveyed in earlier steps (their first K); a known row wins
    earlier = np.array([0.6, 0.3, 0.1])
    np.testing.assert_allclose(population_prior(np.full((2, 2), np.nan), 0.5, earlier),
                               [[0.6, 0.3]] * 2)  # fmt: skip
    np.testing.assert_allclose(population_prior(conf, 1.0, earlier), surv)


@pytest.mark.parametrize("small", [True, False])
def test_a_step_with_no_known_row_plans_on_the_earlier_survivals(small, monkeypatch):
    """A request's first verifying step has no confidences older than its drafts (the budget
    may not read theirs). When no row of the step has any, the planner prices them with the
    survivals the drafting decision surveyed in earlier steps, not with a prior of certain
    drafts. (On Python floats and in numpy: small_search.py.)"""
    import dspark.spec.planner as pl

    if not small:
        monkeypatch.setattr(pl, "SMALL_SLOTS", -1)
    cost = CostModel.from_measurements([1, 64], [10.0, 73.0])  # 9 ms + 1 ms per token
    caps, all_nan = np.array([2, 2, 2]), np.full((3, 2), np.nan)
    planner = Planner("lagged", cost, min_predicted_gain=0.0)  # (no standing plans)
    assert planner.plan_cpu(all_nan, caps) == 6  # the prior: drafts look certain
    planner.prior_survival = np.array([0.05, 0.0025, 0.0])  # surveyed: drafts fail
    assert planner.plan_cpu(all_nan, caps) == 0
    planner.prior_survival = np.array([0.99, 0.98, 0.97])
    assert planner.plan_cpu(all_nan, caps) == 6
    assert planner.searches == 3


def test_lagged_snaps_to_allowed_budgets():
    cost = CostModel.from_measurements([1, 4, 5, 64], [1.0, 1.0, 10.0, 80.0])
    caps = np.array([3, 3])
    conf = np.full((2, 3), 0.9)
    d = plan_budget_lagged(conf, caps, 0, 2, cost)
    assert d.budget == 2 and d.trimmed  # 4 tokens cost as little as 1
    d = plan_budget_lagged(conf, caps, 0, 2, cost, allowed_budgets=np.array([0, 1]))
    assert d.budget == 1
    # Graph-aware Planner: the staircase makes 2 tokens cost as much as 4 -> fill the bucket.
    g = CostModel.from_measurements([1, 2, 4, 8, 64], [1.0, 2.0, 2.2, 30.0, 300.0],
                                    graph_sizes=[1, 2, 4, 8])
    p = Planner("lagged", g)
    b = p.plan_cpu(conf, caps, 0, 2)
    assert b == 2 and b in g.budget_candidates(2, 6)
    assert p.last_decision.trimmed and p.last_decision.budget == 2


def reference_top_b(conf, caps, budget):
    num_reqs, k = conf.shape
    surv = np.cumprod(np.nan_to_num(conf, nan=0.0), axis=1)
    slots = sorted((-surv[r, j], j, r) for r in range(num_reqs) for j in range(caps[r]))
    chosen = slots[:budget]
    lengths = np.zeros(num_reqs, dtype=np.int64)
    for r in range(num_reqs):
        pos = sorted(j for _, j, rr in chosen if rr == r)
        assert pos == list(range(len(pos)))  # a prefix of every request
        lengths[r] = len(pos)
    return lengths


def test_allocate_top_b_matches_reference_and_is_prefix():
    rng = np.random.default_rng(1)
    for _ in range(200):
        num_reqs, k = rng.integers(1, 7), rng.integers(1, 6)
        conf = rng.uniform(0, 1, (num_reqs, k))
        if rng.random() < 0.5:  # coarse values -> many exact ties
            conf = np.round(conf * 2) / 2
        caps = rng.integers(0, k + 1, num_reqs)
        budget = int(rng.integers(0, caps.sum() + 2))
        got = allocate_top_b(torch.as_tensor(conf, dtype=torch.float32), torch.as_tensor(caps),
                             torch.tensor(budget))
        assert got.dtype == torch.int64
        np.testing.assert_array_equal(got.numpy(), reference_top_b(conf, caps, budget))
        assert got.sum() == min(budget, caps.sum())
        assert np.all(got.numpy() <= caps)


def test_allocate_ties_by_position_then_request():
    ones = torch.ones(3, 3)
    caps = torch.tensor([3, 3, 3])
    assert allocate_top_b(ones, caps, 4).tolist() == [2, 1, 1]
    # Equal survivals 0.5 at (0,0), (0,1), (1,0): position wins, not request 0's later slot.
    conf = torch.tensor([[0.5, 1.0], [0.5, 0.1]])
    assert allocate_top_b(conf, torch.tensor([2, 2]), 2).tolist() == [1, 1]
    assert allocate_top_b(conf, torch.tensor([2, 2]), 3).tolist() == [2, 1]


def test_allocate_edge_budgets_and_zero_capacity():
    conf = torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    conf[2] = float("nan")  # NaN -> never preferred over real candidates
    caps = torch.tensor([5, 0, 3, 2])
    assert allocate_top_b(conf, caps, 0).tolist() == [0, 0, 0, 0]
    assert allocate_top_b(conf, caps, 10).tolist() == [5, 0, 3, 2]
    assert allocate_top_b(conf, caps, 100).tolist() == [5, 0, 3, 2]
    got = allocate_top_b(conf, caps, 7)
    assert got[1] == 0 and got[2] == 0 and got.sum() == 7
    assert allocate_top_b(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 3).numel() == 0


def reference_algorithm1(conf, caps, other, n_sampling, table):
    """The paper's Algorithm 1, step by step."""
    num_reqs, _ = conf.shape
    a = np.cumprod(conf, axis=1)
    cand = sorted((-a[r, j], j, r) for r in range(num_reqs) for j in range(caps[r])
                  if a[r, j] > 0)
    lengths = np.zeros(num_reqs, dtype=np.int64)
    tokens, tau = num_reqs + other, float(n_sampling)
    best, best_l = tau / table[tokens], lengths.copy()
    for neg_a, j, r in cand:
        lengths[r] = j + 1
        tokens += 1
        tau += -neg_a
        theta = tau / table[tokens]
        if theta > best:
            best, best_l = theta, lengths.copy()
        else:
            break
    return best_l


def test_early_stop_matches_reference_algorithm1():
    rng = np.random.default_rng(2)
    outcomes = set()
    for _ in range(300):
        num_reqs, k = rng.integers(1, 7), rng.integers(1, 6)
        conf = rng.uniform(0, 1, (num_reqs, k)) ** rng.uniform(0.1, 1.5)
        conf[rng.random(conf.shape) < 0.05] = 0.0
        caps = rng.integers(0, k + 1, num_reqs)
        other = int(rng.integers(0, 3))
        n_sampling = int(rng.integers(0, num_reqs + 1))
        cost = random_cost(rng, max_tokens=64)
        table = cost.as_tensor_table(num_reqs + other + num_reqs * k, num_reqs,
                                     dtype=torch.float64)
        got = early_stop_lengths(torch.as_tensor(conf), torch.as_tensor(caps), other,
                                 n_sampling, table)
        want = reference_algorithm1(conf, caps, other, n_sampling, table.numpy())
        np.testing.assert_array_equal(got.numpy(), want)
        outcomes.add((int(want.sum()) == 0, int(want.sum()) == caps.sum()))
    assert len(outcomes) >= 3  # nothing, everything and partial plans all occur


def test_early_stop_stops_on_exact_tie():
    # Theta0 = 1 / 1.0, Theta1 = (1 + 0.5) / 1.5: equal, not an improvement -> stop at 0.
    table = torch.tensor([1.0, 1.0, 1.5, 1.6])
    conf, caps = torch.tensor([[0.5, 1.0]]), torch.tensor([2])
    assert early_stop_lengths(conf, caps, 0, 1, table).tolist() == [0]
    assert early_stop_lengths(conf, caps, 0, 1, torch.tensor([1.0, 1.0, 1.4, 1.5])).tolist() == [2]


def test_early_stop_table_too_short_raises():
    with pytest.raises(ValueError, match="step_time_table"):
        early_stop_lengths(torch.ones(2, 3), torch.tensor([3, 3]), 0, 2, torch.ones(5))


def test_threshold_and_fixed():
    conf = torch.tensor([[0.9, 0.4, 0.9], [0.6, 0.7, 0.8], [0.2, 0.9, 0.9]])
    caps = torch.tensor([3, 2, 3])
    assert threshold_lengths(conf, caps, 0.5).tolist() == [1, 2, 0]
    assert threshold_lengths(conf, caps, 0.6).tolist() == [1, 2, 0]  # >= threshold verifies
    assert threshold_lengths(conf, caps, torch.tensor([0.5, 0.3, 0.85])).tolist() == [3, 2, 0]
    assert threshold_lengths(torch.full((1, 2), float("nan")), torch.tensor([2]),
                             0.5).tolist() == [0]
    assert fixed_lengths(caps).tolist() == [3, 2, 3]


def test_planner_facade():
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.2, fixed_overhead_ms=0.5)
    conf = torch.tensor([[0.9, 0.5, 0.1, 0.1], [0.95, 0.9, 0.9, 0.2]])
    caps = torch.tensor([4, 4])
    with pytest.raises(ValueError):
        Planner("global_argmax", cost)
    with pytest.raises(ValueError):
        Planner("lagged", None)
    p = Planner("lagged", cost, min_predicted_gain=0.0)
    with pytest.raises(RuntimeError):
        p.allocate_device(conf, caps)
    b = p.plan_cpu(conf.numpy(), caps.numpy(), 0, 2)
    assert p.last_decision.budget == b and 0 < b < 8
    lengths = p.allocate_device(conf, caps)
    assert lengths.sum() == b and lengths.tolist() == allocate_top_b(conf, caps, b).tolist()
    es = Planner("early_stop", cost)
    assert es.plan_cpu(conf.numpy(), caps.numpy()) is None
    table = cost.as_tensor_table(64, 2)
    assert es.allocate_device(conf, caps).tolist() == early_stop_lengths(
        conf, caps, 0, 2, table).tolist()
    assert Planner("threshold", threshold=0.6).allocate_device(conf, caps).tolist() == [1, 3]
    assert Planner("fixed").allocate_device(conf, caps).tolist() == [4, 4]


def test_planner_warns_loudly_on_flat_table():
    flat = CostModel.from_measurements([1, 512], [30.0, 30.01])
    with pytest.warns(RuntimeWarning, match="flat"):
        Planner("lagged", flat)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Planner("lagged", CostModel.from_measurements([1, 512], [30.0, 60.0]))


def test_lagged_trim_penalty_is_paid_by_trimmed_budgets_only():
    """A trimmed step runs the eager path (no whole-step graph): its measured extra fixed cost
    is added to every budget below verify-all, so trimming must save more than that."""
    cost = CostModel.from_measurements([1, 64], [10.0, 73.0])  # 9 ms + 1 ms per token
    caps = np.array([4, 4])
    conf = np.array([[0.9, 0.2, 0.2, 0.2], [0.9, 0.2, 0.2, 0.2]])
    free = plan_budget_lagged(conf, caps, 0, 2, cost)
    assert free.trimmed and free.budget == 2
    # theta(2) = (2 + 1.8) / 13 = 0.292, theta(8) = (2 + 2 * 1.1232) / 19 = 0.224: a penalty
    # of 2 ms keeps trimming ahead (3.8 / 15 = 0.253), one of 6 ms does not (3.8 / 19 = 0.2)
    assert plan_budget_lagged(conf, caps, 0, 2, cost, trim_penalty_ms=2.0).budget == 2
    slow = plan_budget_lagged(conf, caps, 0, 2, cost, trim_penalty_ms=6.0)
    assert not slow.trimmed and slow.budget == 8
    p = Planner("lagged", cost)
    assert p.plan_cpu(conf, caps, 0, 2, trim_penalty_ms=6.0) == 8
    assert p.plan_cpu(conf, caps, 0, 2) == 2


def test_plan_cpu_reads_confidences_only_when_a_trim_could_pay():
    conf = np.full((2, 3), 0.5)
    calls = []

    def stale():
        calls.append(1)
        return conf

    flat = CostModel.from_measurements([1, 64], [10.0, 10.05])  # extra tokens nearly free
    with pytest.warns(RuntimeWarning, match="flat"):
        planner = Planner("lagged", flat)
    assert planner.plan_cpu(stale, np.array([3, 3]), 0, 2) == 6
    assert calls == []  # the bound settled it: verify all without looking
    steep = CostModel.from_measurements([1, 64], [1.0, 64.0])
    p = Planner("lagged", steep)
    assert p.plan_cpu(stale, np.array([3, 3]), 0, 2) == plan_budget_lagged(
        conf, np.array([3, 3]), 0, 2, steep).budget  # fmt: skip
    assert calls == [1]


def test_plan_cpu_with_cached_shapes_decides_as_the_uncached_search():
    """plan_cpu caches each batch shape's candidates and variable step times; decisions must
    stay those of plan_budget_lagged, bit for bit, while the fixed term moves (it is learned
    online), the drafter's price switches mode, and penalties, prefill rates and graph
    snapping vary, and with the shape cache warm (shapes repeat)."""
    rng = np.random.default_rng(11)
    cost = random_cost(rng, max_tokens=96)
    cost.graph_sizes = [1, 2, 4, 8, 16, 24, 32, 48]
    cost.draft_greedy_ms = np.array([0.1, 0.3])
    planners = [Planner("lagged", cost, min_predicted_gain=0.0, snap_to_graphs=snap)
                for snap in (True, False)]  # fmt: skip
    shapes = [(int(rng.integers(1, 6)), int(rng.integers(0, 3))) for _ in range(6)]
    trimmed = 0
    for step in range(600):
        p = planners[step % 2]
        num_reqs, other = shapes[int(rng.integers(len(shapes)))]
        caps = rng.integers(0, 8, num_reqs)
        conf = rng.uniform(0, 1, (num_reqs, 7)) ** rng.uniform(0.2, 3)
        cost.fixed_overhead_ms = float(rng.choice([0.0, 0.5, rng.uniform(0, 3)]))
        if cost.use_greedy_drafts(bool(rng.integers(2))):
            for q in planners:
                q.invalidate_tables()
        penalty = float(rng.choice([0.0, rng.uniform(0, 1)]))
        rate = None if rng.random() < 0.7 or other == 0 else float(rng.uniform(0.1, 5))
        allowed = (cost.budget_candidates(num_reqs + other, int(caps.sum()))
                   if p.snap_to_graphs else None)  # fmt: skip
        want = plan_budget_lagged(conf, caps, other, num_reqs, cost, 0.0, allowed, 1.0,
                                  penalty, rate)  # fmt: skip
        got = p.plan_cpu(conf, caps, other, num_reqs, penalty, rate)
        assert got == want.budget, step
        if p.last_decision.theta_best == p.last_decision.theta_best:  # not the bound's NaN
            assert p.last_decision == want
        trimmed += want.trimmed
    assert 50 < trimmed < 550  # both outcomes exercised


def _counting_reads(reads: list):
    """stale(conf) -> a lazy confidence read that appends to `reads` when called."""

    def stale(conf):
        def read():
            reads.append(1)
            return conf
        return read

    return stale


def test_a_clear_verify_all_plan_stands_for_the_next_plans_of_its_shape():
    """With reuse_clear_plans = 4, a verify-all plan whose best trim was far from the guard
    is reused, confidences unread, for the next 3 plans of the same shape; a far shape, or a
    plan that trims, searches at every plan; a plan near the guard stands as long as the
    shorter of the two reuses."""
    steep = CostModel.from_measurements([1, 64], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_clear_plans=4)
    caps = np.array([3, 3])
    reads = []
    stale = _counting_reads(reads)

    sure = np.full((2, 3), 0.99)  # every draft nearly certain: verify-all clearly best
    assert plan_budget_lagged(sure, caps, 0, 2, steep).predicted_gain < 0.02
    budgets = [p.plan_cpu(stale(sure), caps, 0, 2) for _ in range(8)]
    assert budgets == [6] * 8 and len(reads) == 2  # plans 1 and 5 searched
    far = np.full(20, 3)  # a shape far from this one (ten times the rows): its own search
    p.plan_cpu(stale(np.full((20, 3), 0.99)), far, 0, 20)
    assert len(reads) == 3
    weak = np.full((2, 3), 0.3)  # trimming pays: searched at every plan, never reused
    want = plan_budget_lagged(weak, caps, 0, 2, steep).budget
    assert want < 6
    reads.clear()
    assert [p.plan_cpu(stale(weak), caps, 0, 2) for _ in range(5)] == [want] * 5
    assert len(reads) == 5
    exact = Planner("lagged", steep)  # the default: every plan searches
    reads.clear()
    for _ in range(4):
        exact.plan_cpu(stale(sure), caps, 0, 2)
    assert len(reads) == 4
    # a verify-all near the guard (predicted gain between half the guard and the guard)
    # searches at every plan while trimmed plans are not reused, else stands as long as the
    # shorter of the two reuses
    near = np.full((2, 3), 0.98)
    d = plan_budget_lagged(near, caps, 0, 2, steep)
    assert not d.trimmed and 0.02 <= d.predicted_gain < 0.04
    reads.clear()
    assert [p.plan_cpu(stale(near), caps, 0, 2) for _ in range(4)] == [6] * 4
    assert len(reads) == 4
    both = Planner("lagged", steep, reuse_clear_plans=4, reuse_trimmed_plans=8)
    reads.clear()
    assert [both.plan_cpu(stale(near), caps, 0, 2) for _ in range(8)] == [6] * 8
    assert len(reads) == 2  # plans 1 and 5


def test_budget_yields_are_scaled_by_the_measured_acceptance_ratio():
    """survival_scale multiplies every stale survival (capped at 1) before the search: the
    plan equals the uncorrected search on survivals scaled so; understated confidences
    (scale > 1) verify more drafts, overstated ones fewer, and 1 changes nothing."""
    cost = CostModel.from_measurements([1, 64], [1.0, 64.0], fixed_ms=2.0)
    conf = np.array([[0.9, 0.6, 0.5, 0.4], [0.7, 0.5, 0.3, 0.2]])
    caps = np.array([4, 4])
    budgets = {}
    for scale in (0.5, 1.0, 1.4, 3.0):
        p = Planner("lagged", cost, min_predicted_gain=0.0)
        budgets[scale] = p.plan_cpu(conf, caps, 0, 2, survival_scale=scale)
        surv = np.minimum(np.cumprod(conf, axis=1) * scale, 1.0)
        # conditional confidences whose survivals are the scaled ones
        cond = surv / np.concatenate([np.ones((2, 1)), surv[:, :-1]], axis=1)
        assert budgets[scale] == plan_budget_lagged(cond, caps, 0, 2, cost, 0.0).budget
    assert budgets[1.0] == plan_budget_lagged(conf, caps, 0, 2, cost, 0.0).budget
    assert budgets[0.5] < budgets[1.0] < budgets[1.4] < budgets[3.0]  # 0, 2, 3, 5


def test_stale_survivals_fast_path_matches_the_general_one():
    """Stale confidences covering every row take a shorter path (hot: every lagged step);
    it must give the general path's sorted survivals, NaN (unknown) entries and ragged
    capacities included."""
    from dspark.spec.budget_search import stale_survivals

    rng = np.random.default_rng(3)
    for _ in range(200):
        r, k = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        caps = rng.integers(0, k + 1, r)
        caps[rng.integers(r)] = k
        conf = rng.uniform(-0.2, 1.2, (r + int(rng.integers(0, 3)), k + int(rng.integers(0, 2))))
        conf[rng.uniform(size=conf.shape) < 0.1] = np.nan
        prior = 1.0 if rng.uniform() < 0.5 else float(rng.uniform())  # 1.0: the default
        np.testing.assert_array_equal(stale_survivals(conf, caps, prior),
                                      _reference_survivals(conf[:r, :k], caps, prior))
        # rows missing: the general path, the missing rows unknown
        got = stale_survivals(conf[: r - 1], caps, prior)
        c2 = np.vstack([conf[: r - 1, :k], np.full((1, k), np.nan)])
        np.testing.assert_array_equal(got, _reference_survivals(c2, caps, prior))


def _reference_survivals(c: np.ndarray, caps: np.ndarray, prior: float) -> np.ndarray:
    """The general path, as a reference: clip, survivals; rows with an unknown entry take the
    known rows' mean survivals (the prior where no row is known); sorted descending."""
    unknown = np.isnan(c).any(axis=1)
    surv = np.cumprod(np.clip(np.where(np.isnan(c), prior, c), 0.0, 1.0), axis=1)
    if unknown.any() and not unknown.all():
        surv[unknown] = surv[~unknown].mean(axis=0)
    return np.sort(surv[np.arange(c.shape[1])[None, :] < caps[:, None]])[::-1]


def test_steps_with_prefill_value_drafts_at_the_decoding_rate():
    """With a prefill chunk in the step, its time is spent anyway: a draft is verified only if
    its survival per marginal ms beats the rate decoding would earn. The step's own ratio
    verifies everything (its prefill makes the step's tokens/ms tiny)."""
    from dspark.spec.rates import decode_rate

    # 10 ms + 0.02 ms per token; 4 requests x 4 drafts; a 4000-token prefill chunk
    cost = CostModel.from_measurements([1, 10_000], [10.02, 210.0])
    conf = np.array([[0.9, 0.5, 0.3, 0.2]] * 4)
    caps, other = np.full(4, 4), 4000
    ratio = plan_budget_lagged(conf, caps, other, 4, cost)
    assert not ratio.trimmed and ratio.budget == 16  # the old objective: verify all
    # at 40 tokens/ms, a draft is worth 0.02 ms x 40 = 0.8 tokens: only the 0.9 survivals pay
    net = plan_budget_lagged(conf, caps, other, 4, cost, opportunity_rate=40.0)
    assert net.trimmed and net.budget == 4
    # survivals 0.9, 0.45, 0.135, 0.027: at 10 tokens/ms (0.2 tokens per draft) two pay, at 5
    # (0.1 per draft) three
    assert plan_budget_lagged(conf, caps, other, 4, cost, opportunity_rate=10.0).budget == 8
    assert plan_budget_lagged(conf, caps, other, 4, cost, 0.0, opportunity_rate=5.0).budget == 12
    # brute force over every budget: the chosen one maximises tokens - rate * time
    surv = np.sort(np.cumprod(conf, axis=1).reshape(-1))[::-1]
    value = [4 + surv[:b].sum() - 40.0 * float(cost.step_time_lookup(np.array([4 + other + b]),
                                                                     4)[0]) for b in range(17)]
    assert int(np.argmax(value)) == net.budget
    p = Planner("lagged", cost, min_predicted_gain=0.0)
    assert p.plan_cpu(conf, caps, other, 4, opportunity_rate=40.0) == 4
    # decoding's own rate: plain 4 / (10 + 0.08) ms, or verifying l drafts per request
    survival = np.cumprod(conf[0])
    def step_ms(tokens):
        return float(cost.step_time_lookup(np.array([tokens]), 4)[0])

    plain = 4 / step_ms(4)
    spec = [4 * (1 + survival[:n].sum()) / step_ms(4 * (1 + n)) for n in (1, 2, 3, 4)]
    assert decode_rate(cost, survival, 4, None) == pytest.approx(max([plain] + spec))
    assert decode_rate(cost, None, 4, 5.0) == pytest.approx(4 / (5.0 + cost.verify_lookup(4)))


def test_a_trimmed_plan_stands_for_the_next_plans_of_its_shape():
    """With reuse_trimmed_plans = 4, a trimmed plan's budget (and decision) is reused,
    confidences unread, for the next 3 plans of its shape; a far shape searches; a step
    with prefill chunks (an opportunity rate) is its own shape; a changed cost model (tables
    invalidated) searches again."""
    steep = CostModel.from_measurements([1, 64], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_trimmed_plans=4)
    caps = np.array([3, 3])
    reads = []
    stale = _counting_reads(reads)

    weak = np.full((2, 3), 0.3)
    want = plan_budget_lagged(weak, caps, 0, 2, steep)
    assert want.trimmed
    budgets = [p.plan_cpu(stale(weak), caps, 0, 2) for _ in range(6)]
    assert budgets == [want.budget] * 6 and len(reads) == 2  # plans 1 and 5 searched
    assert p.last_decision.budget == want.budget and p.last_decision.trimmed
    # plan 7: the searched budget still stands, though the confidences have moved since
    sure = np.full((2, 3), 0.99)
    assert p.plan_cpu(stale(sure), caps, 0, 2) == want.budget and len(reads) == 2
    far = np.full(20, 3)  # a shape far from this one (ten times the rows): its own search
    p.plan_cpu(stale(np.full((20, 3), 0.3)), far, 0, 20)
    assert len(reads) == 3
    p.plan_cpu(stale(weak), caps, 0, 2, opportunity_rate=0.5)  # prefill chunks: searched
    assert len(reads) == 4
    p.invalidate_tables()
    assert p.plan_cpu(stale(sure), caps, 0, 2) == 6 and len(reads) == 5


def test_plans_of_steps_with_prefill_chunks_stand_for_similar_chunks_and_rates():
    """A step with prefill chunks plans against the opportunity rate of decoding; its plan
    stands, confidences unread, for the next plans whose chunk is in the same power-of-two
    size group and whose rate is within ~5% of the rate it was searched at; another size
    group, a rate further off, or a step without chunks searches. The reused budget is the
    one a search would find while the confidences stay put."""
    from dspark.spec.plan_reuse import near_rate, nearby_other

    assert [nearby_other(n) for n in (0, 1, 2, 3, 256, 257, 512, 513)] == [
        0, 1, 2, 4, 256, 512, 512, 1024]
    assert near_rate(None, None) and not near_rate(None, 10.0) and not near_rate(10.0, None)
    assert near_rate(10.2, 10.0) and near_rate(9.6, 10.0) and not near_rate(11.0, 10.0)
    # (rates either side of where fixed 5% groups split them, int(20 ln r): 9.97 | 9.98)
    assert near_rate(9.98, 9.97) and near_rate(9.97, 9.98)
    steep = CostModel.from_measurements([1, 512], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_trimmed_plans=8, reuse_clear_plans=8)
    caps = np.full(8, 3)
    weak = np.full((8, 3), 0.3)
    reads = []
    stale = _counting_reads(reads)
    want = plan_budget_lagged(weak, caps, 300, 8, steep, opportunity_rate=1.93)
    assert want.trimmed
    got = [p.plan_cpu(stale(weak), caps, n, 8, opportunity_rate=r)  # (within 5% of 1.93)
           for n, r in ((300, 1.93), (400, 1.93), (500, 2.02), (300, 1.84))]
    assert got == [want.budget] * 4 and len(reads) == 1  # one search, three reuses
    p.plan_cpu(stale(weak), caps, 600, 8, opportunity_rate=1.93)  # 513-1024: another group
    assert len(reads) == 2 and p.standing.miss == "new"  # (why it searched: the step log)
    p.plan_cpu(stale(weak), caps, 300, 8, opportunity_rate=2.05)  # 6% above the searched 1.93
    assert len(reads) == 3 and p.standing.miss == "rate"
    p.plan_cpu(stale(weak), caps, 300, 8, opportunity_rate=2.14)  # within 5% of 2.05, now
    assert len(reads) == 3
    for _ in range(7):  # (the 2.05 search stands for 7 plans: one used above)
        p.plan_cpu(stale(weak), caps, 300, 8, opportunity_rate=2.05)
    assert len(reads) == 4 and p.standing.miss == "spent"
    p.plan_cpu(stale(weak), caps, 0, 8)  # no prefill chunk: its own shape
    assert len(reads) == 5


def test_a_standing_plan_of_a_step_with_prefill_chunks_builds_no_context_for_its_chunk():
    """Chunk sizes vary from step to step, and each size is its own shape context (the
    candidate budgets and their step times: ~150-190 µs to build with the caches cold,
    development machine). A step with prefill chunks has no bound to check, so a standing plan
    of its group is taken without building its chunk's context, unless a trimmed plan must be
    rescaled to another draft count. The budgets are those of a planner that builds every
    context."""
    from dspark.spec.plan_reuse import rescaled

    steep = CostModel.from_measurements([1, 512], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_trimmed_plans=8, reuse_clear_plans=8)
    caps, weak = np.full(8, 3), np.full((8, 3), 0.3)
    first = p.plan_cpu(weak, caps, 300, 8, opportunity_rate=1.93)
    d = p.last_decision
    assert d.trimmed and len(p._contexts) == 1
    got = [p.plan_cpu(weak, caps, n, 8, opportunity_rate=1.93) for n in (301, 350, 420, 511)]
    assert got == [first] * 4 and len(p._contexts) == 1 and p.searches == 1
    fewer = np.array([3] * 7 + [1])  # 22 drafts: the trimmed plan is rescaled, no context
    b = p.plan_cpu(weak, fewer, 400, 8, opportunity_rate=1.93)
    assert len(p._contexts) == 1 and p.searches == 1
    assert b == rescaled(d, p._context(8, 400, 22)[0], 22).budget


def test_budget_at_most_is_the_largest_built_candidate_at_most_the_wish():
    """plan_reuse.budget_at_most (a trimmed standing plan's rescale, candidates not built)
    picks what rescaled picks from the candidates _context builds (budget_candidates, then
    candidate_budgets), with and without graph sizes, on random shapes: bucket edges, shapes
    whose fixed tokens pass every bucket, wishes below every candidate and at verify-all."""
    from dspark.spec.budget_search import candidate_budgets
    from dspark.spec.plan_reuse import budget_at_most

    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(400):
        sizes = tuple(sorted({int(x) for x in rng.integers(1, 300, rng.integers(1, 12))}))
        cost = CostModel.from_measurements([1, 512], [1.0, 2.0], graph_sizes=sizes)
        fixed, total = int(rng.integers(0, 320)), int(rng.integers(1, 64))
        for snap in (True, False):
            allowed = cost.budget_candidates(fixed, total) if snap else None
            cand = candidate_budgets(allowed, total)
            for want in range(total + 1):
                expect = int(cand[max(int(np.searchsorted(cand, want, side="right")) - 1, 0)])
                got = budget_at_most(cost.graph_sizes if snap else None, fixed, want, total)
                assert got == expect, (sizes, fixed, total, want, snap)
                checked += 1
    assert checked > 10_000


def test_a_standing_plan_serves_nearby_shapes_as_the_same_share_of_their_drafts():
    """Shapes whose request counts are within ~6% (33 rows after 32; 240-255; 256-287) share
    a standing plan: a trimmed budget is carried over as the same share of the new shape's
    drafts, rounded down to one of its candidate budgets (graph-filling ones when graph sizes
    are known), confidences unread; verify-all stays verify-all; a count outside the group
    searches. Below 16 rows, only the same count shares."""
    from dspark.spec.plan_reuse import nearby_rows

    assert [nearby_rows(n) for n in (7, 15, 16, 31, 32, 33, 35, 36, 255, 256, 287, 288)] == [
        7, 15, 16, 30, 32, 32, 32, 36, 240, 256, 256, 288]
    steep = CostModel.from_measurements([1, 64], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_trimmed_plans=4, reuse_clear_plans=4)
    reads = []
    stale = _counting_reads(reads)
    weak = np.full((40, 3), 0.3)
    first = p.plan_cpu(stale(weak[:32]), np.full(32, 3), 0, 32)
    assert p.last_decision.trimmed and len(reads) == 1
    # 33 rows: the same group; the budget scales with the drafts (99 against 96), no read
    b33 = p.plan_cpu(stale(weak[:33]), np.full(33, 3), 0, 33)
    assert b33 == round(first * 99 / 96) and len(reads) == 1
    assert p.last_decision.max_budget == 99 and p.last_decision.trimmed
    # with graph sizes, the carried budget is rounded down to a candidate of the new shape
    cand = np.array([0, 10, 40, 70, 99])
    from dspark.spec.plan_reuse import BudgetDecision, rescaled

    d = BudgetDecision(48, 96, 1.0, 0.5, 1.0, True)
    assert rescaled(d, cand, 99).budget == 40  # 48 * 99 / 96 = 49.5 -> 50 -> 40
    assert rescaled(BudgetDecision(96, 96, 1.0, 1.0, 0.0, False), cand, 99).budget == 99
    assert rescaled(BudgetDecision(1, 96, 1.0, 0.5, 1.0, True), cand, 99).budget == 0
    # 36 rows: another group, its own search
    p.plan_cpu(stale(weak[:36]), np.full(36, 3), 0, 36)
    assert len(reads) == 2


def test_a_fixed_term_move_keeps_standing_plans_and_shape_contexts():
    """The online fixed term moves on many steps: the planner's host contexts (the variable
    step times, fixed-free) and its standing plans survive invalidate_tables(keep_plans=True),
    and the search after the stand sees the new term; without keep_plans (the drafter's price
    changed) the next plan searches at once."""
    steep = CostModel.from_measurements([1, 64], [1.0, 64.0])
    p = Planner("lagged", steep, reuse_trimmed_plans=4)
    caps, weak = np.array([3, 3]), np.full((2, 3), 0.3)
    reads = []
    stale = _counting_reads(reads)
    first = p.plan_cpu(stale(weak), caps, 0, 2)
    contexts = dict(p._contexts)
    steep.fixed_overhead_ms = 20.0  # a fixed term under which a new search trims less
    moved = plan_budget_lagged(weak, caps, 0, 2, steep)
    assert moved.trimmed and moved.budget != first
    p.invalidate_tables(keep_plans=True)
    for _ in range(3):  # the plan stands for the 3 plans after its search, unread
        assert p.plan_cpu(stale(weak), caps, 0, 2) == first
    assert len(reads) == 1 and p._contexts == contexts  # (the same arrays: nothing rebuilt)
    assert p.plan_cpu(stale(weak), caps, 0, 2) == moved.budget and len(reads) == 2
    steep.fixed_overhead_ms = 0.0
    p.invalidate_tables()
    assert p.plan_cpu(stale(weak), caps, 0, 2) == first and len(reads) == 3


def test_a_step_the_bound_settles_is_verify_all_for_any_penalty_and_confidences():
    """The engine skips gathering a decode step's plan inputs (penalty, acceptance ratio,
    rows) when `bound_settles` says so: that must be exactly when the full search would verify
    everything anyway, whatever the confidences, trim penalty and graph snapping."""
    rng = np.random.default_rng(5)
    settled = searched = 0
    for step in range(400):
        cost, planner, snap = random_planner(rng, 96, [1, 2, 4, 8, 16, 24, 32, 48])
        num_reqs = int(rng.integers(1, 7))
        caps = rng.integers(1, 8, num_reqs)
        total = int(caps.sum())
        if not planner.bound_settles(num_reqs, total):
            searched += 1
            continue
        settled += 1
        assert planner.last_decision.budget == total and not planner.last_decision.trimmed
        allowed = cost.budget_candidates(num_reqs, total) if snap else None
        for _ in range(5):
            conf = rng.uniform(0, 1, (num_reqs, 7)) ** rng.uniform(0.2, 3)
            penalty = float(rng.choice([0.0, rng.uniform(0, 2)]))
            want = plan_budget_lagged(conf, caps, 0, num_reqs, cost, planner.min_predicted_gain,
                                      allowed, 1.0, penalty)  # fmt: skip
            assert want.budget == total, step
            scale = float(rng.uniform(1.0, 3.0))  # the engine's acceptance ratio (>= 1)
            assert planner.plan_cpu(conf, caps, 0, num_reqs, penalty, None, scale) == total
    assert settled > 40 and searched > 40  # both outcomes exercised


def test_rate_memo_reads_its_mode_and_unexpired_groups_only():
    """A rate stands in its mode for `lifetime` plans; a put in another mode, or past
    MAX_GROUPS groups, starts the memo afresh."""
    from dspark.spec.rates import RateMemo

    memo = RateMemo(lifetime=4)
    assert memo.get((True, False), 7, now=0) is None
    memo.put((True, False), 7, 2.5, now=10)
    assert memo.get((True, False), 7, now=13) == 2.5
    assert memo.get((True, False), 7, now=14) is None  # (lifetime plans old)
    assert memo.get((False, False), 7, now=11) is None  # (another mode)
    assert memo.get((True, False), 8, now=11) is None  # (another group)
    memo.put((True, False), 8, 3.0, now=11)
    assert memo.get((True, False), 7, now=12) == 2.5 and memo.get((True, False), 8, now=12) == 3.0
    memo.put((False, False), 8, 4.0, now=12)  # a new mode forgets the old one's rates
    assert memo.get((True, False), 8, now=12) is None and memo.get((False, False), 8, now=12) == 4.0
    for g in range(RateMemo.MAX_GROUPS):
        memo.put((False, False), 100 + g, 1.0, now=13)
    assert memo.get((False, False), 8, now=13) is None  # (the 17th group restarted it)
    assert memo.get((False, False), 100 + RateMemo.MAX_GROUPS - 1, now=13) == 1.0
    memo.clear()
    assert memo.get((False, False), 100 + RateMemo.MAX_GROUPS - 1, now=13) is None
