"""Online correction of the cost table's fixed per-step term.

A start-up profile times the target forward and the drafter only; a real step also pays host
work that no trimming removes. Left out, every token looks too expensive and the planner
over-trims. Each step's residual (measured step time beyond the table's forward + drafter
time) feeds an exponential moving average, one per kind of step, because the kinds differ:

  spec   speculative steps that verify every draft (one whole-step graph where available):
         replaces the table's `fixed_overhead_ms`, the term every candidate pays;
  plain  steps without speculation (drafting skipped): the baseline drafting must beat;
  eager  speculative steps on the eager path, when whole-step graphs exist: a trimmed plan
         pays its excess over `spec` (`trim_penalty_ms`).
One shared term would make whichever kind is cheaper look dearer and the other cheaper.
A residual may be negative: a table profiled on a slower path than the one serving (e.g. the
drafter timed through per-call input copies, then run inside a whole-step graph) overstates a
step, and the correction takes that back (step times stay floored at a positive minimum).
"""

from __future__ import annotations

WARMUP_STEPS = 3  # first steps compile kernels and fill caches: not representative
ALPHA = 0.1  # EMA weight of the newest residual


class FixedCosts:
    def __init__(self) -> None:
        self.steps = 0
        self.spec_seen = False
        self.plain_ms: float | None = None
        self.eager_ms: float | None = None

    def observe(self, cost, kind: str, residual_ms: float) -> bool:
        """Fold one step's residual into its kind's average. Returns True when the table's
        fixed term (kind "spec") moved."""
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return False
        if kind == "spec":  # the first measurement replaces the table's term outright
            prev = cost.fixed_overhead_ms if self.spec_seen else None
            cost.fixed_overhead_ms = _ema(prev, residual_ms)
            self.spec_seen = True
            return True
        if kind == "plain":
            self.plain_ms = _ema(self.plain_ms, residual_ms)
        else:
            self.eager_ms = _ema(self.eager_ms, residual_ms)
        return False

    def trim_penalty_ms(self, cost) -> float:
        """Measured extra fixed cost of an eager (trimmed) step over a whole-step graph."""
        if self.eager_ms is None or cost is None:
            return 0.0
        return max(0.0, self.eager_ms - cost.fixed_overhead_ms)


def _ema(prev: float | None, x: float) -> float:
    return x if prev is None else (1 - ALPHA) * prev + ALPHA * x
