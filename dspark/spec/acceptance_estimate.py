"""What drafting would earn, as the drafting decision estimates it (DraftingDecision's
mixin; drafting.py's module doc): the survival estimate of its decision steps' stale
confidences, per sampling mode, and the acceptance ratios (drafts accepted against those the
same confidences predicted, over all positions and position by position) that scale it."""

from __future__ import annotations

import math

import numpy as np

from dspark.spec.rates import predicted_accepted, prefix_survival

_ACCEPT_DECAY = 0.9  # per observed decision step of _ACCEPT_DECAY_ROWS checked rows or more:
# the acceptance ratio's memory; a step of fewer rows decays the sums by the fraction of a
# step its rows are (_ACCEPT_DECAY ** (rows / _ACCEPT_DECAY_ROWS)), so the memory always spans
# ~10 steps and ~80 rows at least. Ten steps of one request were ~19 rows' worth of evidence
# on a quantity whose per-row spread at T = 1 is larger than its mean (0-7 drafts accepted),
# and the ratio wandered to 0.52 where fixed K's rows showed ~1.0: drafting turned off where
# fixed K beat no speculation by 5% (H100, trained pair, T = 1, c = 1; fifty-seventh session)
_ACCEPT_DECAY_ROWS = 8
_ACCEPT_MIN_PREDICTED = 8.0  # predicted accepted drafts (decayed) before the ratio is used,
# or this many observed decision steps: the decayed sum never exceeds ~80 rows' prediction
# (10 steps' at 8 rows or more), which at one request of very low survival stays under 8
# (with the memory of 10 steps of any size, 0.78 drafts predicted a step never reached it:
# demo pair, H200, c = 1, 1.13 accepted, and the ratio stayed at 1 while the decision turned
# drafting off on the underestimate where fixed K beat no speculation by 7%)
_ACCEPT_MIN_STEPS = 16
_ACCEPT_RATIO_BOUNDS = (0.5, 2.0)
_POSITION_RATIO_BOUNDS = (0.25, 4.0)  # ... and a position's own (rates.PositionRatios), which
# corrects the shape of the survival curve: far positions' confidences were off by up to ~3x
# where the first position's were by ~1.35x (H100, trained pair, T = 0)


def step_decay(rows: int) -> float:
    """How much a step of `rows` checked rows decays the acceptance sums (_ACCEPT_DECAY_ROWS)."""
    if rows >= _ACCEPT_DECAY_ROWS:
        return _ACCEPT_DECAY
    return _ACCEPT_DECAY ** (rows / _ACCEPT_DECAY_ROWS)


class AcceptanceEstimate:
    """Mixin of DraftingDecision: the survival estimate and the acceptance ratios. The
    attributes are DraftingDecision's (set in its __init__)."""

    k: int
    survival: np.ndarray | None
    _survival: dict
    _accepted: dict
    _accept_steps: dict
    _by_position: dict
    updates: int
    record: object

    def update_survival(self, stale: np.ndarray, greedy: bool = True) -> np.ndarray:
        """Fold the rows with drafts' stale confidences into the sampling mode's survival
        estimate (EMA over decision steps; unknown confidences count as 1). Returns the rows'
        prefix survivals (what `predicted_accepted` sums)."""
        rows = prefix_survival(stale)
        if rows.size:
            self.updates += 1
            survival = np.add.reduce(rows, axis=0)  # (the mean without np.mean's wrapper)
            survival *= 1.0 / rows.shape[0]
            prev = self._survival.get(greedy)
            if prev is not None:
                survival *= 0.2
                survival += 0.8 * prev
            self.survival = survival
            self._survival[greedy] = self.survival
        return rows

    def survey(self, rows: np.ndarray, stale: np.ndarray, greedy: bool) -> tuple | None:
        """A decision step's drafting rows (indices in the step) and their stale confidences:
        update the mode's survival estimate and return the prediction that
        `check_prediction` pairs with the drafts the step accepts (None: no row known). A
        row whose slot has no confidences in the landed copy yet (NaN: its first drafts'
        copy is in flight) would count as certain drafts: it is left out."""
        # (numpy's Python wrappers cost several µs each with the caches cold: one C call
        # tells that every row is known, the usual case)
        if math.isnan(np.add.reduce(stale, axis=None)):
            known = ~np.logical_or.reduce(np.isnan(stale), axis=1)
            rows, stale = rows[known], stale[known]
        if not rows.size:
            return None
        return rows, predicted_accepted(self.update_survival(stale, greedy)), greedy

    def observe_acceptance(self, greedy: bool, accepted: float, predicted: float,
                           rows: int = _ACCEPT_DECAY_ROWS) -> None:  # fmt: skip
        """Drafts accepted in a verified step's `rows` checked rows against the number their
        confidences predicted at the lengths verified (`predicted_accepted`)."""
        self.updates += 1
        decay = step_decay(rows)
        sums = self._accepted[greedy]
        sums[0] = decay * sums[0] + accepted
        sums[1] = decay * sums[1] + predicted
        self._accept_steps[greedy] += 1

    def check_prediction(self, prediction: tuple, emitted: list, verified: list) -> None:
        """A committed step's accepted drafts against the number its rows' confidences
        predicted at the lengths verified: prediction = (rows, predicted_accepted of their
        confidences, sampling mode); emitted / verified per row of the step. Rows that emitted
        nothing (finished meanwhile) or verified nothing are left out."""
        rows, predicted, greedy = prediction
        num_out = np.fromiter(map(len, emitted), dtype=np.int64, count=len(emitted))[rows]
        lengths = np.minimum(np.asarray(verified, dtype=np.int64)[rows], predicted.shape[1] - 1)
        ok = np.flatnonzero((num_out > 0) & (lengths > 0))
        if ok.size:
            accepted, lengths = np.minimum(num_out[ok] - 1, lengths[ok]), lengths[ok]
            raw = float(predicted[ok, lengths].sum())
            # (what the decision priced these rows at: before this step moves the ratios)
            self.record.checked(self.estimate(greedy), accepted, lengths, raw)
            self.observe_acceptance(greedy, float(accepted.sum()), raw, ok.size)
            self._by_position[greedy].observe(accepted, lengths, predicted[ok],
                                              step_decay(ok.size))  # fmt: skip

    def acceptance_ratio(self, greedy: bool) -> float:
        """Accepted / predicted drafts lately in this sampling mode (1 until measured)."""
        if not self._ratio_measured(greedy):
            return 1.0
        accepted, predicted = self._accepted[greedy]
        lo, hi = _ACCEPT_RATIO_BOUNDS  # (every plan asks: no numpy on scalars)
        return min(max(accepted / predicted, lo), hi)

    def _ratio_measured(self, greedy: bool) -> bool:
        predicted = self._accepted[greedy][1]
        return predicted > 0.0 and (predicted >= _ACCEPT_MIN_PREDICTED
                                    or self._accept_steps[greedy] >= _ACCEPT_MIN_STEPS)

    def survival_of(self, greedy: bool) -> np.ndarray | None:
        """The mode's mean prefix survival per position as surveyed (else the other mode's),
        unscaled; None before any survey."""
        return self._survival.get(greedy, self.survival)

    def estimate(self, greedy: bool) -> list[float] | None:
        """The mode's mean prefix survival (else the other mode's), scaled position by
        position by its acceptance ratios (each position's where enough was predicted there,
        else the one over all positions) and kept a non-increasing probability (K floats:
        see decode_rates)."""
        survival = self.survival_of(greedy)
        if survival is None:
            return None
        ratio, out, low = self.acceptance_ratio(greedy), [], 1.0
        ratios = (self._by_position[greedy].ratios(ratio, _POSITION_RATIO_BOUNDS)
                  if self._ratio_measured(greedy) else [ratio] * self.k)  # fmt: skip
        for s, r in zip(survival[: self.k].tolist(), ratios):
            low = min(low, max(s * r, 0.0))  # (clipped to [0, 1], non-increasing)
            out.append(low)
        return out
