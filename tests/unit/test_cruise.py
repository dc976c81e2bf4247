"""A streak of verify-all plans lets the lagged policy skip the next plans (cruise.py): they
verify every draft, as the full path would have, until a plan trims or stops drafting."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cruise import CRUISE_AFTER, CRUISE_FIRST, CRUISE_MAX, Cruise
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import _table


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("cr")), tiny_qwen, seed=9)


def _streak(c: Cruise, start: int, count: int, reqs: int = 10, other: int = 0) -> int:
    for p in range(start, start + count):
        c.record(p, True, reqs, other)
    return start + count


def _until_cruising(c: Cruise, p: int, reqs: int = 10) -> tuple[int, int]:
    """Record verify-all plans from plan p until a cruise covers the next one: (that plan's
    number, the streak's length)."""
    streak = 0
    while not c.covers(p, reqs, 0):
        c.record(p, True, reqs, 0)
        p, streak = p + 1, streak + 1
        assert streak <= CRUISE_AFTER
    return p, streak


def test_a_cruise_starts_after_the_streak_and_lasts_its_life_doubling_to_the_max():
    c = Cruise()
    p, streak = _until_cruising(c, 1)
    assert streak == CRUISE_AFTER  # the first cruise: a whole streak first
    lives, streaks = [], []
    for _ in range(8):
        life = 0
        while c.covers(p + life, 10, 0):
            life += 1
        lives.append(life)
        p, streak = _until_cruising(c, p + life)  # (the full path again, verify-all)
        streaks.append(streak)
    assert lives == [min(CRUISE_FIRST << i, CRUISE_MAX) for i in range(8)]
    assert lives[-1] == CRUISE_MAX
    assert streaks == [CRUISE_AFTER // 4] * 8  # (after a cruise no trim ended: a quarter)


def test_a_trim_or_drafting_off_ends_the_cruise_and_resets_its_life():
    c = Cruise()
    p, _ = _until_cruising(c, 1)
    p, _ = _until_cruising(c, c.until)  # (a second cruise)
    assert c.covers(p, 10, 0) and c.life > CRUISE_FIRST
    c.record(p, False, 10, 0)
    assert not c.covers(p + 1, 10, 0) and c.life == CRUISE_FIRST and c.streak == 0
    p = _streak(c, p + 1, CRUISE_AFTER - 1)
    assert not c.covers(p, 10, 0)  # a whole streak again first


def test_a_cruise_covers_only_shapes_like_its_streaks():
    c = Cruise()
    p = _streak(c, 1, CRUISE_AFTER - 1, reqs=40, other=0)
    p = _streak(c, p, 1, reqs=32, other=100)  # (the largest chunk seen: 100 tokens)
    assert c.covers(p, 51, 128) and c.covers(p, 1, 0)  # (up to a quarter more, and one)
    assert not c.covers(p, 52, 0)  # more requests than that
    assert not c.covers(p, 40, 129)  # a chunk past the next power of two
    off = Cruise(after=0)
    _streak(off, 1, 10 * CRUISE_AFTER)
    assert not off.covers(10 * CRUISE_AFTER, 1, 0)


def _plans(llm, after: int) -> tuple[list, list, Cruise]:
    """Generate staggered requests four at a time (prompts arrive in chunks beside decoding
    rows); every plan as (budget, kind, drafting, probe, trimmed, draft share), outputs."""
    spec, seen = llm.engine.runner.spec, []
    spec.cruise = Cruise(after=after)
    spec.drafting._min_interval_s = 0.0  # (decisions independent of the wall clock)
    plan = spec.plan

    def recording(host, *room):
        budget = plan(host, *room)
        seen.append((budget, spec.last_kind, spec.draft_enabled, spec.probing,
                     spec._step_trimmed, spec.draft_share))  # fmt: skip
        return budget

    spec.plan = recording
    prompts = [[(7 + 3 * i + j) % 200 for j in range(30 + 9 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 5 * i, ignore_eos=True)
              for i in range(12)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return seen, [o.outputs[0].token_ids for o in outs], spec.cruise


def _cheap_llm(tiny_qwen, drafter, tmp_path) -> LLM:
    """A lagged engine, four requests at a time, whose table makes verification nearly free
    beside a 1 ms step (every plan verifies every draft)."""
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.5, draft_base_ms=0.05, draft_ms_per_req=0.0)  # fmt: skip
    return LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, max_num_seqs=4,
               speculative_config={"model": drafter, "num_speculative_tokens": 5,
                                   "adaptive_policy": "lagged", "cost_table_path": path})


def test_cruised_plans_are_the_plans_the_full_path_makes_where_verification_is_cheap(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """Verification nearly free beside a 1 ms step: every plan verifies every draft. With
    cruises on, most plans after the first streak are cruised, and plan for plan the budget,
    kind, drafting state and draft share are the full path's; the tokens are no
    speculation's."""
    runs = [_plans(_cheap_llm(tiny_qwen, drafter, tmp_path), after)
            for after in (0, CRUISE_AFTER)]  # fmt: skip
    (full, full_out, off), (fast, fast_out, on) = runs
    plain = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    assert fast_out == full_out == _plans_free(plain)
    assert fast == full
    assert off.cruised == 0
    assert on.cruised >= (len(fast) - CRUISE_AFTER) // 2, (on.cruised, len(fast))
    assert any(k == "mixed" for _, k, *_ in fast)  # (steps with prefill chunks cruised too)


def _plans_free(llm) -> list:
    prompts = [[(7 + 3 * i + j) % 200 for j in range(30 + 9 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 5 * i, ignore_eos=True)
              for i in range(12)]  # fmt: skip
    return [o.outputs[0].token_ids for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_no_cruise_where_plans_trim(tiny_qwen, drafter, tmp_path):
    """Verification dear (a token costs 0.2 ms beside a 0.5 ms step): the plans trim, no
    streak of verify-alls forms, nothing is cruised, and the tokens are unchanged."""
    path = _table(tmp_path, "dear", weight_read_ms=0.5, ms_per_token=0.2,
                  fixed_overhead_ms=0.1, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    spec = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
            "cost_table_path": path, "draft_skipping": False}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, max_num_seqs=4,
              speculative_config=spec)  # fmt: skip
    seen, outs, cruise = _plans(llm, CRUISE_AFTER)
    plain = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    assert outs == _plans_free(plain)
    assert sum(trimmed for *_, trimmed, _ in seen) > len(seen) // 4
    assert cruise.cruised == 0


def test_a_plain_probe_step_neither_ends_nor_extends_a_cruise_and_drafting_off_ends_it(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """After a generation that cruised, a plan whose step does not draft while drafting pays
    (a plain probe's) leaves the cruise as it was; one whose drafting decision turned
    drafting off ends it."""
    llm = _cheap_llm(tiny_qwen, drafter, tmp_path)
    _, _, cruise = _plans(llm, CRUISE_AFTER)
    spec = llm.engine.runner.spec
    assert cruise.cruised > 0 and spec.drafting.pays
    state = dict(vars(cruise))
    spec.drafting.after_plan = lambda *a: (False, False)  # (a plain probe's step)
    spec._after_budget(10, 10, False, 2, 2, 0)
    assert not spec.draft_enabled and vars(cruise) == state
    spec.drafting.pays = False  # (drafting turned off by the decision)
    spec._after_budget(10, 10, False, 2, 2, 0)
    assert cruise.until == 0 and cruise.streak == 0 and cruise.life == CRUISE_FIRST


def test_cruised_steps_skip_most_confidence_copies_and_no_plan_reads_the_drafts_it_verifies(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """A step whose plan stood (a cruise's or a standing plan's) skips its confidences' host
    copy, but for one in CONF_PUSH_EVERY in a row; other steps copy. A plan after a skipped
    copy may read the newest copy queued (it holds older drafts); after a queued one, only
    older copies (never the drafts the planned step verifies). The tokens are no speculation's."""
    from dspark.spec.decoder import CONF_PUSH_EVERY

    llm = _cheap_llm(tiny_qwen, drafter, tmp_path)
    spec = llm.engine.runner.spec
    copies, copy, stale = spec.host_confs, spec._copy_conf_to_host, spec._stale
    calls, reads = [], []  # (stood, copied) per drafting step; (pushed last, newest, read)

    def copying():
        before = copies.newest_generation
        copy()
        calls.append((spec.last_stood, copies.newest_generation > before))

    def reading(slots):
        pushed_last, newest = spec._conf_skips == 0, copies.newest_generation
        out = stale(slots)
        reads.append((pushed_last, newest, copies.landed_generation))
        return out

    spec._copy_conf_to_host, spec._stale = copying, reading
    _, outs, cruise = _plans(llm, CRUISE_AFTER)
    assert outs == _plans_free(LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64,
                                   max_num_seqs=4))  # fmt: skip
    assert cruise.cruised > 0
    skipped = [stood for stood, copied in calls if not copied]
    assert skipped and all(skipped)  # only steps whose plan stood skip
    assert any(not stood for stood, _ in calls)  # (the others copy: the streak's first plans)
    assert len(skipped) >= cruise.cruised // 2
    run = longest = 0
    for _, copied in calls:
        run = 0 if copied else run + 1
        longest = max(longest, run)
    assert longest == CONF_PUSH_EVERY - 1
    assert reads and all(read <= newest for _, newest, read in reads)
    assert all(read < newest for pushed, newest, read in reads if pushed and newest)
    # (on the CPU copies land at once: after a skipped copy the newest is read)
    assert any(read == newest > 0 for pushed, newest, read in reads if not pushed)


def test_with_cruises_off_standing_plans_skip_copies_and_the_tokens_stay(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """Cruises off: a settled verify-all plan standing (step_planning._stand) reads no
    confidences either, so its steps skip the host copy as cruised ones do, but for one in
    CONF_PUSH_EVERY in a row; the plans' paths say so, and the tokens are no speculation's."""
    from dspark.spec.decoder import CONF_PUSH_EVERY

    llm = _cheap_llm(tiny_qwen, drafter, tmp_path)
    spec = llm.engine.runner.spec
    copies, copy, calls = spec.host_confs, spec._copy_conf_to_host, []

    def copying():
        before = copies.newest_generation
        copy()
        calls.append((spec.last_stood, spec.overhead.last_part,
                      copies.newest_generation > before))  # fmt: skip

    spec._copy_conf_to_host = copying
    _, outs, cruise = _plans(llm, after=0)
    assert cruise.cruised == 0 and outs == _plans_free(
        LLM(tiny_qwen, device="cpu", max_num_batched_tokens=64, max_num_seqs=4))
    skipped = [(stood, path) for stood, path, copied in calls if not copied]
    assert skipped and all(stood and path == "standing" for stood, path in skipped)
    assert all(copied for stood, _, copied in calls if not stood)
    assert spec.overhead.paths["standing"][0] >= len(skipped)
    run = longest = 0
    for *_, copied in calls:
        run = 0 if copied else run + 1
        longest = max(longest, run)
    assert longest == CONF_PUSH_EVERY - 1
