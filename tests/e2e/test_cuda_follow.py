"""Following speculative steps on CUDA graphs (dspark/engine/follow.py): the next step is
captured graph work launched before the step in flight is waited for, its rows moved on the
device; tokens equal those of waited-for eager steps (tests/unit/test_follow.py runs the same
code on the CPU without capture)."""

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.testing.drafters import make_tiny_drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))}
           for i, n in enumerate((4, 9, 17, 33, 5, 12, 7, 21, 3))]  # fmt: skip
MAX_TOKENS = (48, 19, 37, 60, 23, 42, 30, 40, 11)


def _generate(path, spec, follow: bool, temperature: float, **kw):
    llm = LLM(path, device="cuda", num_kv_blocks=4096, max_num_seqs=16, dtype="float32",
              speculative_config=spec, **kw)  # fmt: skip
    assert llm.engine.follows or spec is None
    llm.engine.follows = follow and spec is not None
    launch, followers = llm.engine.runner.launch, [0]

    def counting(sched, tables, follows=False):
        followers[0] += follows
        return launch(sched, tables, follows)

    llm.engine.runner.launch = counting
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    steps, stats = llm.engine.stats["steps"], llm.engine.spec_stats
    keys = dict(llm.engine.runner.step_graphs.steps) if llm.engine.runner.step_graphs else {}
    llm.shutdown()
    return out, followers[0], steps, stats, keys


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("synthetic", [True, False])
def test_following_graph_steps_match_waited_for_eager_steps(ckpt_dir, tmp_path, temperature,
                                                            synthetic):  # fmt: skip
    path = ckpt_dir("qwen3_gqa2")
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path, seed=4),
            "num_speculative_tokens": 4, "adaptive_policy": "fixed",
            "draft_sample_method": "probabilistic"}  # fmt: skip
    if synthetic:  # outcomes of every length, 1 to 1 + K tokens
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[0.9, 0.7, 0.6, 0.5])  # fmt: skip
    a, followers, steps, st, keys = _generate(path, spec, True, temperature)
    assert 2 * followers >= steps and any(key[0] == "spec" for key in keys), (followers, keys)
    b, none, _, ref_st, _ = _generate(path, spec, False, temperature, enforce_eager=True)
    assert none == 0 and a == b
    assert (st.num_verified_tokens, st.num_accepted_tokens) == (
        ref_st.num_verified_tokens, ref_st.num_accepted_tokens)


@pytest.mark.parametrize("capture_trims", [True, False])
def test_following_trimmed_plans_on_graphs_keep_the_target_greedy_output(
        ckpt_dir, tmp_path, monkeypatch, capture_trims):  # fmt: skip
    """Lagged plans that trim; with DSPARK_CAPTURE_TRIMS=0 a trimmed key is captured on first
    use, which a following step never is (StepGraphCapture.captured): it takes the
    per-phase path (a waited-for step may capture the key later: trimmed graphs need not
    run at all then)."""
    from dspark.spec.cost_model import CostModel

    monkeypatch.setenv("DSPARK_CAPTURE_TRIMS", "1" if capture_trims else "0")
    path = ckpt_dir("qwen3_gqa2")
    table = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, ms_per_token=0.08,
                       draft_base_ms=0.1, draft_ms_per_req=0.0).to_json(table)  # fmt: skip
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path, seed=4),
            "num_speculative_tokens": 4, "adaptive_policy": "lagged", "cost_table_path": table}
    a, followers, steps, st, keys = _generate(path, spec, True, 0.0)
    assert 2 * followers >= steps, (followers, steps)
    assert not capture_trims or any(key[0] == "trim" for key in keys), keys
    assert 0 < st.num_verified_tokens < st.num_drafted_tokens
    b, *_ = _generate(path, None, False, 0.0)
    assert a == b
