import json

import numpy as np
import pytest
import torch

from dspark.spec.cost_model import CostModel
from dspark.spec.profiler import make_provenance, median_of_repeats


def test_monotone_running_max_and_duplicates():
    cm = CostModel.from_measurements([1, 8, 4, 16, 32, 8], [5.0, 7.0, 6.0, 6.5, 9.0, 7.5])
    assert cm.verify_tokens.tolist() == [1, 4, 8, 16, 32]
    # 8 keeps the larger duplicate (7.5); the 16-token dip (6.5) is lifted to 7.5.
    assert cm.verify_ms.tolist() == [5.0, 6.0, 7.5, 7.5, 9.0]
    n = np.arange(0, 100)
    t = cm.step_time_ms(n, 4)
    assert np.all(np.diff(t) >= 0)


def test_interpolation_and_extrapolation():
    cm = CostModel.from_measurements([10, 20, 40], [2.0, 4.0, 5.0], draft_reqs=[1, 9],
                                     draft_times_ms=[1.0, 3.0], fixed_ms=0.5)
    v = cm.verify_cost_ms(np.array([0, 10, 15, 30, 40, 60]))
    np.testing.assert_allclose(v, [2.0, 2.0, 3.0, 4.5, 5.0, 6.0])  # flat below, slope past
    np.testing.assert_allclose(cm.draft_cost_ms([1, 5, 9, 13]), [1.0, 2.0, 3.0, 4.0])
    # step time = fixed + draft(R) + verify(n), broadcast over arrays
    t = cm.step_time_ms(np.array([15, 60]), 5)
    np.testing.assert_allclose(t, [0.5 + 2.0 + 3.0, 0.5 + 2.0 + 6.0])
    t2 = cm.step_time_ms(np.array([15, 15]), np.array([1, 9]))
    np.testing.assert_allclose(t2, [0.5 + 1.0 + 3.0, 0.5 + 3.0 + 3.0])


def test_graph_staircase_and_snapping():
    cm = CostModel.from_measurements([1, 8, 16, 32, 64], [1.0, 2.0, 3.0, 5.0, 9.0],
                                     graph_sizes=[1, 2, 4, 8, 16, 32])
    # Inside the captured range a count pays for its bucket.
    np.testing.assert_allclose(cm.verify_cost_ms([9, 16]), [3.0, 3.0])
    np.testing.assert_allclose(cm.verify_cost_ms([17, 32]), [5.0, 5.0])
    assert cm.verify_cost_ms(5) == pytest.approx(cm.verify_cost_ms(8))
    # Past the largest bucket: plain interpolation of the (eager) measurements.
    assert cm.verify_cost_ms(48) == pytest.approx(7.0)
    assert cm.graph_bucket(np.array([3, 17, 33])).tolist() == [4, 32, -1]
    t = cm.step_time_ms(np.arange(1, 80), 1)
    assert np.all(np.diff(t) >= 0)
    # 5 fixed tokens: budgets that fill a bucket exactly (8, 16, 32 -> n=3, 11, 27), every
    # budget past the captured range (n >= 28), and the maximum.
    cand = cm.budget_candidates(5, 30)
    assert cand.tolist() == [3, 11, 27, 28, 29, 30]
    assert cm.budget_candidates(5, 20).tolist() == [3, 11, 20]
    assert cm.snap_budget(5, 4, 100) == 11  # 9 tokens -> 16 bucket -> 11 drafts
    assert cm.snap_budget(5, 4, 7) == 7  # never past the maximum
    assert cm.snap_budget(5, 40, 100) == 40  # eager region: unchanged
    no_graphs = CostModel.from_measurements([1, 8], [1.0, 2.0])
    assert no_graphs.budget_candidates(5, 4).tolist() == [0, 1, 2, 3, 4]


def test_json_round_trip_preserves_everything(tmp_path):
    prov = make_provenance(model="tiny-qwen3", dtype="bfloat16", device_name="cpu",
                           num_speculative_tokens=7, graph_sizes=[1, 2, 4])
    assert prov["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert prov["date"] and prov["num_speculative_tokens"] == 7
    cm = CostModel.from_measurements([1, 2, 4, 64], [1.0, 1.5, 2.0, 8.0], [1, 16], [0.3, 0.9],
                                     fixed_ms=0.25, provenance=prov, graph_sizes=[1, 2, 4])
    path = tmp_path / "cost.json"
    cm.to_json(path)
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 1 and raw["provenance"]["model"] == "tiny-qwen3"
    back = CostModel.from_json(path)
    assert back.provenance == prov
    assert back.graph_sizes == (1, 2, 4)
    assert back.fixed_overhead_ms == 0.25
    n = np.arange(0, 100)
    np.testing.assert_array_equal(back.step_time_ms(n, 7), cm.step_time_ms(n, 7))
    assert back.provenance_mismatches({"model": "tiny-qwen3"}) == []
    assert len(back.provenance_mismatches({"model": "other", "dtype": "bfloat16"})) == 1
    raw["schema_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="schema_version"):
        CostModel.from_json(path)


def test_flat_table_detected_and_described():
    flat = CostModel.from_measurements([1, 64, 512], [30.0, 30.05, 30.1], fixed_ms=1.0)
    assert flat.is_flat()
    assert "flat" in flat.describe_problem()
    single = CostModel.from_measurements([8], [3.0])
    assert single.is_flat() and "single" in single.describe_problem()
    empty = CostModel.from_measurements([], [])
    assert "no verify" in empty.describe_problem()
    steep = CostModel.from_measurements([1, 512, 2048], [30.0, 30.0, 69.0])
    assert not steep.is_flat() and steep.describe_problem() is None


def test_analytic_roofline_and_tensor_table():
    cm = CostModel.analytic(weight_read_ms=4.0, ms_per_token=0.01, fixed_overhead_ms=1.0,
                            draft_base_ms=0.5, draft_ms_per_req=0.0)
    # Memory-bound (flat) below the knee at 400 tokens, compute-bound above.
    np.testing.assert_allclose(cm.verify_cost_ms([1, 200, 400, 1000, 4000]),
                               [4.0, 4.0, 4.0, 10.0, 40.0], rtol=1e-9)
    assert cm.describe_problem() is None
    table = cm.as_tensor_table(1000, 8)
    assert table.shape == (1001,) and table.dtype == torch.float32
    np.testing.assert_allclose(table.numpy(), cm.step_time_ms(np.arange(1001), 8), rtol=1e-6)


def test_validation_errors():
    with pytest.raises(ValueError):
        CostModel.from_measurements([1, 2], [1.0])
    with pytest.raises(ValueError):
        CostModel.from_measurements([1, 2], [1.0, float("nan")])
    with pytest.raises(ValueError):
        CostModel.from_measurements([1, 2], [1.0, 2.0], fixed_ms=-1.0)


def test_median_of_repeats_calls_and_times():
    calls = []
    ms = median_of_repeats(lambda: calls.append(sum(range(1000))), repeats=5, warmup=2,
                           sync=False)
    assert len(calls) == 7
    assert 0.0 < ms < 1000.0
    with pytest.raises(ValueError):
        median_of_repeats(lambda: None, repeats=0)


@pytest.mark.parametrize("graphs", [None, (1, 8, 64, 512)])
def test_lookup_tables_equal_the_interpolation_bit_for_bit(graphs):
    """The planner's dense host tables give exactly step_time_ms / verify_cost_ms (also past
    the profiled range, with graph buckets, and after the fixed term is corrected online)."""
    rng = np.random.default_rng(3)
    tokens = np.unique(rng.integers(1, 3000, 12))
    cost = CostModel.from_measurements(tokens, np.sort(rng.uniform(1, 30, tokens.size)),
                                       [1, 16, 256], [0.5, 0.9, 3.0], fixed_ms=0.7,
                                       graph_sizes=graphs)  # fmt: skip
    n = np.concatenate([np.arange(0, 70), rng.integers(0, 6000, 300)])
    for reqs in (1, 7, 300):
        assert np.array_equal(cost.step_time_lookup(n, reqs), cost.step_time_ms(n, reqs))
    cost.fixed_overhead_ms = 2.5
    assert np.array_equal(cost.step_time_lookup(n, 7), cost.step_time_ms(n, 7))
    for t in (0, 1, 63, 2999, 5000):
        assert cost.verify_lookup(t) == float(cost.verify_cost_ms(t))


def test_budget_candidates_are_exactly_the_bucket_filling_budgets():
    """Every n in [0, max] whose total fills a captured bucket, every n past the captured
    range, and max itself — checked against a brute-force filter."""
    cost = CostModel.analytic(graph_sizes=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128))
    sizes = set(cost.graph_sizes)
    for fixed in (0, 3, 17, 64, 127, 128, 200):
        for max_budget in (0, 1, 5, 40, 111, 300):
            want = [n for n in range(max_budget + 1)
                    if fixed + n in sizes or fixed + n > 128 or n == max_budget]
            got = cost.budget_candidates(fixed, max_budget)
            assert got.tolist() == want, (fixed, max_budget)
    assert CostModel.analytic().budget_candidates(5, 7).tolist() == list(range(8))


def test_greedy_drafter_table_prices_all_greedy_steps(tmp_path):
    """Greedy drafts (argmax only) cost less than sampled ones; the planner prices the drafter
    it will run. A table without greedy times prices both alike; JSON keeps the table."""
    cm = CostModel.from_measurements([1, 64], [1.0, 3.0], [1, 64], [0.5, 8.0],
                                     draft_greedy_times_ms=[0.4, 4.0])  # fmt: skip
    n = np.array([32, 64])
    sampled = cm.step_time_lookup(n, 64).copy()
    assert cm.draft_lookup(64) == 8.0 and not cm.greedy_drafts
    assert cm.use_greedy_drafts(True) and not cm.use_greedy_drafts(True)  # changed once
    assert cm.draft_lookup(64) == 4.0 and cm.draft_cost_ms(32) == pytest.approx(0.4 + 3.6 * 31 / 63)
    np.testing.assert_allclose(cm.step_time_lookup(n, 64), sampled - 4.0)
    path = tmp_path / "cost.json"
    cm.to_json(path)
    back = CostModel.from_json(path)
    back.use_greedy_drafts(True)
    assert back.draft_lookup(64) == 4.0
    old = CostModel.from_measurements([1, 64], [1.0, 3.0], [1, 64], [0.5, 8.0])
    assert not old.use_greedy_drafts(True) and old.draft_lookup(64) == 8.0  # nothing changed
    with pytest.raises(ValueError, match="greedy times"):
        CostModel.from_measurements([1], [1.0], [1, 64], [0.5, 8.0], draft_greedy_times_ms=[0.4])
