"""The drafting decision's speculative probes (plain_probes.py): while drafting is off, a
verdict for plain decoding on a speculative term not measured lately at the batch size runs
every row's drafting for a few steps first, then decides again on the term they measured."""

from __future__ import annotations

import numpy as np

from dspark.spec.cost_model import CostModel


def _off_decision(spec_ms: float):
    """A decision that turned drafting off at 32 requests on a speculative term of `spec_ms`
    (and a plain one of 0.1 ms) learned there; survivals ~0.45, 0.2, ..."""
    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    # a forward of n tokens: 0.2 ms + 0.001 ms per token; the drafter 0.1 ms
    cost = CostModel.analytic(weight_read_ms=0.2, ms_per_token=0.001, fixed_overhead_ms=0.0,
                              draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        fixed.observe("spec", spec_ms, 32)
        fixed.observe("plain", 0.1, 32)
    fixed.apply(cost, 32)
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    for _ in range(20):
        d.update_survival(np.full((4, 4), 0.45))
    assert d.after_plan(True, cost, fixed, True, 32, 32, 0) == (False, True)  # off at once
    assert not d.pays
    return d, cost, fixed


def _plan(d, cost, fixed, n: int = 32, decide: bool | None = None) -> tuple[bool, bool]:
    """One planned step, deciding where due (as the step planner asks)."""
    return d.after_plan(d.due(n) if decide is None else decide, cost, fixed, True, n, n, 0)


def test_a_stale_speculative_term_is_measured_before_drafting_stays_off():
    """Drafting turned off on a speculative term of 3 ms. Fresh (observed within 64 steps at
    this batch size), it stands: decisions keep drafting off, no probe. Once stale (plain
    steps only since), the next verdict for plain decoding first runs 12 steps drafting for
    every row (ordinary drafting steps, not a draft probe's few rows), then decides again at
    once; there, with the speculative steps measured at 0.1 ms, drafting is ahead."""
    from dspark.spec.plain_probes import _SPEC_FRESH, _SPEC_PROBE_STEPS

    d, cost, fixed = _off_decision(3.0)
    assert _plan(d, cost, fixed, decide=True) == (False, True)  # fresh: off, no probe
    for _ in range(_SPEC_FRESH + 1):  # plain steps only
        fixed.observe("plain", 0.1, 32)
    plans = [_plan(d, cost, fixed, decide=True)]  # the verdict on the stale term: a probe
    for _ in range(_SPEC_PROBE_STEPS - 1):
        fixed.observe("spec", 0.1, 32)  # (what the probe's steps measure)
        plans.append(_plan(d, cost, fixed))
    assert plans == [(True, False)] * _SPEC_PROBE_STEPS
    assert d._forced and d.due(32)  # decided again at once
    fixed.observe("spec", 0.1, 32)
    fixed.apply(cost, 32)
    assert fixed.get("spec", 32) < 1.0
    d.after_plan(True, cost, fixed, True, 32, 32, 0)
    assert d._numbers[1] > d._numbers[2] * 1.05  # drafting ahead now (one verdict of two)


def test_speculative_probes_are_spaced_per_batch_size_and_back_off():
    """At most one speculative probe per 512 plans at a batch-size bucket (another bucket has
    its own), none beside prefill chunks or where the bucket never measured speculative
    steps, and twice as far apart after each probe whose decision still kept drafting off by
    twice the guard."""
    from dspark.spec.plain_probes import _SPEC_FRESH, _SPEC_PROBE_EVERY, _SPEC_PROBE_STEPS

    d, cost, fixed = _off_decision(3.0)

    def stale() -> None:
        for _ in range(_SPEC_FRESH + 1):
            fixed.observe("plain", 0.1, 32)

    def probe_runs() -> bool:
        """A decision now starts a probe (run to its end; its steps measure 3 ms again)."""
        if d.after_plan(True, cost, fixed, True, 32, 32, 0) != (True, False):
            return False
        for _ in range(_SPEC_PROBE_STEPS - 1):
            fixed.observe("spec", 3.0, 32)
            assert _plan(d, cost, fixed, decide=False) == (True, False)
        assert d.after_plan(True, cost, fixed, True, 32, 32, 0)[0] is False  # still off
        return True

    stale()
    assert d.after_plan(True, cost, fixed, True, 32, 32, 64) == (False, True)  # (prefill)
    assert probe_runs()
    stale()
    assert not probe_runs()  # within 512 plans of the last one
    d._plans += _SPEC_PROBE_EVERY
    assert not probe_runs()  # its verdict was off by far: now 1024 plans apart
    d._plans += _SPEC_PROBE_EVERY
    assert probe_runs()
    # a bucket that never measured speculative steps takes its neighbours' term, no probe
    # (a level's tail passes through several); one that did has its own schedule
    assert d.after_plan(True, cost, fixed, True, 5, 5, 0)[0] is False
    for _ in range(8):
        fixed.observe("spec", 3.0, 5)
    stale()
    assert d.after_plan(True, cost, fixed, True, 5, 5, 0) == (True, False)


def test_a_plain_term_learned_at_a_quarter_of_the_requests_bounds_no_probe():
    """Plain steps' fixed term learned at 4 requests (0.9x the speculative one) prices plain
    decoding at 4 requests and, its share, at 8 and at 64 requests' tails (plain_floor):
    there no probe runs where plain decoding at that share could not win. At 16 requests
    and up it bounds nothing (a host-bound step's term moves with the batch): where plain
    decoding at the table's bare forward would win, plain steps there are probed."""
    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    # a forward of n tokens: 1 ms + 0.01 ms per token; the drafter 1 ms; spec fixed term 2 ms
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=2.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        fixed.observe("spec", 2.0, 4)
        fixed.observe("plain", 1.8, 4)
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    for _ in range(20):  # survivals ~0.45: ahead of plain steps at 1.8 ms, behind bare ones
        d.update_survival(np.full((4, 4), 0.45))
    for n, probed in ((4, False), (8, False), (16, True), (32, True)):
        assert abs(fixed.get("plain", n) - 1.8) < 1e-9  # (the term at 4 requests, wherever asked)
        assert d._pays(cost, fixed, n)
        assert d._plain_may_win is probed and d._plain_probe_due(fixed, n, 0) is probed, n
    assert not fixed.learned_below("plain", 7) and fixed.learned_below("plain", 16)
    fixed2 = FixedCosts()  # learned above: the share stands (a level's tail)
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        fixed2.observe("spec", 2.0, 64)
        fixed2.observe("plain", 1.8, 64)
    assert d._pays(cost, fixed2, 16) and not d._plain_may_win


def test_where_no_plain_term_was_learned_near_the_tables_price_gets_slack():
    """The start-up table overstated plain steps of 16-32 sampling requests by 13-16% (H200,
    trained pair, T = 1, fifty-sixth session): with the plain term learned at one request
    only, drafting priced 10-18% ahead stayed on, unprobed, 3-7% below no-spec. Where no
    plain term was learned within two buckets, plain decoding's best case is the table's bare
    forward made _PLAIN_TABLE_SLACK cheaper: drafting ahead by less than that gets a plain
    probe, ahead by more does not; and a plain term learned at the batch size bounds the
    probe as before (no slack)."""
    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts
    from dspark.spec.plain_probes import _PLAIN_TABLE_SLACK
    from dspark.spec.rates import decode_rates

    # a forward of n tokens: 0.4 ms + 0.001 ms per token; the drafter 0.1 ms
    cost = CostModel.analytic(weight_read_ms=0.4, ms_per_token=0.001, fixed_overhead_ms=0.0,
                              draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip

    def decide(survival: float, plain_at: int) -> DraftingDecision:
        fixed = FixedCosts(greedy=False)
        for _ in range(WARMUP_STEPS + MIN_SAMPLES):
            fixed.observe("spec", 0.15, 16)
            fixed.observe("plain", 0.0, plain_at)  # plain steps priced at the bare forward
        fixed.apply(cost, 16)
        d = DraftingDecision(k=4, min_predicted_gain=0.04, enabled=True)
        for _ in range(20):
            d.update_survival(np.full((4, 4), survival))
        assert d._pays(cost, fixed, 16)  # drafting ahead of plain decoding at the table's price
        lead = d._numbers[1] / decode_rates(cost, None, 16, 0.0)[0]
        assert 1.04 < lead, lead
        d.lead, d.fixed = lead, fixed
        return d

    near_tie = decide(0.5, plain_at=1)  # ahead by ~19%, the plain term from one request
    assert near_tie.lead * 1.04 < 1 + _PLAIN_TABLE_SLACK
    assert near_tie._plain_may_win and near_tie._plain_probe_due(near_tie.fixed, 16, 0)
    far = decide(0.6, plain_at=1)  # ahead by ~42%: beyond the slack, no probe
    assert far.lead * 1.04 > 1 + _PLAIN_TABLE_SLACK
    assert not far._plain_may_win and not far._plain_probe_due(far.fixed, 16, 0)
    measured = decide(0.5, plain_at=16)  # the same lead on a plain term learned here
    assert not measured._plain_may_win and not measured._plain_probe_due(measured.fixed, 16, 0)
