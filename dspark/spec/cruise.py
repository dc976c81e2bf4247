"""Cruise: the lagged policy's plans skipped while every plan verifies every draft.

Where verification costs little against the step (a small target, or a host-bound engine),
every plan of the lagged policy comes out verify-all, and planning is pure overhead. On an
H100 (trained pair, T = 1, forty-first session) adaptive verified 99.98% of its drafts
offline at C = 128 (fixed K: all of them), in as many steps as fixed K, and ran 8% slower:
its plans (the budget searches of steps with prefill chunks, whose chunk sizes and rates
change at every step; the drafting decisions; the paths that stand a plan) cost ~0.23 ms a
step more than fixed K's host work.

After CRUISE_AFTER plans in a row that verified every draft with drafting on (whatever path
planned them; a quarter as many after a cruise that no trim ended), the next `life` plans of
shapes like those seen in the streak verify every draft without planning
(StepPlanning._plan_cruise). The life starts at CRUISE_FIRST plans and doubles at each cruise
that ends with the next streak, up to CRUISE_MAX; any plan that trims or stops drafting ends
the cruise and resets the life (a plain probe's step, which measures plain decoding while
drafting pays, neither ends nor extends it). Shapes "like those seen": at most ~1/4 more
requests and a prefill chunk of at most the next power of two above the largest seen; other
shapes take the full path (their verdict, if verify-all, extends the streak).

What a cruise does not skip: the drafting decision at its cadence (a batch size that moved
by a quarter forces one) and any probe (DraftingDecision.routine says none is due), the
draft room, the kind counts and the online cost model's observations. A decision's plan that
trims ends the cruise. Lossless either way: a budget only says how many drafts are verified.
"""

from __future__ import annotations

CRUISE_AFTER = 32  # verify-all plans in a row before a cruise
CRUISE_FIRST = 32  # plans the first cruise lasts (doubling up to CRUISE_MAX)
CRUISE_MAX = 512


class Cruise:
    def __init__(self, after: int = CRUISE_AFTER) -> None:
        self.after = after  # (0: never cruise)
        self.until = 0  # the plan count the cruise runs to (exclusive)
        self.life = CRUISE_FIRST  # plans the next cruise lasts
        self.streak = 0  # verify-all plans in a row (with drafting on)
        self.max_reqs = 0  # the largest request count of the streak ...
        self.max_other = 0  # ... and prefill chunk (tokens)
        self.cruised = 0  # plans a cruise stood for (observability, tests)

    def covers(self, plans: int, num_reqs: int, other: int) -> bool:
        """Whether plan number `plans` (of `num_reqs` requests beside `other` prefill tokens)
        is cruised: within the cruise and like the shapes its streak saw."""
        return (plans < self.until and 4 * num_reqs <= 5 * self.max_reqs + 4
                and other <= 1 << self.max_other.bit_length())

    def record(self, plans: int, verified_all: bool, num_reqs: int, other: int) -> None:
        """A planned step with drafts to verify: `verified_all` when its plan (before the
        draft room's cap) verified every draft with drafting on."""
        if not verified_all:  # a trim, or drafting off: planning pays again
            self.until, self.life, self.streak = 0, CRUISE_FIRST, 0
            self.max_reqs = self.max_other = 0
            return
        self.streak += 1
        self.max_reqs = max(self.max_reqs, num_reqs)
        self.max_other = max(self.max_other, other)
        # (after a cruise that ended without a trim, a quarter of the streak: the plans
        # between two cruises were 669 of 3,134 in a server at c = 64, 26 µs each; H200,
        # trained pair, T = 1, forty-first session)
        after = self.after if self.life == CRUISE_FIRST else -(-self.after // 4)
        if 0 < after <= self.streak and plans >= self.until:
            self.until = plans + 1 + self.life
            self.life = min(2 * self.life, CRUISE_MAX)
            self.streak = 0
