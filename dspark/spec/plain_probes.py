"""The drafting decision's probes of its fixed terms (DraftingDecision's mixin; drafting.py's
module doc). Plain probes: while drafting pays, a batch size whose plain steps were not
measured lately gets _PLAIN_PROBE_STEPS steps without drafting, so that plain decoding is
priced with its own fixed term rather than the speculative steps'. Speculative probes: while
drafting is off, a verdict for plain decoding on a speculative term not measured lately at
this batch size gets _SPEC_PROBE_STEPS steps drafting for every row first."""

from __future__ import annotations

import math

from dspark.spec.online_cost import FixedCosts, size_bucket

# planned steps of a plain probe: the first still verifies the drafts before it, the others
# are observed (with async scheduling a step left in flight is observed by the next call): ~10,
# more than the fixed term's MIN_SAMPLES, so one probe gives the term of a run of plain steps
# rather than of the two first ones after drafting (4-step probes learned plain steps far
# cheaper than a plain server ran them: H200, ninth session)
_PLAIN_PROBE_STEPS = 12
_PLAIN_PROBE_EVERY = 512  # at most once per this many plans and batch-size bucket
# drafting turns off only on a plain term measured within this many observed steps at the
# batch size (else a plain probe first: _plain_term_stale), at most one such probe per
# bucket in _PLAIN_RECENT plans
_PLAIN_FRESH = 64
_PLAIN_RECENT = 4 * _PLAIN_PROBE_STEPS
# ... and only on one learned at about this batch size: its steps' mean request count within
# this factor of the decision's (FixedCosts.measured_at); a verdict on a term from further off
# runs a plain probe where one may, else it waits (DraftingDecision.after_plan)
_PLAIN_NEAR = 1.25
# where no plain term was learned within two buckets of the batch size (FixedCosts.learned_below,
# or none), plain decoding's best case is the start-up table's bare forward made this much
# cheaper: that table is a profile, not the served step, and overstated plain steps of 16-32
# sampling requests by 13-16% (0.53 ms against no-spec's 0.46; H200, trained pair, T = 1,
# fifty-sixth session), so drafting priced 10-18% ahead stayed on, unprobed, 3-7% below
# no-spec. A probe at a batch size where drafting really is ahead by up to this much costs
# at most its 12 steps' tokens times that lead, once per _PLAIN_PROBE_EVERY plans
_PLAIN_TABLE_SLACK = 0.25
# a speculative probe's planned steps (the first only drafts; the others verify and are
# observed), and how fresh its term must be for drafting to stay off without one: once
# drafting is off nothing measures speculative steps again (draft probes are not observed),
# and a term learned in a level's first steps held drafting off for the whole level where
# fixed K beat it by 37% (H100, trained pair, T = 0, c = 32: learned 0.83 ms, the level's
# first verify steps 1.36 ms against 0.93 in fixed K's steady state; fifty-fifth session; why
# those steps were slow is not known: another call's step log showed no such start)
_SPEC_PROBE_STEPS = 12
_SPEC_FRESH = 64  # observed steps
# at most one speculative probe per this many plans and bucket, twice as far apart after each
# whose decision kept drafting off by twice the guard (up to _SPEC_PROBE_BACKOFF_MAX times):
# where plain decoding does win, a probe's steps each earn less than a plain one
_SPEC_PROBE_EVERY = 512
_SPEC_PROBE_BACKOFF_MAX = 8
_SPEC_KINDS = ("spec", "trim", "eager")


def plain_near(fixed: FixedCosts, num_sampling: int) -> bool:
    """The plain term at this batch size's bucket was learned at about this many requests
    (_PLAIN_NEAR): what a fresh term must also be before drafting turns off on it."""
    at = fixed.measured_at("plain", num_sampling)
    return at is not None and num_sampling / _PLAIN_NEAR <= at <= num_sampling * _PLAIN_NEAR


class PlainProbes:
    """Mixin of DraftingDecision: when a plain probe is due."""

    enabled: bool
    plain_probes: bool
    pays: bool
    survival: object
    _plans: int
    _plain_probe_left: int
    _plain_may_win: bool
    _plain_probed: dict[tuple, int]
    _spec_probe_left: int
    _spec_probed: dict[tuple, tuple[int, int]]
    _spec_probe_key: tuple | None

    def _plain_term_stale(self, fixed: FixedCosts, num_sampling: int,
                          prefill_tokens: int) -> bool:  # fmt: skip
        """A verdict for plain decoding while drafting rests on a plain steps' term not
        measured at this batch size (its bucket, at about as many requests: plain_near)
        within the last _PLAIN_FRESH observed steps (or never), and a plain probe can
        measure it now (a decode step; this bucket not probed in the last _PLAIN_RECENT
        plans, so a probe whose steps went unobserved does not repeat).
        The two terms are wall-clock window means, and a host-bound engine's host speed drifts:
        on the H200's host the same Python work took 0.9-2.2x as long from one second or
        CPU to the next (scripts/cpu_speed_map.py), so a speculative term measured in a slow
        spell against a plain term from a fast one turned drafting off where it won (demo
        pair, c = 4: spec 0.561 ms against plain 0.292 ms at the flip, their level means
        0.20 / 0.19; 434 plain steps of 2,370, each ~20% less productive)."""
        if not self.plain_probes or prefill_tokens > 0 or num_sampling == 0:
            return False
        if fixed.age("plain", num_sampling) <= _PLAIN_FRESH and plain_near(fixed, num_sampling):
            return False
        last = self._plain_probed.get((fixed.greedy, size_bucket(num_sampling)))
        return last is None or self._plans - last >= _PLAIN_RECENT

    def _plain_probe_due(self, fixed: FixedCosts, num_sampling: int, prefill_tokens: int) -> bool:
        """While drafting pays: plain steps at this batch size not measured lately. Only on
        decode steps (steps with prefill chunks are not observed), at most once per
        _PLAIN_PROBE_EVERY plans and bucket, and only where the last decision found that
        plain decoding could win (`_plain_may_win`, plain steps at FixedCosts.plain_floor):
        elsewhere a probe costs ~60% of its steps' tokens and cannot change the verdict
        (H200, 8B SYNTHETIC, c = 4: 22 probe steps, -3%; the trained pair, c = 64: a probe
        at every batch size of a level's tail while priced at the bare forward)."""
        if prefill_tokens > 0 or not self._plain_probe_open(fixed, num_sampling, self._plans):
            return False
        self._plain_probed[(fixed.greedy, size_bucket(num_sampling))] = self._plans
        return True

    def _plain_probe_open(self, fixed: FixedCosts, num_sampling: int, plans: int) -> bool:
        """_plain_probe_due's answer on a decode step at plan count `plans`, nothing
        recorded (DraftingDecision.routine asks it of the plan to come)."""
        if (not self.enabled or not self.plain_probes or not self.pays
                or not self._plain_may_win or self._plain_probe_left > 0
                or self.survival is None or num_sampling == 0):
            return False
        last = self._plain_probed.get((fixed.greedy, size_bucket(num_sampling)))  # (per mode)
        if last is not None and plans - last < _PLAIN_PROBE_EVERY:
            return False
        return fixed.age("plain", num_sampling) >= _PLAIN_PROBE_EVERY

    def _spec_term_stale(self, fixed: FixedCosts, num_sampling: int, prefill_tokens: int) -> bool:
        """A verdict for plain decoding while drafting is off rests on a speculative term that
        this batch size's bucket measured (any speculative kind), but not within the last
        _SPEC_FRESH observed steps, and a speculative probe may measure it now (a decode
        step; none at this bucket in the last _SPEC_PROBE_EVERY plans times its spacing).
        Starting one is recorded here. A bucket never measured takes its neighbours' term, as
        before: a level's tail passes through several while requests finish, and a probe at
        each would cost what plain probes there did (plain_floor's doc)."""
        if prefill_tokens > 0 or num_sampling == 0:
            return False
        ages = [fixed.age(kind, num_sampling) for kind in _SPEC_KINDS]
        if min(ages) <= _SPEC_FRESH or min(ages) == math.inf:  # (fresh; or never measured)
            return False
        key = (fixed.greedy, size_bucket(num_sampling))
        last, spacing = self._spec_probed.get(key, (None, 1))
        if last is not None and self._plans - last < _SPEC_PROBE_EVERY * spacing:
            return False
        self._spec_probed[key] = (self._plans, spacing)
        self._spec_probe_key = key
        return True

    def _spec_probe_judged(self, wide_off: bool) -> None:
        """The decision after a speculative probe: kept drafting off by twice the guard
        (`wide_off`: the next probe at its bucket twice as far off) or not (back to 1x)."""
        key, self._spec_probe_key = self._spec_probe_key, None
        last, spacing = self._spec_probed[key]
        spacing = min(2 * spacing, _SPEC_PROBE_BACKOFF_MAX) if wide_off else 1
        self._spec_probed[key] = (last, spacing)
