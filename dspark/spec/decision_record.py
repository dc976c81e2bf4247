"""What a drafting decision's numbers were, summed for reports (no decision reads them): its
verdicts, and its survival estimates against the drafts then accepted. A run's deltas
(scripts/closed_loop.py) say whether a round's decisions priced drafting right, and on which
side they erred (e2e_report.py: m, priced, s)."""

from __future__ import annotations

import math

import numpy as np


class DecisionRecord:
    def __init__(self) -> None:
        # every verdict on real numbers: how many, the sum of log(drafting's rate / plain
        # decoding's) they priced, and the plain and verify-all step times they priced (ms)
        self.verdicts = {"decisions": 0, "log_spec_over_plain": 0.0, "plain_ms": 0.0,
                         "verify_ms": 0.0}  # fmt: skip
        # every checked prediction: rows, and the drafts accepted at the lengths verified
        # against those the rows' confidences (raw) and the decision's estimate predicted
        self.tally = dict.fromkeys(("rows", "accepted", "raw", "estimated"), 0.0)

    def verdict(self, spec_rate: float, plain_rate: float, num_sampling: int,
                verify_ms: float) -> None:  # fmt: skip
        """A verdict's rates (tok/ms) at `num_sampling` requests; `verify_ms`: its price of a
        step verifying every draft."""
        v = self.verdicts
        v["decisions"] += 1
        v["log_spec_over_plain"] += math.log(spec_rate / plain_rate)
        v["plain_ms"] += num_sampling / plain_rate
        v["verify_ms"] += verify_ms

    def checked(self, estimate: list[float] | None, accepted: np.ndarray, lengths: np.ndarray,
                raw: float) -> None:  # fmt: skip
        """A checked step's rows: drafts accepted [n] of the lengths verified [n], the raw
        prediction's sum, and the survival estimate the decision priced them at (K floats)."""
        t = self.tally
        t["rows"] += accepted.size
        t["accepted"] += float(accepted.sum())
        t["raw"] += raw
        if estimate is not None:
            t["estimated"] += float(np.cumsum(estimate)[lengths - 1].sum())
