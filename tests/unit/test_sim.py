import numpy as np
import pytest

from dspark.spec.cost_model import CostModel
from dspark.spec.planner import Planner
from dspark.spec.sim import TraceStep, load_trace, save_trace, simulate, synthetic_trace

RATES = [0.9, 0.75, 0.6, 0.5, 0.4, 0.3]


@pytest.fixture(scope="module")
def trace():
    return synthetic_trace(120, 32, 6, RATES, seed=0, churn=0.05)


def expensive_verify():
    # Compute-bound already at small batches: every verified token costs 0.2 ms.
    return CostModel.from_measurements([1, 4096], [0.2, 0.2 * 4096], fixed_ms=2.0)


def cheap_verify():
    # Launch-bound: a 30 ms forward, more tokens almost free (not flat: 8% more at 512).
    return CostModel.from_measurements([1, 512, 4096], [30.0, 32.5, 60.0], fixed_ms=1.0)


def test_expensive_verification_trims_and_wins(trace):
    cost = expensive_verify()
    fixed = simulate(trace, "fixed", cost)
    lagged = simulate(trace, "lagged", cost)
    early = simulate(trace, "early_stop", cost)
    assert fixed.verified == fixed.drafted and fixed.trim_fraction == 0.0
    assert lagged.verified < 0.8 * lagged.drafted
    assert lagged.predicted_throughput > 1.1 * fixed.predicted_throughput
    assert lagged.throughput > 1.1 * fixed.throughput  # realised outcomes agree
    assert early.throughput > 1.1 * fixed.throughput
    # Calibrated trace: predicted and realised tokens agree closely.
    assert lagged.predicted_tokens == pytest.approx(lagged.emitted_tokens, rel=0.03)
    # Bookkeeping: tokens = accepted drafts + one per request per step.
    assert lagged.emitted_tokens == lagged.accepted_drafts + lagged.num_req_steps
    assert lagged.mean_verified_per_req < 6 and lagged.mean_accepted_per_req > 0


def test_cheap_verification_verifies_everything(trace):
    cost = cheap_verify()
    assert cost.describe_problem() is None
    fixed = simulate(trace, "fixed", cost)
    lagged = simulate(trace, "lagged", cost)
    assert lagged.verified == lagged.drafted
    assert lagged.throughput == pytest.approx(fixed.throughput)
    # Algorithm 1 has no gain guard: it only drops slots whose survival is ~0.
    assert simulate(trace, "early_stop", cost).verified > 0.8 * fixed.drafted


def test_lag_uses_earlier_confidences():
    # Step 0 is confident, step 1 is hopeless: with lag 1, step 1 plans from step 0's
    # confidences (budget = all) while its current survivals are ~0; with lag 0 it trims.
    cost = expensive_verify()
    ids = [0, 1, 2, 3]
    good = TraceStep(conf=np.full((4, 3), 0.99), accept_len=np.full(4, 3), request_ids=ids)
    bad = TraceStep(conf=np.full((4, 3), 0.01), accept_len=np.zeros(4), request_ids=ids)
    lag1 = simulate([good, bad], "lagged", cost, lag=1)
    lag0 = simulate([good, bad], "lagged", cost, lag=0)
    assert lag1.step_verified.tolist() == [12, 12]
    assert lag0.step_verified.tolist() == [12, 0]
    # Request ids align stale rows: a brand-new request has no history and takes the known
    # rows' mean survivals (the planner's population prior), not the survivals of the
    # request that held its row before. Here request 0 was confident and the others were not.
    mixed = TraceStep(conf=np.array([[0.99] * 3] + [[0.01] * 3] * 3), accept_len=np.zeros(4),
                      request_ids=ids)
    newcomer = TraceStep(conf=np.full((4, 3), 0.01), accept_len=np.zeros(4),
                         request_ids=[9, 1, 2, 3])
    res = simulate([mixed, newcomer], "lagged", cost, lag=1, prior_conf=1.0)
    assert res.step_verified[1] == 0  # by row, the newcomer had request 0's 0.99s: 3 drafts
    kept = TraceStep(conf=np.full((4, 3), 0.01), accept_len=np.zeros(4),
                     request_ids=[3, 2, 9, 0])  # request 0 kept, on another row
    res = simulate([mixed, kept], "lagged", cost, lag=1, prior_conf=1.0)
    assert res.step_verified[1] >= 3


def test_threshold_and_planner_instance(trace):
    cost = expensive_verify()
    thr = simulate(trace, Planner("threshold", threshold=0.7), cost)
    direct = sum(int(np.cumprod(s.conf >= 0.7, axis=1).sum()) for s in trace)
    assert thr.verified == direct and thr.policy == "threshold"


def test_trace_round_trip(tmp_path):
    trace = synthetic_trace(5, 3, 4, 0.7, seed=3)
    trace[1].num_other_tokens = 17
    path = tmp_path / "trace.jsonl"
    save_trace(path, trace)
    with open(path, "a") as f:
        f.write('{"meta": {"note": "ignored"}}\n')
    back = load_trace(path)
    assert len(back) == 5 and back[1].num_other_tokens == 17
    for a, b in zip(trace, back, strict=True):
        np.testing.assert_allclose(a.conf, b.conf)
        np.testing.assert_array_equal(a.accept_len, b.accept_len)
        np.testing.assert_array_equal(a.accept_bits, b.accept_bits)
        np.testing.assert_array_equal(a.request_ids, b.request_ids)
    cost = expensive_verify()
    assert simulate(back, "lagged", cost).emitted_tokens == simulate(
        trace, "lagged", cost).emitted_tokens


def test_synthetic_trace_statistics():
    trace = synthetic_trace(200, 64, 3, [0.8, 0.5, 0.2], seed=5, request_spread=0.0,
                            step_noise=0.0)
    bits = np.concatenate([s.accept_bits for s in trace])
    np.testing.assert_allclose(bits.mean(axis=0), [0.8, 0.5, 0.2], atol=0.02)
    lens = np.concatenate([s.accept_len for s in trace])
    assert np.mean(lens) == pytest.approx(0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.2, abs=0.03)
    with pytest.raises(ValueError):
        TraceStep(conf=np.ones((2, 2)))


def test_steps_with_prefill_plan_at_the_decoding_rate():
    """The replay plans a step that carries prefill tokens as the engine does: drafts valued at
    the rate decoding would earn (the step's own tokens/ms would verify every draft)."""
    cost = CostModel.from_measurements([1, 10_000], [10.02, 210.0])  # 10 ms + 0.02 ms/token
    conf = np.tile([0.9, 0.5, 0.3, 0.2], (8, 1))  # survivals 0.9, 0.45, 0.135, 0.027
    steps = [TraceStep(conf=conf, accept_len=np.full(8, 2), request_ids=np.arange(8),
                       num_other_tokens=other) for other in (0, 0, 4000, 4000)]  # fmt: skip
    res = simulate(steps, "lagged", cost, lag=1, snap_to_graphs=False, min_predicted_gain=0.0)
    # decode steps run at ~1.87 tokens/ms, so a draft's 0.02 ms is worth 0.037 tokens: the
    # 0.027 slots go, on the step's ratio (decode steps) as on the decoding rate (prefill);
    # step 0 has no stale confidences yet (prior 1.0: verify all)
    assert list(res.step_verified) == [32, 24, 24, 24]
    # on the step's own ratio (the objective before) a 4000-token step verified everything
    p = Planner("lagged", cost, min_predicted_gain=0.0)
    assert p.plan_cpu(conf, np.full(8, 4), 4000, 8) == 32
