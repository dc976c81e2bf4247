"""Tokens per ms of decode-only steps, and prefix survivals: the arithmetic that the drafting
decision (drafting.py), the planner's steps with prefill chunks (step_planning.py) and the replay
simulator (sim.py) share.

A decode-only step of R sampling requests either decodes plainly (R tokens for the forward of
R tokens plus the plain steps' fixed term) or has every request verify l drafts of a mean
prefix survival s (R * (1 + s_1 + ... + s_l) expected tokens for the forward of R * (1 + l)
tokens, the drafter and the speculative fixed term: CostModel.step_time_lookup). Both pay
the step's context read (CostModel.set_step_context).
"""

from __future__ import annotations

import numpy as np

from dspark.spec.cost_model import CostModel


def decode_rates(cost: CostModel, survival, num_reqs: int,
                 plain_fixed_ms: float | None) -> tuple[float, float]:
    """Tokens per ms of a decode-only step of `num_reqs` sampling requests: (plain decoding,
    the best verify length l = 1..K with every request verifying l drafts of the given mean
    prefix survival (a sequence of K floats), its drafter paid; -inf without a survival
    estimate). Plain decoding costs `plain_fixed_ms` (the measured fixed cost of steps
    without speculation; the table's fixed term until one is measured) + the forward of one
    token per request."""
    fixed = cost.fixed_overhead_ms if plain_fixed_ms is None else plain_fixed_ms
    if survival is not None and not isinstance(survival, list):
        survival = np.asarray(survival, dtype=np.float64).reshape(-1).tolist()
    k = 0 if survival is None else len(survival)
    plain_ms, spec_ms = cost.decode_variable(num_reqs, k)
    plain = num_reqs / max(fixed + cost.step_context_ms + plain_ms, 1e-6)  # (add_fixed's)
    # K floats (a decision every few steps): a loop over positions costs a few µs where the
    # same arithmetic through numpy's small-array calls cost ~100 (2-core development machine)
    best, tokens = float("-inf"), 1.0
    for s, variable_ms in zip(survival or (), spec_ms):
        tokens += s
        best = max(best, num_reqs * tokens / cost.add_fixed(variable_ms))
    return plain, best


def decode_rate(cost: CostModel, survival: np.ndarray | None, num_reqs: int,
                plain_fixed_ms: float | None) -> float:
    """Tokens per ms of the best decode-only step (decode_rates): what a draft's marginal
    time in a step with prefill chunks must beat."""
    return max(decode_rates(cost, survival, num_reqs, plain_fixed_ms))


def prefix_survival(stale: np.ndarray, prior_conf: float = 1.0, dtype=None) -> np.ndarray:
    """[R, K] prefix survival of each row's drafts from stale conditional confidences
    (unknown ones: the prior), in a new array of `dtype` (default: the input's)."""
    # ufuncs with `out` (np.clip / np.where cost several µs each on a [1, 7] array; a plan
    # runs this every few steps); fmin maps NaN to its other operand, so with the usual prior
    # of 1.0 one call both fills unknowns and clips from above
    if prior_conf == 1.0:
        conf = np.fmin(stale, 1.0, dtype=dtype)
    else:  # (in `dtype` before the prior goes in: a float64 result holds the prior exactly)
        if dtype is not None:
            stale = stale.astype(dtype, copy=False)
        conf = np.where(np.isnan(stale), prior_conf, stale)
        np.fmin(conf, 1.0, out=conf)
    np.fmax(conf, 0.0, out=conf)
    return conf.cumprod(axis=1, out=conf)


def mean_survival(stale: np.ndarray | None, prior_conf: float = 1.0) -> np.ndarray | None:
    """Mean prefix survival per position over rows of stale conditional confidences (unknown
    ones: the prior)."""
    if stale is None or stale.size == 0:
        return None
    return prefix_survival(stale, prior_conf).mean(axis=0)


def predicted_accepted(survival: np.ndarray) -> np.ndarray:
    """[rows, K + 1]: the drafts each row is expected to get accepted if it verifies
    l = 0..K of them (the sum of its first l prefix survivals, [rows, K])."""
    out = np.zeros((survival.shape[0], survival.shape[1] + 1))
    survival.cumsum(axis=1, out=out[:, 1:])  # (the method: no wrapper)
    return out


class PositionRatios:
    """Drafts accepted against drafts predicted, position by position (decayed sums over the
    observed steps, verified positions only): how far a drafter's confidences are off at each
    position. One ratio over all positions scales a survival curve but cannot change its
    shape, and a drafter's confidences can be off by a different factor at each position
    (H100, trained pair, T = 0, fifty-second session: an estimate of [0.84, 0.39, 0.18, ...]
    after the one ratio, where [0.80, 0.51, 0.33, ...] was accepted offline and the
    speculative steps' rate was priced 26% under fixed K's measured one)."""

    MIN_PREDICTED = 1.0  # decayed predicted drafts at a position before its own ratio is used

    def __init__(self, k: int, decay: float) -> None:
        self.decay = decay
        self.accepted = np.zeros(k)
        self.predicted = np.zeros(k)
        self._positions = np.arange(1, k + 1)

    def observe(self, accepted: np.ndarray, lengths: np.ndarray, predicted: np.ndarray,
                decay: float | None = None) -> None:  # fmt: skip
        """One step's rows: drafts accepted [n] of the lengths verified [n] (accepted <=
        length), and `predicted_accepted` of their confidences [n, K + 1]. `decay`: the
        old sums' (default: the one given at construction)."""
        # (a decision step's work: a histogram and column sums, not [n, K] masks, where
        # every row verified all K, the usual case: 7-11 µs against 10-27 for 1-256 rows on
        # the 2-core development machine)
        k = self.accepted.size
        decay = self.decay if decay is None else decay
        self.accepted *= decay
        self.predicted *= decay
        rows_accepting = np.bincount(accepted, minlength=k + 1)  # exactly 0..K drafts
        self.accepted += rows_accepting[::-1].cumsum()[::-1][1:]  # (at least 1..K)
        if lengths.min() >= k:
            column = predicted.sum(axis=0)  # (each position's prefix survival, summed)
            self.predicted += column[1:] - column[:-1]
        else:
            verified = self._positions <= lengths[:, None]  # [n, K]
            self.predicted += (np.diff(predicted, axis=1) * verified).sum(axis=0)

    def ratios(self, fallback: float, bounds: tuple[float, float]) -> list[float]:
        """Each position's ratio within `bounds`; `fallback` (the ratio over all positions)
        where too few drafts were predicted there (never verified, or confidences near 0)."""
        lo, hi = bounds
        return [min(max(a / p, lo), hi) if p >= self.MIN_PREDICTED else fallback
                for a, p in zip(self.accepted.tolist(), self.predicted.tolist())]


class RateMemo:
    """Decode rates (decode_rate) memoized per request-count group, each for `lifetime`
    plans, in one mode at a time: a rate priced in another mode (sampling mode, or with and
    without a survival estimate) is not read, and the first put in a new mode forgets the
    old ones. Times are plan counts (the caller's clock). At most MAX_GROUPS groups: more
    start the memo afresh (groups are ~6% wide, so a serving level holds a few)."""

    MAX_GROUPS = 16

    def __init__(self, lifetime: int):
        self.lifetime = lifetime
        self.mode: tuple | None = None
        self.rates: dict = {}  # group -> (rate, the plan count it stands until)

    def get(self, mode: tuple, group, now: int) -> float | None:
        hit = self.rates.get(group) if mode == self.mode else None
        return None if hit is None or now >= hit[1] else hit[0]

    def put(self, mode: tuple, group, rate: float, now: int) -> None:
        if mode != self.mode or len(self.rates) >= self.MAX_GROUPS:
            self.mode, self.rates = mode, {}
        self.rates[group] = (rate, now + self.lifetime)

    def clear(self) -> None:
        self.mode, self.rates = None, {}
