"""Scheduler.draft_share: rows with drafts are charged, against the step's token budget, only
the share of their draft slots that steps with prefill chunks have been verifying; the
prefill chunks get the rest. The rows keep every slot (the plan may verify up to the room
the budget left: SchedulerOutput.draft_room). Share 1.0: every slot charged, as before."""

from __future__ import annotations

import math

import pytest

from dspark import SamplingParams
from dspark.engine.block_manager import BlockManager
from dspark.engine.request import Request, RequestStatus
from dspark.engine.scheduler import Scheduler

K = 7


def _scheduler(budget: int, share: float) -> tuple[Scheduler, list[Request]]:
    """Four decoding requests with drafts (prompt 10 + 1 output each), then one waiting
    prompt of 500 tokens."""
    s = Scheduler(BlockManager(num_blocks=512, block_size=16), max_num_seqs=8,
                  max_num_batched_tokens=1000, num_lookahead_slots=K)  # fmt: skip
    s.draft_share = share
    params = SamplingParams(max_tokens=64)
    reqs = []
    for i in range(4):
        r = Request(f"d{i}", list(range(1, 11)), params, [], seed=i)
        s.add(r)
        reqs.append(r)
    s.schedule()  # their prefill
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
        r.token_ids.append(5)  # one sampled token; drafts for the next step on the device
        r.has_drafts = True
        assert r.status is RequestStatus.RUNNING
    s.max_num_batched_tokens = budget
    waiting = Request("p", list(range(1, 501)), params, [], seed=9)
    s.add(waiting)
    return s, reqs


@pytest.mark.parametrize("share", [1.0, 0.25, 0.0])
def test_prefill_gets_the_draft_slots_that_are_not_charged(share):
    s, reqs = _scheduler(budget=100, share=share)
    out = s.schedule()
    decode, prefill = out.rows[:4], out.rows[4]
    charged = math.ceil(share * K)
    for row in decode:  # every slot laid out, whatever was charged
        assert row.num_draft_slots == K and row.num_new_tokens == 1 + K
    assert prefill.req.request_id == "p"
    assert prefill.num_new_tokens == 100 - 4 * (1 + charged)
    # the plan may verify what was charged plus what no row took (none: the prompt took it)
    assert out.draft_room == 4 * charged
    assert out.num_draft_slots == 4 * K


def test_without_competition_the_room_is_every_slot():
    """No prefill waiting: nothing competes for the budget, so the share limits nothing."""
    s, reqs = _scheduler(budget=100, share=0.25)
    s.waiting.clear()
    out = s.schedule()
    assert [r.num_new_tokens for r in out.rows] == [1 + K] * 4
    assert out.draft_room >= 4 * K


def test_a_row_that_does_not_fit_its_charge_is_cut_as_before():
    """A budget below a row's charge: its draft slots are cut first, and each slot left is
    charged (what the budget bounds is the stream as laid out)."""
    s, reqs = _scheduler(budget=3 * (1 + 2) + 2, share=0.25)  # 3 rows charged 1 + 2, then 2
    out = s.schedule()
    assert [r.num_new_tokens for r in out.rows] == [1 + K] * 3 + [2]
    assert out.rows[3].num_draft_slots == 1
    assert out.draft_room == 3 * 2 + 1 and out.num_draft_slots == 3 * K + 1
    assert len(out.rows) == 4  # no room left for the prompt


def test_prefill_takes_the_slots_the_plans_leave_and_output_is_unchanged(tiny_qwen, tmp_path):
    """An adaptive engine whose steps with prefill chunks verify few drafts (each verified
    token costs a full millisecond): later such steps charge only that share, so their
    prompts get more of the budget than the rows' full draft slots would leave; no step's
    forward exceeds the budget; greedy output equals no speculation."""
    from dspark import LLM
    from dspark.spec.cost_model import CostModel
    from dspark.testing.drafters import make_tiny_drafter

    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=9)
    table = str(tmp_path / "expensive.json")
    CostModel.analytic(weight_read_ms=0.01, ms_per_token=1.0, fixed_overhead_ms=4.0,
                       draft_base_ms=0.0, draft_ms_per_req=0.0).to_json(table)  # fmt: skip
    budget, k = 48, 5
    prompts = [{"prompt_token_ids": list(range(5 + i, 35 + i))} for i in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=budget, max_num_seqs=8,
              speculative_config={"model": drafter, "num_speculative_tokens": k,
                                  "adaptive_policy": "lagged", "cost_table_path": table,
                                  "draft_skipping": False})  # fmt: skip
    runner, steps = llm.engine.runner, []
    launch = runner.launch

    def recording_launch(sched, block_tables, follows=False):
        wait = launch(sched, block_tables, follows)
        spec = runner.spec
        drafting = [r for r in sched.rows if r.num_draft_slots]
        prefill = sum(r.num_new_tokens for r in sched.rows if not r.num_draft_slots)
        slots = sum(r.num_draft_slots for r in drafting)
        steps.append((len(drafting), slots, prefill, spec.last_budget,
                      sum(r.num_new_tokens for r in sched.rows) - slots + spec.last_budget))
        return wait

    runner.launch = recording_launch
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    plain = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=budget, max_num_seqs=8)
    assert outs == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert all(forward <= budget for *_, forward in steps), steps
    # steps with drafting rows beside a prompt chunk: the plans trimmed, and some chunk got
    # tokens that charging every slot would have kept for the drafts
    mixed = [s for s in steps if s[0] and s[2]]
    assert mixed and any(b < slots for _, slots, _, b, _ in mixed), mixed
    assert any(prefill > budget - n * (1 + k) for n, _, prefill, _, _ in mixed), mixed
    assert runner.spec.draft_share < 1.0
