"""Following speculative steps (dspark/engine/follow.py): a step that drafts for every decode
row stays in flight and the next is scheduled from the counters before it, its rows moved on
the device by what the step in flight emitted. Not one token may change against waiting for
every speculative step (DSPARK_FOLLOW=0), whatever happens in between: varied acceptance
(synthetic rates: every outcome from 1 to 1 + K tokens), trimmed plans, stop tokens, aborts,
requests waiting for a seat, short KV memory, the padded whole-step path."""

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.step_graph import StepGraphs
from tests.unit.launch_trace import trace_steps
from tests.unit.streamed_run import ABORT_NEXT_PROMPT, abort_in_flight, run_streamed

PROMPTS = [list(range(30 + 3 * i, 30 + 3 * i + n)) for i, n in enumerate((3, 17, 6, 11, 2, 9))]
MAX_TOKENS = [40, 23, 51, 9, 33, 30]


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    from dspark.testing.drafters import make_tiny_drafter

    return make_tiny_drafter(str(tmp_path_factory.mktemp("follow_drafter")), tiny_qwen, seed=5)


def _spec(drafter, policy="fixed", synthetic=True, tmp_path=None) -> dict:
    spec = {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": policy,
            "draft_sample_method": "probabilistic", "draft_skipping": False}  # fmt: skip
    if synthetic:  # every outcome: 1 to 1 + K tokens a row (deterministic given the seeds)
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[0.8, 0.6, 0.5])  # fmt: skip
    if policy == "lagged":  # a table under which plans trim (loaded: the same plans each run)
        from dspark.spec.cost_model import CostModel

        path = str(tmp_path / "trims.json")
        CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, ms_per_token=0.08,
                           draft_base_ms=0.1, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
        spec["cost_table_path"] = path
    return spec


def _run(target, spec, follow: bool, temperature: float, graphs: bool = False, stops=None,
         max_tokens=MAX_TOKENS, **kw):  # fmt: skip
    """Final outputs of every request (streamed pieces checked against them), the engine and
    the number of steps launched as followers."""
    kw.setdefault("max_num_seqs", 8)
    llm = LLM(target, device="cpu", block_size=4, speculative_config=spec, **kw)
    eng = llm.engine
    assert eng.async_scheduling and eng.follows
    eng.follows = follow
    if graphs:  # the padded whole-step path, run without capture
        eng.runner.step_graphs = StepGraphs(eng.runner, use_graphs=False)
    launch, followers = eng.runner.launch, [0, 0]  # following steps, ... with new prompts

    def counting_launch(sched, tables, follows=False):
        followers[0] += follows
        followers[1] += follows and any(not r.num_draft_slots for r in sched.rows)
        return launch(sched, tables, follows)

    eng.runner.launch = counting_launch
    final = run_streamed(eng, PROMPTS, max_tokens, temperature, stops)
    eng.followers_with_prompts = followers[1]
    return final, eng, followers[0]


def _stats(eng) -> tuple:
    st = eng.spec_stats
    return st.num_drafted_tokens, st.num_verified_tokens, st.num_accepted_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("graphs", [False, True])
def test_following_steps_emit_the_tokens_of_waited_for_steps(tiny_qwen, drafter, temperature,
                                                             graphs):  # fmt: skip
    spec = _spec(drafter)
    ref, ref_eng, none = _run(tiny_qwen, spec, False, temperature, graphs)
    got, eng, followers = _run(tiny_qwen, spec, True, temperature, graphs)
    assert none == 0 and 2 * followers >= eng.stats["steps"]  # (most steps follow)
    assert got == ref
    assert [len(ref[f"r{i}"][0]) for i in range(len(PROMPTS))] == MAX_TOKENS
    assert _stats(eng) == _stats(ref_eng)
    accepted = eng.spec_stats.num_accepted_tokens
    assert 0 < accepted < eng.spec_stats.num_verified_tokens  # (outcomes of every length)
    if graphs:
        assert any(key[0] == "spec" for key in eng.runner.step_graphs.steps)


def test_sampled_tokens_stay_those_of_waited_for_steps_through_admissions(tiny_qwen, drafter):
    """Four seats for six requests: a following step cannot admit into the seat of a request
    the step in flight ends (the next one does), but a request's tokens depend on its own
    seed and rounds only, so sampled output stays the waited-for run's token for token."""
    spec = _spec(drafter)
    ref, ref_eng, _ = _run(tiny_qwen, spec, False, 1.0, True, max_num_seqs=4)
    got, eng, followers = _run(tiny_qwen, spec, True, 1.0, True, max_num_seqs=4)
    assert followers > 0 and eng.followers_with_prompts > 0
    assert got == ref and _stats(eng) == _stats(ref_eng)


@pytest.mark.parametrize("graphs", [False, True])
def test_real_verification_follows_and_stays_the_target_greedy_output(tiny_qwen, drafter,
                                                                      graphs):  # fmt: skip
    spec = _spec(drafter, synthetic=False)
    got, eng, followers = _run(tiny_qwen, spec, True, 0.0, graphs)
    assert 2 * followers >= eng.stats["steps"]
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == _greedy(tiny_qwen)


@pytest.mark.parametrize("graphs", [False, True])
def test_trimmed_plans_follow(tiny_qwen, drafter, tmp_path, graphs):
    """The lagged policy's plans trim. A following step's plan reads the acceptance checks of
    one step fewer (the step in flight is committed after it), so its budgets may differ from
    a waited-for run's, and sampled tokens with them: greedy ones may not."""
    spec = _spec(drafter, "lagged", synthetic=False, tmp_path=tmp_path)
    got, eng, followers = _run(tiny_qwen, spec, True, 0.0, graphs)
    drafted, verified, _ = _stats(eng)
    assert 2 * followers >= eng.stats["steps"] and 0 < verified < drafted  # (plans trimmed)
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == _greedy(tiny_qwen)


def test_stop_tokens_leave_wasted_rows_that_change_nothing(tiny_qwen, drafter):
    spec = _spec(drafter)
    free, _, _ = _run(tiny_qwen, spec, False, 1.0)
    # stop each request at the 12th token it generates unconstrained (or its last)
    stops = [[free[f"r{i}"][0][min(11, len(free[f"r{i}"][0]) - 1)]] for i in range(len(PROMPTS))]
    ref, _, _ = _run(tiny_qwen, spec, False, 1.0, stops=stops)
    got, _, followers = _run(tiny_qwen, spec, True, 1.0, stops=stops)
    assert got == ref and followers > 0
    assert sum(reason == "stop" for _, reason in ref.values()) >= 3  # stops did end some


def _greedy(target) -> list[list[int]]:
    """The target's own greedy tokens for PROMPTS (no speculation)."""
    plain = LLM(target, device="cpu", block_size=4, max_num_seqs=8)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_admissions_follow_and_short_memory_falls_back_to_waiting(tiny_qwen, drafter):
    """Four seats for six requests (a request admitted as a seat frees, in a step that
    follows the one in flight) and 24 blocks of 4 tokens (preemptions, at other steps than a
    waited-for run's: a follower's rows hold K + 1 slots more, so sampled tokens may differ
    from that run's; greedy ones may not)."""
    spec = _spec(drafter, synthetic=False)
    got, eng, followers = _run(tiny_qwen, spec, True, 0.0, max_num_seqs=4)
    assert followers > 0 and eng.followers_with_prompts > 0
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == _greedy(tiny_qwen)
    got, eng, followers = _run(tiny_qwen, spec, True, 0.0, max_num_seqs=4, num_kv_blocks=24)
    assert followers > 0 and eng.stats["preemptions"] > 0
    assert [got[f"r{i}"][0] for i in range(len(PROMPTS))] == _greedy(tiny_qwen)


def test_abort_while_a_followed_step_is_in_flight(tiny_qwen, drafter):
    spec = _spec(drafter, synthetic=False)  # (T = 0: the target's greedy tokens, alone or not)
    llm = LLM(tiny_qwen, device="cpu", block_size=4, speculative_config=spec)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    done = abort_in_flight(eng, 30, 4, lambda e: e._in_flight is not None
                           and not e._in_flight.advanced)  # (a speculative step)  # fmt: skip
    alone = LLM(tiny_qwen, device="cpu", block_size=4, speculative_config=spec)
    alone.engine.follows = False
    for rid in ("a0", "a3"):
        prompt = ABORT_NEXT_PROMPT if rid == "a3" else [5, 8, 13, 21]
        ref = alone.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert done[rid] == ref[0].outputs[0].token_ids
    eng.block_manager.check_integrity()
    assert not eng.block_manager.block_tables


def test_a_followed_step_is_waited_for_after_the_next_launch(tiny_qwen, drafter):
    spec = _spec(drafter)
    llm = LLM(tiny_qwen, device="cpu", speculative_config=spec)
    eng, log = llm.engine, []
    trace_steps(eng, log)
    eng.stream_outputs = True
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(2):
        eng.add_request(f"y{i}", {"prompt_token_ids": [9, 4 + i, 6]}, params)
    commits = []
    commit = LLMEngine._commit

    def spy(self, sched, result, advanced, with_drafts=0):
        commits.append((sched.follows, any(r.num_draft_slots for r in sched.rows)))
        return commit(self, sched, result, advanced, with_drafts)

    eng._commit = spy.__get__(eng)
    while eng.has_unfinished_requests():
        assert eng.step() == []
    waits = [e[1] for e in log if e[0] == "wait"]
    # each step waited for after the next one's launch (the prompts' step too: its rows all
    # sample, and it drafts for them), its outputs delivered at once, while the next runs
    out = ("outputs", [("y0", False), ("y1", False)])
    assert log[:7] == [("launch", 0), ("launch", 1), ("wait", 0), out, ("launch", 2),
                       ("wait", 1), out], log  # fmt: skip
    followed = [n for n in waits if ("launch", n + 1) in log
                and log.index(("wait", n)) == log.index(("launch", n + 1)) + 1]  # fmt: skip
    assert waits == sorted(waits) and len(followed) >= len(waits) - 2, (followed, waits)
    assert sum(follows for follows, _ in commits) >= 3
    assert all(drafts for follows, drafts in commits if follows)
