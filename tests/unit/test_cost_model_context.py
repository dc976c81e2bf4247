"""Context pricing of the cost table: a step is priced at the sum of its rows' contexts, not at
the profiled one (CostModel module docstring)."""

import numpy as np
import pytest

from dspark.spec.budget_search import plan_budget_lagged
from dspark.spec.cost_model import CostModel
from dspark.spec.planner import Planner
from dspark.spec.rates import decode_rates

SLOPE = 3.6e-5  # ms per context token: the 8B shape's K and V at ~4 TB/s
L0 = 256  # the profile's context per row
MAX_ROWS = 256  # the profile's rows stop growing here (max_num_seqs)


def _table(graph_sizes=None, **kw) -> CostModel:
    """An 8B-like table: n tokens profiled as min(n, 256) one-token rows of 256 context."""
    tokens = np.array([1, 8, 64, 128, 256, 512, 1024, 2048])
    ms = np.array([4.7, 5.2, 6.1, 8.0, 11.9, 16.0, 28.5, 52.0])
    kw.setdefault("verify_reqs", np.minimum(tokens, MAX_ROWS))
    kw.setdefault("context_ms_per_token", SLOPE)
    kw.setdefault("profile_context_len", L0)
    return CostModel.from_measurements(tokens, ms, [1, 64, 256], [0.5, 2.0, 6.0], fixed_ms=0.3,
                                       graph_sizes=graph_sizes, **kw)  # fmt: skip


def test_a_step_is_priced_at_its_own_context():
    """verify(n | C) = table(n) - slope * L0 * rows(n) + slope * C: the table's point less the
    context it was measured with plus the step's, at the points and between them."""
    cost, raw = _table(), _table(context_ms_per_token=0.0)
    assert cost.prices_context and not raw.prices_context
    for n, rows in ((64, 64), (256, 256), (1024, 256), (96, 96)):  # 96: between two points
        for context in (0, 256 * 640, 64 * 2048):
            cost.set_step_context(context)
            raw.set_step_context(context)  # (ignored: that table does not price context)
            want = float(raw.step_time_ms(n, 64)) + SLOPE * (context - L0 * rows)
            assert float(cost.step_time_ms(n, 64)) == pytest.approx(want, rel=1e-12)
            assert float(cost.step_time_lookup(np.array([n]), 64)[0]) == float(
                cost.step_time_ms(n, 64))  # the planner's dense tables, bit for bit
    # at the profile's own context a plain step of n <= 256 rows costs what was measured
    cost.set_step_context(64 * L0)
    assert float(cost.step_time_ms(64, 64)) == pytest.approx(float(raw.step_time_ms(64, 64)))
    # the H200 case (BENCHMARKS.md, twenty-second session): 256 plain rows over ~640 tokens
    cost.set_step_context(256 * 640)
    extra = float(cost.step_time_ms(256, 256) - raw.step_time_ms(256, 256))
    assert extra == pytest.approx(SLOPE * 256 * (640 - 256))  # ~3.5 ms understated before
    # ... and 64 rows verifying 3 drafts each (256 tokens: priced as 256 rows of 256) over 640
    cost.set_step_context(64 * 640)
    assert float(cost.step_time_ms(256, 64) - raw.step_time_ms(256, 64)) == pytest.approx(
        SLOPE * (64 * 640 - 256 * L0))  # overstated by ~0.9 ms before


def test_zero_context_table_stays_monotone_and_non_negative():
    """A slope so large that the profiled rows' context exceeds a point's time: the
    zero-context table is floored at 0 and never lets more tokens cost less."""
    cost = _table(context_ms_per_token=1e-3)  # 256 rows x 256 x 1e-3 = 65 ms > 11.9 ms
    cost.set_step_context(0)
    v = cost.verify_cost_ms(np.arange(0, 3000))
    assert np.all(v >= 0) and np.all(np.diff(v) >= 0)


def test_graph_buckets_price_the_bucket_rows():
    """Inside the captured range a count pays for its bucket, rows included."""
    cost = _table(graph_sizes=(1, 8, 64, 128, 256))
    for n, bucket in ((5, 8), (65, 128), (200, 256)):
        assert float(cost.verify_cost_ms(n)) == float(cost.verify_cost_ms(bucket))
    assert float(cost.verify_cost_ms(200)) == pytest.approx(11.9 - SLOPE * L0 * 256)


def test_context_fields_survive_json_and_older_tables_load(tmp_path):
    cost = _table()
    path = tmp_path / "cost.json"
    cost.to_json(path)
    back = CostModel.from_json(path)
    assert back.prices_context and back.verify_reqs.tolist() == cost.verify_reqs.tolist()
    assert back.context_ms_per_token == SLOPE and back.profile_context_len == L0
    for c in (0, 100_000):
        cost.set_step_context(c)
        back.set_step_context(c)
        np.testing.assert_array_equal(back.step_time_ms(np.arange(3000), 7),
                                      cost.step_time_ms(np.arange(3000), 7))
    d = cost.to_dict()  # a table written before context pricing: no rows, no context record
    del d["context"], d["verify"]["num_reqs"]
    old = CostModel.from_dict(d)
    assert not old.prices_context
    old.set_step_context(10**6)
    assert old.step_context_ms == 0.0
    unpriced = _table(context_ms_per_token=0.0)
    assert float(old.step_time_ms(64, 8)) == float(unpriced.step_time_ms(64, 8))


def test_bad_context_fields_are_refused_by_name():
    with pytest.raises(ValueError, match="request counts"):
        _table(verify_reqs=[1, 2, 3])
    with pytest.raises(ValueError, match="context_ms_per_token"):
        _table(context_ms_per_token=-1.0)
    with pytest.raises(ValueError, match="profile_context_len"):
        _table(profile_context_len=float("nan"))


def test_duplicate_points_keep_their_rows_in_token_order():
    cost = CostModel.from_measurements([64, 8, 64, 1], [6.0, 5.0, 6.2, 4.0],
                                       verify_reqs=[64, 8, 64, 1], context_ms_per_token=SLOPE,
                                       profile_context_len=L0)  # fmt: skip
    assert cost.verify_tokens.tolist() == [1, 8, 64]
    assert cost.verify_reqs.tolist() == [1, 8, 64]


def test_a_long_context_makes_trimming_pay_less():
    """The context read is paid by every candidate budget alike, so the longer it is, the
    less a trimmed draft saves in proportion: the plan verifies at least as many drafts,
    and here all of them where a short context trims. plan_cpu agrees with the reference
    search at each context."""
    cost = _table()
    caps = np.full(64, 7)
    conf = np.tile(np.array([0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1]), (64, 1))
    budgets = []
    for context in (64 * 16, 64 * 40_000):
        cost.set_step_context(context)
        planner = Planner("lagged", cost, snap_to_graphs=False)
        budget = planner.plan_cpu(conf, caps)
        ref = plan_budget_lagged(conf, caps, 0, 64, cost)
        assert budget == ref.budget
        budgets.append(budget)
    assert budgets[0] < 64 * 7 == budgets[1]


def test_the_drafting_decision_prices_both_sides_at_the_step_context():
    """decode_rates: plain decoding and every verify length pay the same context read."""
    cost = _table()
    survival = [0.9, 0.8, 0.7]
    cost.set_step_context(0)
    plain0, spec0 = decode_rates(cost, survival, 64, 0.2)
    cost.set_step_context(64 * 2000)
    plain1, spec1 = decode_rates(cost, survival, 64, 0.2)
    read = SLOPE * 64 * 2000
    assert 64 / plain1 - 64 / plain0 == pytest.approx(read)
    assert spec1 < spec0 and plain1 < plain0
    assert spec1 / plain1 > spec0 / plain0  # a constant added to both favours more tokens
