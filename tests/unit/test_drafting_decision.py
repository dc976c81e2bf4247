"""The lagged policy's drafting decision in the engine: skipped when it cannot pay (lossless),
draft probes while skipping, plain probes while drafting, drafting kept when it pays."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cost_model import CostModel
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import MAX_NEW, PROMPTS, _generate, _llm, _table


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("ad")), tiny_qwen, seed=9)


def test_drafting_is_skipped_when_it_cannot_pay(tiny_qwen, drafter, tmp_path):
    # the drafter costs 20 ms per step, verification is nearly free: with this random drafter's
    # low acceptance, plain decoding wins and the lagged policy stops drafting
    reference = _generate(LLM(tiny_qwen, device="cpu"))
    path = _table(tmp_path, "costly_drafter", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.0, draft_base_ms=20.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path)
    assert _generate(llm) == reference  # lossless: skipped rounds are plain decoding
    spec = llm.engine.runner.spec
    decode_rounds = sum(MAX_NEW - 1 for _ in PROMPTS)
    assert 0 < llm.engine.spec_stats.num_steps < 0.25 * decode_rounds
    assert spec.metrics()["drafting"] is False
    # the same table with skipping disabled drafts every round
    llm = _llm(tiny_qwen, drafter, "lagged", path, draft_skipping=False)
    assert _generate(llm) == reference
    assert llm.engine.spec_stats.num_steps >= 0.9 * decode_rounds


def test_probes_while_skipping_draft_for_a_few_rows(tiny_qwen, drafter, monkeypatch, tmp_path):
    """While drafting is skipped, a probe every few steps drafts for at most 8 rows of the
    batch (enough to refresh an aggregate survival estimate) instead of all of them; the
    output stays the plain decoding output."""
    import dspark.spec.drafting as drafting_mod

    monkeypatch.setattr(drafting_mod, "_PROBE_EVERY", 4)
    monkeypatch.setattr(drafting_mod, "_PROBE_BACKOFF_MAX", 1)  # (a probe every 4 steps)
    path = _table(tmp_path, "costly_drafter", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.0, draft_base_ms=20.0, draft_ms_per_req=0.0)  # fmt: skip
    prompts = [list(range(5 + i, 12 + i)) for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs]

    want = run(LLM(tiny_qwen, device="cpu"))
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=512)
    spec = llm.engine.runner.spec
    sizes, propose = [], spec.drafter.propose
    spec.drafter.propose = lambda anchors, *a, **k: (sizes.append(anchors.shape[0]),
                                                     propose(anchors, *a, **k))[1]
    assert run(llm) == want
    # before the first verdict on known confidences every row drafts: the prefill step's
    # drafts, and the first verifying step's (it may read no confidences but older ones)
    assert sizes[:2] == [12, 12]
    probes = sizes[2:]
    assert len(probes) >= 3 and all(n <= 8 for n in probes)


def test_drafting_continues_when_it_pays(tiny_qwen, tmp_path):
    from pathlib import Path

    full = make_tiny_drafter(str(tmp_path / "full"), tiny_qwen)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(full) / "config.json").read_text())
    path = _table(tmp_path, "cheap_drafter", weight_read_ms=5.0, ms_per_token=0.001,
                  fixed_overhead_ms=1.0, draft_base_ms=0.5, draft_ms_per_req=0.0)  # fmt: skip
    cfg = {"model": str(bare), "num_speculative_tokens": 4, "adaptive_policy": "lagged",
           "cost_table_path": path, "rejection_sample_method": "synthetic",
           "synthetic_acceptance_rates": [0.95] * 4}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", load_format="dummy", speculative_config=cfg)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    st = llm.engine.spec_stats
    assert llm.engine.runner.spec.metrics()["drafting"] is True
    assert st.num_accepted_tokens > 2 * st.num_steps  # long accepted runs, drafting kept on


@pytest.mark.parametrize("probe", [True, False])
def test_plain_steps_are_probed_while_drafting(tiny_qwen, tmp_path, caplog, probe):
    """While every step drafts, no plain step is measured and the drafting decision prices
    plain decoding with the speculative steps' fixed term, which also holds what only
    speculation pays. With `plain_probes`, a short plain probe measures it: here speculative
    steps pay 4 ms of fixed cost and plain ones 0.2 ms, so drafting stops once plain steps
    are measured (the default), and never without the probe."""
    from pathlib import Path

    full = make_tiny_drafter(str(tmp_path / "full"), tiny_qwen)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(full) / "config.json").read_text())
    cfg = {"model": str(bare), "num_speculative_tokens": 4, "adaptive_policy": "lagged",
           "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.6] * 4}
    cfg["plain_probes"] = probe
    llm = LLM(tiny_qwen, device="cpu", load_format="dummy", speculative_config=cfg)
    spec = llm.engine.runner.spec
    table = CostModel.from_measurements([1, 64], [1.0, 1.5], [1, 64], [0.5, 0.5],
                                        provenance={"source": "profiled"})  # fmt: skip
    spec.set_cost_model(table, "profiled at start-up")
    assert spec._online_cost
    observe, kinds = spec.observe_step_time, []

    def steps_as_priced(step_ms, num_tokens, num_reqs, tag):
        # the step's time as the test's device would take it (this CPU's are noise here)
        if tag is not None:
            kinds.append(tag[0])
            fixed = 0.2 if tag[0] == "plain" else 4.0
            step_ms = float(spec.cost.verify_cost_ms(num_tokens)) + tag[1] + fixed
        observe(step_ms, num_tokens, num_reqs, tag)

    spec.observe_step_time = steps_as_priced
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="dspark.spec.drafting"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    flips = [r.getMessage() for r in caplog.records if "drafting o" in r.getMessage()]
    if probe:
        # measured: plain steps at this batch size, at their true fixed cost; drafting off
        assert spec.fixed_costs.get("plain", len(PROMPTS)) == pytest.approx(0.2, abs=1e-6)
        assert spec.metrics()["drafting"] is False
        # the flip is logged with the numbers it was decided on
        assert flips and flips[0].startswith("adaptive verification: drafting off at ")
        assert f"plain 0.200 ms (measured at {len(PROMPTS)} requests)" in flips[0]
        first_plain = kinds.index("plain")
        assert "spec" in kinds[:first_plain]  # it drafted before it measured plain steps
    else:  # plain steps never measured: the speculative term stands in and drafting goes on
        assert "plain" not in kinds and not flips
        assert spec.metrics()["drafting"] is True
        assert llm.engine.spec_stats.num_steps > 60


def test_survival_is_scaled_by_drafts_accepted_over_predicted():
    """A calibration fitted on one workload can be off on another (H200, trained pair, T = 0:
    survivals summing to 1.9 predicted, 2.9 drafts accepted per round, and drafting was turned
    off where it paid). The decision scales each sampling mode's survival by its drafts
    accepted / the number its confidences predicted at the lengths verified."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import FixedCosts
    from dspark.spec.rates import predicted_accepted, prefix_survival

    # plain decoding 1 token per ms; drafting costs another ms: it pays above ~1.1 survivals
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    greedy, sampled = FixedCosts(greedy=True), FixedCosts(greedy=False)
    stale = np.full((8, 4), 0.5)
    predicted = predicted_accepted(prefix_survival(stale))
    np.testing.assert_allclose(predicted[0], [0.0, 0.5, 0.75, 0.875, 0.9375])
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    d.update_survival(stale, greedy=True)
    assert d.acceptance_ratio(True) == 1.0  # nothing observed: the confidences as they are
    assert not d._pays(cost, greedy, 1)  # 0.94 survivals in all
    d.observe_acceptance(True, accepted=2.0, predicted=predicted[0, 3], rows=1)
    assert d.acceptance_ratio(True) == 1.0  # too little observed yet
    for _ in range(6):
        d.observe_acceptance(True, accepted=8 * 1.75, predicted=8 * predicted[0, 4], rows=8)
    assert d.acceptance_ratio(True) == pytest.approx(1.75 / 0.9375, rel=0.01)
    for _ in range(40):  # the old observations decay
        d.observe_acceptance(True, accepted=8 * 1.875, predicted=8 * predicted[0, 4], rows=8)
    assert d.acceptance_ratio(True) == pytest.approx(2.0, rel=1e-3)
    np.testing.assert_allclose(d.estimate(True), [1.0, 0.5, 0.25, 0.125], rtol=1e-3)
    assert d._pays(cost, greedy, 1)
    # the other sampling mode keeps its own ratio (and, unmeasured, this mode's survival)
    assert d.acceptance_ratio(False) == 1.0 and not d._pays(cost, sampled, 1)
    for _ in range(40):  # bounded: a ratio never claims more than twice or half the drafts
        d.observe_acceptance(False, accepted=0.0, predicted=8.0, rows=8)
    assert d.acceptance_ratio(False) == 0.5


def test_the_survey_leaves_out_rows_with_an_unknown_confidence():
    """survey(): a row with any NaN (its confidences' copy not landed) stays out of the
    estimate and the prediction; none known: no prediction, the estimate unchanged."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision

    d = DraftingDecision(k=3, min_predicted_gain=0.05, enabled=True)
    stale = np.array([[0.5, 0.5, 0.5], [0.9, np.nan, 0.9], [1.0, 0.5, 0.0], [np.nan] * 3])
    rows, predicted, greedy = d.survey(np.array([2, 5, 6, 9]), stale, True)
    assert rows.tolist() == [2, 6] and greedy
    np.testing.assert_allclose(predicted, [[0, 0.5, 0.75, 0.875], [0, 1.0, 1.5, 1.5]])
    np.testing.assert_allclose(d.survival, [0.75, 0.375, 0.0625])  # (their mean)
    assert d.survey(np.array([0, 1]), np.full((2, 3), np.nan), True) is None
    np.testing.assert_allclose(d.survival, [0.75, 0.375, 0.0625])
    rows, _, _ = d.survey(np.array([4]), np.array([[0.5, 0.5, 0.5]]), True)  # all known
    assert rows.tolist() == [4]
    np.testing.assert_allclose(d.survival, [0.7, 0.35, 0.075])  # (EMA: 0.2 new, 0.8 old)


def test_the_ratio_is_measured_at_one_request_of_low_survival_too():
    """The decayed sums never exceed ~80 rows' numbers, so at one request whose confidences
    predict under 0.1 drafts a step the predicted sum never reaches the 8 drafts the ratio
    waits for, and it would stay at 1 however far the confidences were off (with the sums'
    first memory of 10 steps, 0.78 predicted drafts a step never reached them: demo pair on
    the H200, c = 1: 0.78 predicted, 1.13 accepted a step). Sixteen observed decision steps
    are enough evidence too; fewer are not."""
    from dspark.spec.acceptance_estimate import _ACCEPT_MIN_STEPS
    from dspark.spec.drafting import DraftingDecision

    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    for _ in range(_ACCEPT_MIN_STEPS - 1):
        d.observe_acceptance(True, accepted=0.13, predicted=0.09, rows=1)
    assert d.acceptance_ratio(True) == 1.0  # too few steps, too few drafts
    for _ in range(400):
        d.observe_acceptance(True, accepted=0.13, predicted=0.09, rows=1)
    assert d._accepted[True][1] < 8.0  # (the decayed sum stays under the drafts' threshold)
    assert d.acceptance_ratio(True) == pytest.approx(0.13 / 0.09, rel=1e-6)
    assert d.acceptance_ratio(False) == 1.0  # (the other mode: nothing observed)
    # at 0.78 predicted drafts a step the drafts' threshold comes first (~11 steps)
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    for _ in range(12):
        d.observe_acceptance(True, accepted=1.13, predicted=0.78, rows=1)
    assert d.acceptance_ratio(True) == pytest.approx(1.13 / 0.78, rel=1e-6)


def test_the_ratios_memory_spans_enough_rows_at_one_request():
    """At one request a decision step checks one row, and at T = 1 a row's accepted drafts
    spread wider than their mean; ten steps' memory let the ratio wander to ~0.5 where it was
    ~1 (H100, trained pair, T = 1, c = 1, fifty-seventh session). Steps of fewer than
    _ACCEPT_DECAY_ROWS rows decay the sums by their share of a step, so over 2,000 one-row
    steps drawn with a true ratio of 1 the ratio stays within 0.65-1.4 (with one step's
    decay per row it reaches 0.55 and 1.6), while steps of 8 rows or more keep
    the ten-step memory (a workload change is followed as fast as before)."""
    import numpy as np

    from dspark.spec.acceptance_estimate import _ACCEPT_DECAY, step_decay
    from dspark.spec.drafting import DraftingDecision

    # a row's accepted drafts at T = 1: each of K = 7 drafts survives with 0.6 given its
    # prefix: 1.3 expected, spread 1.5; its prediction is that mean
    mean = float((0.6 ** np.arange(1, 8)).sum())

    def ratios(draws, rows_told):  # one row a step, told as `rows_told` rows
        d = DraftingDecision(k=7, min_predicted_gain=0.05, enabled=True)
        out = []
        for accepted in draws:
            d.observe_acceptance(True, float(accepted), mean, rows=rows_told)
            out.append(d.acceptance_ratio(True))
        return np.array(out[100:])

    for seed in range(4):
        rng = np.random.default_rng(seed)
        draws = np.cumprod(rng.random((2000, 7)) < 0.6, axis=1).sum(axis=1)
        assert abs(draws.mean() - mean) < 0.1 and draws.std() > mean  # (wider than the mean)
        now = ratios(draws, 1)
        assert now.min() > 0.65 and now.max() < 1.4, seed
        before = ratios(draws, 8)  # (a full step's decay at every row: the memory before)
        assert before.min() < 0.55 and before.max() > 1.6, seed
        assert now.std() < 0.5 * before.std()
    assert step_decay(8) == step_decay(64) == _ACCEPT_DECAY
    assert step_decay(1) == pytest.approx(_ACCEPT_DECAY ** (1 / 8))
    # a committed step's check passes its checked rows' count: one row, a row's decay
    d = DraftingDecision(k=3, min_predicted_gain=0.05, enabled=True)
    d._accepted[True] = [10.0, 10.0]
    prediction = d.survey(np.array([0]), np.array([[0.5, 0.5, 0.5]]), True)
    d.check_prediction(prediction, [[1, 2]], [3])  # 2 tokens emitted: 1 draft accepted
    assert d._accepted[True] == pytest.approx([10.0 * step_decay(1) + 1.0,
                                               10.0 * step_decay(1) + 0.875])


@pytest.mark.parametrize("accepted, predicted, first_scale", [(30.0, 10.0, 2.0),
                                                              (5.0, 20.0, 1.0)])
def test_the_budget_is_planned_with_the_measured_acceptance_ratio(tiny_qwen, tmp_path, accepted,
                                                                  predicted, first_scale):
    """Each plan's survivals are scaled by the sampling mode's accepted / predicted ratio as
    it stands at that plan when it is above 1 (understated confidences: fewer drafts
    trimmed), never below 1 (a lower budget would starve the ratio of verified drafts)."""
    path = _table(tmp_path, "steep", weight_read_ms=1.0, ms_per_token=0.2,
                  fixed_overhead_ms=0.5, draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    cfg = {"model": make_tiny_drafter(str(tmp_path / "d"), tiny_qwen),
           "num_speculative_tokens": 4, "adaptive_policy": "lagged", "cost_table_path": path,
           "online_cost_correction": False}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", speculative_config=cfg)
    spec = llm.engine.runner.spec
    spec.drafting._accepted[True] = [accepted, predicted]  # as if measured so
    plan_cpu, scales = spec.planner.plan_cpu, []

    def spy(*args, **kwargs):
        scales.append((args[6], max(spec.drafting.acceptance_ratio(True), 1.0)))
        return plan_cpu(*args, **kwargs)

    spec.planner.plan_cpu = spy
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert scales and all(got == want for got, want in scales)
    assert scales[0][0] == first_scale  # 3.0 bounded to 2; 0.25 not applied


class _LandsAtNextPush:
    """A CUDA event stand-in: a copy lands once the next copy is queued (the GPU pipeline,
    where a plan reads while the last step's copy is in flight: tests/unit/test_host_copy.py)."""

    recorded: list = []

    def __init__(self):
        self.done = True

    def record(self):
        for ev in _LandsAtNextPush.recorded:
            ev.done = True
        _LandsAtNextPush.recorded = [self]
        self.done = False

    def query(self):
        return self.done


def _copies_a_step_behind(tiny_qwen, drafter, tmp_path, max_num_seqs: int):
    """A lagged engine that drafts every step and decides at every plan, whose confidence
    copies land a step late as on a GPU (_LandsAtNextPush); returns (llm, its decoder, the
    stale confidences each decision surveys, as they come)."""
    from dspark.spec.host_copy import LandedCopies

    path = _table(tmp_path, "steep", weight_read_ms=1.0, ms_per_token=0.2,
                  fixed_overhead_ms=0.5, draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    cfg = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
           "cost_table_path": path, "online_cost_correction": False,
           "draft_skipping": False}  # every step drafts  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=max_num_seqs, speculative_config=cfg)
    spec = llm.engine.runner.spec
    spec.host_confs = LandedCopies(tuple(spec.conf.shape), spec.conf.device,
                                   fill=float("nan"), event_factory=_LandsAtNextPush)  # fmt: skip
    seen, update = [], spec.drafting.update_survival

    def spy(stale, greedy=True):
        seen.append(stale.copy())
        return update(stale, greedy)

    spec.drafting.update_survival = spy
    spec.drafting.due = lambda num_reqs: True  # every step decides: also a row's first verify
    spec.drafting.routine = lambda *args: False  # (no plan skips `due`)
    return llm, spec, seen


def test_rows_without_landed_confidences_stay_out_of_the_decision(tiny_qwen, drafter, tmp_path):
    """A slot's confidences are NaN until its first drafts' copy lands; with copies one step
    behind, a request's first decision step would read its slot's fill. Such rows are left
    out of the survival estimate and of the acceptance check (they counted as certain
    drafts: the acceptance ratio at a level's start fell to 0.58 on the H200)."""
    llm, spec, seen = _copies_a_step_behind(tiny_qwen, drafter, tmp_path, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts[:2], params)  # slots 0-1 drafted; the others never were
    fresh = len(seen)
    llm.generate(prompts, params)  # new requests in never-drafted slots, all at once
    assert len(seen) > fresh + 5 and all(not np.isnan(s).any() for s in seen)
    assert any(s.shape[0] < len(PROMPTS) for s in seen[fresh:])  # some rows were left out
    assert spec.drafting.acceptance_ratio(True) > 0  # the check still ran on known rows


def test_a_reused_slot_reads_no_earlier_requests_confidences(tiny_qwen, drafter, tmp_path):
    """A slot given to a new request still holds its previous request's confidences in the
    landed copy until the copy of the new request's first drafts lands (one step later on a
    GPU). Until then the slot reads as unknown: neither the budget search nor the decision's
    survey nor its acceptance check may take another request's confidences for this one's
    (a likely cause of drafting turning off 15 s after start-up on an acceptance ratio of
    0.52, 1.06 at the level's end: H200, trained pair, thirty-second session)."""
    llm, spec, seen = _copies_a_step_behind(tiny_qwen, drafter, tmp_path, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm.generate(prompts[:2], params)  # both slots drafted
    # what the finished requests left in their slots: a value no drafter of this test makes
    old = 0.123
    spec.conf.fill_(old)
    spec.host_confs.push(spec.conf)
    seen.clear()
    searched, stale = [], spec._stale
    spec._stale = lambda slots: searched.append(stale(slots)) or searched[-1]
    outs = llm.generate(prompts, params)  # six requests through the two reused slots
    assert [o.outputs[0].token_ids for o in outs] == _generate(LLM(tiny_qwen, device="cpu"))
    assert len(seen) > 10 and not any(np.isclose(s, old).any() for s in seen)
    assert searched and not any(np.isclose(s, old).any() for s in searched)
    assert any(np.isnan(s).all(axis=1).any() for s in searched)  # new requests read unknown
    assert not spec._unmarked_slots  # every request drafted: no slot left to mark
    assert spec.drafting.acceptance_ratio(True) > 0  # the check still ran on known rows


def test_plain_probes_only_where_plain_decoding_could_win():
    """A plain probe costs most where drafting wins by far (c = 4: 12 steps of one token in
    place of ~2.5 each) and there it cannot change the verdict: drafting turns off only if
    plain decoding beats it by the guard, and plain steps cost at least the table's bare
    forward, less the table's own slack where no plain term was learned near (none here).
    So a bucket is probed only where plain decoding at that price would win."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import FixedCosts
    from dspark.spec.plain_probes import _PLAIN_TABLE_SLACK
    from dspark.spec.rates import decode_rates

    # a forward of n tokens: 1 ms + 0.01 ms per token; the drafter 1 ms; spec fixed term 2 ms
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=2.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    # ... and one whose speculative steps cost 1.4 ms in all beside the forward
    cheap = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.2,
                               draft_base_ms=0.2, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    assert d.plain_probes  # the default
    d.update_survival(np.full((4, 4), 0.9))  # survivals sum to ~3.1: drafting far ahead
    assert d._pays(cheap, fixed, 4)
    bare = decode_rates(cheap, None, 4, 0.0)[0]
    assert d._numbers[1] > bare * (1 + _PLAIN_TABLE_SLACK) * 1.05  # (beyond the slack)
    assert not d._plain_may_win and not d._plain_probe_due(fixed, 4, 0)
    for _ in range(20):  # survivals ~0.45, 0.2, ...: drafting ahead only by the stand-in
        d.update_survival(np.full((4, 4), 0.45))
    assert d._pays(cost, fixed, 4)  # with plain priced by the speculative term (2 ms) ...
    assert d._plain_may_win  # ... but at the bare forward (1.04 ms) plain decoding wins
    assert d._plain_probe_due(fixed, 4, 0)
    assert not d._plain_probe_due(fixed, 4, 0)  # just probed: not again for 512 plans
    assert not d._plain_probe_due(fixed, 16, 64)  # (never beside prefill chunks)
    d._plans += 600
    assert d._plain_probe_due(fixed, 4, 0)
    assert d._plain_probe_due(fixed, 64, 0)  # another bucket has its own schedule


def test_plain_probes_price_plain_steps_at_the_nearest_measured_share():
    """Once a plain probe measured plain steps' fixed term beside the speculative one at some
    batch size, a plain step is priced at no less than that ratio, at the nearest batch size
    measured, times the speculative term (a host's per-step work is shared by both kinds),
    not at the bare forward: on the H200 the trained pair's plain term was 0.97x the
    speculative one at 64 requests, and probes at each smaller batch size of a level's tail
    ran 12 plain steps each where plain decoding could not win (87 plain steps of 1,457 at
    c = 64). The nearest share, not the least: the least was the 1-4 request buckets' ~0,
    and plain steps at 51-64 requests were probed again (thirty-ninth session)."""
    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts
    from dspark.spec.rates import decode_rates

    def decision(*terms: tuple[int, float, float]) -> tuple[DraftingDecision, FixedCosts]:
        fixed = FixedCosts()
        for n, spec_ms, plain_ms in terms:  # both kinds measured at n requests
            for _ in range(WARMUP_STEPS + MIN_SAMPLES):
                fixed.observe("spec", spec_ms, n)
                fixed.observe("plain", plain_ms, n)
        d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
        for _ in range(20):  # survivals ~0.45: ahead of plain steps priced at 2 ms, not 0
            d.update_survival(np.full((4, 4), 0.45))
        return d, fixed

    # a forward of n tokens: 1 ms + 0.01 ms per token; the drafter 1 ms; spec fixed term 2 ms
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=2.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d, fixed = decision()  # nothing measured: the bare forward, as before
    assert fixed.plain_share(4) is None
    assert d._pays(cost, fixed, 4) and d._plain_probe_due(fixed, 4, 0)
    d, fixed = decision((64, 2.0, 1.8))  # plain 0.9x spec: at 4 requests >= 1.8 ms
    assert fixed.plain_share(4) == pytest.approx(0.9)
    assert d._pays(cost, fixed, 4) and not d._plain_may_win
    assert not d._plain_probe_due(fixed, 4, 0)
    d, fixed = decision((64, 2.0, 1.8), (256, 4.0, -0.5))  # a negative term bounds nothing
    assert fixed.plain_share(300) < 0
    assert d._pays(cost, fixed, 4) and not d._plain_may_win  # (4: 64's share)
    # the nearest share counts: plain 0.1x spec at 4 requests does not price plain steps at
    # 64 requests, whose own share is 0.9 (a forward of 0.001 ms a token: drafting ahead at
    # 64 requests of plain steps at 1.8 ms, behind plain ones at the 0.2 ms 0.1x would give)
    flat = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.001, fixed_overhead_ms=2.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    d, fixed = decision((4, 2.0, 0.2), (64, 2.0, 1.8))
    assert fixed.plain_share(4) == pytest.approx(0.1)
    assert fixed.plain_share(64) == pytest.approx(0.9)
    assert d._pays(flat, fixed, 64) and not d._plain_may_win
    assert not d._plain_probe_due(fixed, 64, 0)
    assert decode_rates(flat, None, 64, 0.1 * 2.0)[0] > d._numbers[1] * 1.05  # (would win)


def test_plans_take_the_surveyed_survivals_for_steps_with_no_known_row(tiny_qwen, drafter,
                                                                      tmp_path):  # fmt: skip
    """Every plan hands the planner the drafting decision's surveyed survivals of its sampling
    mode, which stand in when no row of the step has landed confidences (Planner.prior_survival)."""
    llm, spec, _ = _copies_a_step_behind(tiny_qwen, drafter, tmp_path, max_num_seqs=4)
    handed, plan_cpu = [], spec.planner.plan_cpu

    def spy(*a, **k):
        handed.append(spec.planner.prior_survival is spec.drafting.survival_of(
            spec.fixed_costs.greedy) and spec.planner.prior_survival is not None)
        return plan_cpu(*a, **k)

    spec.planner.plan_cpu = spy
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(handed) > 10 and sum(handed) >= len(handed) - 2  # (none before the first survey)


def test_a_verdict_records_the_step_times_it_priced():
    """DecisionRecord.verdicts: each verdict's plain and verify-all step prices (ms), summed,
    so that a report can set them against the periods the steps took (which side of a
    verdict erred: fifty-third session, T = 1, where decisions priced drafting 7-12% ahead
    with survival estimates within 8%, and no-spec won)."""
    import math

    import numpy as np

    from dspark.spec.drafting import DraftingDecision
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    # a forward of n tokens: max(1 ms, 0.1 ms a token); the drafter 1 ms; spec fixed term 2 ms
    cost = CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.1, fixed_overhead_ms=2.0,
                              draft_base_ms=1.0, draft_ms_per_req=0.0)  # fmt: skip
    fixed = FixedCosts()
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        fixed.observe("plain", 0.5, 4)  # plain steps: 0.5 ms beyond their forward
    d = DraftingDecision(k=4, min_predicted_gain=0.05, enabled=True)
    d.update_survival(np.full((4, 4), 0.9))
    d._pays(cost, fixed, 4)
    d._pays(cost, fixed, 4)
    v = d.record.verdicts
    assert v["decisions"] == 2
    assert v["plain_ms"] == pytest.approx(2 * (0.5 + 1.0))  # 4 tokens: the 1 ms floor
    assert v["verify_ms"] == pytest.approx(2 * (2.0 + 2.0 + 1.0))  # 4 x 5 tokens, the drafter
    _, spec_rate, plain_rate = d._numbers[:3]
    assert v["log_spec_over_plain"] == pytest.approx(2 * math.log(spec_rate / plain_rate))
