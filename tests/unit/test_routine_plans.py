"""A standing plan on a routine step (no decision, no probe, drafting on) takes one short path
(DraftingDecision.routine + StepPlanning._plan_standing). It must be the full path's plan
exactly: the same budget, kind and drafting state, the same decisions later."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dspark import LLM, SamplingParams
from dspark.spec.cruise import Cruise
from dspark.spec.drafting import DraftingDecision
from dspark.spec.online_cost import fixed_costs_by_mode
from dspark.spec.plan_reuse import BudgetDecision, StandingPlans, nearby_rows
from dspark.testing.drafters import make_tiny_drafter
from tests.unit.test_adaptive_engine import _table


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("rp")), tiny_qwen, seed=9)


def _state(obj) -> dict:
    """An object's attributes, arrays as tuples (comparable with ==)."""
    out = {}
    for k, v in vars(obj).items():
        if isinstance(v, np.ndarray):
            v = (v.shape, tuple(v.ravel().tolist()))
        elif hasattr(v, "__dict__") and not callable(v):  # (a helper object: its state)
            v = _state(v)
        elif isinstance(v, dict):  # (arrays as tuples, helper objects as their state)
            v = {kk: (tuple(vv.tolist()) if isinstance(vv, np.ndarray)
                      else _state(vv) if hasattr(vv, "__dict__") and not callable(vv) else vv)
                 for kk, vv in v.items()}  # fmt: skip
        out[k] = v
    return out


def _random_decision(rng: np.random.Generator) -> DraftingDecision:
    now = 100.0
    d = DraftingDecision(5, 0.05, enabled=bool(rng.random() < 0.8),
                         plain_probes=bool(rng.random() < 0.7),
                         min_interval_s=float(rng.choice([0.0, 0.02])),
                         clock=lambda: now)  # fmt: skip
    d._forced = bool(rng.random() < 0.15)
    d.pays = bool(rng.random() < 0.8)
    d._plain_probe_left = int(rng.choice([0, 0, 0, 1, 5]))
    if rng.random() < 0.9:
        d.survival = d._survival[True] = np.sort(rng.random(6))[::-1].copy()
    d._decide_spacing = int(rng.choice([1, 2, 4, 8]))
    d._since_decision = int(rng.integers(0, 8 * d._decide_spacing + 8))  # (due at 8x spacing)
    d._decided_reqs = int(rng.integers(0, 40))
    d._decided_at = now - float(rng.choice([rng.uniform(0.0, 0.05), 1.0]))
    d._plain_may_win = bool(rng.random() < 0.5)
    d._skipped = int(rng.choice([rng.integers(0, 100), 63, 127]))  # (a draft probe next, or not)
    d._probe_spacing = int(rng.choice([1, 2]))
    d._plans = int(rng.integers(0, 2000))
    if rng.random() < 0.3:
        d._plain_probed[(True, 4)] = d._plans - int(rng.integers(0, 1000))
    return d


def _random_fixed(rng: np.random.Generator):
    """Fixed terms whose plain steps were last measured at random ages (or never) in each
    batch-size bucket: a plain probe may start only where that term is old."""
    fixed = fixed_costs_by_mode()[True]
    fixed.steps = int(rng.integers(0, 3000))
    for b in range(8):
        if rng.random() < 0.6:
            fixed._last["plain"][b] = fixed.steps - int(rng.choice([rng.integers(0, 1024), 511,
                                                                    512]))  # fmt: skip
    return fixed


def test_routine_has_exactly_the_effects_of_due_and_after_plan():
    """Where routine() answers True, due() would have said False and after_plan(False, ...)
    (True, False), and the state is what those two calls leave; where it answers False it
    leaves the state as it was, and either a decision is due or after_plan's answer differs
    from the routine one (a probe runs or starts: a plan waiting out the decision's minimum
    interval is routine, and so is one where the last decision found plain decoding might
    win but no plain probe can start, its term fresh, its bucket probed lately or the step
    holding a prefill chunk). Random states, both answers exercised, the waiting ones too."""
    rng = np.random.default_rng(0)
    answers = {True: 0, False: 0, "waiting": 0}  # (waiting: routine, DECIDE_MIN_S not out)
    # (routine though the last decision found plain decoding might win: no probe can start)
    answers["may_win"] = 0
    for _ in range(4000):
        d, fixed = _random_decision(rng), _random_fixed(rng)
        # (mostly near the batch size decided at: a move by a quarter forces a decision)
        near = max(1, d._decided_reqs + int(rng.integers(-3, 4)))
        n = near if rng.random() < 0.7 else int(rng.integers(1, 40))
        online = bool(rng.random() < 0.6)
        other = int(rng.choice([0, 0, 0, 48]))  # (prefill tokens beside the rows)
        fast, full = copy.deepcopy(d), copy.deepcopy(d)
        routine = fast.routine(n, online, fixed, n, other)
        answers[routine] += 1
        answers["waiting"] += routine and d._since_decision + 1 >= 8 * d._decide_spacing
        answers["may_win"] += routine and d.pays and d._plain_may_win and online and (
            d.plain_probes and d.enabled)  # fmt: skip
        if routine:
            assert not full.due(n)
            after = full.after_plan(False, None, fixed, online, n, n, other)
            assert after == (d.pays, not d.pays)  # (drafting or not; no probe starts)
            assert _state(fast) == _state(full)
        else:
            assert _state(fast) == _state(d)
            if not full.due(n):  # (not routine though no decision is due: the plan's
                # outcome is not the routine one; nothing else, the clock included, makes
                # a plan non-routine)
                after = full.after_plan(False, None, fixed, online, n, n, other)
                assert after != (d.pays, not d.pays)
    assert min(answers[True], answers[False]) > 300 and answers["waiting"] > 20, answers
    assert answers["may_win"] > 20, answers


def _plans(llm, fast: bool, prompt_len: int = 13) -> tuple[list, list, dict]:
    """Generate with the drafting decision's clock out of play; every plan as (budget, kind,
    drafts, probe, trimmed, the settled plans standing, the draft share charged, the part
    the step log names), the outputs, and counters (routine plans, decisions, plans of steps
    with prefill chunks that took their short path, plans counted by part, steps by kind).
    Prompts of `prompt_len` + 2i tokens."""
    spec = llm.engine.runner.spec
    spec.drafting._min_interval_s = 0.0  # (else decisions would depend on the wall clock)
    spec.cruise = Cruise(after=0)  # (the routine paths against the full one: no cruise)
    routine, due, plan, seen = spec.drafting.routine, spec.drafting.due, spec.plan, []
    counts = {"routine": 0, "decisions": 0, "chunk_short": 0}
    chunk_short = spec._plan_chunk_standing

    def counting_chunk_short(*args):
        budget = chunk_short(*args)
        counts["chunk_short"] += budget is not None
        return budget

    def counting_routine(*args):
        ok = fast and routine(*args)
        counts["routine"] += ok
        return ok

    def counting_due(n):
        decide = due(n)
        counts["decisions"] += decide
        return decide

    def recording(host, *room):
        budget = plan(host, *room)
        seen.append((budget, spec.last_kind, spec.draft_enabled, spec.probing,
                     spec._step_trimmed, sorted((k, tuple(v)) for k, v in spec._settled.items()),
                     spec.draft_share, _part(spec.overhead.last_part)))  # fmt: skip
        return budget

    spec.drafting.routine, spec.drafting.due, spec.plan = counting_routine, counting_due, recording
    spec._plan_chunk_standing = counting_chunk_short
    prompts = [[(7 + 3 * i + j) % 200 for j in range(prompt_len + 2 * i)] for i in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=18 + 4 * i, ignore_eos=True)
              for i in range(10)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    counts |= {"parts": dict(spec.overhead.plans), "kinds": dict(spec.step_counts),
               "paths": {path: n for path, (n, _) in spec.overhead.paths.items()}}
    return seen, [o.outputs[0].token_ids for o in outs], counts


def _part(path: str | None) -> str | None:
    """The part of a plan's path: the paths of the "other" part name themselves
    (tracing.Overhead.paths), the routine ones apart from the full path's."""
    short = path in ("standing", "chunk_standing", "idle")
    return "other" if short or (path or "").startswith("other:") else path


@pytest.mark.parametrize("draft_ms,max_seqs", [(0.0, 16), (0.3, 4), (20.0, 4)])
def test_routine_plans_equal_the_full_path(tiny_qwen, drafter, tmp_path, monkeypatch, draft_ms,
                                           max_seqs):  # fmt: skip
    """The same requests (staggered lengths: the batch size moves as they finish) planned
    with and without the routine path: plan for plan the same budget, kind and drafting
    state, the same outputs and counters. A 0.3 ms drafter beside a 1 ms step, four
    requests at a time (the others admitted as slots free: reused slots, steps with prefill
    chunks between decode steps); a 20 ms drafter (drafting turns off; a draft probe every
    8 plain steps)."""
    import dspark.spec.drafting as drafting_mod

    monkeypatch.setattr(drafting_mod, "_PROBE_EVERY", 8)  # (draft probes within the run)
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.5, draft_base_ms=draft_ms, draft_ms_per_req=0.0)  # fmt: skip
    spec = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
            "cost_table_path": path}  # fmt: skip
    runs = [_plans(LLM(tiny_qwen, device="cpu", max_num_batched_tokens=256,
                       max_num_seqs=max_seqs, speculative_config=spec), fast)
            for fast in (False, True)]  # fmt: skip
    (full, full_out, full_counts), (fast, fast_out, fast_counts) = runs
    assert fast_out == full_out
    assert fast == full
    assert fast_counts["decisions"] == full_counts["decisions"] > 2
    for key in ("parts", "kinds"):
        assert fast_counts[key] == full_counts[key]
    assert full_counts["routine"] == 0
    assert fast_counts["routine"] >= len(fast) // 3, fast_counts
    if draft_ms > 1.0:  # (drafting off: routine plain steps; probes and decisions between)
        kinds = fast_counts["kinds"]
        assert kinds["plain"] > len(fast) // 2 and kinds["draft"] > 2, fast_counts


def test_a_routine_plain_step_keeps_a_standing_settled_plan_and_drops_an_expired_one(
        tiny_qwen, drafter, tmp_path):  # fmt: skip
    """As the full path: a settled plan of the same requests that still stands outlives a
    plain step (it stands for it), one past its plans is dropped (_plan pops it)."""
    path = _table(tmp_path, "costly", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.5, draft_base_ms=20.0, draft_ms_per_req=0.0)  # fmt: skip
    spec_cfg = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
                "cost_table_path": path}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", speculative_config=spec_cfg)
    spec, hosts, plan = llm.engine.runner.spec, [], llm.engine.runner.spec.plan
    spec.plan = lambda host, *room: hosts.append(host) or plan(host, *room)
    llm.generate([{"prompt_token_ids": list(range(5 + i, 15 + i))} for i in range(3)],
                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))  # fmt: skip
    spec.plan = plan
    host = next(h for h in reversed(hosts) if h.plan_scalars()[1:3] == (0, 0))  # a plain step
    n, routine, d = host.plan_scalars()[0], spec.drafting.routine, spec.drafting
    assert not d.pays and d.survival is not None  # (drafting off, decided)
    for expired in (True, False):
        seen = []
        for fast in (True, False):
            d.routine = routine if fast else (lambda *args: False)
            d._forced, d._plain_probe_left, d._since_decision, d._decided_reqs = False, 0, 0, n
            d._skipped, d._probe_spacing = 0, 1
            until = spec._plans_counted + (1 if expired else 5)  # (the plan counts itself first)
            spec._settled = {(n, True): [until, 5 * n, False]}
            budget = spec.plan(host)
            settled = {k: (v[0] - spec._plans_counted, *v[1:]) for k, v in spec._settled.items()}
            seen.append((budget, spec.last_kind, spec.draft_enabled, settled, d._skipped,
                         d._since_decision))  # fmt: skip
        assert seen[0] == seen[1]
        assert ((n, True) in seen[0][3]) is not expired and seen[0][:3] == (0, "plain", False)


@pytest.mark.parametrize("ms_per_token", [0.001, 0.1])
def test_chunk_plans_standing_equal_the_full_path(tiny_qwen, drafter, tmp_path, ms_per_token):
    """Prompts of 120-138 tokens arriving in chunks of a 48-token budget beside decoding
    rows, four requests at a time: the steps with prefill chunks that take their short path
    (a plan standing in the planner, the opportunity rate memoized, the terms not applied)
    plan what the full path plans, and everything after is the same. Tokens cheap (the
    chunk bound settles, and that plan stands) and dear (searched plans stand)."""
    path = _table(tmp_path, "chunks", weight_read_ms=1.0, ms_per_token=ms_per_token,
                  fixed_overhead_ms=0.5, draft_base_ms=0.05, draft_ms_per_req=0.0)  # fmt: skip
    spec = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
            "cost_table_path": path}  # fmt: skip
    runs = [_plans(LLM(tiny_qwen, device="cpu", max_num_batched_tokens=48, max_num_seqs=4,
                       speculative_config=spec), fast, prompt_len=120)
            for fast in (False, True)]  # fmt: skip
    (full, full_out, full_counts), (fast, fast_out, fast_counts) = runs
    assert fast_out == full_out
    assert fast == full
    for key in ("decisions", "parts", "kinds"):
        assert fast_counts[key] == full_counts[key]
    assert full_counts["chunk_short"] == 0
    # every plan of the "other" part names its path, and one that took the full path without
    # a search or decision says why (what the host timers' plans by path print)
    for counts in (full_counts, fast_counts):
        paths = counts["paths"]
        other = {p: c for p, c in paths.items() if not p.startswith(("decision", "search"))}
        assert sum(other.values()) == counts["parts"]["other"] and "other" not in other, paths
        why = {p.removeprefix("other:") for p in other if p.startswith("other:")}
        assert why and why <= {"unmarked", "unsettled", "due", "probe", "mode", "chunk:rate",
                               "chunk:shape", "chunk:due", "chunk:mode", "chunk:nodraft"}, paths
    mixed = sum(fast_counts["kinds"].get(k, 0) for k in ("mixed", "mixed_verify"))
    assert fast_counts["chunk_short"] >= mixed // 4, fast_counts
    if ms_per_token > 0.01:  # (searched, trimmed plans beside chunks; the step log says why)
        searches = [p[-1] for p in fast if p[-1].startswith("search")]
        assert len(searches) == fast_counts["parts"]["search"] > 0
        assert set(searches) <= {"search:new", "search:spent", "search:rate"}, searches
        assert any(p[4] and p[0] > 0 for p in fast if p[1] == "mixed"), fast


def test_a_chunk_plan_standing_leaves_what_the_full_path_leaves(tiny_qwen, drafter, tmp_path):
    """A step with prefill chunks on which a trimmed plan stands, planned after state another
    plan left (not trimmed, another draft share charged), within a draft room below the
    plan's budget: the short path and the full path return and leave the same."""
    path = _table(tmp_path, "chunks", weight_read_ms=1.0, ms_per_token=0.1,
                  fixed_overhead_ms=0.5, draft_base_ms=0.05, draft_ms_per_req=0.0)  # fmt: skip
    spec_cfg = {"model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
                "cost_table_path": path}  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", max_num_batched_tokens=48, max_num_seqs=4,
              speculative_config=spec_cfg)  # fmt: skip
    spec, hosts, plan = llm.engine.runner.spec, [], llm.engine.runner.spec.plan
    spec.plan = lambda host, *room: hosts.append((host, host.plan_scalars())) or plan(host, *room)
    llm.generate([{"prompt_token_ids": [(5 + i + j) % 200 for j in range(120)]}
                  for i in range(6)],
                 SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))  # fmt: skip
    spec.plan = plan
    host, (n, total, other, n_sampling, greedy, _) = next(
        (h, s) for h, s in reversed(hosts) if s[2] > 0 and s[1] >= 10)
    assert host.plan_scalars()[:3] == (n, total, other)  # (its packed scalars still hold)
    d, routine, chunk_short = spec.drafting, spec.drafting.routine, spec._plan_chunk_standing
    assert d.pays and d.survival is not None
    group = StandingPlans.group(n, other, 0.0, n_sampling == n)
    standing = BudgetDecision(total // 2, total, 1.0, 0.9, 0.1, True)
    taken, seen = [], []
    spec.cost._context_slope = 1e-4  # (a table that prices the context read)
    spec._plan_chunk_standing = lambda *a: taken.append(chunk_short(*a)) or taken[-1]
    for fast in (True, False):
        d.routine = routine if fast else (lambda *args: False)
        d._forced, d._plain_probe_left, d._since_decision, d._decided_reqs = False, 0, 0, n
        d._plain_may_win, d._min_interval_s = False, 0.0
        spec.fixed_costs = spec._fixed_by_mode[greedy]
        spec.rate_memo.clear()
        spec.rate_memo.put((greedy, d.survival is None), nearby_rows(n_sampling), 2.0,
                           spec._plans_counted + 5 - spec.rate_memo.lifetime)
        spec.planner.standing.clear()
        spec.planner.standing._plans[group] = [3, standing, 2.0]
        spec.draft_share, spec._step_trimmed, spec.last_budget = 0.123, False, -1
        spec.cost.set_step_context(0)
        budget = spec.plan(host, total // 3)
        seen.append((budget, spec.last_kind, spec.draft_enabled, spec.probing,
                     spec._step_trimmed, spec.draft_share, spec.last_budget,
                     spec.planner.standing._plans[group][0], d._since_decision,
                     spec.cost.step_context_ms))  # fmt: skip
    assert taken == [total // 3]  # (the fast run took the short path; the full run did not)
    assert seen[0] == seen[1]
    assert seen[0][:7] == (total // 3, "mixed", True, False, True, 0.5, total // 3)
    assert seen[0][-1] > 0  # (the step's context read priced, as step_tag reads it)


def test_opportunity_rates_are_memoized_per_request_count_group(tiny_qwen, drafter, tmp_path):
    """In serving the request count of steps with prefill chunks crosses group edges and back:
    each group keeps the rate priced for it (until the sampling mode changes or the rate is
    lifetime plans old: a new survival estimate does not reprice it, nor does the
    first one's arrival leave a rate priced without one standing); a count of the same group
    reads it."""
    path = _table(tmp_path, "rates", weight_read_ms=1.0, ms_per_token=0.1,
                  fixed_overhead_ms=0.5, draft_base_ms=0.05, draft_ms_per_req=0.0)  # fmt: skip
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=4, speculative_config={
        "model": drafter, "num_speculative_tokens": 5, "adaptive_policy": "lagged",
        "cost_table_path": path})  # fmt: skip
    spec = llm.engine.runner.spec
    spec.drafting.survival = spec.drafting._survival[True] = np.array([0.9, 0.7, 0.5, 0.3, 0.2])
    assert nearby_rows(40) == nearby_rows(41) != nearby_rows(60)
    rate40, rate60 = spec._opportunity_rate(40), spec._opportunity_rate(60)
    assert 0 < rate40 < rate60  # (more rows decoding earn more per ms on this table)
    priced = []
    spec.cost.decode_variable = lambda *a, p=spec.cost.decode_variable: priced.append(a) or p(*a)
    assert spec._opportunity_rate(40) == rate40 and spec._opportunity_rate(41) == rate40
    assert spec._opportunity_rate(60) == rate60 and priced == []  # (both groups kept)
    spec.drafting.update_survival(np.full((3, 5), 0.5))  # a new estimate: rates stand
    assert spec._memoized_rate(40) == rate40 and spec._memoized_rate(60) == rate60
    spec._plans_counted += spec.rate_memo.lifetime - 1
    assert spec._memoized_rate(40) == rate40
    spec._plans_counted += 1  # (lifetime plans old)
    assert spec._memoized_rate(40) is None and spec._memoized_rate(60) is None
    fresh = spec._opportunity_rate(40)
    assert priced == [(40, 5)] and spec._memoized_rate(40) == fresh
    spec.fixed_costs = spec._fixed_by_mode[False]  # another sampling mode: priced afresh
    assert spec._memoized_rate(40) is None
    spec.fixed_costs = spec._fixed_by_mode[True]
    spec.drafting.survival = None  # (priced with no estimate: stands only while none comes)
    spec.rate_memo.clear()
    spec._opportunity_rate(40)
    spec.drafting.survival = spec.drafting._survival[True]
    assert spec._memoized_rate(40) is None
