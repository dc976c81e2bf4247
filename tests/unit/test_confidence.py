import json

import numpy as np
import pytest
import torch

from dspark.spec.confidence import (
    OnlineAcceptanceEstimator,
    apply_sts,
    auc,
    ece,
    features_from_draft_logits,
    features_from_draft_probs,
    fit_sts,
    load_sts,
    prefix_labels,
    save_sts,
)

K = 4
TRUE_T = np.array([2.5, 1.8, 3.0, 1.4])  # overconfidence factor of the head per position


def overconfident_blocks(n, seed, censor=True):
    """Head logits are sharper than the truth: head = true_logit * TRUE_T. Verification
    lengths depend on the head logits only (like a real non-anticipating policy)."""
    rng = np.random.default_rng(seed)
    true_logit = rng.normal([1.5, 0.8, 0.5, 0.2], 1.2, (n, K))
    head = true_logit * TRUE_T
    bits = rng.random((n, K)) < 1 / (1 + np.exp(-true_logit))
    full_len = np.cumprod(bits, axis=1).sum(axis=1)
    if censor:
        ok = (head > -2.0) | (rng.random((n, K)) < 0.5)
        verified = np.cumprod(ok, axis=1).sum(axis=1)
    else:
        verified = np.full(n, K)
    return head, np.minimum(full_len, verified), verified


def cumulative_ece(logits, temps, accepted, verified):
    surv = np.cumprod(apply_sts(logits, temps), axis=1)
    y, observed = prefix_labels(accepted, verified, K)
    return np.array([ece(surv[:, j], y[:, j], mask=observed[:, j]) for j in range(K)])


def test_metrics_against_hand_and_pairwise_values():
    assert ece([0.1, 0.1, 0.9, 0.9], [0, 1, 1, 1]) == pytest.approx((0.4 + 0.1) / 2)
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5
    assert np.isnan(auc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(0)
    s, y = np.round(rng.random(300), 1), rng.random(300) < 0.4
    pairs = (s[y][:, None] > s[~y][None, :]) + 0.5 * (s[y][:, None] == s[~y][None, :])
    assert auc(s, y) == pytest.approx(pairs.mean())


def test_sts_reduces_ece_and_preserves_ranking():
    logits, acc, ver = overconfident_blocks(30_000, seed=1)
    temps = fit_sts(logits, acc, ver)
    # Early positions are well identified; later ones absorb earlier errors (the target is
    # the cumulative product), so only ask them to detect the overconfidence.
    assert np.all(np.abs(np.log(np.array(temps[:3]) / TRUE_T[:3])) < 0.1), temps
    assert min(temps) > 1.2, temps
    h_logits, h_acc, h_ver = overconfident_blocks(30_000, seed=2)  # held out
    before = cumulative_ece(h_logits, [1.0] * K, h_acc, h_ver)
    after = cumulative_ece(h_logits, temps, h_acc, h_ver)
    assert np.all(after < 0.5 * before), (before, after)
    assert after.mean() < 0.02
    # Order-preserving per position: each slot's conditional AUC is unchanged.
    y, observed = prefix_labels(h_acc, h_ver, K)
    raw, cal = apply_sts(h_logits, [1.0] * K), apply_sts(h_logits, temps)
    for j in range(K):
        m = observed[:, j] & (j <= h_acc)  # slot j reached: its conditional outcome is known
        assert auc(cal[:, j], y[:, j], m) == pytest.approx(auc(raw[:, j], y[:, j], m))
        sa, sb = np.cumprod(raw, axis=1)[:, j], np.cumprod(cal, axis=1)[:, j]
        assert auc(sb, y[:, j], observed[:, j]) > auc(sa, y[:, j], observed[:, j]) - 0.01


def test_sts_censor_aware_labels():
    y, observed = prefix_labels([0, 2, 1], [2, 2, 1], 3)
    assert y.tolist() == [[False] * 3, [True, True, False], [True, False, False]]
    # Only verified slots are observed, even after an early rejection.
    assert observed.tolist() == [[True, True, False], [True, True, False],
                                 [True, False, False]]
    # Unverified positions cannot inform their temperature: it stays at 1.
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (500, 3))
    acc = rng.integers(0, 2, 500)
    assert fit_sts(logits, acc, np.ones(500, dtype=int))[1:] == [1.0, 1.0]


def test_apply_sts_torch_numpy_and_json(tmp_path):
    logits = np.array([[2.0, -1.0, 0.5], [0.0, 4.0, -3.0]])
    temps = [2.0, 0.5, 1.0, 7.0]  # longer than K: the first K are used
    want = 1 / (1 + np.exp(-logits / np.array(temps[:3])))
    np.testing.assert_allclose(apply_sts(logits, temps), want)
    got = apply_sts(torch.tensor(logits, dtype=torch.float32), temps)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    with pytest.raises(ValueError):
        apply_sts(logits, [1.0, 1.0])
    path = tmp_path / "sts.json"
    save_sts(path, temps, {"model": "tiny-drafter"})
    back, prov = load_sts(path)
    assert back == temps and prov["model"] == "tiny-drafter" and "date" in prov
    (tmp_path / "sglang.json").write_text(json.dumps({"temperatures": [1.5, 2.0]}))
    assert load_sts(tmp_path / "sglang.json")[0] == [1.5, 2.0]
    (tmp_path / "bad.json").write_text(json.dumps({"sts_temperatures": [1.0, -2.0]}))
    with pytest.raises(ValueError):
        load_sts(tmp_path / "bad.json")


def test_sts_file_with_a_fit_per_sampling_mode(tmp_path):
    from dspark.spec.confidence import load_sts_by_mode

    path = tmp_path / "sts.json"
    save_sts(path, [1.0, 2.0], {"model": "m"}, {"greedy": [0.5, 0.7], "sampled": [1.5, 3.0]})
    temps, modes, prov = load_sts_by_mode(path)
    assert temps == [1.0, 2.0] and prov["model"] == "m"
    assert modes == {"greedy": [0.5, 0.7], "sampled": [1.5, 3.0]}
    assert load_sts(path)[0] == [1.0, 2.0]  # readers of one list keep working
    save_sts(path, [1.0, 2.0])
    assert load_sts_by_mode(path)[1] == {}
    for bad in ({"hot": [1.0]}, {"greedy": [0.0]}, ["greedy"]):
        (tmp_path / "bad.json").write_text(json.dumps({"sts_temperatures": [1.0],
                                                       "sts_temperatures_by_mode": bad}))
        with pytest.raises(ValueError, match="sts_temperatures_by_mode"):
            load_sts_by_mode(tmp_path / "bad.json")


def test_features():
    p = torch.tensor([[0.5, 0.9, 1.0, 0.0]])
    x = features_from_draft_probs(p)
    assert x[0, 0] == pytest.approx(0.0, abs=1e-6)
    assert x[0, 1] == pytest.approx(np.log(9.0), rel=1e-5)
    assert torch.isfinite(x).all() and x[0, 2] > 10 and x[0, 3] < -10
    logits = torch.randn(3, 2, 11, generator=torch.Generator().manual_seed(0)) * 3
    via_probs = features_from_draft_probs(torch.softmax(logits, -1).amax(-1))
    torch.testing.assert_close(features_from_draft_logits(logits), via_probs, atol=1e-4,
                               rtol=1e-4)


def test_online_estimator_censoring_bookkeeping():
    est = OnlineAcceptanceEstimator(3)
    x = torch.tensor([[0.0, 1.0, 2.0], [0.5, -1.0, 3.0], [1.0, 1.0, 1.0]])
    verified = torch.tensor([1, 3, 0])
    accepted = torch.tensor([1, 1, 0])
    est.observe(x, verified, accepted)
    n, g_b = est.stats[0], est.stats[1]
    # Row 0: slot 0 verified+accepted (label 1); slots 1-2 trimmed -> never counted.
    # Row 1: slot 0 accepted, slot 1 rejected (label 0), slot 2 after rejection -> uncounted.
    # Row 2: nothing verified.
    assert n.tolist() == [2.0, 1.0, 0.0]
    p = est.predict(x).double()
    want = [(1 - p[0, 0]) + (1 - p[1, 0]), (0 - p[1, 1]), 0.0]
    torch.testing.assert_close(g_b, torch.tensor(want, dtype=torch.float64))
    # Cold start: sigmoid(0.5 x - 0.2).
    torch.testing.assert_close(est.predict(x), torch.sigmoid(0.5 * x - 0.2))
    assert not est.maybe_refit(every=2)
    est.observe(x, verified, accepted)
    assert est.maybe_refit(every=2) and est.num_refits == 1
    assert torch.count_nonzero(est.stats) == 0  # window reset


def test_online_estimator_converges_on_censored_data():
    true_w, true_b = 0.8, np.array([1.2, 0.4, -0.3, -1.0])
    gen = torch.Generator().manual_seed(0)
    est = OnlineAcceptanceEstimator(K)
    for _ in range(800):
        x = 1.0 + 1.5 * torch.randn(128, K, generator=gen)
        q = torch.sigmoid(true_w * x + torch.tensor(true_b, dtype=torch.float32))
        bits = torch.rand(128, K, generator=gen) < q
        full_len = torch.cumprod(bits.long(), 1).sum(1)
        # Verification depends on the features (leading run of x > 0, or a coin): heavy,
        # feature-dependent trimming, like a real policy.
        ok = (x > 0.0) | (torch.rand(128, K, generator=gen) < 0.3)
        verified = torch.cumprod(ok.long(), 1).sum(1)
        accepted = torch.minimum(full_len, verified)
        est.observe(x, verified, accepted)
        est.maybe_refit(every=50)
    w, b = est.coefficients()
    assert est.num_refits == 16
    assert w == pytest.approx(true_w, abs=0.08)
    np.testing.assert_allclose(b, true_b, atol=0.15)


def test_apply_sts_takes_device_tensor_temperatures():
    import torch

    from dspark.spec.confidence import apply_sts

    logits = torch.randn(5, 4)
    temps = [1.5, 0.8, 1.2, 2.0, 3.0]
    want = apply_sts(logits, temps)
    torch.testing.assert_close(apply_sts(logits, torch.tensor(temps)), want)
    torch.testing.assert_close(want, torch.sigmoid(logits / torch.tensor(temps[:4])))
    # one row of temperatures per logits row (each row's sampling mode's)
    per_row = torch.tensor([temps, [t * 2 for t in temps]])[torch.tensor([0, 1, 1, 0, 1])]
    torch.testing.assert_close(apply_sts(logits, per_row),
                               torch.sigmoid(logits / per_row[:, :4]))  # fmt: skip
    with pytest.raises(ValueError):
        apply_sts(logits, per_row[:, :3])
