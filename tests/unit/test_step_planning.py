"""A plan the cost bound settles stands for the next plans of its shape (step_planning.py):
they verify every draft without re-reading the learned terms or re-checking the bound; a new
batch size, more draft fills than the settled plan's, a drafting decision or a step with
prefill chunks re-reads them. Output unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cruise import Cruise
from dspark.spec.step_planning import RATE_MEMO_PLANS, SETTLED_PLANS
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import PROMPTS, _llm, _table


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("sp")), tiny_qwen, seed=9)


def _run(llm, max_tokens: int = 40):
    """Generate PROMPTS; every lagged plan as (requests, draft fills, prefill tokens, whether
    it re-read the terms, whether the drafting decision was due, budget)."""
    spec, plans = llm.engine.runner.spec, []
    spec.cruise = Cruise(after=0)  # (the settled plans alone: a cruise would skip them)
    plan, apply_terms, due = spec.plan, spec._apply_terms, spec.drafting.due
    state = {"reads": 0, "due": False}

    def counting_apply(*a):
        state["reads"] += 1
        return apply_terms(*a)

    def recording_due(n):
        state["due"] = due(n)
        return state["due"]

    def recording_plan(host, *room):
        # (a routine plan, DraftingDecision.routine, does not ask `due`: it would say False)
        reads, state["due"] = state["reads"], False
        budget = plan(host, *room)
        n, total, other, *_ = host.plan_scalars()
        plans.append((n, total, other, state["reads"] > reads, state["due"], budget))
        return budget

    spec.plan, spec._apply_terms, spec.drafting.due = recording_plan, counting_apply, recording_due
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs], plans


def _count_term_reads(spec) -> list[int]:
    """Count the plans that re-read the learned terms (spec._apply_terms) from now on: a
    one-element list, read as reads[0]."""
    reads, apply_terms = [0], spec._apply_terms

    def counting(*a):
        reads[0] += 1
        return apply_terms(*a)

    spec._apply_terms = counting
    return reads


def test_a_settled_plan_stands_for_the_plans_of_its_shape(tiny_qwen, drafter, tmp_path):
    # verification nearly free beside a 2 ms step: the bound settles every decode plan
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=2.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256, draft_skipping=False)
    outs, plans = _run(llm)
    plain = LLM(tiny_qwen, device="cpu").generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))  # fmt: skip
    assert outs == [o.outputs[0].token_ids for o in plain]  # lossless

    standing = [i for i, p in enumerate(plans) if not p[3]]
    decode = [p for p in plans if p[2] == 0 and p[1] > 0]
    assert len(standing) >= len(decode) // 3, (len(standing), len(decode))  # it happens
    for i, (n, total, other, reread, due, budget) in enumerate(plans):
        # the last decode plan of these requests that re-read the terms (settled here: the
        # cheap table's bound settles every decode plan)
        j = next((j for j in range(i - 1, -1, -1)
                  if plans[j][3] and plans[j][0] == n and plans[j][2] == 0), None)  # fmt: skip
        could_stand = (not due and other == 0 and j is not None and i - j < SETTLED_PLANS
                       and total <= plans[j][1])  # fmt: skip
        # a standing plan: verify-all, on a decode step with no decision due, within
        # SETTLED_PLANS - 1 plans of the plan that settled its requests, with at most its
        # draft fills; every other plan re-read the terms
        assert reread != could_stand, (plans[j] if j is not None else None, plans[i])
        if not reread:
            assert budget == total > 0


class _Shape:
    """A packed host step planned as if it had `n` requests and `total` draft fills (the
    plans below read only its scalars: the bound settles them)."""

    def __init__(self, host, n: int, total: int):
        self.host, self.n, self.total = host, n, total

    def plan_scalars(self):
        _, _, other, _, greedy, context = self.host.plan_scalars()
        return self.n, self.total, other, self.n, greedy, context


def test_a_settled_plan_stands_for_fewer_fills_and_across_other_shapes(tiny_qwen, drafter,
                                                                       tmp_path):  # fmt: skip
    """In a server the request count moves by one and back as requests finish and their
    successors are admitted (n -> n - 1 -> n), and a row may lay out fewer draft slots. A plan
    settled at n stands for n's plans with as many or fewer fills among the next
    SETTLED_PLANS - 1 plans, whatever plans between; more fills, or an older settlement,
    re-read the terms."""
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=2.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256, draft_skipping=False)
    spec, hosts, plan = llm.engine.runner.spec, [], llm.engine.runner.spec.plan
    spec.plan = lambda host, *room: hosts.append(host) or plan(host, *room)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # fmt: skip
    host = next(h for h in hosts if h.prefill_tokens() == 0 and h.get("num_draft_fills") > 0)
    spec.plan, spec.drafting.due = plan, lambda num_reqs: False
    reads, k = _count_term_reads(spec), spec.k
    spec._settled = {}

    def rereads(n: int, fills: int) -> bool:
        before = reads[0]
        assert spec.plan(_Shape(host, n, fills)) == fills  # verify-all throughout
        return reads[0] > before

    assert rereads(6, 6 * k)  # settles 6 requests
    assert not rereads(6, 5 * k)  # fewer draft fills: stands
    assert rereads(5, 5 * k)  # a request fewer: its own plan, settled
    assert not rereads(6, 6 * k) and not rereads(5, 5 * k)  # each stands again
    assert not rereads(6, 6 * k - 1)
    for _ in range(SETTLED_PLANS - 6):
        assert not rereads(6, 6 * k)
    assert rereads(6, 6 * k)  # SETTLED_PLANS plans after it settled: re-read, settles again
    assert not rereads(5, 5 * k)  # 5 settled two plans after 6: it stands one plan longer
    assert rereads(5, 5 * k)
    assert rereads(5, 5 * k + 1)  # more fills than it settled with: re-read


def test_without_standing_every_plan_rereads(tiny_qwen, drafter, tmp_path):
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=2.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256, draft_skipping=False)
    llm.engine.runner.spec.settled_plans = 1
    _, plans = _run(llm, 24)
    assert plans and all(p[3] for p in plans)


def test_a_bucket_that_only_trims_measures_untrimmed_steps(tiny_qwen, drafter):
    """A bucket whose steps all trimmed prices its trims against themselves (the 24th
    session's rule: its speculative term is then the trims' own), so its trim penalty is ~0
    and, where the host bounds the step, trims that save nothing never stop. Where the trims'
    term is a large share of their period, an untrimmed probe (12 verify-all plans, at most
    once per 512 observed steps and bucket) measures the untrimmed steps; once they take as
    long as the trimmed ones, the penalty stops trimming."""
    from dspark.spec.online_cost import MIN_SAMPLES, WARMUP_STEPS, fixed_costs_by_mode
    from dspark.spec.step_planning import UNTRIMMED_PROBE_EVERY, UNTRIMMED_PROBE_STEPS

    spec, table, host = _steep_decode_step(tiny_qwen, drafter, "profiled")
    n, total = host.get("num_reqs"), host.get("num_draft_fills")

    def residual_ms(tokens: int) -> float:  # host-bound: every step takes 8 ms
        return 8.0 - float(table.verify_cost_ms(tokens)) - table.draft_lookup(n)

    # where the device bounds the step (trimmed steps take what the table says, plus a small
    # term) no probe is due: the table's savings are real there
    device_bound = fixed_costs_by_mode()[True]
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):
        device_bound.observe("trim", 0.2, n, float(table.verify_cost_ms(n + 2)) + 0.3)
    assert not device_bound.untrimmed_stale(n)

    spec._fixed_by_mode = fixed_costs_by_mode()
    fixed = spec._fixed_by_mode[True]
    for _ in range(WARMUP_STEPS + MIN_SAMPLES):  # every step so far trimmed (to 2 drafts)
        fixed.observe("trim", residual_ms(n + 2), n, 8.0)
    assert fixed.untrimmed_stale(n) and fixed.trim_penalty_ms(fixed.speculative(n), n) == 0.0
    budgets = [spec.plan(host) for _ in range(UNTRIMMED_PROBE_STEPS)]
    assert budgets == [total] * UNTRIMMED_PROBE_STEPS  # the probe: verify every draft
    assert spec.plan(host) < total  # it ran its course; trimming pays by the table again
    # its steps went unobserved: no new probe before UNTRIMMED_PROBE_EVERY observed steps
    probed = dict(spec._untrimmed_probed)
    for _ in range(20):
        spec.plan(host)
    assert spec._untrimmed_left == 0 and spec._untrimmed_probed == probed
    for _ in range(UNTRIMMED_PROBE_EVERY):
        fixed.observe("trim", residual_ms(n + 2), n, 8.0)
    spec._settled.clear()  # (no standing verify-all plan in the way)
    assert spec.plan(host) == total  # probing again
    assert spec._untrimmed_left == UNTRIMMED_PROBE_STEPS - 1
    for _ in range(MIN_SAMPLES):  # its steps, observed: as long as the trimmed ones
        fixed.observe("spec", residual_ms(n + total), n, 8.0)
    assert not fixed.untrimmed_stale(n)
    assert fixed.trim_penalty_ms(fixed.speculative(n), n) == pytest.approx(
        float(table.verify_cost_ms(n + total) - table.verify_cost_ms(n + 2)))  # fmt: skip
    spec._untrimmed_left = 0
    assert all(spec.plan(host) == total for _ in range(20))  # trimming stopped


def test_a_searched_clear_verify_all_stands_too(tiny_qwen, drafter):
    """Where the bound does not settle (verification costs) but a search finds every draft
    worth verifying by far (confident drafts), that plan stands for the next plans of its
    shape in the same way: one search per SETTLED_PLANS decode plans, none of the plans
    between re-reading the terms; the planner's own standing plan for it is retired, so it
    does not stand twice."""
    spec, _, host = _steep_decode_step(tiny_qwen, drafter, "loaded")  # (no online terms)
    total = host.get("num_draft_fills")
    spec._stale = lambda slots: np.full((len(slots), spec.k), 0.999)  # confident drafts
    spec.planner.invalidate_tables()  # (the plans standing from the generation: dropped)
    assert not spec.planner.bound_settles(host.get("num_reqs"), total)
    searches, reads = spec.planner.searches, _count_term_reads(spec)
    budgets = [spec.plan(host) for _ in range(3 * SETTLED_PLANS)]
    assert budgets == [total] * len(budgets)  # verify-all throughout
    assert spec.planner.searches - searches == 3  # one search per SETTLED_PLANS plans
    assert reads[0] == 3
    spec.settled_plans = 1  # without standing here: the planner's own plans stand (15 plans)
    spec._settled, before = {}, spec.planner.searches
    assert [spec.plan(host) for _ in range(32)] == [total] * 32
    assert spec.planner.searches - before == 2


def test_a_searched_verify_all_near_the_guard_stands_as_long_as_in_the_planner(tiny_qwen,
                                                                               drafter):
    """A searched verify-all whose best trim came within the guard's upper half stands for
    as many plans as the planner's own standing plan would (StandingPlans.plans_for: 8 in the
    engine), but here: the plans between re-read neither the terms nor the planner (at c = 4
    on the trained pair 55-143 such searches a level, each followed by ~7 plans through the
    planner, thirty-second session). The next one in a row for the same requests stands as
    long as a clear one (SETTLED_PLANS); a trimmed search in between starts over."""
    from dspark.spec.plan_reuse import BudgetDecision, clear_of_guard

    spec, _, host = _steep_decode_step(tiny_qwen, drafter, "loaded")
    total, planner = host.get("num_draft_fills"), spec.planner
    assert not planner.bound_settles(host.get("num_reqs"), total)
    near = BudgetDecision(total, total, 1.03, 1.0, 0.03, False)  # a 3% trim, under the 4% guard
    assert not clear_of_guard(near, planner.min_predicted_gain)
    stands = planner.standing.plans_for(near)
    assert 1 < stands < SETTLED_PLANS

    def search(*a, **k):  # the planner's search, answering near the guard
        planner.searches += 1
        planner.last_decision, planner.last_settled = near, False
        return total

    reads = _count_term_reads(spec)
    planner.plan_cpu, spec._settled = search, {}
    before = planner.searches
    plans = stands + 2 * SETTLED_PLANS
    assert [spec.plan(host) for _ in range(plans)] == [total] * plans
    # searched at plans 0, `stands` and `stands` + SETTLED_PLANS: the plans between standing
    assert planner.searches - before == 3 and reads[0] == 3
    trimmed = BudgetDecision(total - 1, total, 1.1, 1.0, 0.1, True)
    planner.last_decision = trimmed
    answers = iter([trimmed, near, near])  # a trim, then near the guard twice

    def search_again(*a, **k):
        planner.searches += 1
        planner.last_decision, planner.last_settled = next(answers), False
        return planner.last_decision.budget

    planner.plan_cpu, spec._settled, before = search_again, {}, planner.searches
    budgets = [spec.plan(host) for _ in range(2 + stands)]
    assert budgets == [total - 1, total] + [total] * stands
    assert planner.searches - before == 3  # after the trim, the first near one stands 8


def test_a_verify_all_settled_by_the_trim_penalty_stands_too(tiny_qwen, drafter):
    """Where the bound settles verify-all only with the learned trim penalty (a host-bound
    pair whose trimmed steps were measured to save nothing: the trained pair at T = 0, c = 1
    on the H200, thirty-first session), that plan stands for the next plans of its shape as one the
    bound settles outright does: one re-read of the terms per SETTLED_PLANS decode plans, not
    one per plan (each ~55 us in the H200 host's serving loop). Without the penalty it would
    search."""
    spec, _, host = _steep_decode_step(tiny_qwen, drafter, "profiled")
    n, total = host.get("num_reqs"), host.get("num_draft_fills")
    assert not spec.planner.bound_settles(n, total)  # verification costs by the table
    for fixed in spec._fixed_by_mode.values():  # trimmed steps measured 100 ms dearer
        fixed.trim_penalty_ms = lambda *a: 100.0
    reads, searches = _count_term_reads(spec), spec.planner.searches
    spec._settled = {}
    budgets = [spec.plan(host) for _ in range(3 * SETTLED_PLANS)]
    assert budgets == [total] * len(budgets)  # verify-all throughout
    assert reads[0] == 3 and spec.planner.searches == searches  # settled, not searched
    spec.settled_plans, spec._settled, reads[0] = 1, {}, 0  # without standing: every plan
    assert [spec.plan(host) for _ in range(8)] == [total] * 8 and reads[0] == 8


def _steep_decode_step(tiny_qwen, drafter, source: str):
    """A lagged engine at 4-7 requests priced by a steep table (verification costs: the
    random drafter's drafts are worth trimming by it) of provenance `source` ("profiled":
    online terms on), after a short generation; returns (decoder, table, the packed host step
    of its last decode step of the whole batch). Its plans decide nothing from then on."""
    from dspark.spec.cost_model import CostModel

    cfg = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
           "draft_skipping": False}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, speculative_config=cfg)
    spec = llm.engine.runner.spec
    table = CostModel.from_measurements([1, 64], [1.0, 20.0], [1, 64], [0.1, 0.1],
                                        provenance={"source": source})  # fmt: skip
    spec.set_cost_model(table, f"{source} (test)")
    hosts, plan = [], spec.plan
    spec.plan = lambda host, *room: hosts.append(host) or plan(host, *room)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # fmt: skip
    host = next(h for h in reversed(hosts)
                if h.prefill_tokens() == 0 and h.get("num_draft_fills") > 0)  # fmt: skip
    spec.plan, spec.drafting.due = plan, lambda num_reqs: False
    spec.cruise = Cruise(after=0)  # (the standing plans alone: a cruise would skip them)
    return spec, table, host


def test_plain_steps_plan_without_reading_the_terms(tiny_qwen, drafter, tmp_path):
    """While drafting is off a plain step has nothing to verify and no budget to search: its
    plan reads neither the learned terms nor the planner, unless the drafting decision is due
    or the sampling mode changed (the drafter's price, which step_tag reads, is per mode).
    Output unchanged."""
    # the drafter costs 50 ms a step beside a 1 ms forward: drafting never pays
    path = _table(tmp_path, "dear", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=1.0, draft_base_ms=50.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256)
    spec, hosts = llm.engine.runner.spec, []
    pack = spec.plan
    spec.plan = lambda host, *room: hosts.append(host) or pack(host, *room)
    outs, plans = _run(llm)
    plain = LLM(tiny_qwen, device="cpu").generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))  # fmt: skip
    assert outs == [o.outputs[0].token_ids for o in plain]  # lossless
    idle = [p for p in plans if p[1] == 0 and p[2] == 0 and not p[4]]
    assert len(idle) >= len(plans) // 2, (len(idle), len(plans))  # drafting was off
    assert all(not p[3] and p[5] == 0 for p in idle)
    assert all(p[3] for p in plans if p[4] or p[2] > 0)  # decisions and prefill re-read
    # a plain step after a sampled one (another mode) re-reads: it reprices the drafter
    host = hosts[[i for i, p in enumerate(plans) if p in idle][-1]]
    apply_terms, reads = spec._apply_terms, []
    spec._apply_terms = lambda *a: reads.append(a) or apply_terms(*a)
    spec.fixed_costs = spec._fixed_by_mode[False]
    spec.drafting._since_decision = 0  # (no decision due)
    assert pack(host) == 0 and len(reads) == 1 and spec.fixed_costs is spec._fixed_by_mode[True]
    assert pack(host) == 0 and len(reads) == 1  # ... and the next one reads nothing


def test_steps_with_prefill_chunks_reuse_the_priced_decode_rate(tiny_qwen, drafter, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """A prompt arriving in chunks plans several steps in a row beside the same decoding rows;
    what decoding would earn (the drafts' opportunity rate) is priced again only once the
    request count changed, the first survival estimate came, or RATE_MEMO_PLANS plans went
    by (a moved estimate or acceptance ratio waits for that). Output unchanged."""
    import dspark.spec.step_planning as sp

    path = _table(tmp_path, "steep", weight_read_ms=1.0, ms_per_token=0.2,
                  fixed_overhead_ms=0.5, draft_base_ms=0.1, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=16, draft_skipping=False)
    spec = llm.engine.runner.spec
    priced, rate = [], sp.decode_rate
    monkeypatch.setattr(sp, "decode_rate", lambda *a: priced.append(rate(*a)) or priced[-1])
    mixed, plan = [], spec.plan

    def recording_plan(host, *room):
        calls, unsurveyed = len(priced), spec.drafting.survival is None
        budget = plan(host, *room)
        n, total, other, n_sampling, *_ = host.plan_scalars()
        if other and total:  # (a step with prefill chunks and drafts to verify)
            mixed.append((n_sampling, unsurveyed, spec._plans_counted, len(priced) > calls))
        return budget

    spec.plan = recording_plan
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 120, 90, 150, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    want = LLM(tiny_qwen, device="cpu").generate([{"prompt_token_ids": p} for p in prompts],
                                                 params)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert len(mixed) >= 15 and 0 < len(priced) < len(mixed)
    last = None
    for n, unsurveyed, count, fresh in mixed:
        if last is None or (n, unsurveyed) != last[:2] or count >= last[2] + RATE_MEMO_PLANS:
            assert fresh  # priced again: a new count, the first estimate, RATE_MEMO_PLANS on
            last = (n, unsurveyed, count)
        else:
            assert not fresh
