"""A plan the cost bound settles stands for the next plans of its shape (step_planning.py):
they verify every draft without re-reading the learned terms or re-checking the bound; a new
shape, a drafting decision or a step with prefill chunks re-reads them. Output unchanged."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.spec.step_planning import SETTLED_PLANS
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import PROMPTS, _llm, _table


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("sp")), tiny_qwen, seed=9)


def _run(llm, max_tokens: int = 40):
    """Generate PROMPTS; every lagged plan as (requests, draft fills, prefill tokens, whether
    it re-read the terms, whether the drafting decision was due, budget)."""
    spec, plans = llm.engine.runner.spec, []
    plan, apply_terms, due = spec.plan, spec._apply_terms, spec.drafting.due
    state = {"reads": 0, "due": False}

    def counting_apply(*a):
        state["reads"] += 1
        return apply_terms(*a)

    def recording_due(n):
        state["due"] = due(n)
        return state["due"]

    def recording_plan(host):
        reads = state["reads"]
        budget = plan(host)
        n, total, other, *_ = host.plan_scalars()
        plans.append((n, total, other, state["reads"] > reads, state["due"], budget))
        return budget

    spec.plan, spec._apply_terms, spec.drafting.due = recording_plan, counting_apply, recording_due
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs], plans


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
    run = 0
    for i in standing:
        n, total, other, _, due, budget = plans[i]
        # verify-all, on a decode step with no decision due, of the shape of the plan before
        assert other == 0 and not due and budget == total > 0
        assert plans[i - 1][:2] == (n, total)
        run = run + 1 if i - 1 in standing else 1
        assert run <= SETTLED_PLANS - 1
    # every plan that changed shape, decided, or carried prefill chunks re-read the terms
    for prev, cur in zip(plans, plans[1:]):
        if cur[:2] != prev[:2] or cur[4] or cur[2] > 0:
            assert cur[3], (prev, cur)


def test_without_standing_every_plan_rereads(tiny_qwen, drafter, tmp_path):
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=2.0, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    llm = _llm(tiny_qwen, drafter, "lagged", path, budget_tokens=256, draft_skipping=False)
    llm.engine.runner.spec.settled_plans = 1
    _, plans = _run(llm, 24)
    assert plans and all(p[3] for p in plans)
