"""The drafting decision's cadence and hysteresis, unit level (DraftingDecision alone, rates
from analytic cost tables): turning after two decisions against the state, a dead band of the
guard's width, draft probes and routine decisions spaced further while one side wins widely."""

from __future__ import annotations

import logging

import pytest

from dspark.spec.cost_model import CostModel


def test_drafting_turns_after_two_decisions_against_it(caplog):
    """A server passes through batch sizes for a step or two (a request finished, the next
    not yet arrived) and the decision re-runs at once when the batch size moves by a quarter:
    drafting turns on or off only after two decisions in a row against its state (the first
    verdict on real numbers sets the state at once). Each turn is logged with its numbers."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d, fixed = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True), FixedCosts()
    high, low = np.array([0.9, 0.81, 0.73, 0.66]), np.array([0.3, 0.09, 0.03, 0.01])

    def decide(survival) -> bool:  # a decision step on this survival: whether it drafts
        d._survival[True] = d.survival = survival
        return d.after_plan(True, cost, fixed, False, 4, 4, 0)[0]

    with caplog.at_level(logging.DEBUG, logger="dspark.spec.drafting"):
        assert decide(low) is False  # the first verdict: at once
        assert [decide(s) for s in (high, low, high, high)] == [False, False, False, True]
        assert [decide(s) for s in (low, high, low, low)] == [True, True, True, False]
    flips = [r.getMessage().split(" at ")[0] for r in caplog.records]
    assert flips == ["adaptive verification: drafting " + w for w in ("off", "on", "off")]


def test_margins_inside_the_guard_leave_the_state_as_it_is(monkeypatch):
    """A dead band around parity: drafting turns on where it beats plain decoding by the
    guard (5% here) and off only where plain decoding beats it by the guard; margins between
    (the estimates' noise) never flip the state, however many decisions in a row see them.
    The rates are set directly: this is the rule, not the cost model's arithmetic."""
    import numpy as np

    import dspark.spec.drafting as drafting
    from dspark.spec.online_cost import FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d, fixed = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True), FixedCosts()
    d._survival[True] = d.survival = np.array([0.5, 0.25, 0.12, 0.06])
    rates = {}  # spec tok/ms against a plain rate of 1.0
    monkeypatch.setattr(drafting, "decode_rates", lambda *a: (1.0, rates["spec"]))

    def decide(spec: float) -> bool:
        rates["spec"] = spec
        return d.after_plan(True, cost, fixed, False, 4, 4, 0)[0]

    assert decide(1.03) is False  # the first verdict: drafting must win by the guard
    assert [decide(s) for s in (1.04, 1.0, 1.049, 1.03)] == [False] * 4  # inside: stays off
    assert [decide(s) for s in (1.06, 1.06)] == [False, True]  # won by the guard twice: on
    # on: margins down to plain winning by just under the guard keep it on ...
    assert [decide(s) for s in (0.97, 0.96, 1.0, 0.953, 0.96)] == [True] * 5
    # ... plain winning by more than the guard twice in a row turns it off
    assert [decide(s) for s in (0.94, 0.93)] == [True, False]


def test_draft_probes_grow_sparser_while_plain_decoding_wins_widely():
    """While drafting is skipped, a draft probe every _PROBE_EVERY steps re-measures it. Each
    probe whose verdict is plain decoding by twice the guard doubles the spacing, up to
    _PROBE_BACKOFF_MAX times; a batch size moving by a quarter resets it."""
    import numpy as np

    import dspark.spec.drafting as drafting_mod
    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import FixedCosts

    # the drafter costs 20 ms against ~1.2 ms plain steps: plain decoding wins by far
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=20.0, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True, plain_probes=False)
    d.update_survival(np.full((16, 4), 0.5))

    def run(steps, num_reqs=16):
        probes = []
        for i in range(steps):
            drafts, _ = d.after_plan(d.due(num_reqs), cost, fixed, False, num_reqs, num_reqs, 0)
            if drafts:
                probes.append(i)
        return probes

    every = drafting_mod._PROBE_EVERY
    probes = run(32 * every)
    assert not d.pays and d._probe_spacing == drafting_mod._PROBE_BACKOFF_MAX
    gaps = np.diff(probes).tolist()
    assert gaps[:4] == [every, 2 * every, 4 * every, 8 * every]
    assert set(gaps[4:]) == {8 * every}  # capped
    d.due(40)  # the batch size moved by more than a quarter: probes as often as at first
    assert d._probe_spacing == 1
    # a verdict for plain decoding by less than twice the guard keeps probes frequent
    d2 = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True, plain_probes=False)
    near = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d2.update_survival(np.full((16, 4), 0.5))  # plain 16 tokens/ms, drafting 15.5
    d, cost = d2, near
    probes = run(8 * every)
    assert not d.pays and d._numbers[2] < d._numbers[1] * 1.1  # plain ahead, but not by 10%
    assert np.diff(probes).tolist() == [every] * (len(probes) - 1) and len(probes) >= 7


def _decided_at(d, cost, fixed, n: int, reqs: int, after=None) -> list[int]:
    """Which of n plans of `reqs` requests decided; `after(due)` after each plan."""
    out = []
    for i in range(n):
        due = d.due(reqs)
        d.after_plan(due, cost, fixed, False, reqs, reqs, 0)
        if due:
            out.append(i)
        if after is not None:
            after(due)
    return out


def _clocked_decision(enabled: bool):
    """(a decision spaced by DECIDE_MIN_S on a fake clock, a cost table, fixed terms, the
    clock's [now]); its survival estimate makes plain decoding the winner."""
    import numpy as np

    import dspark.spec.drafting as drafting
    from dspark.spec.online_cost import FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    now = [0.0]
    d = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=enabled,
                                  plain_probes=False, min_interval_s=drafting.DECIDE_MIN_S,
                                  clock=lambda: now[0])  # fmt: skip
    d._survival[True] = d.survival = np.array([0.05, 0.01, 0.0, 0.0])
    return d, cost, FixedCosts(), now


def test_routine_decisions_are_spaced_in_time_but_forced_ones_are_not():
    """In the engine routine decisions come every _DECIDE_EVERY plans and at least
    DECIDE_MIN_S apart (small models' steps are short, a decision step's host work is not);
    a changed batch size, a plain probe's end and a draft probe's verdict still decide at the
    next plan whatever the clock says."""

    import dspark.spec.drafting as drafting

    d, cost, fixed, now = _clocked_decision(enabled=True)  # plain decoding wins

    def plans(n: int, reqs: int = 16) -> list[bool]:  # which of n plans decide (1 ms apart)
        out = []
        for _ in range(n):
            due = d.due(reqs)
            d.after_plan(due, cost, fixed, False, reqs, reqs, 0)
            now[0] += 0.001
            out.append(due)
        return out

    first = plans(1)
    assert first == [True]  # (no decision yet at this batch size)
    decided = plans(40)
    # every 8 plans is not enough while the last decision is under 20 ms old
    assert [i for i, x in enumerate(decided) if x] == [19, 39]
    assert not d.pays  # off: every _PROBE_EVERY skipped steps one drafts for a few rows ...
    d._skipped = drafting._PROBE_EVERY - 1
    assert d.after_plan(False, cost, fixed, False, 16, 16, 0) == (True, True)
    assert plans(1) == [True]  # ... and the next plan decides on its drafts at once
    assert plans(1, reqs=40) == [True]  # a batch size that moved by a quarter: at once

    unspaced = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True,
                                         plain_probes=False)  # fmt: skip
    unspaced._survival[True] = unspaced.survival = d.survival
    due = []
    for _ in range(24):  # without the interval (the class's default): every 8 plans
        due.append(unspaced.due(16))
        unspaced.after_plan(due[-1], cost, fixed, False, 16, 16, 0)
    assert [i for i, x in enumerate(due) if x] == [0, 8, 16]


def test_a_dear_decision_spaces_the_routine_ones_by_its_own_host_time():
    """Routine decisions come no closer than a decision's host time (running mean) over
    DECIDE_HOST_SHARE, where that is longer than DECIDE_MIN_S; forced ones (a batch size that
    moved by a quarter) still decide at once. Without a minimum interval (tests, the class's
    default) the clock spaces nothing."""
    import numpy as np

    import dspark.spec.drafting as drafting

    # (draft skipping off: the verdict stands and no probe forces a decision; the cadence is
    # the same)
    d, cost, fixed, now = _clocked_decision(enabled=False)

    def plans(n: int, decision_s: float, reqs: int = 16) -> list[int]:  # 1 ms apart
        def tick(due: bool) -> None:
            if due:
                d.note_decision_s(decision_s)
            now[0] += 0.001

        return _decided_at(d, cost, fixed, n, reqs, tick)

    share = drafting.DECIDE_HOST_SHARE
    cheap = 0.5 * drafting.DECIDE_MIN_S * share  # (its share's interval is under the floor)
    assert plans(1, cheap) == [0]
    assert plans(60, cheap) == [19, 39, 59]  # DECIDE_MIN_S apart
    dear = 0.3e-3  # 0.3 ms a decision: 60 ms apart at a 0.5% share
    assert dear / share == pytest.approx(0.06)
    # the running mean moves a fifth of the way per decision: spacing grows to ~60 plans
    gaps = np.diff(plans(2000, dear)).tolist()
    assert gaps[0] == 20 and all(59 <= g <= 61 for g in gaps[-10:]), gaps[-12:]
    assert plans(1, dear, reqs=40) == [0]  # a batch size that moved: at once, as before
    d._min_interval_s = 0.0  # no interval: every _DECIDE_EVERY plans, whatever the cost
    assert np.diff(plans(40, dear, reqs=40)).tolist() == [drafting._DECIDE_EVERY] * 4


def test_decisions_grow_sparser_while_drafting_wins_widely():
    """While drafting beats plain decoding by twice the guard or more, each routine decision
    doubles the spacing of the next, up to _DECIDE_BACKOFF_MAX times _DECIDE_EVERY; a batch
    size that moved by a quarter forces a decision at once, which leaves the spacing as it was
    when drafting still wins widely there; a verdict closer than that brings it back to every
    _DECIDE_EVERY plans."""
    import numpy as np

    import dspark.spec.drafting as drafting
    from dspark.spec.online_cost import FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    d = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True, plain_probes=False)
    high = np.array([0.9, 0.81, 0.73, 0.66])  # drafting wins by far
    d._survival[True] = d.survival = high

    def decided_at(n: int, reqs: int = 16) -> list[int]:
        return _decided_at(d, cost, fixed, n, reqs)

    every, cap = drafting._DECIDE_EVERY, drafting._DECIDE_BACKOFF_MAX
    gaps = np.diff(decided_at(40 * every)).tolist()
    assert d.pays
    # (the first decision, at a batch size not decided before, is forced: 1x after it)
    assert gaps[:4] == [every, 2 * every, 4 * every, cap * every]
    assert set(gaps[3:]) == {cap * every}
    assert decided_at(1, reqs=24) == [0]  # the batch size moved by a quarter: at once ...
    # ... and, drafting still far ahead at 24 requests, the spacing stands
    assert decided_at(cap * every, reqs=24) == [cap * every - 1]
    # near parity (drafting ahead by less than twice the guard): every _DECIDE_EVERY plans
    close = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                               draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d2 = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True,
                                   plain_probes=False)  # fmt: skip
    d2._survival[True] = d2.survival = np.array([0.55, 0.35, 0.18, 0.1])  # ahead by 9%
    d, cost = d2, close
    decided = decided_at(8 * every)
    spec_rate, plain_rate = d._numbers[1:3]
    assert d.pays and spec_rate < plain_rate * 1.1
    assert np.diff(decided).tolist() == [every] * (len(decided) - 1)


def test_one_request_more_or_less_does_not_force_a_decision():
    """A batch size moving by a quarter forces a decision at once, but only when it moved by
    at least _MOVED_MIN requests: at c = 4 each request leaving or arriving moved it between 3
    and 4 and decided on ~7% of the plans."""
    import numpy as np

    import dspark.spec.drafting as drafting
    from dspark.spec.online_cost import FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    d = drafting.DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True, plain_probes=False)
    d._survival[True] = d.survival = np.array([0.9, 0.81, 0.73, 0.66])
    fixed = FixedCosts()

    def plan(reqs: int) -> bool:
        due = d.due(reqs)
        d.after_plan(due, cost, fixed, False, reqs, reqs, 0)
        return due

    assert plan(4)  # (the first decision)
    assert [plan(n) for n in (3, 4, 3, 4)] == [False] * 4  # +-1 request: routine cadence only
    assert plan(2)  # 4 -> 2 (decided at 4): moved by half, two requests
    assert plan(40) and not plan(39) and plan(29)  # (40 -> 29: a quarter and 11 requests)


def _slow_spell(plain_age: int, reqs: int = 4, plain_reqs: int = 4, per_token: float = 0.01):
    """A drafting engine at `reqs` requests whose speculative steps' term jumps from 0.2 to
    3 ms (the host's slow spell: every step's wall time grows), its plain term measured at
    0.2 ms `plain_age` observed steps ago, at `plain_reqs` requests. Returns (decision, fixed
    terms, table, step) where step(decide) runs one plan."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import WARMUP_STEPS, FixedCosts

    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=per_token, fixed_overhead_ms=0.2,
                              draft_base_ms=0.2, draft_ms_per_req=0.0)  # fmt: skip
    d, fixed = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True), FixedCosts()
    d._survival[True] = d.survival = np.array([0.5, 0.25, 0.12, 0.06])
    for _ in range(WARMUP_STEPS + 15):
        fixed.observe("plain", 0.2, plain_reqs)
    for _ in range(plain_age):
        fixed.observe("spec", 0.2, reqs)

    def step(decide: bool) -> bool:  # one plan (the decoder applies the spec term first)
        cost.fixed_overhead_ms = fixed.speculative(reqs)
        return d.after_plan(decide, cost, fixed, True, reqs, reqs, 0)[0]

    assert step(True) and d.pays  # drafting wins (at 4 requests: 4.8 against 3.2 tok/ms)
    for _ in range(15):  # the slow spell: a window of speculative steps at 3 ms
        fixed.observe("spec", 3.0, reqs)
    return d, fixed, step


def test_drafting_turns_off_only_on_a_plain_term_of_the_same_moment():
    """Both fixed terms are wall-clock medians and a host-bound engine's host speed drifts
    (H200 host: 0.9-2.2x for the same work). A verdict for plain decoding that rests on a
    plain term measured long ago runs a plain probe first, then decides on both terms as
    measured now: the slow spell slowed plain steps too, so drafting stays on. A plain term
    measured lately is trusted: two such verdicts turn drafting off, as before."""
    d, fixed, step = _slow_spell(plain_age=200)  # plain measured 200 steps ago
    assert step(True) is False and d.pays  # the verdict went to a plain probe, not a flip
    drafted = []
    for _ in range(12):  # the probe's steps, observed in the same slow spell
        fixed.observe("plain", 3.0, 4)
        drafted.append(step(d.due(4)))
    assert drafted[-1] is True and d.pays  # decided again on today's terms: drafting wins
    assert not any(drafted[:-1])  # (the probe's own steps drafted nothing)
    assert fixed.age("plain", 4) <= 2

    d, fixed, step = _slow_spell(plain_age=10)  # plain measured 10 steps ago: trusted
    assert step(True) is True and d.pays  # one verdict against: stands (_FLIP_AFTER)
    assert step(True) is False and not d.pays  # two: off, with no probe in between


def test_drafting_turns_off_only_on_a_plain_term_learned_at_about_this_batch_size():
    """A batch-size bucket spans up to 2x in requests, and a host-bound step's fixed term grows
    with them (H100, trained pair, T = 0, c = 256: a plain term learned at 128 requests, 0.6
    ms, priced plain steps at 251 that took 1.9 ms; drafting went off for 37 steps and the
    level ran 9% behind fixed K). A fresh plain term from the same bucket but another batch
    size sends the verdict to a plain probe at this one, as a stale term does; where no probe
    can run (one just did), the verdict waits."""
    from dspark.spec.plain_probes import plain_near

    d, fixed, step = _slow_spell(10, reqs=200, plain_reqs=128, per_token=0.001)  # one bucket
    assert fixed.age("plain", 200) <= 30 and fixed.measured_at("plain", 200) == 128
    assert not plain_near(fixed, 200)
    assert step(True) is False and d.pays  # the verdict went to a plain probe, not a flip
    for _ in range(12):  # the probe's steps, at 200 requests
        fixed.observe("plain", 0.2, 200)
        step(d.due(200))
    assert plain_near(fixed, 200)  # (the window's mean: 3 steps at 128, 12 at 200)
    # a probe whose steps went unobserved (prefill chunks beside them, say): no probe again
    # so soon, and the far term still turns nothing off, however many verdicts go against
    d, fixed, step = _slow_spell(10, reqs=200, plain_reqs=128, per_token=0.001)
    assert step(True) is False and d.pays  # the probe (its 12 plain steps)
    assert [step(True) for _ in range(12)] == [False] * 11 + [True]  # (none observed)
    assert all(step(True) for _ in range(6)) and d.pays
    d, fixed, step = _slow_spell(10, reqs=150, plain_reqs=128, per_token=0.001)  # within 1.25x
    assert plain_near(fixed, 150)
    assert step(True) is True and d.pays  # one verdict against: stands (_FLIP_AFTER)
    assert step(True) is False and not d.pays  # two: off, with no probe in between
