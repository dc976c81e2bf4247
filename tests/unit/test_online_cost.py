"""The online fixed-cost terms of adaptive verification in the engine: learned per kind of
step (speculative, plain, eager, trimmed), batch-size bucket and sampling mode, only from tables
profiled here, never from steps that captured a graph; the drafter priced as it runs."""

from __future__ import annotations

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cost_model import CostModel
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import PROMPTS, _generate, _llm, _table


def _fenced_mean(window: list[float]) -> float:
    """The reference term: the window's mean with each residual clipped to Tukey's far fences
    (lower / upper quartile -/+ 3 x the spread between them)."""
    s = sorted(window)
    q1, q3 = s[len(s) // 4], s[3 * len(s) // 4]
    lo, hi = q1 - 3.0 * (q3 - q1), q3 + 3.0 * (q3 - q1)
    return float(np.mean(np.clip(s, lo, hi)))


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("ad")), tiny_qwen, seed=9)


def test_online_correction_learns_the_fixed_step_cost(tiny_qwen, drafter):
    """A start-up profile times only the forward and the drafter; the engine's real steps also
    pay host work. Each step's residual (measured time beyond the table's forward + drafter
    time) joins a window whose fenced mean is the term, per batch-size bucket: speculative steps the
    table's fixed term, steps without speculation (drafting skipped) the plain one; steps
    with prefill chunks feed nothing. Replayed here exactly."""
    from dspark.spec.online_cost import WINDOW, bucket_label, size_bucket

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
    seen = {"spec": {}, "plain": {}, "eager": {}}  # every residual, by kind and bucket
    kinds, counts, untagged = [], {}, [0]
    observe = spec.observe_step_time

    totals = {}  # every observed step (warm-up too), by kind and batch-size range

    def spy(step_ms, num_tokens, num_reqs, tag):
        if tag is None:  # prefill chunks (or the first steps of a request)
            untagged[0] += 1
        else:
            kinds.append(tag[0])
            variable = float(spec.cost.verify_cost_ms(num_tokens)) + tag[1]
            total = totals.setdefault((tag[0], bucket_label(size_bucket(num_reqs))), [0, 0, 0])
            for i, v in enumerate((1, step_ms, step_ms - variable)):
                total[i] += v
        if tag is not None and len(kinds) > 3:  # warm-up steps are skipped
            kind, draft_ms, _ = tag
            assert draft_ms in (0.0, spec.cost.draft_lookup(num_reqs))  # drafted, or not
            residual = step_ms - float(spec.cost.verify_cost_ms(num_tokens)) - draft_ms
            b = size_bucket(num_reqs)
            seen[kind].setdefault(b, []).append(residual)
            want[kind][b] = _fenced_mean(seen[kind][b][-WINDOW:])
            counts[kind, b] = counts.get((kind, b), 0) + 1
        observe(step_ms, num_tokens, num_reqs, tag)

    spec.observe_step_time = spy
    plans, plan, apply_terms, applied = [], spec.plan, spec._apply_terms, [False]

    def apply_spy(*a):
        applied[0] = True
        return apply_terms(*a)

    def plan_spy(host, *room):
        applied[0] = False
        budget = plan(host, *room)
        if applied[0]:  # (a standing plan reads no terms: step_planning.py)
            plans.append((spec.cost.fixed_overhead_ms,
                          spec.fixed_costs.get("spec", spec._step_reqs)))  # fmt: skip
        return budget

    spec.plan, spec._apply_terms = plan_spy, apply_spy
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert kinds.count("plain") >= 5 and untagged[0] >= 1
    # plain steps never move the speculative terms (and vice versa); buckets apart
    for kind, by_bucket in want.items():
        got = spec.fixed_costs._term[kind]
        assert got.keys() == by_bucket.keys(), kind
        assert all(got[b] == pytest.approx(v, rel=1e-9, abs=1e-12) for b, v in by_bucket.items())
    # every plan that reads the terms prices its step with the speculative term of its
    # batch size (a standing plan reads none; where timing kept drafting on, standing plans
    # followed spec steps whose observations had moved the term since: a 2-core CI run under
    # load, thirty-second session)
    assert plans and all(used == (0.0 if want is None else want) for used, want in plans)
    busiest = max((b for kind, b in counts if kind == "plain"), key=lambda b: counts["plain", b])
    assert want["plain"][busiest] > 0  # host work of a CPU step is real
    # what the terms were learned from, by kind, for /metrics: steps, periods, residuals
    observed = spec.metrics()["observed_steps"]
    assert {(k, b) for k, by_batch in observed.items() for b in by_batch} == set(totals)
    for (kind, batch), (n, period, residual) in totals.items():
        assert observed[kind][batch][0] == n
        assert observed[kind][batch][1:] == pytest.approx([period, residual], rel=1e-9,
                                                          abs=1e-9)  # fmt: skip
    assert sum(v[0] for v in observed["plain"].values()) == kinds.count("plain") >= 5


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
        spec.land_periods()  # (the next plan lands them before it reads a term)

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
    learned = spec.metrics()["learned_fixed_ms"]  # every term, for /metrics
    assert learned["sampled"] == {} and set(learned["greedy"]) == {"spec", "plain"}
    assert learned["greedy"]["spec"] == pytest.approx({"8-15": 3.0, "64-127": 7.0}, rel=1e-3)
    assert learned["greedy"]["plain"] == pytest.approx({"8-15": 1.0}, rel=1e-3)
    assert spec.metrics()["acceptance_ratio"] == {"greedy": 1.0, "sampled": 1.0}
    spec._step_other = 5  # a step with a prefill chunk is not observed
    assert spec.step_tag() is None
    # nor one that verifies a draft probe's drafts while drafting is off: it carries the
    # decision on them, and would be the only speculative step observed in that state
    spec._step_other, spec.draft_enabled, spec._no_drafts = 0, False, False
    assert spec.step_tag() is None
    spec.draft_enabled = True  # a drafting step that verifies: observed as speculative
    assert spec.step_tag() == ("spec", cost.draft_lookup(reqs), True)
    # the decision uses the plain term for plain decoding: with plain steps made expensive,
    # drafting pays; with them cheap, it does not
    verify_base = cost.verify_lookup(reqs)
    spec.fixed_costs._term["plain"][size_bucket(reqs)] = 1e3
    assert spec.drafting._pays(cost, spec.fixed_costs, reqs)
    spec.fixed_costs._term["plain"][size_bucket(reqs)] = 0.0
    cost.fixed_overhead_ms = 1e3 + verify_base
    assert not spec.drafting._pays(cost, spec.fixed_costs, reqs)


def test_no_online_correction_for_tables_from_elsewhere(tiny_qwen, drafter, tmp_path):
    path = _table(tmp_path, "given", weight_read_ms=1.0, ms_per_token=0.01)
    llm = _llm(tiny_qwen, drafter, "lagged", path)
    before = llm.engine.runner.spec.cost.fixed_overhead_ms
    _generate(llm)
    assert llm.engine.runner.spec.cost.fixed_overhead_ms == before


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
        spec.land_periods()  # (the next plan lands them before it reads a term)

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
        spec.land_periods()  # (the next plan does this ...
        spec.fixed_costs.apply(cost, reqs)  # ... and this)

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
    launch, observe, step_tag = runner.launch, spec.observe_step_time, spec.step_tag

    class Tag(tuple):  # a step's tag (taken at its launch) that knows which launch it was
        pass

    def spy_launch(sched, tables, follows=False):
        launches[0] += 1
        if launches[0] == 6:
            captures[0] += 1  # this step captured a graph
        return launch(sched, tables, follows)

    def spy_tag():
        tag = step_tag()
        if tag is None:
            return None
        tag = Tag(tag)
        tag.launch = launches[0]
        return tag

    def spy_observe(step_ms, num_tokens, num_reqs, tag):
        observed.append(None if tag is None else tag.launch)
        observe(step_ms, num_tokens, num_reqs, tag)

    runner.launch, spec.step_tag, spec.observe_step_time = spy_launch, spy_tag, spy_observe
    _generate(llm)
    assert launches[0] > 8 and 6 not in observed and {5, 7} <= set(observed)
    assert len(observed) == launches[0] - 1  # every step but the one that captured


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


def test_a_table_profiled_at_start_up_is_written_where_the_env_says(tiny_qwen, drafter,
                                                                     tmp_path, monkeypatch):
    """DSPARK_COST_TABLE_OUT: the engine's start-up profile is also written there (a served
    run's planning can then be replayed on the CPU against its own table); a loaded table is
    not rewritten."""
    from dspark.spec.cost_model import CostModel
    from dspark.spec.profiler import COST_TABLE_OUT_ENV

    out = tmp_path / "served_table.json"
    monkeypatch.setenv(COST_TABLE_OUT_ENV, str(out))
    spec = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged"}
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, speculative_config=spec)
    cost, written = llm.engine.runner.spec.cost, CostModel.from_json(str(out))
    assert np.array_equal(written.verify_tokens, cost.verify_tokens)
    assert np.array_equal(written.verify_ms, cost.verify_ms) and np.all(cost.verify_ms > 0)
    assert np.array_equal(written.draft_ms, cost.draft_ms)
    # (also when the CPU's timings make the table flat, UNUSABLE: it once did in CI)
    assert str(out) in llm.engine.runner.spec.metrics()["cost_table_status"]
    written.to_json(str(tmp_path / "t.json"))
    out.unlink()
    LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
        speculative_config=dict(spec, cost_table_path=str(tmp_path / "t.json")))
    assert not out.exists()


def test_a_pause_between_steps_does_not_move_the_learned_term():
    """A served step's period also holds what the driver did between steps (a request's
    arrival, a collection pause): one 20 ms outlier among 1 ms residuals leaves the term at
    1 ms (an average would have carried +1.3 ms for a whole window), and a lasting change is
    learned step by step from a quarter of a window in, fully within a window."""
    from dspark.spec.online_cost import WARMUP_STEPS, WINDOW, FixedCosts

    fc = FixedCosts()
    for _ in range(WARMUP_STEPS):
        fc.observe("plain", 99.0, 8)  # warm-up steps: ignored
    assert fc.get("plain", 8) is None
    for _ in range(WINDOW):
        fc.observe("plain", 1.0, 8)
    fc.observe("plain", 20.0, 8)
    assert fc.get("plain", 8) == 1.0
    terms = []
    for _ in range(WINDOW):
        fc.observe("plain", 3.0, 8)
        terms.append(fc.get("plain", 8))
    # (a quarter of a window in, the new level is no outlier any more and counts in full)
    assert all(a <= b for a, b in zip(terms, terms[1:])) and 1.0 < terms[WINDOW // 4] < 3.0
    assert terms[-1] == 3.0
    assert fc.get("spec", 8) is None and fc.get("plain", 64) == 3.0  # nearest bucket


def test_the_term_is_a_kinds_mean_cost_tail_included():
    """Throughput is tokens over the sum of periods: a tail a kind pays every few steps is part
    of its cost. Residuals of 0.1 ms with every fourth step at 0.5 ms (a host-bound speculative
    step's sampling, collection or copy stalls) price the kind at their mean, 0.2 ms; the
    median, 0.1, made speculative steps look cheaper than plain ones of a flatter 0.15 ms
    (demo pair, H200, T = 1, c = 4: drafting ran 32% below no speculation). Negative residuals
    (a table profiled slower than serving) are fenced the same way."""
    from dspark.spec.online_cost import WARMUP_STEPS, WINDOW, FixedCosts, fenced_mean

    fc = FixedCosts()
    for _ in range(WARMUP_STEPS):
        fc.observe("spec", 0.0, 4)
    tail = [0.5 if i % 4 == 3 else 0.1 for i in range(4 * WINDOW)]
    for r in tail:
        fc.observe("spec", r, 4)
        fc.observe("plain", 0.15, 4)
    window = tail[-WINDOW:]
    assert fc.get("spec", 4) == pytest.approx(sum(window) / WINDOW)  # 0.1 x 11 + 0.5 x 4
    assert fc.get("spec", 4) > fc.get("plain", 4) == pytest.approx(0.15)
    # one pause among steady steps counts as a step at the far fence: q3 + 3 x (q3 - q1)
    steady = [0.4 + 0.01 * (i % 5) for i in range(WINDOW - 1)]
    q1, q3 = sorted(steady + [30.0])[WINDOW // 4], sorted(steady + [30.0])[3 * WINDOW // 4]
    want = (sum(steady) + q3 + 3.0 * (q3 - q1)) / WINDOW
    assert fenced_mean(steady + [30.0]) == pytest.approx(want) and want < 0.5
    assert fenced_mean([-0.3, -0.2, -0.25, -0.3, -9.0]) == pytest.approx(
        (-0.3 - 0.2 - 0.25 - 0.3 + (-0.3 - 3 * 0.05)) / 5)  # (q1 = -0.3, q3 = -0.25)


def test_terms_read_at_any_time_are_the_windows_fenced_means():
    """The terms are computed when read (an observed step only marks its bucket): read
    between observations, through every accessor, in any order, each is its window's fenced
    mean, and a bucket observed but never read is fresh when first read."""
    from dspark.spec.online_cost import WARMUP_STEPS, WINDOW, FixedCosts, bucket_label

    fc = FixedCosts()
    for _ in range(WARMUP_STEPS):
        fc.observe("spec", 0.0, 4)
    rng = np.random.default_rng(3)
    seen = {("spec", 4): [], ("spec", 32): [], ("plain", 4): []}
    for step in range(3 * WINDOW):
        for (kind, n), window in seen.items():
            r = float(rng.normal(0.2, 0.05)) + (2.0 if step % 9 == 0 else 0.0)
            fc.observe(kind, r, n)
            window.append(r)
        if step % 4 == 1:  # read some of the time, through different accessors
            assert fc.get("spec", 4) == pytest.approx(_fenced_mean(seen["spec", 4][-WINDOW:]))
        if step % 7 == 3:
            snap = fc.snapshot()
            assert snap["plain"][bucket_label(3)] == pytest.approx(
                _fenced_mean(seen["plain", 4][-WINDOW:]))  # fmt: skip
    # ("spec", 32) was never read until now
    assert fc.get("spec", 32) == pytest.approx(_fenced_mean(seen["spec", 32][-WINDOW:]))
    assert fc.speculative(4) == pytest.approx(_fenced_mean(seen["spec", 4][-WINDOW:]))
    assert sorted(fc.snapshot()["spec"]) == sorted([bucket_label(3), bucket_label(6)])


def test_a_bucket_measured_a_few_times_defers_to_a_measured_neighbour():
    """Batch sizes a server passes through (requests finishing and arriving) are measured a
    few times in those moments: their term is used once measured MIN_SAMPLES times, before
    that the nearest well-measured bucket's (a lone bucket's is used from its first step)."""
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    approx = pytest.approx
    fc = FixedCosts()
    for _ in range(WARMUP_STEPS):
        fc.observe("spec", 0.0, 1)
    fc.observe("spec", 2.5, 3)  # 2-3 requests: one step at a level's edge
    assert fc.get("spec", 3) == 2.5  # nothing better measured
    for _ in range(MIN_SAMPLES):
        fc.observe("spec", 0.9, 1)  # steady single-request steps
    assert fc.get("spec", 3) == approx(0.9) and fc.get("spec", 2) == approx(0.9)
    for _ in range(MIN_SAMPLES - 2):
        fc.observe("spec", 1.2, 3)
    assert fc.get("spec", 3) == approx(0.9)
    fc.observe("spec", 1.2, 3)  # its MIN_SAMPLES-th: its own term now
    assert fc.get("spec", 3) == approx(1.2) and fc.get("spec", 1) == approx(0.9)


def test_trimmed_steps_learn_what_trimming_saves():
    """A trimmed step's residual is its period beyond the table's price of its (fewer) tokens.
    Where the host bounds the step, trimming saves nothing and the residual grows by what the
    table promised: that excess over untrimmed steps is the penalty of a trimmed plan. Where
    the device bounds it, the excess is ~0. Only a bucket's own MIN_SAMPLES trimmed steps count,
    and only while fresh: a stale term is measured afresh before it prices trims again."""
    from dspark.spec.online_cost import MIN_SAMPLES, TRIM_FRESH_STEPS, WARMUP_STEPS, FixedCosts

    table = {48: 6.0, 30: 4.0}  # the table's forward ms of an untrimmed and a trimmed step
    reqs = 8

    def learned(trim_period_ms: float, n_trim: int = MIN_SAMPLES) -> FixedCosts:
        fc = FixedCosts()
        for _ in range(WARMUP_STEPS + 20):
            fc.observe("spec", 7.0 - table[48], reqs)  # untrimmed steps take 7 ms
        for _ in range(n_trim):
            fc.observe("trim", trim_period_ms - table[30], reqs)
        return fc

    spec_term = 1.0
    host_bound = learned(7.0)  # trimmed steps take as long as untrimmed ones
    assert host_bound.trim_penalty_ms(spec_term, reqs) == pytest.approx(table[48] - table[30])
    device_bound = learned(5.0)  # they take what the table says (+ the same fixed term)
    assert device_bound.trim_penalty_ms(spec_term, reqs) == pytest.approx(0.0)
    assert learned(7.0, MIN_SAMPLES - 1).trim_penalty_ms(spec_term, reqs) == 0.0  # too few
    assert host_bound.trim_penalty_ms(spec_term, 64) == 0.0  # another bucket: its own steps
    # not refreshed for TRIM_FRESH_STEPS observed steps: it lapses, and one new trimmed step
    # does not bring the old window back
    for _ in range(TRIM_FRESH_STEPS + 1):
        host_bound.observe("spec", 1.0, reqs)
    assert host_bound.trim_penalty_ms(spec_term, reqs) == 0.0
    host_bound.observe("trim", 7.0 - table[30], reqs)
    assert host_bound.trim_penalty_ms(spec_term, reqs) == 0.0
    for _ in range(MIN_SAMPLES - 1):
        host_bound.observe("trim", 7.0 - table[30], reqs)
    assert host_bound.trim_penalty_ms(spec_term, reqs) == pytest.approx(table[48] - table[30])


@pytest.mark.parametrize("host_bound", [True, False])
def test_trimming_stops_where_trimmed_steps_are_not_faster(tiny_qwen, drafter, host_bound):
    """In the engine: a steep table makes the random drafter's drafts worth trimming. When
    every step takes as long whatever its tokens (a host-bound engine: the periods fed to the
    online correction are a constant), the trimmed steps' measured excess stops the trimming;
    when steps take what the table says, trimming goes on."""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged",
                                  "draft_skipping": False})  # fmt: skip
    spec = llm.engine.runner.spec
    table = CostModel.from_measurements([1, 64], [1.0, 20.0], [1, 64], [0.1, 0.1],
                                        provenance={"source": "profiled"})  # fmt: skip
    spec.set_cost_model(table, "profiled at start-up")
    observe, plan, trimmed = spec.observe_step_time, spec.plan, []

    def periods(step_ms, num_tokens, num_reqs, tag):
        if tag is not None:  # as the engine would measure it, host- or device-bound
            step_ms = 40.0 if host_bound else float(table.verify_cost_ms(num_tokens)) + 0.6
        observe(step_ms, num_tokens, num_reqs, tag)

    def plans(host, *room):
        budget = plan(host, *room)
        if spec._step_other == 0 and host.get("num_draft_fills") > 0:
            trimmed.append(spec._step_trimmed)
        return budget

    spec.observe_step_time, spec.plan = periods, plans
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert len(trimmed) > 40 and sum(trimmed[:20]) >= 5  # trimming pays by the table
    late = trimmed[len(trimmed) // 2:]
    if host_bound:
        assert not any(late)
        reqs = len(PROMPTS)  # (the batch of the trimmed steps: 4-7 requests)
        assert spec.fixed_costs.trim_penalty_ms(spec.fixed_costs.get("spec", reqs), reqs) > 1.0
    else:
        assert sum(late) >= len(late) // 2


def test_steps_are_observed_net_of_their_own_context_read(tiny_qwen, drafter):
    """With a table that prices context, every plan prices its step's KV read from the
    packed rows' contexts, and the step is observed net of that same read (its tag, taken at
    launch): the learned terms hold no context error. The start-up profile on the CPU
    records its rows (for context pricing) but measures no slope."""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                  "adaptive_policy": "lagged"})  # fmt: skip
    spec = llm.engine.runner.spec
    profiled = spec.cost
    assert profiled.verify_reqs.tolist() == [
        min(llm.engine.config.max_num_seqs, n) for n in profiled.verify_tokens]
    assert not profiled.prices_context and "context_probe" in profiled.provenance
    slope = 1e-3
    table = CostModel.from_measurements([1, 64], [0.01, 0.05], [1, 64], [50.0, 50.0],
                                        provenance={"source": "profiled"}, verify_reqs=[1, 64],
                                        context_ms_per_token=slope, profile_context_len=4)
    with pytest.warns(RuntimeWarning, match="flat"):
        spec.set_cost_model(table, "profiled at start-up")
    planned, seen = [], []
    plan, observe = spec.plan, spec.observe_step_time

    def plan_spy(host, *room):
        budget = plan(host, *room)
        planned.append((host.get("context_tokens"), spec.cost.step_context_ms))
        return budget

    def observe_spy(step_ms, num_tokens, num_reqs, tag):
        if tag is not None:
            kind, priced, _ = tag
            seen.append(priced - (0.0 if kind == "plain" else spec.cost.draft_lookup(num_reqs)))
        observe(step_ms, num_tokens, num_reqs, tag)

    spec.plan, spec.observe_step_time = plan_spy, observe_spy
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert planned and all(ms == pytest.approx(slope * c, abs=1e-15) for c, ms in planned)
    assert len(seen) >= 5 and min(seen) > 0  # every observed step read a context
    planned_ms = [ms for _, ms in planned]
    assert all(min(abs(s - p) for p in planned_ms) < 1e-12 for s in seen)


def test_a_bucket_that_only_trims_prices_speculative_steps_by_its_trims():
    """Where every step of a batch size trims, no untrimmed step measures the speculative
    term there; its own trimmed steps' term prices speculative steps rather than a few
    untrimmed steps of other batch sizes. Once MIN_SAMPLES untrimmed steps are measured at
    that size, theirs does."""
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    fc = FixedCosts()
    for _ in range(WARMUP_STEPS + 3):
        fc.observe("spec", 0.2, 20)  # a few untrimmed steps at 16-31 requests
    cost = CostModel.from_measurements([1, 64], [1.0, 3.0])
    for _ in range(MIN_SAMPLES - 1):
        fc.observe("trim", 1.1, 128)
    assert fc.speculative(128) == pytest.approx(0.2)  # too few trims yet: the neighbour's
    fc.observe("trim", 1.1, 128)
    assert fc.speculative(128) == pytest.approx(1.1)
    assert fc.apply(cost, 128) and cost.fixed_overhead_ms == pytest.approx(1.1)
    assert fc.trim_penalty_ms(cost.fixed_overhead_ms, 128) == 0.0
    assert fc.speculative(20) == pytest.approx(0.2)  # (another bucket keeps its own)
    for _ in range(MIN_SAMPLES):
        fc.observe("spec", 0.5, 128)
    assert fc.speculative(128) == pytest.approx(0.5)
    assert fc.trim_penalty_ms(0.5, 128) == pytest.approx(0.6)


def test_a_term_names_the_batch_size_it_was_learned_at_once_its_own_buckets():
    """FixedCosts.measured_at: the mean request count of the steps behind the term `get`
    answers with at a batch size, while that term is its own bucket's (MIN_SAMPLES steps);
    None while a neighbour's stands in."""
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, FixedCosts

    fc = FixedCosts()
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        fc.observe("plain", 0.5, 64)  # bucket 64-127
    for n in (130, 140, 150):
        fc.observe("plain", 1.0, n)  # bucket 128-255: too few steps of its own yet
    assert fc.get("plain", 250) == pytest.approx(0.5)  # (64's term stands in)
    assert fc.measured_at("plain", 250) is None and fc.measured_at("plain", 100) == 64
    for _ in range(MIN_SAMPLES - 3):
        fc.observe("plain", 1.0, 250)
    assert fc.get("plain", 250) == pytest.approx(1.0)
    assert fc.measured_at("plain", 200) == pytest.approx((130 + 140 + 150 + 250 * 5) / 8)
