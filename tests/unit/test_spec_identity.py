"""Temperature 0: speculative output equals non-speculative output token for token.

A random drafter must pass too: losslessness cannot depend on drafting well. Batches mix
prompt lengths; chunked prefill is forced by a small token budget, prefix-cache hits by a
shared prefix, preemption by a tiny KV cache.
"""

import pytest

from dspark import LLM, SamplingParams
from dspark.testing.drafters import make_tiny_drafter

SHARED = list(range(40, 72))
PROMPTS = [SHARED + [1, 2], [5, 6, 7], list(range(100, 141)), SHARED + [9], [3] * 11]
MAX_NEW = 16


@pytest.fixture(scope="module")
def reference(tiny_qwen):
    return _run(tiny_qwen, None)


def _run(target, spec, **kwargs):
    args = dict(device="cpu", block_size=4, max_num_batched_tokens=24, num_kv_blocks=30)
    args.update(kwargs)
    llm = LLM(target, speculative_config=spec, **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    llm.engine.block_manager.check_integrity()
    return llm, [o.outputs[0].token_ids for o in outs], outs


DRAFTERS = {
    "vanilla": dict(markov_head_type="vanilla"),
    "gated": dict(markov_head_type="gated"),
    "rnn": dict(markov_head_type="rnn", num_layers=2),
    "nohead": dict(enable_confidence_head=False),
    "conf_without_markov": dict(confidence_head_with_markov=False),
    "dflash": dict(markov_rank=0, enable_confidence_head=False),
}


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            path = str(tmp_path_factory.mktemp(f"drafter_{name}"))
            cache[name] = make_tiny_drafter(path, tiny_qwen, seed=7, **DRAFTERS[name])
        return cache[name]

    return get


CASES = [
    ("vanilla", 1, "greedy", "fixed"),
    ("vanilla", 3, "probabilistic", "fixed"),
    ("gated", 3, "greedy", "fixed"),
    ("rnn", 7, "probabilistic", "fixed"),
    ("conf_without_markov", 5, "probabilistic", "fixed"),
    ("dflash", 3, "greedy", "fixed"),
    ("vanilla", 7, "probabilistic", "lagged"),
    ("vanilla", 7, "greedy", "early_stop"),
    ("gated", 5, "probabilistic", "threshold"),
    ("nohead", 7, "greedy", "lagged"),  # online acceptance estimator
]


@pytest.mark.parametrize("name,k,draft_method,policy", CASES)
def test_greedy_identity(tiny_qwen, reference, drafter, name, k, draft_method, policy):
    spec = {
        "model": drafter(name), "num_speculative_tokens": k,
        "draft_sample_method": draft_method, "adaptive_policy": policy,
    }  # fmt: skip
    llm, got, outs = _run(tiny_qwen, spec)
    assert got == reference[1]
    assert llm.engine.stats["preemptions"] > 0, "the tiny KV cache should force preemption"
    assert outs[3].metrics.num_cached_tokens >= 32 or outs[0].metrics.num_cached_tokens >= 32
    stats = llm.engine.spec_stats
    assert stats.num_steps > 0 and stats.num_drafted_tokens == stats.num_steps * k
    assert 0 <= stats.num_accepted_tokens <= stats.num_verified_tokens
    assert stats.num_verified_tokens <= stats.num_drafted_tokens
    if policy == "fixed":
        assert stats.num_verified_tokens == stats.num_drafted_tokens
    for o in outs:
        sd = o.spec_decode
        assert sd["num_drafted_tokens"] >= sd["num_verified_tokens"] >= sd["num_accepted_tokens"]


def test_block_verification_identity(tiny_qwen, reference, drafter):
    spec = {"model": drafter("vanilla"), "num_speculative_tokens": 4,
            "rejection_sample_method": "block"}  # fmt: skip
    _, got, _ = _run(tiny_qwen, spec)
    assert got == reference[1]


def test_acceptance_accounting(tiny_qwen, reference, tmp_path):
    """Every token after the first comes from a verify round (accepted drafts + one)."""
    k = 3
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=1),
            "num_speculative_tokens": k}  # fmt: skip
    llm, got, outs = _run(tiny_qwen, spec, num_kv_blocks=400)
    assert got == reference[1]
    for o in outs:
        sd = o.spec_decode
        produced = sd["num_accepted_tokens"] + sd["num_steps"]
        # the last round may emit more than max_tokens allows; the surplus is dropped
        assert 0 <= produced - (len(o.outputs[0].token_ids) - 1) <= k


def test_block_tables_fit_the_graph_buffers_at_max_model_len(tiny_qwen, drafter):
    """CUDA graphs size their block-table buffer by max_blocks_per_seq; a sequence at
    max_model_len with K lookahead slots (and a following step's K + 1 more: follow.py) must
    fit it."""
    spec = {"model": drafter("vanilla"), "num_speculative_tokens": 7}
    llm = LLM(tiny_qwen, device="cpu", block_size=4, max_model_len=40, speculative_config=spec)
    runner = llm.engine.runner
    widest = []
    launch = runner.launch  # every step the engine runs starts here

    def spy(sched, tables, follows=False):
        widest.append(max(len(t) for t in tables))
        return launch(sched, tables, follows)

    runner.launch = spy
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(1, 31))}], params)
    assert max(widest) > -(-40 // 4) + 1  # past the old max_model_len-only sizing
    assert max(widest) <= runner.max_blocks_per_seq


@pytest.mark.parametrize("method", ["standard", "block"])
def test_all_greedy_steps_draft_greedily(tiny_qwen, reference, drafter, method):
    """With probabilistic drafting configured, a step whose rows are all greedy drafts
    greedily (no draft distributions); a step with a sampled row drafts probabilistically.
    Greedy requests stay identical to plain decoding when sampled requests join later and are
    verified in the same batches (their skipped distributions are never read)."""
    spec = {"model": drafter("vanilla"), "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic", "rejection_sample_method": method}
    llm = LLM(tiny_qwen, speculative_config=spec, device="cpu", block_size=4,
              max_num_batched_tokens=24, num_kv_blocks=60)  # fmt: skip
    d = llm.engine.runner.spec.drafter
    seen, propose = [], d.propose
    d.propose = lambda *a, **k: seen.append(a[10]) or propose(*a, **k)  # the draft method
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True, seed=3)
    engine = llm.engine
    engine.add_request("g", {"prompt_token_ids": PROMPTS[1]}, greedy)
    outs = {}
    for step in range(40):
        if step == 4:  # after some greedy-only drafting rounds a sampled request joins
            engine.add_request("s", {"prompt_token_ids": PROMPTS[2]}, sampled)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert outs["g"] == reference[1][1] and len(outs["s"]) == MAX_NEW
    assert "greedy" in seen and "probabilistic" in seen
    assert seen[:2] == ["greedy", "greedy"]  # only the greedy request was running
