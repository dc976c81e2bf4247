"""Whether a step drafts (the lagged policy's draft skipping).

Drafting has a cost no trimming removes (the drafter's pass), so at high load or low acceptance
plain decoding can win. Every few steps the decision compares the best decode-only step with
drafts (every request verifying l drafts of the mean stale prefix survival, its drafter paid)
against plain decoding, each priced by the cost table with its own fixed term learned online
(online_cost.py); drafting turns on or off after two decisions in a row against its state,
each won by the guard margin (between, the state stands: a dead band around parity).
It reads only stale, aggregate survival, never the drafts it gates, so a skipped round is
plain decoding and the output is unchanged (lossless).

The survival estimate is the confidences' (one per sampling mode), scaled by how many drafts
were accepted against how many the same confidences predicted at the lengths verified: a
calibration fitted on one workload is off on another (H200, trained pair, T = 0: prefix
survivals summing to 1.9 predicted, 2.9 drafts accepted per round, and drafting was turned
off where fixed K beat no speculation by 66%). The lagged budget's expected yields are
corrected by the same ratio when it is above 1 (Planner.plan_cpu: at T = 0, c = 256 a ratio of
1.16 stood beside trims to 324 verified drafts per request against fixed K's 568, and 12%
fewer tokens per step); not below 1, where a smaller budget would leave fewer verified drafts
to measure the ratio on, none at a zero budget. The device's top-B allocation still ranks the
raw live confidences.

Three kinds of probe keep both sides of the comparison measured:
  draft probe   while skipping, every _PROBE_EVERY steps one step drafts for at most
                PROBE_ROWS rows (a fresh survival estimate and speculative steps' cost),
                further apart while verdicts for plain decoding stay wide;
  plain probe   (`plain_probes`, on by default) while drafting, a batch size whose plain
                steps were not measured lately gets _PLAIN_PROBE_STEPS steps without drafting.
                Without it plain decoding is priced with the speculative steps' fixed term,
                which also holds what only speculative steps pay (verification, the drafter's
                context, the allocation: 2.0 ms per step offline at c = 64 on the 8B shape;
                8.7 ms learned in a server at c = 128, not broken down). Plain decoding then
                looks dearer than it is and drafting goes on where it loses (H200, 8B shape,
                SYNTHETIC, twelfth session: drafting never stopped at c = 128, 20% below no
                speculation; trained pair, T = 1, c = 1: no speculation 24% faster). The
                ninth session's 4-step probes learned plain steps too cheap and turned
                drafting off where it won; probes are now 12 steps (a term over ~10
                observed ones), and only where plain steps at the table's bare forward
                price could win (at low load drafting beats even that: no probe);
  speculative probe  while drafting is off, a verdict for plain decoding on a speculative
                term its batch size measured, but not lately, gets _SPEC_PROBE_STEPS steps
                drafting for every row first (draft probes' few rows are not observed): a
                term learned in a level's first steps held drafting off for the whole level.
"""

from __future__ import annotations

import math
import time

import numpy as np

from dspark.spec.acceptance_estimate import _ACCEPT_DECAY, AcceptanceEstimate
from dspark.spec.decision_record import DecisionRecord
from dspark.spec.drafting_log import FlipLog
from dspark.spec.online_cost import FixedCosts, size_bucket
from dspark.spec.plain_probes import (
    _PLAIN_PROBE_STEPS,
    _PLAIN_TABLE_SLACK,
    _SPEC_PROBE_STEPS,
    PlainProbes,
    plain_near,
)
from dspark.spec.rates import PositionRatios, decode_rates

_DECIDE_EVERY = 8  # steps between decisions (sooner when the batch size moves by a quarter
# and by at least _MOVED_MIN requests: at c = 4 a request leaving or arriving moved 4 to 3 and
# back, and forced 80 of 1,238 plans to decide, ~200 us each on the H200's host, where one
# request more or less barely changes a step's price)
_MOVED_MIN = 2
# ... and, in the engine (SpecDecoder passes it), at least this long between routine ones: a
# decision step plans for 0.26-0.38 ms on the H200's host against 0.02-0.03 ms for the others
# (demo pair, c = 4, fifteenth session), which at 0.8 ms steps every 8 steps is ~5% of the
# step time; at 8B scale 8 steps take longer than this anyway. Decisions on a probe's drafts,
# after a plain probe or on a batch size that moved are never deferred.
DECIDE_MIN_S = 0.02
# ... and no closer than a decision's own host time (running mean: note_decision_s) over this
# share: the trained pair's routine decisions came every ~10 steps of ~2 ms, 0.2 ms each on an
# H100's host, 44% of the planning time (109 decisions, 21.8 of 50 ms; forty-second session)
DECIDE_HOST_SHARE = 0.005
# ... both twice as far apart after each routine decision that keeps drafting on by twice the
# guard or more, up to this many times (back to 1x on a closer verdict or a flip): at low load
# drafting wins by 30-70% and a decision there surveys and prices the batch for ~0.2 ms of
# host time on the H200 (trained pair, c = 4: 113 decisions, 16 us per step of 1.2 ms), where
# nothing is close to changing. A forced decision (the batch size moved by a quarter, a plain
# probe ended) that finds drafting still ahead by that much leaves the spacing as it was:
# requests of equal lengths started together finish together, and each such wave moved the
# batch size twice, and with the spacing back to 1x, three routine decisions followed before
# the next wave (H200, trained pair, T = 0, c = 16: 33 decisions a level of ~1.1 s at
# 0.24-0.26 ms each, thirty-second session)
_DECIDE_BACKOFF_MAX = 8
_PROBE_EVERY = 64  # while drafting is skipped, draft every this many steps to re-measure
PROBE_ROWS = 8  # ... for this many rows of the step
# ... and twice as far apart after each probe whose verdict was plain decoding by twice the
# guard, up to this many times _PROBE_EVERY (back to 1x on a closer verdict or when the batch
# size moves by a quarter): a probe is a drafting step plus one verifying it (eager, it was
# 28 ms against 9 ms plain steps: H200, 8B shape, c = 128, sixth session; on a plain step it
# now runs as a whole-step graph, step_graph.key_for), and a steady verdict needs few
_PROBE_BACKOFF_MAX = 8
# drafting turns on / off after this many consecutive decisions against its state: a server
# passes through batch sizes for a step or two (a request finished, the next not yet arrived),
# the decision re-runs at once when the batch size moves by a quarter, and single verdicts
# there turned drafting off at c = 4 (logged at 3 requests; H200, trained pair)
_FLIP_AFTER = 2


class DraftingDecision(PlainProbes, AcceptanceEstimate):
    def __init__(self, k: int, min_predicted_gain: float, enabled: bool,
                 plain_probes: bool = True, min_interval_s: float = 0.0,
                 clock=time.perf_counter):  # fmt: skip
        self.k = k
        self.min_predicted_gain = min_predicted_gain
        self.enabled = enabled  # draft skipping on (off: every step drafts)
        self.plain_probes = plain_probes
        self.survival: np.ndarray | None = None  # the estimate last updated (either mode)
        self._survival: dict[bool, np.ndarray] = {}  # per sampling mode (all greedy: True)
        # per mode, decayed sums of (accepted drafts, the confidences' prediction of them)
        self._accepted = {True: [0.0, 0.0], False: [0.0, 0.0]}
        self._accept_steps = {True: 0, False: 0}  # decision steps observed per mode
        # ... and the same position by position, per mode (what `estimate` scales by)
        self._by_position = {g: PositionRatios(k, _ACCEPT_DECAY) for g in (True, False)}
        self.updates = 0  # survival estimates and acceptance checks folded in (what `estimate`
        # answers changes only with these)
        self.pays = True
        self._against = 0  # consecutive decisions against the current state (see _FLIP_AFTER)
        self._decided = False  # a verdict on real numbers has set the state
        self._numbers: tuple | None = None  # the last decision's rates and terms (for the log)
        self._since_decision, self._decided_reqs = 0, 0
        self._min_interval_s, self._clock = min_interval_s, clock
        self._decided_at = -math.inf  # clock() at the last decision
        self._decision_s = 0.0  # a decision plan's host time, running mean (note_decision_s)
        self._decide_spacing = 1  # x _DECIDE_EVERY and x _interval_s() (_DECIDE_BACKOFF_MAX)
        self._forced = False  # the next plan decides whatever the interval (see DECIDE_MIN_S)
        self._skipped = 0  # consecutive steps that skipped drafting
        self._probe_spacing = 1  # x _PROBE_EVERY between draft probes (see _PROBE_BACKOFF_MAX)
        self._after_probe = False  # the next decision is on a probe's drafts
        self._plans = 0
        self._plain_probe_left = 0  # steps of the plain probe still to come
        self._plain_probed: dict[tuple, int] = {}  # (mode, batch-size bucket) -> its last probe
        self._spec_probe_left = 0  # ... and a speculative probe's (plain_probes.py)
        self._spec_probed: dict[tuple, tuple[int, int]] = {}  # ... -> (last probe, spacing)
        self._spec_probe_key: tuple | None = None  # the probe the next decision judges
        self._flip_log = FlipLog()
        # its verdicts and checked predictions, summed for reports (decision_record.py)
        self.record = DecisionRecord()
        # the last decision: could plain decoding at its cheapest (the table's bare forward,
        # less a negative fixed term if one was measured) beat drafting by the guard? If
        # not, no plain probe can turn drafting off, and probing would only cost tokens
        self._plain_may_win = False
        self._plain_best = 0.0  # ... its rate then, tokens/ms (the step log's)

    def due(self, num_reqs: int) -> bool:
        """Whether this step decides again (call once per planned step)."""
        self._since_decision += 1
        moved = self._moved(num_reqs)
        if moved:  # (a forced decision: not a routine one, which may space the next)
            self._probe_spacing, self._forced = 1, True
        if moved or self._forced or self.survival is None:
            return True
        return self._routine_due(self._since_decision)

    def routine(self, num_reqs: int, online: bool, fixed: FixedCosts, num_sampling: int,
                prefill_tokens: int) -> bool:  # fmt: skip
        """A plan that neither decides nor probes, told from the state alone: due(num_reqs)
        would return False and after_plan(False, ...) (pays, not pays), no draft or plain
        probe starting. Then both methods' effects are made here and it returns True; else
        nothing changes and the caller takes due / after_plan (the short paths of a standing
        plan while drafting and of a plain step while not: step_planning.py). A plan waiting
        out DECIDE_MIN_S after its _DECIDE_EVERY steps is routine too: with ~1 ms steps many
        plans between two decisions wait on the clock, and until the thirty-fifth session
        they took the full path (145 of 400 plans at c = 16 with a 1 ms stub device,
        scripts/host_step_cost.py's loop on the development machine; "other" plans there
        9.7-10.3 -> 7.4-8.8 µs). The last three arguments are after_plan's: whether a plain
        probe could start is its own test (_plain_probe_open), not the last verdict alone:
        where plain decoding at the table's bare forward might win, a probe starts once per
        _PLAIN_PROBE_EVERY plans, and until the fifty-ninth session every plan between two
        took the full path, no cruise among them (found reading the code after an H100 run,
        trained pair, T = 0, c = 256, in which 463 plans of 771 took the full path at ~70 µs
        and 172 cruised; whether this was their cause was not logged)."""
        if (self._forced or self._plain_probe_left or self._spec_probe_left
                or self.survival is None):  # fmt: skip
            return False  # (a decision is due, or a plain probe runs)
        if self._routine_due(self._since_decision + 1):
            return False  # (a routine decision is due: due()'s own test)
        if self.pays:  # (a plain probe may be due: after_plan's test, at its plan count)
            if (online and not prefill_tokens
                    and self._plain_probe_open(fixed, num_sampling, self._plans + 1)):
                return False
        elif (self._skipped + 1) % (_PROBE_EVERY * self._probe_spacing) == 0:
            return False  # (a draft probe is due)
        if self._moved(num_reqs):
            return False  # (a forced decision is due)
        self._since_decision += 1
        self._plans += 1
        self._skipped = 0 if self.pays else self._skipped + 1
        return True

    def _routine_due(self, since_decision: int) -> bool:
        """A routine decision is due after `since_decision` planned steps: _DECIDE_EVERY of
        them and _interval_s() of time since the last one, both times the spacing."""
        spacing = self._decide_spacing
        if since_decision < _DECIDE_EVERY * spacing:
            return False
        interval = self._interval_s()
        return interval <= 0 or self._clock() - self._decided_at >= interval * spacing

    def note_decision_s(self, seconds: float) -> None:
        """A decision plan's host time: routine decisions then come no closer than the
        running mean over DECIDE_HOST_SHARE (where a minimum interval is set at all)."""
        self._decision_s += (seconds - self._decision_s) * (0.2 if self._decision_s else 1.0)

    def _interval_s(self) -> float:
        """The least time between routine decisions (0: none)."""
        floor = self._min_interval_s
        cost = self._decision_s * (1.0 / DECIDE_HOST_SHARE)
        return floor if floor <= 0 or cost <= floor else cost

    def _moved(self, num_reqs: int) -> bool:
        """The batch size moved by a quarter, and by _MOVED_MIN requests at least, since the
        last decision (which forces the next)."""
        change = abs(num_reqs - self._decided_reqs)
        return change * 4 > num_reqs and change >= _MOVED_MIN

    def after_plan(self, decide: bool, cost, fixed: FixedCosts, online: bool, num_reqs: int,
                   num_sampling: int, prefill_tokens: int) -> tuple[bool, bool]:  # fmt: skip
        """(whether this step drafts, whether that is a draft probe: a few rows only).
        `online`: the fixed terms are learned from this engine's steps (plain probes can
        measure them)."""
        self._plans += 1
        if decide:  # on decode steps' economics (prefill chunks come and go)
            routine = not self._forced
            verdict = self._pays(cost, fixed, num_sampling)
            against = not verdict and self.pays and online
            stale = against and self._plain_term_stale(fixed, num_sampling, prefill_tokens)
            # nor does drafting stay off on a speculative term not measured lately here
            spec_stale = (not verdict and not self.pays and online  # (stale needs pays)
                          and self._spec_term_stale(fixed, num_sampling, prefill_tokens))
            # nor does drafting turn off on a plain term learned at another batch size where
            # no probe can measure this one now: the verdict waits (plain_near)
            far = against and self.plain_probes and not plain_near(fixed, num_sampling)
            counted = not (stale or spec_stale or far)
            if stale:  # measure plain steps now, then decide again on both terms
                self._plain_probe_left = _PLAIN_PROBE_STEPS
                self._plain_probed[(fixed.greedy, size_bucket(num_sampling))] = self._plans
            elif spec_stale:  # likewise speculative steps (plain_probes.py)
                self._spec_probe_left = _SPEC_PROBE_STEPS
            elif counted and verdict == self.pays:
                self._against = 0
            elif counted:
                self._against += 1
                # (the first verdict on real numbers overrides the default state at once)
                first = self._numbers is not None and not self._decided
                if first or self._against >= _FLIP_AFTER:
                    self.pays, self._against = verdict, 0
                    if self._numbers is not None:
                        self._flip_log.say(verdict, *self._numbers)
            self._decided = self._decided or (counted and self._numbers is not None)
            self._since_decision, self._decided_reqs = 0, num_reqs
            self._forced = False
            if not self._wins_widely(True):
                self._decide_spacing = 1
            elif routine:
                self._decide_spacing = min(2 * self._decide_spacing, _DECIDE_BACKOFF_MAX)
            # (a forced decision that finds drafting still ahead widely leaves the spacing)
            if self._min_interval_s > 0:
                self._decided_at = self._clock()
            if self._spec_probe_key is not None and not spec_stale:  # (after such a probe)
                self._spec_probe_judged(self._wins_widely(False))  # (off, by twice the guard)
            if self._after_probe:  # the verdict on a probe's drafts sets the next spacing
                self._after_probe = False
                self._probe_spacing = (min(2 * self._probe_spacing, _PROBE_BACKOFF_MAX)
                                       if self._wins_widely(False) else 1)  # fmt: skip
        if online and self._plain_probe_due(fixed, num_sampling, prefill_tokens):
            self._plain_probe_left = _PLAIN_PROBE_STEPS
        if self._plain_probe_left > 0:
            self._plain_probe_left -= 1
            if self._plain_probe_left == 0:
                self._forced = True  # decide again on the measured term
            return False, False
        if self._spec_probe_left > 0:  # every row drafts (an ordinary drafting step)
            self._spec_probe_left -= 1
            if self._spec_probe_left == 0:
                self._forced = True
            return True, False
        self._skipped = 0 if self.pays else self._skipped + 1
        probe = not self.pays and self._skipped % (_PROBE_EVERY * self._probe_spacing) == 0
        if probe:  # the next step verifies the probe's drafts: it decides on their survival
            self._forced, self._after_probe = True, True
        return self.pays or probe, not self.pays

    def _wins_widely(self, drafting: bool) -> bool:
        """The last decision, on real numbers, left drafting on (`drafting`) or off, that side
        ahead by twice the guard or more (its verdict then agreed with the state)."""
        if self._numbers is None or self.pays != drafting:
            return False
        _, spec_rate, plain_rate = self._numbers[:3]
        ahead, behind = (spec_rate, plain_rate) if drafting else (plain_rate, spec_rate)
        return ahead > behind * (1 + 2 * self.min_predicted_gain)

    def _pays(self, cost, fixed: FixedCosts, num_sampling: int) -> bool:
        """Draft only if some verify length beats plain decoding by the guard margin once the
        drafter's own cost is paid; once drafting on a decided state, stop only if plain
        decoding beats the best verify length by that margin. Judged for a decode step of
        the sampling requests."""
        survival = self.estimate(fixed.greedy)
        self._numbers = None
        if not self.enabled or survival is None or num_sampling == 0:
            return True
        plain_fixed = fixed.get("plain", num_sampling)
        plain, spec = decode_rates(cost, survival, num_sampling, plain_fixed)
        if spec > 0.0 and plain > 0.0:
            self.record.verdict(spec, plain, num_sampling, cost.add_fixed(
                cost.decode_variable(num_sampling, self.k)[1][-1]))  # fmt: skip
        g = self.min_predicted_gain
        # (probes) a plain term learned at a quarter of the requests or fewer bounds nothing
        # here: a host-bound step's term moves with the batch (H100, trained pair, T = 1: a
        # term learned at 4 requests priced plain steps at 16 at 0.64 ms where no-spec's took
        # 0.46, no probe ran, drafting stayed on 9.8% below no-spec; fifty-fifth session).
        # Learned above, its share stands (plain_floor: tails of levels, thirty-ninth
        # session). Learned nowhere near, or not at all, the table's own price may be high
        # too (_PLAIN_TABLE_SLACK).
        unknown = plain_fixed is None or fixed.learned_below("plain", num_sampling)
        if unknown:  # the bare forward, less a negative term if one was measured
            cheapest = 0.0 if plain_fixed is None else min(plain_fixed, 0.0)
        else:
            cheapest = fixed.plain_floor(cost.fixed_overhead_ms, plain_fixed, num_sampling)
        best = self._plain_best = decode_rates(cost, None, num_sampling, cheapest)[0]
        self._plain_may_win = best * (1 + _PLAIN_TABLE_SLACK * unknown) > spec * (1 + g)
        # (what a flip is logged with)
        self._numbers = (num_sampling, spec, plain, cost.fixed_overhead_ms, plain_fixed,
                         fixed.measured_at("plain", num_sampling), survival,
                         self.acceptance_ratio(fixed.greedy))  # fmt: skip
        # a dead band of the guard's width on each side of parity: once decided, drafting
        # turns off only where plain decoding wins by the guard, as it turns on only where
        # drafting does. Between, the state stands: margins inside it are the estimates' own
        # noise (H200, trained pair, T = 1, c = 4: flips on margins of 0.1-5% ran 206 plain
        # and 149 speculative steps, below both pure arms: 2,548 tok/s against 3,225 / 3,789)
        if self.pays and self._decided:
            return spec * (1.0 + g) >= plain
        return spec > plain * (1.0 + g)
