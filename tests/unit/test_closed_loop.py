"""scripts/closed_loop.py: the closed loop keeps exactly C requests in the engine and counts
what it produced, its scheduler overhead and tokens; in turns, each engine is charged its own
turns and marked idle between them; the arms' T = 0 tokens are compared prompt by prompt
(the demo pair on the CPU; its numbers are not checked beyond sanity)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from dspark import LLM, SamplingParams

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from closed_loop import (  # noqa: E402
    DIVERGED_KEPT,
    _lockstep,
    closed_loop,
    closed_loops_in_turns,
    compare_tokens,
)

DEMO = os.path.join(ROOT, "dspark", "assets", "demo")
PROMPTS = [list(range(5 + i, 9 + 2 * i)) for i in range(7)]  # 4..10 tokens each
MAX_TOKENS, CONCURRENCY = 8, 3


@pytest.mark.parametrize("arm", ["nospec", "fixed", "adaptive"])
def test_closed_loop_holds_exactly_c_requests_and_counts_what_they_produced(arm):
    spec = None if arm == "nospec" else {
        "model": f"{DEMO}/drafter", "num_speculative_tokens": 3,
        **({"adaptive_policy": "fixed"} if arm == "fixed"
           else {"enable_adaptive_verification": True})}  # fmt: skip
    with LLM(f"{DEMO}/target", device="cpu", max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=256, speculative_config=spec) as llm:  # fmt: skip
        engine = llm.engine
        params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for t in (0.0, 1.0) * 4]  # fmt: skip
        tokens0 = engine.stats["generation_tokens"]
        outputs = []
        res = closed_loop(engine, [{"prompt_token_ids": p} for p in PROMPTS],
                          params.__getitem__, CONCURRENCY, warmup=CONCURRENCY,
                          warmup_tokens=2, outputs=outputs)  # fmt: skip
        produced = engine.stats["generation_tokens"] - tokens0
    # every measured prompt finished once with exactly max_tokens tokens (ignore_eos)
    assert sorted(o.prompt_token_ids for o in outputs) == sorted(PROMPTS)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outputs)
    assert res["completed"] == res["num_prompts"] == len(PROMPTS)
    assert res["output_tokens"] == sum(len(o.outputs[0].token_ids) for o in outputs)
    # the warm-up ran (C prompts cut to 2 tokens) and is not counted
    assert produced == res["output_tokens"] + CONCURRENCY * 2
    # never more than C requests in the engine, and C in it (and in one step's batch) at times
    assert res["max_in_flight"] == CONCURRENCY and res["batch_max"] == CONCURRENCY
    assert 0 < res["batch_mean"] <= CONCURRENCY and 1 <= res["batch_p50"] <= CONCURRENCY
    assert res["output_throughput"] > 0 and res["wall_s"] > 0 and res["steps"] > 0
    assert res["mean_tpot_ms"] > 0 and res["mean_ttft_ms"] >= 0
    assert res["graph_steps"] is None  # (the CPU engine has no whole-step graphs)
    if arm == "nospec":
        assert res["spec_decode"] is None and res["policy"] is None
        assert res["scheduler_overhead"] is None
    else:  # acceptance of the measured requests: tokens per decoding round
        assert res["spec_decode"]["mean_acceptance_length"] >= 1.0
        # the policy's counts are this run's alone (the warm-up's steps are not in them):
        # every measured step counted once by kind
        kinds = res["policy"]["steps_by_kind"]
        assert sum(kinds.values()) == res["steps"] and kinds["verify"] > 0
        if arm == "fixed":  # fixed K never holds drafting off nor decides
            assert kinds["plain"] == 0 and res["policy"]["plans"]["decision"] == 0
        # the run's scheduler overhead: its planning and allocation over its step time
        spent = res["policy"]["overhead_ms"]
        assert spent["alloc"] >= 0 and (spent["plan"] > 0) == (arm == "adaptive")
        assert res["scheduler_overhead"] == pytest.approx(
            (spent["plan"] + spent["alloc"]) / (res["step_ms_per_step"] * res["steps"]))
        assert 0 <= res["scheduler_overhead"] < 1


def test_the_levels_end_is_the_steps_begun_with_fewer_than_c_requests_held():
    """closed_loop reports the level's end: the steps begun with fewer than C requests in the
    engine (the prompts ran out) and their share of the run's own time, counted here by a
    wrapper around engine.step (demo pair, CPU). Prompts of equal output lengths started
    together with no speculation finish together, so only the last wave's end counts; with
    fewer prompts than C, "full" is every prompt."""
    with LLM(f"{DEMO}/target", device="cpu", max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=256) as llm:  # fmt: skip
        engine, sched, seen = llm.engine, llm.engine.scheduler, []
        step = engine.step

        def counted_step():  # (requests held when the step began, the call's seconds)
            held, t0 = len(sched.running) + len(sched.waiting), time.perf_counter()
            out = step()
            seen.append((held, time.perf_counter() - t0))
            return out

        engine.step = counted_step
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        res = closed_loop(engine, prompts, lambda i: params, CONCURRENCY)
        end = [s for held, s in seen if held < CONCURRENCY]
        assert res["end_steps"] == len(end) > 0 and res["end_steps"] < res["steps"]
        assert res["end_share"] == pytest.approx(sum(end) / sum(s for _, s in seen), rel=0.2)
        assert 0 < res["end_share"] < 1
        seen.clear()
        few = closed_loop(engine, prompts[:2], lambda i: params, concurrency=5)
        # (the two run together to the same step, none begun with fewer than both held:
        # against C, every step would have counted)
        assert few["end_steps"] == sum(1 for held, _ in seen if held < 2) == 0
        assert seen and all(held < 5 for held, _ in seen)


def test_closed_loop_counts_the_steps_run_on_whole_step_graphs():
    """With whole-step graphs (here their padded path, eager on the CPU), the run counts the
    steps that took them: with the graphs' steps with prefill chunks cut to 8 tokens, its
    decode / verify steps, none of those with prompts' chunks (the per-phase path)."""
    from dspark.engine.step_graph import StepGraphs

    spec = {"model": f"{DEMO}/drafter", "num_speculative_tokens": 3, "adaptive_policy": "fixed"}
    with LLM(f"{DEMO}/target", device="cpu", max_num_seqs=8, max_model_len=128,
             max_num_batched_tokens=256, speculative_config=spec) as llm:  # fmt: skip
        graphs = llm.engine.runner.step_graphs = StepGraphs(llm.engine.runner, use_graphs=False)
        graphs.mixed_tokens = 8  # (every step with a prompt's chunk here carries more)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        res = closed_loop(llm.engine, [{"prompt_token_ids": p} for p in PROMPTS],
                          lambda i: params, CONCURRENCY)  # fmt: skip
        on_graphs = sum(graphs.steps.values())
    assert res["graph_steps"] == on_graphs  # (no warm-up: every step is the run's)
    mixed = res["policy"]["steps_by_kind"]["mixed"]
    assert mixed > 0 and res["graph_steps"] == res["steps"] - mixed > 0


def test_closed_loop_with_fewer_prompts_than_c_holds_them_all():
    with LLM(f"{DEMO}/target", device="cpu", max_num_seqs=8, max_model_len=128) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        res = closed_loop(llm.engine, PROMPTS[:2], lambda i: params, concurrency=5)
    assert res["completed"] == 2 and res["output_tokens"] == 8 and res["max_in_flight"] == 2


def test_lockstep_runs_generators_in_turns_and_charges_each_its_own_time():
    """_lockstep: round robin, `turn` steps at a time, a sync ending every turn (inside it);
    a generator done early drops out; each result's wall_s gains its turns' syncs."""
    calls = []

    def run(name: str, steps: int):
        for i in range(steps):
            calls.append((name, i))
            yield
        return {"name": name, "wall_s": 1.0}

    syncs = []
    res = _lockstep([run("a", 5), run("b", 2)], 2, lambda: syncs.append(len(calls)))
    assert calls == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("a", 3), ("a", 4)]
    assert [r["name"] for r in res] == ["a", "b"]
    assert syncs == [2, 4, 6, 6, 7]  # after every turn, the ending ones included
    assert all(r["wall_s"] >= 1.0 for r in res)


def test_in_turns_an_engines_step_periods_leave_out_the_other_engines_turns(monkeypatch):
    """closed_loops_in_turns marks each engine idle when its turn ends: the adaptive engine's
    online cost model never sees the other engines' turns as part of a step's period. The
    step() call that follows such a gap (the other engine's two steps and a 30 ms sync) has
    a period no longer than the call itself, whatever the machine's speed, and the periods
    the cost model observes are the calls' periods. The pause rule, which also leaves out
    gaps over 0.1 s, is set to 10 s here so that only the idle marking can (demo pair,
    CPU). This test's earlier bound, 55 ms on every period, failed on a slow machine."""
    import dspark.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "_MAX_GAP_S", 10.0)
    spec = {"model": f"{DEMO}/drafter", "num_speculative_tokens": 3,
            "enable_adaptive_verification": True}  # fmt: skip
    kw = {"device": "cpu", "max_num_seqs": 8, "max_model_len": 128,
          "max_num_batched_tokens": 256}  # fmt: skip
    with LLM(f"{DEMO}/target", **kw) as plain, LLM(f"{DEMO}/target", speculative_config=spec,
                                                   **kw) as adaptive:  # fmt: skip
        engine, decoder, observed, calls = adaptive.engine, adaptive.engine.runner.spec, [], []
        observe = decoder.observe_step_time
        decoder.observe_step_time = lambda ms, *a: observed.append(ms) or observe(ms, *a)
        step, period_of, last_end, period = engine.step, engine._step_period_ms, [None], []

        def timed_step():  # (the gap before the call, the call's own time, its period: ms)
            t0 = time.perf_counter()
            out = step()
            t1 = time.perf_counter()
            gap = None if last_end[0] is None else (t0 - last_end[0]) * 1e3
            calls.append((gap, (t1 - t0) * 1e3, period.pop()))
            last_end[0] = t1
            return out

        engine.step = timed_step
        engine._step_period_ms = lambda t0: period.append(period_of(t0)) or period[-1]
        params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        rows = closed_loops_in_turns([plain.engine, adaptive.engine],
                                     [{"prompt_token_ids": p} for p in PROMPTS],
                                     lambda i: params, CONCURRENCY, turn_steps=2,
                                     sync=lambda: time.sleep(0.03))  # fmt: skip
    assert all(r["completed"] == len(PROMPTS) for r in rows)
    assert len(observed) >= 8  # (several turns' steps observed)
    assert set(observed) <= {ms for _, _, ms in calls}  # (each observed: a call's period)
    after_gap = [(own, ms) for gap, own, ms in calls if gap is None or gap >= 30.0]
    assert len(after_gap) >= 4  # (the first call, and every turn's)
    for own, ms in after_gap:  # (spanning the gap, it would be 30 ms longer at least)
        assert ms <= own + 1.0, (own, ms)


def test_compare_tokens_counts_the_prompts_equal_to_the_first_arms():
    rows = [{"_tokens": {0: [1, 2], 1: [3], 2: [5]}}, {"_tokens": {0: [1, 2], 1: [4], 2: [5]}},
            {"_tokens": {0: [1, 2], 2: [5]}}]  # (the last arm lost prompt 1's output)
    compare_tokens(rows)
    assert [r.get("t0_identical") for r in rows] == [None, [2, 3], [2, 3]]
    # where each other output left the first arm's: prompt 1 at its token 0; a lost output -1
    assert [r.get("t0_diverged") for r in rows] == [None, [[1, 0]], [[1, -1]]]
    assert not any("_tokens" in r for r in rows)


def test_compare_tokens_lists_the_first_differing_token_of_a_few_prompts():
    base = {i: [7, 8, 9, i] for i in range(40)}
    other = {i: [7, 8, 9, i] if i % 2 else [7, 8, 1, i] for i in range(40)}
    other[1] = [7, 8, 9, 1, 5]  # longer than the first arm's: it left it at token 4
    rows = [{"_tokens": base}, {"_tokens": other}]
    compare_tokens(rows)
    assert rows[1]["t0_identical"] == [19, 40]
    assert rows[1]["t0_diverged"] == ([[0, 2], [1, 4]] + [[i, 2] for i in range(2, 30, 2)]
                                      )[:DIVERGED_KEPT] and DIVERGED_KEPT == 16  # fmt: skip
