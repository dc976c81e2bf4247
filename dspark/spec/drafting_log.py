"""The drafting decision's log line when drafting turns on or off (drafting.py): on which
numbers, at INFO in bursts of up to FLIP_LOG_BURST lines, then at most one a second (DEBUG
beyond). scripts/bench_e2e.py collects these lines from the servers' logs by their prefix.

A plain limit of one line a second hid what matters most: a turn that is undone within a
second. The forty-fourth session's offline engines (trained pair, T = 1, C = 128 / 256)
turned drafting off five times in 13 s and back on within a second each time, and the log
kept only the five "off" lines, not the numbers that turned drafting back on."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

logger = logging.getLogger("dspark.spec.drafting")  # (the decision's logger, by name)

FLIP_LOG_PREFIX = "adaptive verification: drafting "
FLIP_LOG_EVERY_S = 1.0  # once a burst is spent, one INFO line per this many seconds
FLIP_LOG_BURST = 8  # INFO lines back to back (a token bucket: refilled at the rate above)


class FlipLog:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._credit = float(FLIP_LOG_BURST)  # INFO lines that may come now
        self._at = -math.inf  # clock() when the credit was last counted

    def _loud(self) -> bool:
        """Whether this line goes out at INFO (spending one credit)."""
        now = self._clock()
        if now > self._at:  # (the first call: the full burst)
            refill = (now - self._at) / FLIP_LOG_EVERY_S
            self._credit = min(float(FLIP_LOG_BURST), self._credit + refill)
        self._at = now
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def say(self, pays: bool, num_sampling: int, spec_rate: float, plain_rate: float,
            spec_fixed: float, plain_fixed: float | None, measured_at: float | None,
            survival: np.ndarray, ratio: float) -> None:  # fmt: skip
        """Drafting turned on (`pays`) or off at `num_sampling` requests on these rates (tok/ms),
        fixed terms (ms), mean survival (as estimated: scaled position by position) and the
        acceptance ratio over all positions."""
        quiet = not self._loud()
        if plain_fixed is None:
            plain = "unmeasured (the speculative term stands in)"
        else:
            where = ("another batch size's" if measured_at is None
                     else f"measured at {measured_at:.0f} requests")  # (its bucket's mean)
            plain = f"{plain_fixed:.3f} ms ({where})"
        logger.log(logging.DEBUG if quiet else logging.INFO,
                   FLIP_LOG_PREFIX + "%s at %d requests: best verify length "
                   "%.3f tok/ms vs plain decoding %.3f tok/ms; fixed terms: speculative %.3f ms, "
                   "plain %s; mean survival %s (the confidences' scaled by accepted / predicted "
                   "per position; x %.2f over all positions)",
                   "on" if pays else "off", num_sampling, spec_rate, plain_rate, spec_fixed,
                   plain, [round(float(s), 2) for s in survival], ratio)  # fmt: skip
