"""The drafting decision's survival estimate is corrected position by position: a drafter's
confidences can be off by a different factor at each position (H100, trained pair, T = 0:
the estimate fell from 0.84 at position 1 to 0.18 at position 3 where 0.80 and 0.33 were
accepted), which one ratio over all positions cannot correct."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.spec.drafting import DraftingDecision
from dspark.spec.rates import PositionRatios

TRUE_SURVIVAL = np.array([0.9, 0.81, 0.729, 0.6561])  # conditional acceptance 0.9 throughout
CONFIDENCE = 0.7  # what the confidences say at every position (too steep a survival)


def _rows_accepting(survival: np.ndarray, rows: int) -> np.ndarray:
    """Accepted drafts per row, laid out so that exactly survival[j] of the rows accept more
    than j drafts (no sampling noise)."""
    at_least = np.round(np.concatenate([[1.0], survival]) * rows).astype(int)
    counts = at_least - np.append(at_least[1:], 0)  # rows accepting exactly 0..K
    return np.repeat(np.arange(survival.size + 1), counts)


def _observe(d: DraftingDecision, steps: int, rows: int = 1000, lengths: int = 4) -> None:
    accepted = _rows_accepting(TRUE_SURVIVAL, rows)
    stale = np.full((rows, 4), CONFIDENCE)
    for _ in range(steps):
        prediction = d.survey(np.arange(rows), stale, True)
        verified = [lengths] * rows
        emitted = [[7] * (1 + min(a, lengths)) for a in accepted]
        d.check_prediction(prediction, emitted, verified)


def test_the_estimate_follows_the_accepted_drafts_at_each_position():
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    _observe(d, steps=20)
    # one ratio (1.75 here) would give [1.0, 0.86, 0.60, 0.42]: too high first, too low last
    assert d.acceptance_ratio(True) == pytest.approx(TRUE_SURVIVAL.sum() / 1.7731, rel=1e-3)
    np.testing.assert_allclose(d.estimate(True), TRUE_SURVIVAL, rtol=1e-3)


def test_positions_never_verified_take_the_ratio_of_all_positions():
    """Trimmed to 2 drafts a row: positions 3 and 4 are never verified, so nothing says how
    far their confidences are off; they are scaled by the ratio over the verified positions
    (and the estimate stays non-increasing)."""
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    _observe(d, steps=20, lengths=2)
    ratio = d.acceptance_ratio(True)  # (0.9 + 0.81) / (0.7 + 0.49)
    assert ratio == pytest.approx(1.71 / 1.19, rel=1e-3)
    est = d.estimate(True)
    np.testing.assert_allclose(est[:2], TRUE_SURVIVAL[:2], rtol=1e-3)
    np.testing.assert_allclose(est[2:], [0.343 * ratio, 0.2401 * ratio], rtol=1e-3)


def test_a_position_with_too_little_predicted_takes_the_overall_ratio():
    """The per-position ratio needs predicted drafts of its own (PositionRatios.MIN_PREDICTED)
    and stays within its bounds."""
    r = PositionRatios(k=3, decay=0.9)
    predicted = np.array([[0.0, 0.5, 0.51, 0.511]] * 4)  # positions 2, 3 predict ~0.01 a row
    r.observe(np.array([1, 1, 2, 3]), np.array([3, 3, 3, 3]), predicted)
    ratios = r.ratios(fallback=1.5, bounds=(0.25, 4.0))
    assert ratios[0] == pytest.approx(4 / 2.0)  # 4 accepted at position 1 of 2.0 predicted
    assert ratios[1:] == [1.5, 1.5]  # (0.04 and 0.004 predicted: the fallback)
    r.observe(np.array([0, 0, 0, 0]), np.array([3, 3, 3, 3]), predicted * 100)  # 0 of 200
    assert r.ratios(fallback=1.0, bounds=(0.25, 4.0))[0] == 0.25  # (bounded below)


def test_the_tally_pairs_what_was_accepted_with_what_the_decision_priced():
    """DraftingDecision.record.tally (undecayed, for reports): per checked row, the drafts accepted
    at the lengths verified against the confidences' raw prediction and the decision's
    estimate as it stood when the step was decided (before the step's own outcome moved the
    ratios), so a run shows whether the survival it priced tracked what was accepted."""
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    _observe(d, steps=3)  # the ratios measured: the estimate is scaled
    before = dict(d.record.tally)
    rows, lengths = 1000, 3  # this step's rows accept fewer drafts than the earlier ones
    accepted = np.minimum(_rows_accepting(TRUE_SURVIVAL**2, rows), lengths)
    prediction = d.survey(np.arange(rows), np.full((rows, 4), CONFIDENCE), True)
    priced = np.cumsum(d.estimate(True))  # (the survey folded the rows in)
    d.check_prediction(prediction, [[7] * (1 + a) for a in accepted], [lengths] * rows)
    delta = {k: d.record.tally[k] - before[k] for k in before}
    assert delta["rows"] == rows
    assert delta["accepted"] == accepted.sum()
    assert delta["raw"] == pytest.approx(rows * (0.7 + 0.49 + 0.343))
    assert delta["estimated"] == pytest.approx(rows * priced[lengths - 1])
    assert not np.allclose(np.cumsum(d.estimate(True)), priced)  # (the step moved it after)
