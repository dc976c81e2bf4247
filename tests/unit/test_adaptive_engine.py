"""Adaptive verification inside the engine: trimming when verification is expensive (output
unchanged), verify-all with a loud warning when the table is flat, a zero budget, and a trace
recorded from a real run replayed through the simulator."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cost_model import CostModel
from dspark.spec.sim import TraceStep, simulate
from dspark.testing.drafters import make_tiny_drafter

PROMPTS = [list(range(5, 5 + n)) for n in (3, 9, 17, 30, 6, 12)]
MAX_NEW = 20


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("ad")), tiny_qwen, seed=9)


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    return _generate(LLM(tiny_qwen, device="cpu"))


def _generate(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def _table(tmp_path, name, **kw) -> str:
    path = str(tmp_path / f"{name}.json")
    CostModel.analytic(**kw).to_json(path)
    return path


def _llm(tiny_qwen, drafter, policy, cost_path, budget_tokens=64, **spec):
    cfg = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": policy,
           "cost_table_path": cost_path, **spec}  # fmt: skip
    return LLM(tiny_qwen, device="cpu", max_num_batched_tokens=budget_tokens,
               speculative_config=cfg)  # fmt: skip


@pytest.mark.parametrize("policy", ["lagged", "early_stop"])
def test_expensive_verification_trims_and_output_is_unchanged(
    tiny_qwen, drafter, reference, tmp_path, policy
):
    # a big fixed step cost plus a per-token cost: low-survival drafts are not worth verifying
    path = _table(tmp_path, "expensive", weight_read_ms=0.01, ms_per_token=1.0,
                  fixed_overhead_ms=4.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, policy, path, min_predicted_gain=0.0)
    assert _generate(llm) == reference
    st = llm.engine.spec_stats.as_dict()
    assert 0 < st["num_verified_tokens"] < st["num_drafted_tokens"]
    assert st["num_trimmed_tokens"] == st["num_drafted_tokens"] - st["num_verified_tokens"]
    metrics = llm.engine.runner.spec.metrics()
    assert metrics["cost_table_status"].startswith("loaded from")
    if policy == "lagged":
        assert metrics["budget"] is not None and metrics["predicted_gain"] is not None


def test_flat_table_verifies_everything_and_says_so(
    tiny_qwen, drafter, reference, tmp_path, caplog
):
    # step time independent of the token count: every draft looks free
    path = _table(tmp_path, "flat", weight_read_ms=5.0, ms_per_token=1e-9, max_tokens=4096)
    with caplog.at_level(logging.WARNING), pytest.warns(RuntimeWarning, match="flat"):
        llm = _llm(tiny_qwen, drafter, "lagged", path)
    assert any("flat" in r.getMessage() for r in caplog.records)
    assert "UNUSABLE" in llm.engine.runner.spec.metrics()["cost_table_status"]
    assert _generate(llm) == reference
    st = llm.engine.spec_stats
    assert st.num_verified_tokens == st.num_drafted_tokens > 0  # budget R*K every step


def test_zero_budget_discards_every_draft(tiny_qwen, drafter, reference, tmp_path):
    # cost proportional to tokens and nothing fixed: in a pure decode step every token costs
    # as much as the one token it is expected to yield, so a draft (survival < 1) never pays.
    # All prompts prefill in the first step, so no later step mixes in prefill tokens.
    path = _table(tmp_path, "linear", weight_read_ms=0.0, ms_per_token=1.0,
                  fixed_overhead_ms=0.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "early_stop", path, budget_tokens=512)
    assert _generate(llm) == reference
    st = llm.engine.spec_stats
    assert st.num_drafted_tokens > 0 and st.num_verified_tokens == 0
    assert st.num_accepted_tokens == 0


@pytest.mark.parametrize("policy", ["lagged", "early_stop"])
def test_zero_budget_sampling_equals_plain_sampling(tiny_qwen, drafter, tmp_path, policy):
    """At temperature > 0 a step that verifies no draft draws its token with the key of plain
    sampling: with a zero budget every step (lagged: the host knows it and samples directly;
    early_stop: verification of zero-length drafts) the seeded output is token for token the
    output without speculation."""
    path = _table(tmp_path, "linear", weight_read_ms=0.0, ms_per_token=1.0,
                  fixed_overhead_ms=0.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=MAX_NEW, ignore_eos=True,
                             seed=100 + i) for i in range(len(PROMPTS))]  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    want = run(LLM(tiny_qwen, device="cpu"))
    llm = _llm(tiny_qwen, drafter, policy, path, budget_tokens=512, draft_skipping=False)
    assert run(llm) == want
    st = llm.engine.spec_stats
    assert st.num_drafted_tokens > 0 and st.num_verified_tokens == 0


def test_recorded_trace_replays_through_the_simulator(tiny_qwen, drafter, reference, tmp_path):
    llm = _llm(tiny_qwen, drafter, "fixed", None)
    llm.engine.runner.spec.start_trace()
    assert _generate(llm) == reference
    records = llm.engine.runner.spec.trace
    assert records, "the run must record its verify steps"
    trace = [
        TraceStep(conf=r["conf"], accept_len=r["accepted"], capacities=r["capacities"],
                  request_ids=r["slots"])
        for r in records
    ]  # fmt: skip
    # fixed policy verifies everything, so the recorded outcomes are uncensored
    assert all((r["verified"] == r["capacities"]).all() for r in records)
    total_accepted = sum(int(r["accepted"].sum()) for r in records)
    assert total_accepted == llm.engine.spec_stats.num_accepted_tokens
    cheap = CostModel.analytic(weight_read_ms=5.0, ms_per_token=0.001)
    full = simulate(trace, "fixed", cheap)
    assert full.emitted_tokens == total_accepted + sum(len(r["accepted"]) for r in records)
    pricey = CostModel.analytic(weight_read_ms=0.01, ms_per_token=1.0, fixed_overhead_ms=4.0,
                                draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    lag = simulate(trace, "lagged", pricey, min_predicted_gain=0.0)
    fixed = simulate(trace, "fixed", pricey)
    assert lag.verified < fixed.verified
    assert lag.throughput > fixed.throughput
    assert np.isfinite(lag.throughput)


def test_scheduler_overhead_is_measured(tiny_qwen, drafter, tmp_path):
    path = _table(tmp_path, "cost", weight_read_ms=0.01, ms_per_token=1.0,
                  fixed_overhead_ms=4.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path)
    _generate(llm)
    plan_ms, alloc_ms = llm.engine.runner.spec.scheduler_overhead_ms()
    step_ms = llm.engine.stats["step_time_ms"]
    assert 0 < plan_ms < step_ms and 0 < alloc_ms < step_ms


def test_online_correction_learns_the_fixed_step_cost(tiny_qwen, drafter):
    """A start-up profile times only the forward and the drafter; the engine's real steps also
    pay host work. Each step's residual (measured time beyond the table's forward + drafter
    time) feeds an exponential moving average per batch-size bucket: speculative steps the
    table's fixed term, steps without speculation (drafting skipped) the plain one; steps
    with prefill chunks feed nothing. Replayed here exactly."""
    from dspark.spec.online_cost import size_bucket

    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    spec = llm.engine.runner.spec
    assert spec.cost.provenance["source"] == "profiled" and spec.cost.fixed_overhead_ms == 0.0
    # A start-up profile on this shared 2-core CPU can come out slower than the steps that
    # follow; replace it with one of the same provenance whose forward is nearly free and
    # whose drafter (50 ms) never pays: every plain step's residual is then its host work
    table = CostModel.from_measurements([1, 64], [0.01, 0.05], [1, 64], [50.0, 50.0],
                                        provenance={"source": "profiled"})  # fmt: skip
    with pytest.warns(RuntimeWarning, match="flat"):  # (trimming is not what is tested)
        spec.set_cost_model(table, "profiled at start-up")
    want = {"spec": {}, "plain": {}, "eager": {}}  # the first residual replaces the table's
    kinds, counts, untagged = [], {}, [0]
    observe = spec.observe_step_time

    def spy(step_ms, num_tokens, num_reqs, tag):
        if tag is None:  # prefill chunks (or the first steps of a request)
            untagged[0] += 1
        else:
            kinds.append(tag[0])
        if tag is not None and len(kinds) > 3:  # warm-up steps are skipped
            kind, draft_ms, _ = tag
            assert draft_ms in (0.0, spec.cost.draft_lookup(num_reqs))  # drafted, or not
            residual = step_ms - float(spec.cost.verify_cost_ms(num_tokens)) - draft_ms
            b = size_bucket(num_reqs)
            prev = want[kind].get(b)
            want[kind][b] = residual if prev is None else 0.9 * prev + 0.1 * residual
            counts[kind, b] = counts.get((kind, b), 0) + 1
        observe(step_ms, num_tokens, num_reqs, tag)

    spec.observe_step_time = spy
    plans, plan = [], spec.plan

    def plan_spy(host):
        budget = plan(host)
        plans.append((spec.cost.fixed_overhead_ms, spec.fixed_costs.get("spec", spec._step_reqs)))
        return budget

    spec.plan = plan_spy
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert kinds.count("plain") >= 5 and untagged[0] >= 1
    # plain steps never move the speculative terms (and vice versa); buckets apart
    for kind, by_bucket in want.items():
        got = spec.fixed_costs._ema[kind]
        assert got.keys() == by_bucket.keys(), kind
        assert all(got[b] == pytest.approx(v, rel=1e-9, abs=1e-12) for b, v in by_bucket.items())
    # every plan prices its step with the speculative term of its batch size
    assert plans and all(used == (0.0 if want is None else want) for used, want in plans)
    busiest = max((b for kind, b in counts if kind == "plain"), key=lambda b: counts["plain", b])
    assert want["plain"][busiest] > 0  # host work of a CPU step is real


def test_plain_and_speculative_fixed_costs_are_learned_apart(tiny_qwen, drafter):
    """Steps without speculation (drafting skipped, nothing to verify) and speculative steps
    pay different fixed costs; each is learned from its own steps, and the skip decision
    compares drafting against the plain one."""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})
    spec = llm.engine.runner.spec
    cost = spec.cost
    from dspark.spec.online_cost import size_bucket

    spec.drafting.survival = np.full(5, 0.5)
    tokens, reqs = 8, 8

    def feed(drafting: bool, fixed_ms: float, n: int = 120, num_reqs: int = reqs) -> None:
        spec.draft_enabled, spec._no_drafts = drafting, not drafting
        spec._step_reqs, spec._step_other = num_reqs, 0
        tag = spec.step_tag()
        assert tag == (("spec", cost.draft_lookup(num_reqs), True) if drafting
                       else ("plain", 0.0, True))  # fmt: skip
        step = float(cost.verify_cost_ms(tokens)) + fixed_ms + tag[1]
        for _ in range(n):
            spec.observe_step_time(step, tokens, num_reqs, tag)

    feed(True, 3.0)
    feed(False, 1.0)
    feed(True, 7.0, num_reqs=64)  # another batch size: its own term
    spec.fixed_costs.apply(cost, reqs)
    assert cost.fixed_overhead_ms == pytest.approx(3.0, rel=1e-3)
    spec.fixed_costs.apply(cost, 100)
    assert cost.fixed_overhead_ms == pytest.approx(7.0, rel=1e-3)
    assert spec.fixed_costs.get("spec", 4) == pytest.approx(3.0, rel=1e-3)  # nearest measured
    assert spec.fixed_costs.get("plain", 100) == pytest.approx(1.0, rel=1e-3)  # nearest
    spec.fixed_costs.apply(cost, reqs)
    spec._step_reqs = reqs
    assert spec.metrics()["plain_fixed_overhead_ms"] == pytest.approx(1.0, rel=1e-3)
    spec._step_other = 5  # a step with a prefill chunk is not observed
    assert spec.step_tag() is None
    # the decision uses the plain term for plain decoding: with plain steps made expensive,
    # drafting pays; with them cheap, it does not
    verify_base = cost.verify_lookup(reqs)
    spec.fixed_costs._ema["plain"][size_bucket(reqs)] = 1e3
    assert spec.drafting._pays(cost, spec.fixed_costs, reqs)
    spec.fixed_costs._ema["plain"][size_bucket(reqs)] = 0.0
    cost.fixed_overhead_ms = 1e3 + verify_base
    assert not spec.drafting._pays(cost, spec.fixed_costs, reqs)


def test_no_online_correction_for_tables_from_elsewhere(tiny_qwen, drafter, tmp_path):
    path = _table(tmp_path, "given", weight_read_ms=1.0, ms_per_token=0.01)
    llm = _llm(tiny_qwen, drafter, "lagged", path)
    before = llm.engine.runner.spec.cost.fixed_overhead_ms
    _generate(llm)
    assert llm.engine.runner.spec.cost.fixed_overhead_ms == before


def test_drafting_is_skipped_when_it_cannot_pay(tiny_qwen, drafter, reference, tmp_path):
    # the drafter costs 20 ms per step, verification is nearly free: with this random drafter's
    # low acceptance, plain decoding wins and the lagged policy stops drafting
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
    assert sizes[0] == 12  # before the first decision every row drafts
    probes = sizes[1:]
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
def test_plain_steps_are_probed_while_drafting(tiny_qwen, tmp_path, monkeypatch, caplog, probe):
    """While every step drafts, no plain step is measured and the drafting decision prices
    plain decoding with the speculative steps' fixed term, which also holds what only
    speculation pays. A short plain probe measures it: here speculative steps pay 4 ms of
    fixed cost and plain ones 0.2 ms, so drafting stops once plain steps are measured, and
    never without the probe."""
    from pathlib import Path

    import dspark.spec.drafting as drafting_mod

    if not probe:
        monkeypatch.setattr(drafting_mod, "_PLAIN_PROBE_STEPS", 0)
    full = make_tiny_drafter(str(tmp_path / "full"), tiny_qwen)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(full) / "config.json").read_text())
    cfg = {"model": str(bare), "num_speculative_tokens": 4, "adaptive_policy": "lagged",
           "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.6] * 4}
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
        assert "plain 0.200 ms (measured at this batch size)" in flips[0]
        first_plain = kinds.index("plain")
        assert "spec" in kinds[:first_plain]  # it drafted before it measured plain steps
    else:  # plain steps never measured: the speculative term stands in and drafting goes on
        assert "plain" not in kinds and not flips
        assert spec.metrics()["drafting"] is True
        assert llm.engine.spec_stats.num_steps > 60


def test_greedy_and_sampled_steps_learn_their_own_fixed_costs(tiny_qwen, drafter):
    """Sampled steps pay for sampling over the vocabulary (in verification and drafting) that
    greedy ones do not: each sampling mode learns its own terms, a mode that has measured a
    kind at no batch size takes the other mode's, and a real engine's steps land in the mode
    they ran in."""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    spec, cost = llm.engine.runner.spec, llm.engine.runner.spec.cost
    modes, tokens, reqs = spec._fixed_by_mode, 8, 8

    def feed(greedy: bool, kind: str, fixed_ms: float, n: int = 60) -> None:
        spec.fixed_costs = modes[greedy]  # (plan() picks the step's mode)
        spec.draft_enabled, spec._no_drafts = kind == "spec", kind == "plain"
        spec._step_reqs, spec._step_other = reqs, 0
        tag = spec.step_tag()
        assert tag[0] == kind and tag[2] is greedy
        step = float(cost.verify_cost_ms(tokens)) + tag[1] + fixed_ms
        for _ in range(n):
            spec.observe_step_time(step, tokens, reqs, tag)

    feed(True, "spec", 1.0)
    assert modes[False].get("spec", reqs) == pytest.approx(1.0, rel=1e-3)  # greedy stands in
    feed(False, "spec", 3.0)
    feed(False, "plain", 0.5)
    feed(True, "plain", 0.2)
    for greedy, want_spec, want_plain in ((True, 1.0, 0.2), (False, 3.0, 0.5)):
        assert modes[greedy].get("spec", reqs) == pytest.approx(want_spec, rel=1e-3)
        assert modes[greedy].get("plain", reqs) == pytest.approx(want_plain, rel=1e-3)

    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    spec = llm.engine.runner.spec
    for temperature, greedy in ((1.0, False), (0.0, True)):
        params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=1)
        before = {m: spec._fixed_by_mode[m].steps for m in (True, False)}
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert spec.fixed_costs.greedy is greedy
        assert spec._fixed_by_mode[greedy].steps > before[greedy] + 5
        assert spec._fixed_by_mode[not greedy].steps == before[not greedy]


def test_each_row_takes_its_sampling_modes_calibration(tiny_qwen, drafter, tmp_path):
    """An STS file with a fit per sampling mode: greedy rows' confidences use the greedy
    temperatures, sampled rows' the sampled ones (here 100: every confidence ~0.5, and 0.01:
    every confidence ~0 or ~1)."""
    from dspark.spec.confidence import save_sts

    path = str(tmp_path / "sts.json")
    save_sts(path, [1.0] * 5, by_mode={"greedy": [100.0] * 5, "sampled": [0.01] * 5})
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=4,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "fixed",
                                  "confidence_calibration_path": path})  # fmt: skip
    spec = llm.engine.runner.spec
    logits = spec.conf_logits
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=2)]
    llm.engine.add_request("g", PROMPTS[1], params[0])
    llm.engine.add_request("s", PROMPTS[2], params[1])
    llm.engine.step()  # prefill: both rows draft
    slots = [llm.engine.requests[r].slot for r in ("g", "s")]
    conf = spec.conf[slots].numpy()
    raw = logits[slots].numpy()
    assert np.all(np.abs(raw) > 1e-3)  # (the sampled row's case needs non-zero logits)
    np.testing.assert_allclose(conf[0], 1 / (1 + np.exp(-raw[0] / 100.0)), rtol=1e-5)
    np.testing.assert_allclose(conf[1], 1 / (1 + np.exp(-raw[1] / 0.01)), rtol=1e-4,
                               atol=1e-6)  # fmt: skip
    assert np.all(np.abs(conf[0] - 0.5) < 0.1) and np.all((conf[1] < 0.2) | (conf[1] > 0.8))


def test_eager_steps_learn_their_own_fixed_cost(tiny_qwen, drafter):
    """With whole-step graphs, speculative steps on the eager path (trimmed plans) pay more
    host work than graph replays; that excess is learned apart and becomes the planner's
    penalty for trimming. Without whole-step graphs (here, the CPU) nothing changes."""
    from dspark.spec.online_cost import FixedCosts

    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    spec = llm.engine.runner.spec
    cost = spec.cost
    tokens, reqs = 8, 8

    def feed(graph: bool, fixed_ms: float, n: int = 150) -> None:
        spec.draft_enabled, spec._no_drafts, spec.ran_as_graph = True, False, graph
        spec._step_reqs, spec._step_other = reqs, 0
        step = float(cost.verify_cost_ms(tokens)) + float(cost.draft_cost_ms(reqs)) + fixed_ms
        for _ in range(n):
            spec.observe_step_time(step, tokens, reqs, spec.step_tag())
        spec.fixed_costs.apply(cost, reqs)  # (the next plan does this)

    spec.graph_steps = False  # no graphs: every speculative step feeds the table's term
    feed(False, 2.0)
    assert cost.fixed_overhead_ms == pytest.approx(2.0, rel=1e-3)
    assert spec.fixed_costs.get("eager", reqs) is None
    assert spec.metrics()["trim_penalty_ms"] == 0.0
    spec._fixed_by_mode[True] = spec.fixed_costs = FixedCosts(greedy=True)  # start afresh
    spec.graph_steps = True
    feed(True, 1.0)
    feed(False, 4.0)
    assert cost.fixed_overhead_ms == pytest.approx(1.0, rel=1e-3)
    assert spec.fixed_costs.get("eager", reqs) == pytest.approx(4.0, rel=1e-3)
    assert spec.metrics()["trim_penalty_ms"] == pytest.approx(3.0, rel=1e-3)


def test_steps_that_capture_a_graph_do_not_feed_the_online_cost(tiny_qwen, drafter):
    """A first-use graph capture stalls its step (on the H200 ~100 ms against ~10 ms steps):
    folded into the fixed-cost average it made every speculative step look 20 ms dearer.
    (Synchronous steps: each call commits the step it launched, so launches map to steps.)"""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, async_scheduling=False,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    runner, spec = llm.engine.runner, llm.engine.runner.spec
    captures, launches, observed = [0], [0], []
    runner.num_graph_captures = lambda: captures[0]
    launch, observe = runner.launch, spec.observe_step_time

    def spy_launch(sched, tables):
        launches[0] += 1
        if launches[0] == 6:
            captures[0] += 1  # this step captured a graph
        return launch(sched, tables)

    def spy_observe(*args):
        observed.append(launches[0])
        observe(*args)

    runner.launch, spec.observe_step_time = spy_launch, spy_observe
    _generate(llm)
    assert launches[0] > 8 and 6 not in observed and {5, 7} <= set(observed)
    assert len(observed) == launches[0] - 1


def test_profiled_table_prices_the_drafter_the_step_runs(tiny_qwen, drafter):
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    cost = llm.engine.runner.spec.cost
    assert cost.draft_greedy_ms.size == cost.draft_reqs.size > 0
    assert np.all(cost.draft_greedy_ms > 0)
    _generate(llm)  # temperature 0: greedy drafts
    assert cost.greedy_drafts
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)
    assert not cost.greedy_drafts
