"""Online correction of the cost table's fixed per-step term.

A start-up profile times the target forward and the drafter only; a real step also pays host
work that no trimming removes, and attention over contexts longer than the profile's. Left
out, every token looks too expensive and the planner over-trims. Each decode step's residual
(measured step time beyond the table's forward + drafter time) joins a window of the last
WINDOW residuals, one per kind of step and per batch-size bucket (request counts 1, 2-3, 4-7,
...), and the term is the window's fenced mean (`fenced_mean`): throughput is tokens over the
sum of periods, so a term must be a kind's mean cost, tail included, but a served step's period
also holds whatever the driver did between steps (a request's arrival, a collection pause),
and one 20 ms outlier moved a plain average by 2 ms for tens of steps (an H200 server learned
3.9 ms for plain steps that took 2.5, and kept it until the next probe). The median that
replaced that average was blind to the tail a kind pays on every few steps: demo pair, T = 1,
c = 4 (H200, twenty-sixth session), speculative residuals averaged 0.21 ms and plain ones
0.10 over a round, while the window medians at its end were 0.12 and 0.07; drafting turned on
at terms of 0.069 ms speculative against 0.096 plain, and ran 9.9k tok/s where no speculation
ran 14.6k:

  spec   speculative steps that verify every draft (one whole-step graph where available):
         the table's `fixed_overhead_ms`, the term every candidate pays;
  plain  steps without speculation (drafting skipped): the baseline drafting must beat
         (while every step drafts, the decoder runs a few plain steps now and then to
         measure it: drafting.py);
  trim   speculative steps whose plan trimmed (verified fewer drafts than laid out), on any
         path: a trimmed plan pays their excess over `spec` (`trim_penalty_ms`). The table
         prices a trimmed step by its forward tokens; where the host, not the device, bounds
         the step, fewer tokens save nothing and the residual grows by what the table
         promised (H200, trained pair, c = 32: trimmed verify steps 1.07 ms busy + 0.83 idle
         against fixed K's untrimmed 1.03 + 0.72, 22% of drafts unverified, -10% against
         fixed K). The excess, measured, takes that promise back; where trimming does save
         time (device-bound steps) it is ~0. Only a bucket's own trimmed steps count, and
         only while fresh (TRIM_FRESH_STEPS): otherwise a penalty that stopped all trimming
         would never be re-measured;
  eager  untrimmed speculative steps on the eager path when whole-step graphs exist (trimmed
         ones are `trim`); where trimmed plans run eagerly (no trimmed graphs) and no trimmed
         step was measured, their excess over `spec` is the penalty.
Steps that verify a draft probe's drafts while drafting is off are not observed: they carry
the decision made on those drafts (a decision step planned for 0.26-0.38 ms on the H200's host
against 0.02-0.03 ms for others, demo pair) and, drafting being off, they were the only
speculative steps observed: the trained pair at one request learned 1.11 ms against 0.42-0.49
at 2-15 and kept drafting off where fixed K beat no speculation by 20% (fifteenth session).
Each kind is learned per sampling mode too (all rows greedy, or not: FixedCosts per mode).
One shared term would make whichever kind is cheaper look dearer and the other cheaper; one
term over all batch sizes learned at 64 requests where the table overstated steps (-2.3 ms)
made drafting look profitable at 128 where it understated them (measured on the H200: 16 ms
speculative steps planned as 12 ms, against 9 ms plain ones). A bucket not yet measured
MIN_SAMPLES times takes the nearest one that is. A residual may be negative: a table
profiled on a slower path than the one serving overstates a step, and the correction takes
that back (step times stay floored at a positive minimum). Steps with prefill chunks are not
observed: their residual is the table's error at thousands of tokens, not a decode step's
fixed cost.
"""

from __future__ import annotations

import math
from collections import deque

WARMUP_STEPS = 3  # first steps compile kernels and fill caches: not representative
WINDOW = 15  # residuals kept per kind and bucket
FENCE = 3.0  # fenced_mean clips a window's residuals to its quartiles -/+ FENCE x their spread
# a bucket measured fewer times is used only where no bucket has this many: batch sizes a
# server passes through (requests finishing and arriving at a level's edges) are measured a
# few times in those moments, and one such term (2.5 ms at 2-3 requests, H200, against
# speculative steps of 1.1-1.4 ms in all at 1 and 4) turned drafting off at c = 4
MIN_SAMPLES = 8
KINDS = ("spec", "plain", "eager", "trim")
# observed steps (all kinds) after which a bucket's trimmed-step term is dropped, to be
# measured afresh (MIN_SAMPLES trimmed steps) before it prices trims again
TRIM_FRESH_STEPS = 2048
# a bucket that only trims probes untrimmed steps only where its trims' term (host work,
# mostly) is at least this share of their period (untrimmed_stale)
HOST_SHARE = 0.25


def size_bucket(num_reqs: int) -> int:
    """Batch-size bucket: 1 | 2-3 | 4-7 | 8-15 | ... (bit length of the request count)."""
    return max(int(num_reqs), 1).bit_length()


def fenced_mean(values) -> float:
    """The mean of `values` each clipped to [q1 - FENCE * iqr, q3 + FENCE * iqr] (their lower
    and upper quartiles and the spread between: Tukey's far fences). A tail the steps pay every
    few steps stays in (spreads of 2-4x the median are a host-bound step's normal), a rare
    pause tens of times the typical step counts as a step at the fence. Residuals may be
    negative (a table profiled slower than serving), so the fences are not ratios."""
    s = sorted(values)
    n = len(s)
    q1, q3 = s[n // 4], s[(3 * n) // 4]
    lo, hi = q1 - FENCE * (q3 - q1), q3 + FENCE * (q3 - q1)
    total = sum(s)  # then clip the sorted tails only (every observed step: ~1 us, not ~7)
    i = n - 1
    while s[i] > hi:  # (ends at q3 <= hi at the latest; likewise q1 >= lo below)
        total += hi - s[i]
        i -= 1
    i = 0
    while s[i] < lo:
        total += lo - s[i]
        i += 1
    return total / n


class _Terms(dict):
    """Batch-size bucket -> the fenced mean of its window, computed when read: every decode
    step is observed, but a plan reads the terms only where it searches or decides (not a
    standing plan, not a plain step while drafting is off), so an observed step only marks
    its bucket stale (~0.1 µs against the mean's ~0.6 µs). Read through `[b]`, `get`, `items`
    or `values`: each returns fresh means."""

    def __init__(self, windows: dict[int, deque]) -> None:
        super().__init__()
        self._windows = windows
        self._stale: set[int] = set()

    def mark(self, b: int) -> None:
        """Bucket b's window changed (it holds at least one residual)."""
        self._stale.add(b)
        if not dict.__contains__(self, b):
            dict.__setitem__(self, b, 0.0)  # (a key now: a measured bucket; its mean on read)

    def _refresh(self) -> None:
        for b in self._stale:
            dict.__setitem__(self, b, fenced_mean(self._windows[b]))
        self._stale.clear()

    def __getitem__(self, b: int) -> float:
        if b in self._stale:
            self._stale.discard(b)
            dict.__setitem__(self, b, fenced_mean(self._windows[b]))
        return dict.__getitem__(self, b)

    def get(self, b, default=None):
        return self[b] if dict.__contains__(self, b) else default

    def items(self):
        self._refresh()
        return dict.items(self)

    def values(self):
        self._refresh()
        return dict.values(self)


def bucket_label(bucket: int) -> str:
    """The request counts of a bucket: "1", "2-3", "4-7", ..."""
    lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


class FixedCosts:
    """The learned terms of one sampling mode: steps whose rows are all greedy, or sampled
    ones (their verification and drafting sample over the vocabulary: on the H200's 33.6 M
    pair a plain step took 0.57 ms sampled against 0.39 ms greedy at one request). A kind
    this mode has not measured yet takes the other mode's term (`fallback`)."""

    def __init__(self, greedy: bool = True, fallback: FixedCosts | None = None,
                 observed: dict | None = None) -> None:  # fmt: skip
        self.greedy = greedy
        self.fallback = fallback
        self.steps = 0
        self._recent: dict[str, dict[int, deque]] = {kind: {} for kind in KINDS}
        # ... and the request counts of the steps in each window (measured_at)
        self._recent_n: dict[str, dict[int, deque]] = {kind: {} for kind in KINDS}
        # fenced means of the windows, per kind and bucket (computed when read: _Terms)
        self._term: dict[str, _Terms] = {kind: _Terms(self._recent[kind]) for kind in KINDS}
        self._last: dict[str, dict[int, int]] = {kind: {} for kind in KINDS}  # step last seen
        # every observed step by kind and batch-size bucket: [steps, their periods' ms, their
        # residuals' ms] (for /metrics: what the terms were learned from, to set against the
        # step clock's busy + idle and against the windows' terms); one table for both
        # sampling modes (fixed_costs_by_mode)
        self.observed: dict[tuple[str, int], list[float]] = {} if observed is None else observed

    def observe(self, kind: str, residual_ms: float, num_reqs: int,
                step_ms: float | None = None) -> None:  # fmt: skip
        """Add one step's residual to its kind's and batch size's window (the first
        measurement of a bucket replaces the table's term outright). `step_ms`: the step's
        measured period, which the residual was taken from (totalled in `observed` when
        given)."""
        b = size_bucket(num_reqs)
        if step_ms is not None:
            total = self.observed.setdefault((kind, b), [0, 0.0, 0.0])
            total[0] += 1
            total[1] += step_ms
            total[2] += residual_ms
        self.steps += 1
        if self.steps <= WARMUP_STEPS:
            return
        window, sizes = self._recent[kind].get(b), self._recent_n[kind].get(b)
        if kind == "trim" and self._stale_trims(b):
            window.clear()  # measured afresh: MIN_SAMPLES new steps before it prices trims
            sizes.clear()
        if window is None:
            window = self._recent[kind][b] = deque(maxlen=WINDOW)
            sizes = self._recent_n[kind][b] = deque(maxlen=WINDOW)
        window.append(residual_ms)
        sizes.append(num_reqs)
        self._term[kind].mark(b)
        self._last[kind][b] = self.steps

    def plain_share(self, num_reqs: int) -> float | None:
        """The ratio of the plain steps' term to the speculative steps' term at the batch-size
        bucket nearest `num_reqs` (the smaller on a tie) where this mode measured both (None:
        no such bucket). Most of a host-bound step's fixed term is per-step host work that
        both kinds pay (H200, trained pair, c = 64: plain 1.05 ms against speculative 1.08),
        so a plain step near there costs about this share of the speculative term. The least
        share over all buckets (thirty-eighth session) took the 1-4 request buckets', where
        the plain term is ~0 or below (H200, trained pair, T = 1: -0.057 ms at 1 request),
        so plain steps at 64 requests were priced at the bare forward again and probed, in
        11-step runs at 64, 51 and 31 requests (thirty-ninth session)."""
        spec, plain, b = self._term["spec"], self._term["plain"], size_bucket(num_reqs)
        both = [(abs(k - b), k) for k, s in spec.items() if s > 0 and k in plain]
        if not both:
            return None
        k = min(both)[1]
        return plain[k] / spec[k]

    def plain_floor(self, spec_ms: float, plain_ms: float | None, num_reqs: int) -> float:
        """The least a plain step's fixed term can be at `num_reqs` requests where the
        speculative steps' term is `spec_ms`: the share measured nearest of it (plain_share; 0
        with none measured, or a share below 0), or `plain_ms`, the plain term read there
        (None: none), if lower."""
        share = self.plain_share(num_reqs)
        floor = 0.0 if share is None else max(share, 0.0) * spec_ms
        return floor if plain_ms is None else min(floor, plain_ms)

    def measured_at(self, kind: str, num_reqs: int) -> float | None:
        """The mean request count of the steps this kind's term at this batch size was learned
        from, where it is its own bucket's (MIN_SAMPLES steps there; None: another bucket's,
        or none). A bucket spans up to 2x in requests and a host-bound step's term grows with
        them: a plain term learned at 128 requests priced plain steps at 251 at 0.6 ms where
        they took 1.9 (H100, trained pair, T = 0, c = 256, fifty-third session)."""
        sizes = self._recent_n[kind].get(size_bucket(num_reqs))
        return sum(sizes) / len(sizes) if sizes and len(sizes) >= MIN_SAMPLES else None

    def age(self, kind: str, num_reqs: int) -> float:
        """Observed steps since this kind was last measured at this very batch-size bucket
        (inf: never; `get` would answer with a neighbour's term)."""
        last = self._last[kind].get(size_bucket(num_reqs))
        return math.inf if last is None else self.steps - last

    def get(self, kind: str, num_reqs: int) -> float | None:
        """The learned term of a kind at this batch size: the nearest bucket's (its own
        first, the smaller on a tie) among those measured MIN_SAMPLES times, else among all
        measured ones, else the other mode's, else None."""
        own = self._nearest(kind, num_reqs)
        if own is None and self.fallback is not None:
            return self.fallback._nearest(kind, num_reqs)
        return own

    def _nearest(self, kind: str, num_reqs: int) -> float | None:
        k = self._nearest_bucket(kind, num_reqs)
        return None if k is None else self._term[kind][k]

    def _nearest_bucket(self, kind: str, num_reqs: int) -> int | None:
        table = self._term[kind]
        if not table:
            return None
        b = size_bucket(num_reqs)
        windows = self._recent[kind]
        own = windows.get(b)
        if own is not None and len(own) >= MIN_SAMPLES:  # (every step asks: the common case)
            return b
        candidates = [k for k in table if len(windows[k]) >= MIN_SAMPLES] or table
        return min(candidates, key=lambda k: (abs(k - b), k))

    def learned_below(self, kind: str, num_reqs: int) -> bool:
        """The term `get` answers for this kind at this batch size was learned two or more
        buckets below it (at a quarter of the requests or fewer), or not in this sampling
        mode at all (the other mode's, or none)."""
        k = self._nearest_bucket(kind, num_reqs)
        return k is None or k <= size_bucket(num_reqs) - 2

    def observed_totals(self) -> dict[str, dict[str, list[float]]]:
        """{kind: {batch-size range: [steps, period ms, residual ms]}}, cumulative."""
        out: dict[str, dict[str, list[float]]] = {}
        for (kind, b), total in sorted(self.observed.items()):
            out.setdefault(kind, {})[bucket_label(b)] = list(total)
        return out

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every learned term: {kind: {batch-size range ("4-7"): ms}} (for /metrics)."""
        return {kind: {bucket_label(b): v for b, v in sorted(terms.items())}
                for kind, terms in self._term.items() if terms}  # fmt: skip

    def speculative(self, num_reqs: int) -> float | None:
        """The speculative steps' term at this batch size: untrimmed steps' where this bucket
        has MIN_SAMPLES of them, else its own fresh trimmed steps' where it has MIN_SAMPLES
        of those (every step of a level may trim: H200, 8B shape, SYNTHETIC, c = 128, 247
        trimmed steps, 1.1 ms above the table, while the term came from a few untrimmed steps
        of 16-63 requests, 0.2 ms), else the nearest bucket's (`get`)."""
        b = size_bucket(num_reqs)
        own, trims = self._recent["spec"].get(b), self._recent["trim"].get(b)
        if ((own is None or len(own) < MIN_SAMPLES) and trims is not None
                and len(trims) >= MIN_SAMPLES and not self._stale_trims(b)):  # fmt: skip
            return self._term["trim"][b]
        return self.get("spec", num_reqs)

    def apply(self, cost, num_reqs: int) -> bool:
        """Set the table's fixed term to the speculative steps' at this batch size (once
        measured: `speculative`). Returns True when it moved by more than 0.05 ms."""
        spec = self.speculative(num_reqs)
        if spec is None or abs(spec - cost.fixed_overhead_ms) <= 1e-12:
            return False
        moved = abs(spec - cost.fixed_overhead_ms) > 0.05
        cost.fixed_overhead_ms = spec
        return moved

    def trim_penalty_ms(self, spec_ms: float, num_reqs: int, eager_trims: bool = False) -> float:
        """Measured extra fixed cost of a trimmed step over an untrimmed one at this batch
        size: the trimmed steps' term (this bucket's own, MIN_SAMPLES of them, fresh) less
        `spec_ms`, else, where trimmed plans run eagerly (`eager_trims`), the eager steps'
        term less it, else 0."""
        b = size_bucket(num_reqs)
        window = self._recent["trim"].get(b)
        if window is not None and len(window) >= MIN_SAMPLES and not self._stale_trims(b):
            return max(0.0, self._term["trim"][b] - spec_ms)
        eager = self.get("eager", num_reqs) if eager_trims else None
        return 0.0 if eager is None else max(0.0, eager - spec_ms)

    def untrimmed_stale(self, num_reqs: int) -> bool:
        """This bucket prices its trims against no fresh untrimmed steps: it has MIN_SAMPLES
        fresh trimmed steps, and its untrimmed ones are fewer than MIN_SAMPLES or none was
        observed in the last TRIM_FRESH_STEPS. Its trim penalty is then ~0 whatever trimming
        saves (`speculative` prices untrimmed steps at the trims' own term), and an engine
        whose steps the host bounds would trim for nothing (StepPlanning's untrimmed probe).
        Only where the trims' term is at least HOST_SHARE of their mean period: where the
        device bounds the step the table's savings are what trimming saves (H200, 8B shape,
        SYNTHETIC, c = 64: 201 trimmed steps of 13.3 ms, a term of 0.72 ms), and a probe of
        untrimmed steps would only cost time there."""
        b = size_bucket(num_reqs)
        trims = self._recent["trim"].get(b)
        if trims is None or len(trims) < MIN_SAMPLES or self._stale_trims(b):
            return False
        seen = self.observed.get(("trim", b))
        if seen is None or self._term["trim"][b] < HOST_SHARE * seen[1] / max(seen[0], 1):
            return False
        own = self._recent["spec"].get(b)
        return (own is None or len(own) < MIN_SAMPLES
                or self.age("spec", num_reqs) > TRIM_FRESH_STEPS)  # fmt: skip

    def _stale_trims(self, b: int) -> bool:
        last = self._last["trim"].get(b)
        return last is not None and self.steps - last > TRIM_FRESH_STEPS


def fixed_costs_by_mode() -> dict[bool, FixedCosts]:
    """One FixedCosts per sampling mode (all rows greedy: True), each the other's fallback,
    sharing one table of observed steps."""
    observed: dict = {}
    greedy, sampled = FixedCosts(True, observed=observed), FixedCosts(False, observed=observed)
    greedy.fallback, sampled.fallback = sampled, greedy
    return {True: greedy, False: sampled}
