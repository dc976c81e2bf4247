"""The paper's Appendix A counterexample as a statistical test.

One request (R=1), K=2 drafts, vocabulary {A, B}. Token 1: target p_t = (0.7, 0.3), draft
p_d = (0.5, 0.5). Conditional confidences: c1 = 0.8, and c2 = 0.9 if the first draft is A else
0.0 (the second slot's confidence depends on the first drawn token, as through the Markov head).
Throughput Theta = tau * SPS(B) with SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45.

Verification is standard rejection sampling. If the verify length depends on the first draft
token through c2 (a global argmax over the *current* confidences), the law of the first emitted
token becomes (0.85, 0.15). The allowed policies (Algorithm 1 with early stop, a budget from an
earlier step's confidences + top-B over current survivals, a static threshold) keep (0.7, 0.3).
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.spec.budget_search import plan_budget_lagged
from dspark.spec.cost_model import CostModel
from dspark.spec.planner import allocate_top_b, early_stop_lengths, threshold_lengths

A, B = 0, 1
P_T = np.array([0.7, 0.3])
P_D = np.array([0.5, 0.5])
C1 = 0.8
SPS = {1: 1.0, 2: 0.5, 3: 0.45}
COST = CostModel.from_measurements([1, 2, 3], [1 / SPS[1], 1 / SPS[2], 1 / SPS[3]])
CAPS = torch.tensor([2])
N = 400_000


def conf_row(x1: int) -> np.ndarray:
    return np.array([C1, 0.9 if x1 == A else 0.0])


def first_emitted_token(x1, lengths, rng):
    """Standard rejection sampling of the first position, vectorized over samples.

    l = 0: the first token is the bonus token drawn from p_t. l >= 1: accept x1 with
    min(1, p_t(x1) / p_d(x1)); on rejection draw from norm(max(p_t - p_d, 0)).
    (Later slots cannot change the first emitted token.)"""
    n = x1.size
    u_acc, u_res, u_bonus = rng.random(n), rng.random(n), rng.random(n)
    bonus = (u_bonus >= P_T[A]).astype(np.int64)
    accept = u_acc < np.minimum(1.0, P_T[x1] / P_D[x1])
    residual = np.maximum(P_T - P_D, 0.0)
    residual = residual / residual.sum()
    resampled = (u_res >= residual[A]).astype(np.int64)
    verified = np.where(accept, x1, resampled)
    return np.where(lengths == 0, bonus, verified)


def chi2_pvalue(tokens) -> float:
    counts = np.bincount(tokens, minlength=2)
    return float(chisquare(counts, N * P_T).pvalue)


def forbidden_global_argmax(x1):
    """Global argmax of Theta over all plans l in {0,1,2} using the *current* confidences."""
    def best_len(x):
        a = np.cumprod(conf_row(x))
        theta = [(1 + a[:l].sum()) * SPS[1 + l] for l in range(3)]
        return int(np.argmax(theta))

    lengths_of = np.array([best_len(A), best_len(B)])
    return lengths_of[x1]


@pytest.fixture
def draws():
    rng = np.random.default_rng(1234)
    x1 = (rng.random(N) >= P_D[A]).astype(np.int64)  # first draft ~ p_d
    return x1, rng


def test_forbidden_policy_is_biased(draws):
    # The test of the test: the harness must detect the Appendix A bias.
    x1, rng = draws
    lengths = forbidden_global_argmax(x1)
    assert set(np.unique(lengths).tolist()) == {0, 2}  # l = 2 iff x1 = A
    tokens = first_emitted_token(x1, lengths, rng)
    freq_a = np.mean(tokens == A)
    assert freq_a == pytest.approx(0.85, abs=0.005)
    assert chi2_pvalue(tokens) < 1e-12


def test_lagged_planner_fed_current_confidences_is_biased(draws):
    # Misusing the lagged planner with *current* (lag-0) confidences is exactly the forbidden
    # global search: the budget must come from an earlier step.
    x1, rng = draws
    budgets = {x: plan_budget_lagged(conf_row(x)[None], CAPS.numpy(), 0, 1, COST,
                                     min_predicted_gain=0.0).budget for x in (A, B)}
    assert budgets == {A: 2, B: 0}
    lengths = np.array([budgets[A], budgets[B]])[x1]
    assert chi2_pvalue(first_emitted_token(x1, lengths, rng)) < 1e-12


def test_early_stop_is_lossless(draws):
    x1, rng = draws
    table = COST.as_tensor_table(3, 1, dtype=torch.float64)
    per_x1 = np.array([
        int(early_stop_lengths(torch.as_tensor(conf_row(x)[None]), CAPS, 0, 1, table)[0])
        for x in (A, B)])
    # Algorithm 1 stops at Theta1 = 0.9 < Theta0 = 1.0 before looking at c2.
    assert per_x1.tolist() == [0, 0]
    tokens = first_emitted_token(x1, per_x1[x1], rng)
    assert chi2_pvalue(tokens) > 1e-3


def test_lagged_budget_then_current_top_b_is_lossless(draws):
    x1, rng = draws
    # The budget comes from an earlier step's block (an independent first draft x1_stale);
    # the allocation ranks the *current* survivals.
    x1_stale = (rng.random(N) >= P_D[A]).astype(np.int64)
    lengths_of = np.zeros((2, 2), dtype=np.int64)  # [x1_stale, x1]
    for xs in (A, B):
        d = plan_budget_lagged(conf_row(xs)[None], CAPS.numpy(), 0, 1, COST,
                               min_predicted_gain=0.0)
        for x in (A, B):
            cur = torch.as_tensor(conf_row(x)[None])
            lengths_of[xs, x] = int(allocate_top_b(cur, CAPS, torch.tensor(d.budget))[0])
    assert lengths_of.tolist() == [[2, 2], [0, 0]]  # depends on the stale draft only
    lengths = lengths_of[x1_stale, x1]
    assert 0.45 < np.mean(lengths == 2) < 0.55  # the policy really trims half the time
    tokens = first_emitted_token(x1, lengths, rng)
    assert chi2_pvalue(tokens) > 1e-3


def test_threshold_is_lossless(draws):
    x1, rng = draws
    per_x1 = np.array([int(threshold_lengths(torch.as_tensor(conf_row(x)[None]), CAPS, 0.5)[0])
                       for x in (A, B)])
    # x1 is always verified (c1 = 0.8); only x2's admission depends on x1.
    assert per_x1.tolist() == [2, 1]
    tokens = first_emitted_token(x1, per_x1[x1], rng)
    assert chi2_pvalue(tokens) > 1e-3
