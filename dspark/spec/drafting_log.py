"""The drafting decision's log line when drafting turns on or off (drafting.py): on which
numbers, at INFO at most once a second (DEBUG between). scripts/bench_e2e.py collects these
lines from the servers' logs by their prefix."""

from __future__ import annotations

import logging
import math
import time

import numpy as np

logger = logging.getLogger("dspark.spec.drafting")  # (the decision's logger, by name)

FLIP_LOG_PREFIX = "adaptive verification: drafting "
FLIP_LOG_EVERY_S = 1.0


class FlipLog:
    def __init__(self):
        self._logged = -math.inf  # time.monotonic() of the last line at INFO

    def say(self, pays: bool, num_sampling: int, spec_rate: float, plain_rate: float,
            spec_fixed: float, plain_fixed: float | None, measured_here: bool,
            survival: np.ndarray, ratio: float) -> None:  # fmt: skip
        """Drafting turned on (`pays`) or off at `num_sampling` requests on these rates (tok/ms),
        fixed terms (ms), mean survival and acceptance ratio."""
        now = time.monotonic()
        quiet = now - self._logged < FLIP_LOG_EVERY_S
        if not quiet:
            self._logged = now
        if plain_fixed is None:
            plain = "unmeasured (the speculative term stands in)"
        else:
            where = "measured at this batch size" if measured_here else "another batch size's"
            plain = f"{plain_fixed:.3f} ms ({where})"
        logger.log(logging.DEBUG if quiet else logging.INFO,
                   FLIP_LOG_PREFIX + "%s at %d requests: best verify length "
                   "%.3f tok/ms vs plain decoding %.3f tok/ms; fixed terms: speculative %.3f ms, "
                   "plain %s; mean survival %s (the confidences' x %.2f, accepted / predicted)",
                   "on" if pays else "off", num_sampling, spec_rate, plain_rate, spec_fixed,
                   plain, [round(float(s), 2) for s in survival], ratio)  # fmt: skip
