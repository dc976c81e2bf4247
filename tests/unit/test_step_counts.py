"""Every planned step of a speculative engine is counted once by kind (dspark_spec_steps_total):
what a serving benchmark reads to tell whether the adaptive policy drafted, verified or ran
plain steps at a load level."""

from dspark import LLM, SamplingParams
from dspark.testing.drafters import make_tiny_drafter


def test_every_step_is_counted_by_kind(tiny_qwen, tmp_path):
    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=5)
    llm = LLM(tiny_qwen, device="cpu", speculative_config={
        "model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "lagged",
        "min_predicted_gain": 9.9})  # drafts until the first estimate, then plain steps
    eng, spec = llm.engine, llm.engine.runner.spec
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 2, 7]} for i in range(3)]
    llm.generate(prompts, params, use_tqdm=False)
    counts = spec.metrics()["step_counts"]
    assert sum(counts.values()) == eng.stats["steps"]
    assert counts["mixed"] >= 1 and counts["verify"] >= 1 and counts["plain"] >= 1, counts
    # a fixed-K engine verifies every step after the prompts' and never runs a plain one
    fixed = LLM(tiny_qwen, device="cpu", speculative_config={
        "model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "fixed"})
    fixed.generate(prompts, params, use_tqdm=False)
    counts = fixed.engine.runner.spec.metrics()["step_counts"]
    assert counts["plain"] == 0 and counts["draft"] == 0 and counts["verify"] >= 5, counts
    assert sum(counts.values()) == fixed.engine.stats["steps"]
