"""Async scheduling (engines without speculation): step N+1 is scheduled and launched before
step N is waited for and committed, with N's sampled tokens fed to N+1 on the device. It must
not change a single token, whatever happens in between: chunked prefill, preemption, stop
tokens, length limits, aborts, the padded whole-step path."""

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.step_graph import StepGraphs
from tests.unit.launch_trace import trace_steps
from tests.unit.streamed_run import ABORT_NEXT_PROMPT, abort_in_flight, run_streamed

PROMPTS = [list(range(30 + 3 * i, 30 + 3 * i + n)) for i, n in enumerate((3, 17, 6, 11, 2, 9))]
MAX_TOKENS = [14, 5, 21, 9, 1, 12]


def _run(target, async_on: bool, temperature: float, graphs: bool = False, stops=None, **kw):
    """Streamed tokens and final outputs of every request, plus the engine."""
    llm = LLM(target, device="cpu", block_size=4, max_num_seqs=8, async_scheduling=async_on,
              **kw)  # fmt: skip
    eng = llm.engine
    assert eng.async_scheduling is async_on
    if graphs:  # the padded whole-step path, run without capture
        eng.runner.step_graphs = StepGraphs(eng.runner, use_graphs=False)
    final = run_streamed(eng, PROMPTS, MAX_TOKENS, temperature, stops)
    return final, eng


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("graphs", [False, True])
def test_same_tokens_as_synchronous_steps(tiny_qwen, temperature, graphs):
    ref, _ = _run(tiny_qwen, False, temperature, graphs)
    got, eng = _run(tiny_qwen, True, temperature, graphs)
    assert got == ref
    assert [len(ref[f"r{i}"][0]) for i in range(len(PROMPTS))] == MAX_TOKENS
    if graphs:
        assert any(key[0] == "plain" for key in eng.runner.step_graphs.steps)


def test_same_tokens_with_chunked_prefill_and_preemption(tiny_qwen):
    # 8-token chunks; 12 blocks of 4 tokens cannot hold every sequence at once
    kw = dict(max_num_batched_tokens=8, num_kv_blocks=12)
    ref, sync_eng = _run(tiny_qwen, False, 0.0, **kw)
    got, eng = _run(tiny_qwen, True, 0.0, **kw)
    assert got == ref
    assert eng.stats["preemptions"] > 0 and sync_eng.stats["preemptions"] > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_stop_tokens_end_requests_at_the_same_token(tiny_qwen, graphs):
    free, _ = _run(tiny_qwen, False, 1.0, graphs)
    # stop each request at the 3rd token it generates unconstrained (or its last)
    stops = [[free[f"r{i}"][0][min(2, len(free[f"r{i}"][0]) - 1)]] for i in range(len(PROMPTS))]
    ref, _ = _run(tiny_qwen, False, 1.0, graphs, stops=stops)
    got, _ = _run(tiny_qwen, True, 1.0, graphs, stops=stops)
    assert got == ref
    assert sum(reason == "stop" for _, reason in ref.values()) >= 3  # stops did end some


def test_the_next_step_launches_before_the_previous_is_waited_for(tiny_qwen):
    llm = LLM(tiny_qwen, device="cpu")
    eng, log = llm.engine, []
    trace_steps(eng, log)
    eng.stream_outputs = True  # (as a server: every step's outputs)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"x{i}", {"prompt_token_ids": [9, 4 + i, 6]}, params)
    while eng.has_unfinished_requests():
        assert eng.step() == []  # (delivered through on_outputs)
    # prefill + 3 decode steps; every wait comes after the next step's launch, and a step's
    # outputs right after its wait, while the next step runs
    out = ("outputs", [("x0", False), ("x1", False)])
    assert log == [("launch", 0), ("launch", 1), ("wait", 0), out, ("launch", 2), ("wait", 1),
                   out, ("launch", 3), ("wait", 2), out, ("wait", 3),
                   ("outputs", [("x0", True), ("x1", True)])]  # fmt: skip


def test_abort_while_a_step_is_in_flight(tiny_qwen):
    llm = LLM(tiny_qwen, device="cpu", block_size=4)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    done = abort_in_flight(eng, 10, 3, lambda e: e._in_flight is not None)
    assert all(len(t) == 10 for t in done.values())
    alone = LLM(tiny_qwen, device="cpu", block_size=4, async_scheduling=False).generate(
        [{"prompt_token_ids": ABORT_NEXT_PROMPT}], params, use_tqdm=False)  # fmt: skip
    assert done["a3"] == alone[0].outputs[0].token_ids  # the reused slot fed it its own tokens
    eng.block_manager.check_integrity()
    assert not eng.block_manager.block_tables


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    from dspark.testing.drafters import make_tiny_drafter

    return make_tiny_drafter(str(tmp_path_factory.mktemp("async_drafter")), tiny_qwen, seed=9)


def _lagged_spec(drafter, tmp_path, table: str) -> dict:
    """A loaded cost table (plans are the same in every run, so sampled output compares
    exactly): costly_drafter skips drafting (a probe every 4 steps); costly_tokens drafts and
    trims (synthetic acceptance, so that drafting pays)."""
    from dspark.spec.cost_model import CostModel

    kw = dict(weight_read_ms=1.0, ms_per_token=0.001, draft_base_ms=20.0, draft_ms_per_req=0.0)
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
            "draft_sample_method": "probabilistic"}  # fmt: skip
    if table == "costly_tokens":
        kw = dict(weight_read_ms=1.0, ms_per_token=0.08, draft_base_ms=0.1, draft_ms_per_req=0.0)
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[0.9, 0.6, 0.3, 0.1])  # fmt: skip
    path = str(tmp_path / f"{table}.json")
    CostModel.analytic(fixed_overhead_ms=0.0, **kw).to_json(path)
    spec["cost_table_path"] = path
    return spec


@pytest.mark.parametrize("table", ["costly_drafter", "costly_tokens"])
@pytest.mark.parametrize("graphs", [False, True])
def test_speculative_engine_schedules_ahead_only_after_plain_steps(
        tiny_qwen, drafter, tmp_path, monkeypatch, table, graphs):  # fmt: skip
    import dspark.spec.drafting as drafting_mod
    from dspark.engine.llm_engine import LLMEngine

    monkeypatch.setattr(drafting_mod, "_PROBE_EVERY", 4)
    monkeypatch.setattr(drafting_mod, "_PROBE_BACKOFF_MAX", 1)  # (a probe every 4 steps)
    monkeypatch.setenv("DSPARK_FOLLOW", "0")  # (steps that follow: test_follow.py)
    spec = _lagged_spec(drafter, tmp_path, table)
    ref, sync_eng = _run(tiny_qwen, False, 1.0, graphs, speculative_config=spec)
    commits = []  # (scheduled ahead, verified drafts) per committed step
    commit = LLMEngine._commit

    def spy(self, sched, result, advanced, with_drafts=0):
        commits.append((advanced, any(r.num_draft_slots for r in sched.rows)))
        return commit(self, sched, result, advanced, with_drafts)

    monkeypatch.setattr(LLMEngine, "_commit", spy)
    got, eng = _run(tiny_qwen, True, 1.0, graphs, speculative_config=spec)
    assert got == ref
    st, ref_st = eng.spec_stats, sync_eng.spec_stats
    assert (st.num_drafted_tokens, st.num_verified_tokens, st.num_accepted_tokens) == (
        ref_st.num_drafted_tokens, ref_st.num_verified_tokens, ref_st.num_accepted_tokens)
    ahead = [verified for advanced, verified in commits if advanced]
    assert not any(ahead)  # a step that verifies drafts is never left in flight
    assert any(verified for advanced, verified in commits if not advanced)
    if table == "costly_drafter":  # drafting skipped between probes: those steps run ahead
        assert len(ahead) >= 4 and st.num_drafted_tokens > 0
    else:  # drafting pays: steps draft and verify, so they are waited for at once
        assert 0 < st.num_verified_tokens < st.num_drafted_tokens


def test_a_waited_for_steps_outputs_are_built_while_the_next_step_runs(tiny_qwen, drafter,
                                                                      monkeypatch):  # fmt: skip
    """A speculative step that no step follows (DSPARK_FOLLOW=0 here: test_follow.py) is
    waited for in the call that launched it, but its outputs are built in the next call,
    after that call's launch: the output work
    (text, deltas, the driver's delivery) overlaps the next step's device work instead of
    sitting between two steps while the device idles. Only the last step's outputs, with
    nothing after it, come at once."""
    monkeypatch.setenv("DSPARK_FOLLOW", "0")
    spec = {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "fixed"}
    llm = LLM(tiny_qwen, device="cpu", speculative_config=spec)
    eng, log = llm.engine, []
    assert eng.async_scheduling
    trace_steps(eng, log)
    eng.stream_outputs = True
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"y{i}", {"prompt_token_ids": [9, 4 + i, 6]}, params)
    while eng.has_unfinished_requests():
        assert eng.step() == []  # (delivered through on_outputs)
    launches = [e[1] for e in log if e[0] == "launch"]
    deliveries = [i for i, e in enumerate(log) if e[0] == "outputs"]
    assert len(launches) >= 3 and len(deliveries) == len(launches)
    for n, at in enumerate(deliveries[:-1]):
        # step n was waited for in its own call; its outputs follow step n+1's launch
        assert log[at - 1] == ("launch", n + 1) and log.index(("wait", n)) < at - 1, log
    last = launches[-1]
    assert log[-2:] == [("wait", last), ("outputs", [("y0", True), ("y1", True)])]
