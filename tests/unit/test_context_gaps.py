"""speculative_config.skip_idle_context_write (dspark/spec/context_gaps.py): while drafting is
off, plain decode steps write no drafter context; the gaps are rebuilt, from the target run
again over those tokens without writing its KV, before the rows draft again. Output stays
exactly no-spec's at T = 0; the rebuilt context is the context a never-skipping engine wrote;
blocks past a gap stay out of the prefix cache."""

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.engine.block_manager import BlockManager
from dspark.engine.cuda_graph import default_buckets
from dspark.engine.request import Request
from dspark.engine.step_graph import StepGraphs
from dspark.testing.drafters import make_tiny_drafter

PROMPTS = [list(range(40, 40 + n)) for n in (5, 11, 8)]
ARGS = dict(device="cpu", block_size=4, max_num_seqs=4, num_kv_blocks=120,
            max_num_batched_tokens=64)  # fmt: skip


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("gaps_drafter")), tiny_qwen, seed=5)


def _steer(spec, drafting_on) -> None:
    """The drafting decision made by `drafting_on(plan index)` (every plan asks after_plan;
    no probe): the test sets when drafting stops and resumes."""
    d, plans = spec.drafting, [0]
    d.routine = lambda *args: False
    d.due = lambda num_reqs: False

    def after_plan(*args, **kwargs):
        plans[0] += 1
        on = drafting_on(plans[0])
        d.pays = on
        return on, False

    d.after_plan = after_plan


def _engine(target, drafter, skip: bool, graphs: bool, drafting_on) -> LLM:
    spec = {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "lagged",
            "skip_idle_context_write": skip}  # fmt: skip
    llm = LLM(target, speculative_config=spec, **ARGS)
    runner = llm.engine.runner
    if graphs:  # (the whole-step graphs' code, run without capture: their IDLE plain family)
        runner.step_graphs = StepGraphs(runner, use_graphs=False)
        runner.step_graphs.token_buckets = default_buckets(64)
    _steer(runner.spec, drafting_on)
    return llm


@pytest.mark.parametrize("graphs", [False, True])
def test_skipped_writes_then_rebuilt_gaps_keep_greedy_output_exact(tiny_qwen, drafter, graphs):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(tiny_qwen, **ARGS).generate(prompts, params, use_tqdm=False)
    # drafting on for 4 plans, then off for 9, and so on (probes aside, the decision's shape)
    llm = _engine(tiny_qwen, drafter, True, graphs, lambda i: i % 13 < 4)
    spec = llm.engine.runner.spec
    writes = []
    real = spec.drafter.write_context
    spec.drafter.write_context = lambda aux, pos, *a: writes.append(len(pos)) or real(
        aux, pos, *a)  # fmt: skip
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert spec.rebuilt_tokens > 0  # gaps were rebuilt before drafting resumed
    assert spec.metrics()["context_rebuilt_tokens"] == spec.rebuilt_tokens  # (reported)
    steps = llm.engine.stats["steps"]
    assert len(writes) < steps * 0.8, (len(writes), steps)  # plain steps wrote nothing
    llm.engine.block_manager.check_integrity()
    if graphs:  # the plain steps ran as the IDLE family (the one that skips)
        assert any(k[-1] == "idle" for k in llm.engine.runner.step_graphs.steps)


def test_the_rebuilt_context_is_the_context_an_engine_that_never_skipped_wrote(tiny_qwen,
                                                                                drafter):
    """Two engines take the same steps (drafting off from the 3rd plan to the 14th, on
    again at the 15th); one skips the plain steps' writes. After the step that drafts
    again, the drafter's context over every computed position matches."""
    def schedule(i):
        return not 3 <= i < 15

    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engines = [_engine(tiny_qwen, drafter, skip, False, schedule) for skip in (True, False)]
    for llm in engines:
        llm.engine.add_request("r", {"prompt_token_ids": PROMPTS[1]}, params)
    gap = None
    for _ in range(16):
        for llm in engines:
            llm.engine.step()
        req = engines[0].engine.scheduler.running[0]
        gap = req.context_gap if req.context_gap is not None else gap
    assert gap is not None and engines[0].engine.runner.spec.rebuilt_tokens > 0
    caches = []
    for llm in engines:
        eng = llm.engine
        req = eng.scheduler.running[0]
        assert req.context_gap is None  # rebuilt
        table = torch.as_tensor(eng.block_manager.block_table(req))
        pos = torch.arange(req.num_computed_tokens)
        slots = table[pos // 4] * 4 + pos % 4
        caches.append([c.view(-1, *c.shape[2:])[slots] for kv in eng.runner.spec.kv_caches
                       for c in kv])  # fmt: skip
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # ... and the skipping engine's context had been stale there before the rebuild: the
    # check above is not vacuous (the gap began at a decoded token, after the prompt)
    assert len(PROMPTS[1]) <= gap < engines[0].engine.scheduler.running[0].num_computed_tokens


def test_blocks_at_or_past_a_gap_stay_out_of_the_prefix_cache():
    bm = BlockManager(num_blocks=9, block_size=4, enable_prefix_caching=True)
    req = Request("a", list(range(14)), SamplingParams(), [], seed=0)
    assert bm.allocate(req, 14, bm.find_cached_prefix(req))
    req.num_computed_tokens, req.context_gap = 13, 6
    bm.cache_full_blocks(req)
    assert req.num_hashed_blocks == 1  # block 0 only: block 1 holds position 6
    req.context_gap = None  # (rebuilt)
    bm.cache_full_blocks(req)
    assert req.num_hashed_blocks == 3
