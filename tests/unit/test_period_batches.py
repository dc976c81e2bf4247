"""Step periods reach the online cost model in batches (step_observation.observe_step_time):
queued, they land at the next plan that reads the terms (before it reads them), once
OBSERVE_BATCH wait, when a run ends and before /metrics reads the terms; landed late, they
give the terms landing one at a time would."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.spec.online_cost import FixedCosts
from dspark.spec.step_observation import OBSERVE_BATCH
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import PROMPTS


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("pb")), tiny_qwen, seed=9)


def _lagged(tiny_qwen, drafter) -> LLM:
    return LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
               speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                   "adaptive_policy": "lagged"})  # fmt: skip


def test_periods_wait_for_a_batch_and_land_as_one_at_a_time_would(tiny_qwen, drafter):
    spec = _lagged(tiny_qwen, drafter).engine.runner.spec
    cost, reqs, tokens = spec.cost, 8, 48
    spec.draft_enabled, spec._no_drafts, spec._step_reqs, spec._step_other = True, False, reqs, 0
    tag = spec.step_tag()
    assert tag is not None and tag[0] == "spec"
    periods = [float(cost.verify_cost_ms(tokens)) + tag[1] + 0.1 * (i % 7) for i in range(40)]
    reference = FixedCosts(greedy=tag[2])  # (one at a time, as before the queue)
    for ms in periods:
        reference.observe(tag[0], ms - cost.verify_lookup(tokens) - tag[1], reqs, ms)

    def landed() -> int:
        return sum(n for by in spec.fixed_costs.observed_totals().values()
                   for n, *_ in by.values())  # fmt: skip

    for ms in periods[: OBSERVE_BATCH - 1]:
        spec.observe_step_time(ms, tokens, reqs, tag)
    assert landed() == 0 and len(spec._pending_periods) == OBSERVE_BATCH - 1
    spec.observe_step_time(periods[OBSERVE_BATCH - 1], tokens, reqs, tag)
    assert landed() == OBSERVE_BATCH and not spec._pending_periods
    for ms in periods[OBSERVE_BATCH:]:
        spec.observe_step_time(ms, tokens, reqs, tag)
    assert landed() == 2 * OBSERVE_BATCH  # (the last 8 still queued)
    metrics = spec.metrics()  # /metrics reads the terms: the queue lands first
    assert landed() == len(periods) and not spec._pending_periods
    assert metrics["observed_steps"] == reference.observed_totals()
    assert spec.fixed_costs.get("spec", reqs) == pytest.approx(reference.get("spec", reqs))
    spec.observe_step_time(periods[0], tokens, reqs, None)  # (untagged: never queued)
    assert not spec._pending_periods


def test_every_plan_that_reads_the_terms_finds_the_queue_landed(tiny_qwen, drafter):
    llm = _lagged(tiny_qwen, drafter)
    spec = llm.engine.runner.spec
    apply_terms, queued_at_read = spec._apply_terms, []

    def reading(*args):
        queued_at_read.append(len(spec._pending_periods))
        return apply_terms(*args)

    spec._apply_terms = reading
    observed = []
    observe = spec.observe_step_time
    spec.observe_step_time = lambda *a: (observed.append(a[3] is not None), observe(*a))
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                 SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert queued_at_read and set(queued_at_read) == {0}
    # the run over, every tagged period has landed
    assert not spec._pending_periods
    landed = sum(n for by in spec.fixed_costs.observed_totals().values()  # (both modes'
                 for n, *_ in by.values())  # table)  # fmt: skip
    assert landed == sum(observed) > OBSERVE_BATCH


def test_an_engine_without_a_cost_model_runs_to_the_end(tiny_qwen, drafter):
    """Fixed K learns no costs (no cost model): nothing is queued, and the end of a run,
    which lands the queue, has nothing to land."""
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 3,
                                  "adaptive_policy": "fixed"})  # fmt: skip
    spec = llm.engine.runner.spec
    assert spec.cost is None
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert not spec._pending_periods
    spec.land_periods()  # (called with nothing queued: a no-op)
