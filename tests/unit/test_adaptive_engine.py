"""Adaptive verification inside the engine: trimming when verification is expensive (output
unchanged), verify-all with a loud warning when the table is flat, a zero budget, a trace
recorded from a real run replayed through the simulator, the scheduler overhead, and each
row's calibration. (The online cost terms: test_online_cost.py; the drafting decision:
test_drafting_decision.py.)"""

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
    status = llm.engine.runner.spec.metrics()["cost_table_status"]
    assert "UNUSABLE" in status and str(path) in status  # (which table to re-profile)
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
    if policy == "lagged":  # a request's first verifying step has no confidences older than
        # its drafts: the planner's prior stands in for them, and at 1.0 (drafts certain) it
        # verifies them; at 0 it too sees a zero budget (its only use here)
        llm.engine.runner.spec.planner.prior_conf = 0.0
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
    spec = llm.engine.runner.spec
    plan_ms, alloc_ms = spec.scheduler_overhead_ms()
    step_ms = llm.engine.stats["step_time_ms"]
    assert 0 < plan_ms < step_ms and 0 < alloc_ms < step_ms
    # by part: every lagged plan counted once (each planned step's kind is counted too), the
    # first one re-ran the drafting decision (no survival estimate yet)
    snap = spec.metrics()["scheduler_overhead"]
    assert sum(snap["plans"].values()) == sum(spec.step_counts.values()) > 0
    assert snap["plans"]["decision"] >= 1 and snap["plan_ms"]["decision"] > 0
    assert sum(snap["plan_ms"].values()) == pytest.approx(plan_ms)
    assert snap["alloc_ms"] == pytest.approx(alloc_ms)  # (CPU: nothing left in flight)


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


def test_a_probe_that_covers_every_row_is_an_ordinary_drafting_step(tiny_qwen, drafter,
                                                                    tmp_path):  # fmt: skip
    """While drafting is skipped, a draft probe drafts for its first PROBE_ROWS rows (the
    test below: on a plain step, whole-step graphs draft for every row and the commit keeps
    those). A batch no larger than that is drafted whole anyway, so such a probe is an
    ordinary drafting step; a larger batch still probes a few rows. Outputs stay those of no
    speculation."""
    from dspark.spec.drafting import _PROBE_EVERY, PROBE_ROWS

    # the drafter costs 100 ms a pass: drafting never pays, every 64th skipped step probes
    path = _table(tmp_path, "costly_drafter", weight_read_ms=1.0, ms_per_token=0.0,
                  fixed_overhead_ms=0.0, draft_base_ms=100.0, draft_ms_per_req=0.0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=_PROBE_EVERY + 24, ignore_eos=True)
    for num_reqs in (3, PROBE_ROWS + 4):
        prompts = [{"prompt_token_ids": list(range(5, 9 + i))} for i in range(num_reqs)]
        llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256)
        spec, seen = llm.engine.runner.spec, []
        after = spec._after_budget  # (every lagged plan's last word, standing ones too)

        def recording(budget, total, decide, n, *rest, after=after, spec=spec, seen=seen):
            budget = after(budget, total, decide, n, *rest)
            seen.append((n, spec.drafting.pays, spec.draft_enabled, spec.probing))
            return budget

        spec._after_budget = recording
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        ref = [o.outputs[0].token_ids for o in LLM(tiny_qwen, device="cpu").generate(
            prompts, params)]  # fmt: skip
        assert outs == ref
        probes = [s for s in seen if not s[1] and s[2]]  # drafting while skipped
        assert probes and all(n == num_reqs for n, *_ in probes)
        assert all(p[3] == (num_reqs > PROBE_ROWS) for p in probes), probes


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_budget_never_reads_the_confidences_of_the_drafts_it_verifies(
    tiny_qwen, drafter, tmp_path, temperature, follow
):
    """Losslessness of the lagged policy rests on its budget coming from confidences older than
    the drafts it verifies (a budget from the current ones is biased: the Appendix A test in
    test_lossless_policies.py). On the CPU every copy lands at once, and the plan of each step
    had read the copy queued by the step before it: the confidences of the very drafts it was
    about to verify (on a GPU, whenever that copy landed before the plan). The same holds
    for a step planned while the one before is in flight (`follow`: dspark/engine/follow.py),
    whose plans stand more often (twice the tokens, for as many reads)."""
    path = _table(tmp_path, "expensive", weight_read_ms=0.01, ms_per_token=1.0,
                  fixed_overhead_ms=4.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, min_predicted_gain=0.0,
               draft_skipping=False)  # fmt: skip
    llm.engine.follows = follow
    spec = llm.engine.runner.spec
    reads, stale = [], spec._stale

    def spy(slots):
        out = stale(slots)
        reads.append((out.copy(), spec.conf[slots].numpy().copy()))  # (read, live)
        return out

    spec._stale = spy
    params = SamplingParams(temperature=temperature, max_tokens=MAX_NEW * (1 + follow),
                            ignore_eos=True, seed=3)  # fmt: skip
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    st = llm.engine.spec_stats.as_dict()
    assert 0 < st["num_verified_tokens"] < st["num_drafted_tokens"]  # the budget trimmed
    assert (llm.engine.stats["followed_steps"] >= 10) == follow
    assert len(reads) >= 5
    rows = sum(int(np.isfinite(live).all(axis=1).sum()) for _, live in reads)
    same = sum(int((read == live).all(axis=1).sum()) for read, live in reads)
    assert rows > 20 and same == 0  # (random confidences: equal rows only as the same copy)


def test_a_plain_draft_probe_runs_as_a_whole_step_graph_that_keeps_its_first_rows_drafts(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """With whole-step graphs (their code run without capture), a draft probe of a batch
    larger than PROBE_ROWS on a plain step runs as the plain family that drafts (no eager
    step: one cost a probe 28 ms against 9 ms plain steps on the 8B shape), drafting for every
    row; the step after it verifies the probe's first PROBE_ROWS rows' drafts only (K each at
    most), the others decode plainly. Outputs stay those of no speculation."""
    from dspark.engine.cuda_graph import default_buckets
    from dspark.engine.step_graph import StepGraphs
    from dspark.spec.drafting import _PROBE_EVERY, PROBE_ROWS

    path = _table(tmp_path, "costly_drafter", weight_read_ms=1.0, ms_per_token=0.0,
                  fixed_overhead_ms=0.0, draft_base_ms=100.0, draft_ms_per_req=0.0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=2 * _PROBE_EVERY + 8, ignore_eos=True)
    num_reqs = PROBE_ROWS + 4
    prompts = [{"prompt_token_ids": list(range(5, 9 + i))} for i in range(num_reqs)]
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256)
    runner, spec = llm.engine.runner, llm.engine.runner.spec
    sg = runner.step_graphs = StepGraphs(runner, use_graphs=False)
    sg.token_buckets = default_buckets(256)
    graph_steps, eager_steps = [], []
    start, run_step = sg.start, runner.run_step

    def start_spy(host, key, budget=None):
        graph_steps.append((key, spec.draft_enabled, spec.probing, host.num_draft_slots()))
        return start(host, key, budget)

    def run_step_spy(host, plan):
        eager_steps.append((spec.draft_enabled, spec.probing, host.get("max_query_len")))
        return run_step(host, plan)

    sg.start, runner.run_step = start_spy, run_step_spy
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ref = [o.outputs[0].token_ids for o in LLM(tiny_qwen, device="cpu").generate(
        prompts, params)]  # fmt: skip
    assert outs == ref
    probes = [i for i, (_, on, probing, _) in enumerate(graph_steps) if on and probing]
    assert len(probes) >= 2, graph_steps  # (skipped steps: every _PROBE_EVERY-th probes)
    for i in probes:  # the plain family that drafts, then only the probe's rows verify
        assert graph_steps[i][0] == ("plain", 16, "greedy"), graph_steps[i]
        assert graph_steps[i + 1][3] == PROBE_ROWS * spec.k, graph_steps[i + 1]
    # no decode step ran eager: only prefill steps did (their query is the prompt)
    assert all(max_q > 1 for *_, max_q in eager_steps), eager_steps
