"""Whole-step graphs: the bucket-padded step (graph A + drafter graph B) gives exactly the
tokens of the eager step. On the CPU the same padded code runs without capture
(`StepGraphs(use_graphs=False)`); tests/e2e/test_cuda_graphs.py replays real graphs."""

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.attention.base import SENTINEL_SLOT
from dspark.engine.cuda_graph import decode_graph_max_tokens, default_buckets
from dspark.engine.input_batch import pack_step
from dspark.engine.step_graph import StepGraphs
from dspark.engine.step_layout import Layout, fill_host
from dspark.spec.draft_graph import request_buckets
from dspark.testing.drafters import make_tiny_drafter

# 5 requests of different lengths: the batch shrinks through buckets 8 -> 4 -> 2 -> 1
PROMPTS = [list(range(40, 40 + n)) for n in (3, 9, 5, 14, 7)]
MAX_TOKENS = [20, 6, 13, 9, 16]


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("sg_drafter")), tiny_qwen, seed=3)


def _llm(target, spec, step_graphs: bool, capture_all: bool = False) -> LLM:
    """A CPU engine; with `step_graphs`, decode steps take the padded whole-step path."""
    # (a 64-token step budget: start-up's dummy steps with prefill chunks stay small on the CPU)
    llm = LLM(target, speculative_config=spec, device="cpu", block_size=4, max_num_seqs=8,
              num_kv_blocks=200, max_num_batched_tokens=64)  # fmt: skip
    runner = llm.engine.runner
    if step_graphs:
        runner.step_graphs = StepGraphs(runner, use_graphs=False)
        # the CPU has no per-phase graphs: give trimmed steps the GPU's token buckets
        runner.step_graphs.token_buckets = default_buckets(64)
        if capture_all:  # the dummy steps run before serving must leave no trace
            runner.step_graphs.capture_all()
    return llm


def _generate(target, spec, temperature, step_graphs: bool, capture_all: bool = False):
    llm = _llm(target, spec, step_graphs, capture_all)
    runner = llm.engine.runner
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=11 + i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    used = runner.step_graphs.steps if step_graphs else {}
    return [o.outputs[0].token_ids for o in outs], used, llm


SPECS = {
    "nospec": None,
    "fixed": dict(num_speculative_tokens=4, adaptive_policy="fixed"),
    "fixed_probabilistic": dict(num_speculative_tokens=3, adaptive_policy="fixed",
                                draft_sample_method="probabilistic"),
    "lagged": dict(num_speculative_tokens=4, adaptive_policy="lagged"),
    # drafts accepted often: multi-token emission through the padded path
    "synthetic": dict(num_speculative_tokens=4, adaptive_policy="fixed",
                      rejection_sample_method="synthetic",
                      synthetic_acceptance_rates=[0.9, 0.8, 0.7, 0.6]),
}  # fmt: skip


def _costly_tokens_spec(drafter, tmp_path) -> dict:
    """A lagged engine under a loaded table that prices tokens high, with drafts accepted
    often (synthetic): some of its steps trim."""
    from dspark.spec.cost_model import CostModel

    path = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, ms_per_token=0.08,
                       draft_base_ms=0.1, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    return {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
            "cost_table_path": path, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]}  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", list(SPECS))
def test_padded_step_equals_eager_step(tiny_qwen, drafter, name, temperature):
    if name == "lagged" and temperature > 0:
        pytest.skip("lagged plans from measured step times: at T=1 two runs verify different "
                    "drafts, so their (equally distributed) samples differ")
    spec = None if SPECS[name] is None else {"model": drafter, **SPECS[name]}
    ref, _, _ = _generate(tiny_qwen, spec, temperature, step_graphs=False)
    got, used, llm = _generate(tiny_qwen, spec, temperature, step_graphs=True)
    assert got == ref
    assert [len(t) for t in got] == MAX_TOKENS
    # prefill steps draft, so decode steps verify; the lagged policy plans from measured
    # times (it may trim, or stop drafting): any family counts there
    families = {"nospec": {"plain"}, "lagged": {"plain", "spec", "trim"}}.get(name, {"spec"})
    buckets = {key[1] for key in used if key[0] in families}
    assert 8 in buckets and len(buckets) >= 2, used  # 5 rows padded to 8, then smaller
    # the prompts' step (no drafts yet): one graph too, its stream compacted to a bucket
    assert used.get(("mixed_plain", 8, "greedy" if temperature == 0 else "sample", 64)), used
    if name == "synthetic":
        assert llm.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["nospec", "fixed_probabilistic", "lagged"])
def test_capture_all_dummy_steps_leave_no_trace(tiny_qwen, drafter, name):
    spec = None if SPECS[name] is None else {"model": drafter, **SPECS[name]}
    temperature = 0.0 if name == "lagged" else 1.0  # (lagged plans vary with step times)
    ref, _, _ = _generate(tiny_qwen, spec, temperature, step_graphs=False)
    got, _, _ = _generate(tiny_qwen, spec, temperature, step_graphs=True, capture_all=True)
    assert got == ref


def test_trimmed_dummy_step_below_its_request_bucket(tiny_qwen, drafter):
    """Request bucket 12 with a 10-token trim (rows 9..10, no drafts): its dummy step has 10
    real rows, two of padding, and leaves the engine's output unchanged."""
    spec = {"model": drafter, **SPECS["lagged"]}
    llm = LLM(tiny_qwen, speculative_config=spec, device="cpu", block_size=4, max_num_seqs=12,
              num_kv_blocks=200, max_num_batched_tokens=64)  # fmt: skip
    sg = StepGraphs(llm.engine.runner, use_graphs=False)
    sg.token_buckets = [1, 2, 4, 8, 10, 16, 32, 64]
    assert 10 in sg.trim_buckets(12) and sg.trim_dummy(12, 10) == (10, 0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    sg.capture_all()  # (without use_graphs: runs every dummy step once)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == ref


def test_every_trimmed_step_key_is_captured_before_serving(tiny_qwen, drafter, monkeypatch,
                                                          tmp_path):  # fmt: skip
    from dspark.spec.cost_model import CostModel

    k = SPECS["lagged"]["num_speculative_tokens"]
    # every trimmed step a bucket can meet: more rows than the next smaller bucket, each with
    # one token and up to K drafts, a budget of 0 .. (drafts - 1)
    sg = StepGraphs(LLM(tiny_qwen, device="cpu", block_size=4, max_num_seqs=8,
                        speculative_config={"model": drafter, **SPECS["lagged"]}).engine.runner,
                    use_graphs=False)  # fmt: skip
    sg.token_buckets = default_buckets(64)
    for i, rb in enumerate(sg.buckets):
        for rows in range((sg.buckets[i - 1] if i else 0) + 1, rb + 1):
            for drafts in range(1, rows * k + 1):
                for budget in range(drafts):
                    assert sg._trim_bucket(rb, rows + budget) in sg.trim_buckets(rb)
    # a dummy trimmed step fills its bucket exactly, with the GPU's buckets too (where 192
    # rows' bucket has a 160-token trim: rows 129..160 without drafts)
    sg.buckets = request_buckets(256)
    sg.token_buckets = default_buckets(decode_graph_max_tokens(8192, 256, k))
    for rb in sg.buckets:
        for tb in sg.trim_buckets(rb):
            rows, budget = sg.trim_dummy(rb, tb)
            assert 1 <= rows <= min(rb, tb) and rows + budget == tb and budget <= rows * 7
    assert 160 in sg.trim_buckets(192)
    # and the keys a lagged run through the padded path takes were all captured up front
    captured = []
    real_replay = StepGraphs._replay

    def spy(self, key, fn):
        captured.append(key)
        return real_replay(self, key, fn)

    monkeypatch.setattr(StepGraphs, "_replay", spy)
    # verification priced high and drafts accepted often: some steps trim (as in
    # test_lagged_with_a_loaded_table_through_the_padded_path)
    path = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, ms_per_token=0.08,
                       draft_base_ms=0.1, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    spec = {"model": drafter, **SPECS["lagged"], "cost_table_path": path,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]}  # fmt: skip
    _, used, _ = _generate(tiny_qwen, spec, 1.0, step_graphs=True, capture_all=True)
    at_start = set(captured[: next(i for i, key in enumerate(captured)
                                   if key == ("draft", 1, "greedy")) + 1])  # fmt: skip
    trims = {key for key in used if key[0] == "trim"}
    assert trims and trims <= at_start, (trims - at_start)


def test_fill_host_pads_rows_and_tokens(tiny_qwen, drafter):
    llm = LLM(tiny_qwen, device="cpu", block_size=4, max_num_seqs=8, num_kv_blocks=200,
              speculative_config={"model": drafter, "num_speculative_tokens": 2})  # fmt: skip
    runner = llm.engine.runner
    sg = StepGraphs(runner, use_graphs=False)

    class Row:  # the fields pack_step reads
        def __init__(self, req, n, caps):
            self.req, self.num_new_tokens, self.num_draft_slots, self.samples = req, n, caps, True

    class Req:
        def __init__(self, slot, ctx):
            self.num_computed_tokens, self.token_ids, self.slot = ctx, list(range(ctx + 1)), slot
            self.seed, self.round, self.num_pending = 5 + slot, 2, 0
            self.params = SamplingParams(temperature=0.5)

    rows = [Row(Req(0, 6), 3, 2), Row(Req(3, 9), 1, 0), Row(Req(5, 2), 3, 2)]
    tables = np.array([[1, 2, 7], [3, 4, 5], [6, 8, 0]], dtype=np.int64)
    host = pack_step(rows, tables, 4)
    lay = Layout(4, 12, sg.blocks)
    buf = np.full(lay.size + 5, 777, dtype=np.int64)
    fill_host(host, lay, buf, scratch_slot=8, k=2)
    assert (buf[lay.size :] == 777).all()  # nothing written past the layout
    assert buf[lay.budget] == -1  # no draft budget: every slot verified
    rows8 = buf[:32].reshape(8, 4)
    assert rows8[4].tolist() == [0, 3, 5, 8]  # request slots, padding -> scratch row
    assert rows8[1].tolist() == [2, 0, 2, 0]  # draft capacities
    temps = buf[lay.floats : lay.qsl].astype(np.int32).view(np.float32).reshape(3, 4)
    assert temps[0].tolist() == [0.5, 0.5, 0.5, 1.0]
    assert buf[lay.qsl : lay.seq_lens].tolist() == [0, 3, 4, 7, 7]  # zero-length padding row
    assert buf[lay.seq_lens : lay.block_tables].tolist() == [9, 10, 5, 0]
    tbl = buf[lay.block_tables : lay.stream].reshape(4, sg.blocks)
    assert tbl[:3, :3].tolist() == tables.tolist() and not tbl[3].any() and not tbl[:, 3:].any()
    ids, pos, slots, src = buf[lay.stream : lay.budget].reshape(4, 12)
    assert pos[:7].tolist() == [6, 7, 8, 9, 2, 3, 4] and not pos[7:].any()
    assert (slots[7:] == SENTINEL_SLOT).all() and (slots[:7] != SENTINEL_SLOT).all()
    # draft slots read row * K + k of the draft buffer; other tokens are real ids
    assert src.tolist() == [-1, 0, 1, -1, -1, 10, 11] + [-1] * 5
    assert ids[0] == 6 and ids[3] == 9 and ids[4] == 2


@pytest.mark.parametrize("table", ["costly_drafter", "costly_tokens"])
def test_lagged_with_a_loaded_table_through_the_padded_path(tiny_qwen, drafter, tmp_path,
                                                             monkeypatch, table):  # fmt: skip
    """A loaded cost table is never corrected online, so the lagged plans are the same in two
    runs and sampled output can be compared exactly. costly_drafter: drafting is skipped, with
    a probe (drafts for a few rows: the eager path) every 4 steps; costly_tokens: verification
    is trimmed (eager path) in some steps and verifies everything (graph path) in others
    (synthetic acceptance, so that drafting pays)."""
    import dspark.spec.drafting as drafting_mod
    from dspark.spec.cost_model import CostModel

    monkeypatch.setattr(drafting_mod, "_PROBE_EVERY", 4)
    monkeypatch.setattr(drafting_mod, "_PROBE_BACKOFF_MAX", 1)  # (a probe every 4 steps)
    kw = dict(weight_read_ms=1.0, ms_per_token=0.001, draft_base_ms=20.0, draft_ms_per_req=0.0)
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
            "draft_sample_method": "probabilistic"}  # fmt: skip
    if table == "costly_tokens":  # drafts accepted often enough that drafting pays
        kw = dict(weight_read_ms=1.0, ms_per_token=0.08, draft_base_ms=0.1, draft_ms_per_req=0.0)
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[0.9, 0.6, 0.3, 0.1])  # fmt: skip
    path = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, **kw).to_json(path)
    spec["cost_table_path"] = path
    ref, _, eager = _generate(tiny_qwen, spec, 1.0, step_graphs=False)
    got, used, llm = _generate(tiny_qwen, spec, 1.0, step_graphs=True)
    assert got == ref
    assert llm.engine.spec_stats.num_verified_tokens == eager.engine.spec_stats.num_verified_tokens
    if table == "costly_drafter":  # skipped rounds are plain steps: graphs
        assert sum(used.values()) >= 5, used
        # a probe's drafts are verified by a step compacted to the bucket its stream fills,
        # not by the verify-all layout of every row's 1 + K tokens (2,048 tokens at 256 rows)
        assert any(key[0] == "trim" and key[3] < key[1] * 5 for key in used), used
    else:
        st = llm.engine.spec_stats
        assert 0 < st.num_verified_tokens < st.num_drafted_tokens
        # trimmed steps allocate and compact inside the step, to token buckets below the
        # full stream; verify-all steps too
        trims = [key for key in used if key[0] == "trim"]
        assert any(key[3] < key[1] * 5 for key in trims), used
        assert any(key[0] == "spec" for key in used), used
        # the allocation inside the step is still counted as scheduler overhead
        sg = llm.engine.runner.step_graphs
        assert set(sg.alloc_ms) == {key[1] for key in trims} and min(sg.alloc_ms.values()) > 0
        assert llm.engine.runner.spec.scheduler_overhead_ms()[1] >= sum(
            sg.alloc_ms[key[1]] * n for key, n in used.items() if key[0] == "trim")  # fmt: skip


def test_trimmed_steps_with_prefill_chunks_through_the_padded_path(tiny_qwen, drafter, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    """Prompts admitted beside rows verifying drafts (3 rows for 5 prompts), under a loaded
    table that prices tokens high: the lagged plan trims some of those steps, which allocate
    and compact inside their graph; sampled tokens equal the per-phase path's."""
    spec = _costly_tokens_spec(drafter, tmp_path)
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=11 + i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip

    def run(step_graphs: bool):
        llm = LLM(tiny_qwen, speculative_config=spec, device="cpu", block_size=4,
                  max_num_seqs=3, num_kv_blocks=200)  # fmt: skip
        runner = llm.engine.runner
        if step_graphs:
            runner.step_graphs = StepGraphs(runner, use_graphs=False)
            runner.step_graphs.token_buckets = default_buckets(64)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    starts = []
    real_start = StepGraphs.start

    def spy(self, host, key, budget=None):
        starts.append((key, budget, host.num_draft_slots()))
        return real_start(self, host, key, budget)

    ref, eager = run(False)
    monkeypatch.setattr(StepGraphs, "start", spy)
    got, llm = run(True)
    assert got == ref
    assert llm.engine.spec_stats.num_verified_tokens == eager.engine.spec_stats.num_verified_tokens
    trimmed = [key for key, budget, slots in starts
               if key[0] == "mixed" and budget is not None and budget < slots]  # fmt: skip
    assert trimmed, starts
    assert all(key[3] in llm.engine.runner.step_graphs.mixed_buckets for key in trimmed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_synthetic_plain_steps_through_the_padded_path(tiny_qwen, drafter, tmp_path,
                                                       temperature):  # fmt: skip
    """Synthetic acceptance with drafting skipped: a greedy plain step samples plainly (one
    token per row), a sampled one goes through the synthetic verifier (K+1 wide); both give
    the per-phase path's tokens through the padded path's packed outputs."""
    from dspark.spec.cost_model import CostModel

    path = str(tmp_path / "cost.json")  # the drafter costs 20 ms a step: drafting is skipped
    CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.001, fixed_overhead_ms=0.0,
                       draft_base_ms=20.0, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
            "cost_table_path": path, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]}  # fmt: skip
    ref, _, _ = _generate(tiny_qwen, spec, temperature, step_graphs=False)
    got, used, llm = _generate(tiny_qwen, spec, temperature, step_graphs=True)
    assert got == ref and [len(t) for t in got] == MAX_TOKENS
    plain = [key for key in used if key[0] == "plain"]
    assert plain and all(key[2] == ("greedy" if temperature == 0 else "sample") for key in plain)
    sg = llm.engine.runner.step_graphs
    assert {sg.width(key) for key in plain} == ({1} if temperature == 0 else {5})


def test_draft_step_for_the_cost_profile_writes_only_the_scratch_row(tiny_qwen, drafter):
    llm = LLM(tiny_qwen, device="cpu", block_size=4, max_num_seqs=8, num_kv_blocks=200,
              speculative_config={"model": drafter, "num_speculative_tokens": 3})  # fmt: skip
    runner = llm.engine.runner
    spec = runner.spec
    sg = StepGraphs(runner, use_graphs=False)
    spec.draft_tokens.fill_(-5)
    step = sg.draft_step(3)  # bucket 4: four dummy rows, all in the scratch row
    step()
    assert (spec.draft_tokens[: spec.scratch_slot] == -5).all()
    assert (spec.draft_tokens[spec.scratch_slot] >= 0).all()


@pytest.mark.parametrize("policy", [None, "fixed", "lagged"])
def test_padded_steps_under_preemption_prefix_hits_and_chunked_prefill(tiny_qwen, drafter,
                                                                      policy):  # fmt: skip
    """The scenarios of test_spec_identity (a tiny KV cache forcing preemption, a shared
    prefix, chunked prefill under a small token budget) with the padded whole-step path on:
    greedy output equals plain decoding's."""
    shared = list(range(40, 72))
    prompts = [shared + [1, 2], [5, 6, 7], list(range(100, 141)), shared + [9], [3] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    args = dict(device="cpu", block_size=4, max_num_batched_tokens=24, num_kv_blocks=30,
                max_num_seqs=8)  # fmt: skip

    def run(spec, step_graphs):
        llm = LLM(tiny_qwen, speculative_config=spec, **args)
        runner = llm.engine.runner
        if step_graphs:
            runner.step_graphs = StepGraphs(runner, use_graphs=False)
            runner.step_graphs.token_buckets = default_buckets(64)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.engine.block_manager.check_integrity()
        return [o.outputs[0].token_ids for o in outs], llm

    ref, _ = run(None, False)
    spec = None
    if policy is not None:
        spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": policy}
    got, llm = run(spec, True)
    assert got == ref
    assert llm.engine.stats["preemptions"] > 0
    used = llm.engine.runner.step_graphs.steps
    assert sum(used.values()) > 5
    # prompt chunks beside decoding rows (verifying drafts with fixed K; the lagged policy
    # drafts or not from measured step times): graphs too
    mixed = {None: {"mixed_plain"}, "fixed": {"mixed"}}.get(policy, {"mixed", "mixed_plain"})
    assert sum(n for key, n in used.items() if key[0] in mixed) >= 3, used


def test_padding_rows_draft_from_an_empty_context(tiny_qwen, drafter):
    """Rows past the real ones (zero tokens) hand the drafter anchor position 0, never -1
    (a context length of -1 is outside what the drafter's attention kernel is written for)."""
    llm = LLM(tiny_qwen, device="cpu", block_size=4, max_num_seqs=8, num_kv_blocks=200,
              speculative_config={"model": drafter, "num_speculative_tokens": 3})  # fmt: skip
    runner = llm.engine.runner
    sg = runner.step_graphs = StepGraphs(runner, use_graphs=False)
    seen = []
    draft = sg._draft

    def spy(rb, method):
        seen.append(sg.anchor_pos[:rb].clone())
        return draft(rb, method)

    sg._draft = spy
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 7, 4)], params,
                 use_tqdm=False)  # fmt: skip
    padded = [a for a in seen if len(a) == 4]  # 3 rows padded to 4 (then fewer rows)
    assert padded and all(int(a[3]) == 0 for a in padded)
    assert all(int(a.min()) >= 0 for a in seen)


def test_padded_step_runs_without_autograd(tiny_qwen, drafter):
    """The fused kernels (norms, RoPE, SiLU, KV write) decline tensors that autograd tracks, so
    a step recorded with grad enabled silently runs the slow torch reference ops (found on the
    H200: an 8B decode step 6.8 -> 8.7 ms). The weights never require grad and the padded step
    runs with grad disabled."""
    llm = LLM(tiny_qwen, speculative_config={"model": drafter, **SPECS["fixed"]}, device="cpu",
              block_size=4, max_num_seqs=8, num_kv_blocks=200)  # fmt: skip
    runner = llm.engine.runner
    assert not any(p.requires_grad for p in runner.model.parameters())
    assert not any(p.requires_grad for p in runner.spec.drafter.parameters())
    runner.step_graphs = sg = StepGraphs(runner, use_graphs=False)
    grad_modes = []
    step = sg._step
    sg._step = lambda key: grad_modes.append(torch.is_grad_enabled()) or step(key)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert grad_modes and not any(grad_modes)


@pytest.mark.parametrize("step_graphs", [False, True])
def test_step_reports_the_tokens_its_forward_ran_on(tiny_qwen, drafter, tmp_path, step_graphs):
    """The online cost model prices a step by its forward's token count: a trimmed step must
    report the tokens left after trimming (non-draft tokens + verified drafts), not the packed
    stream. The padded path reported the packed count: on the H200 every trimmed step looked
    like a verify-all one and the learned fixed term went far negative."""
    spec = _costly_tokens_spec(drafter, tmp_path)
    llm = _llm(tiny_qwen, spec, step_graphs)
    runner = llm.engine.runner
    seen, launch = [], runner.launch

    def spy(sched, tables, follows=False):
        wait = launch(sched, tables, follows)

        def spy_wait():
            result = wait()
            base = sum(r.num_non_draft_tokens for r in sched.rows)
            seen.append((result.num_tokens, base + sum(result.verified), sched.num_tokens))
            return result

        return spy_wait

    runner.launch = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(got == want for got, want, _ in seen), seen
    assert any(want < packed for _, want, packed in seen)  # some steps were trimmed
    if step_graphs:
        assert any(key[0] == "trim" for key in runner.step_graphs.steps)



@pytest.mark.parametrize("speculative", [False, True])
def test_steps_with_prefill_chunks_are_captured_before_serving(tiny_qwen, drafter, speculative):
    """Start-up captures cover steps with prefill chunks whose rows verify drafts and those
    whose rows do not (a first-use capture stalls a step in the middle of traffic), from the
    bucket's fewest rows up to its verify stream plus MIXED_STARTUP_EXTRA_TOKENS."""
    from dspark.engine.step_graph_capture import MIXED_STARTUP_EXTRA_TOKENS

    spec = {"model": drafter, "num_speculative_tokens": 4} if speculative else None
    llm = LLM(tiny_qwen, speculative_config=spec, device="cpu", block_size=4, max_num_seqs=8,
              max_num_batched_tokens=2048, num_kv_blocks=200)  # fmt: skip
    sg = StepGraphs(llm.engine.runner, use_graphs=False)
    assert sg.mixed_buckets[-1] == 2048
    keys = sg.mixed_startup_keys(8)
    families = {"mixed", "mixed_plain"} if speculative else {"mixed_plain"}
    assert {key[0] for key in keys} == families and {key[2] for key in keys} == {"greedy",
                                                                                 "sample"}
    most = 8 * (1 + sg.k) + MIXED_STARTUP_EXTRA_TOKENS
    assert max(key[3] for key in keys) == max(b for b in sg.mixed_buckets if b <= most)
    assert min(key[3] for key in keys) == 16  # (rows 5..8, one of them a prefill chunk)


def test_steps_with_prefill_chunks_beyond_the_startup_keys_take_the_per_phase_path(
        tiny_qwen, drafter, monkeypatch):  # fmt: skip
    """No first-use capture for them: with no extra tokens captured, the prompts' step (38
    tokens, bucket 64, beyond 8 rows x 5 = 40 tokens' buckets 16 and 32) runs per-phase,
    and the tokens equal the per-phase path's."""
    import dspark.engine.step_graph_capture as capture_mod

    monkeypatch.setattr(capture_mod, "MIXED_STARTUP_EXTRA_TOKENS", 0)
    spec = {"model": drafter, **SPECS["fixed"]}
    ref, _, _ = _generate(tiny_qwen, spec, 0.0, step_graphs=False)
    got, used, llm = _generate(tiny_qwen, spec, 0.0, step_graphs=True)
    assert got == ref
    sg = llm.engine.runner.step_graphs
    assert ("mixed_plain", 8, "greedy", 64) not in sg.mixed_keys
    assert ("mixed_plain", 8, "greedy", 32) in sg.mixed_keys
    assert not any(key[0].startswith("mixed") and key[3] > 40 for key in used), used
    assert used  # (the decode steps still take the graphs)


def test_plain_steps_that_do_not_draft_leave_the_anchors_alone(tiny_qwen, drafter):
    """A plain step while drafting is off runs its own graph (key ending "idle") without the
    next anchors: only a step that drafts replays the drafter, and it writes its own first.
    Drafting held off for the first decode steps, then on: the idle steps leave the anchor
    buffers as they were, the first plain step that drafts writes them, and the tokens are
    those of the eager path."""
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged"}
    ref, _, _ = _generate(tiny_qwen, spec | {"draft_skipping": False}, 0.0, step_graphs=False)
    llm = _llm(tiny_qwen, spec, step_graphs=True)
    runner = llm.engine.runner
    sg, sd = runner.step_graphs, runner.spec
    plans = {"n": 0}

    def held(decide, cost, fixed, online, n, n_sampling, other):
        plans["n"] += 1
        return plans["n"] > 6, False  # off for the first 6 plans, then on for good

    sd.drafting.after_plan = held
    sd.drafting.routine = lambda *args: False  # (every plan asks after_plan)
    step, seen = sg._step, []

    def spy(key):
        before = (sg.anchors.clone(), sg.anchor_pos.clone())
        out = step(key)
        seen.append((key, not (torch.equal(sg.anchors, before[0])
                               and torch.equal(sg.anchor_pos, before[1]))))  # fmt: skip
        return out

    sg._step = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, seed=11 + i)
              for i, m in enumerate(MAX_TOKENS)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    idle = [moved for key, moved in seen if key[-1] == "idle"]
    assert len(idle) >= 3 and not any(idle)  # decode steps while off: anchors untouched
    drafting = [i for i, (key, _) in enumerate(seen) if key[0] == "plain" and key[-1] != "idle"]
    assert drafting and seen[drafting[0]][1]  # the first plain step that drafts writes them
    assert any(key[0] == "spec" for key, _ in seen)  # ... and the next steps verify its drafts


@pytest.mark.parametrize("name,idle", [("lagged", True), ("lagged_always_drafting", False),
                                       ("fixed", False), ("nospec", False)])  # fmt: skip
def test_idle_plain_graphs_are_captured_where_drafting_can_be_off(tiny_qwen, drafter, name,
                                                                  idle):  # fmt: skip
    specs = dict(SPECS, lagged_always_drafting=dict(SPECS["lagged"], draft_skipping=False))
    spec = None if specs[name] is None else {"model": drafter, **specs[name]}
    sg = _llm(tiny_qwen, spec, step_graphs=True).engine.runner.step_graphs
    keys, replay = [], sg._replay
    sg._replay = lambda key, fn: keys.append(key) or replay(key, fn)
    sg.capture_all(trims=False)
    captured = {k for k in keys if k[0] == "plain" and k[-1] == "idle"}
    assert captured == ({("plain", rb, m, "idle") for rb in sg.buckets
                         for m in ("greedy", "sample")} if idle else set())  # fmt: skip


def test_decode_graphs_cover_the_full_verify_stream():
    """The per-phase decode/verify graphs reach every row's 1 + K tokens at max_num_seqs rows
    (up to 2048 tokens), so the profiler prices a full K = 7 verify at 256 rows as the graph
    replay serving runs, not as an eager forward (4x dearer on the H100: the planner then
    trimmed c = 256 steps to 1024 tokens); budgets and the bucket list's top still cap it."""
    assert decode_graph_max_tokens(8192, 256, 7) == 2048
    assert default_buckets(decode_graph_max_tokens(8192, 256, 7))[-1] == 2048
    assert decode_graph_max_tokens(8192, 192, 7) == 1536
    assert default_buckets(1536)[-1] == 1536
    assert decode_graph_max_tokens(8192, 64, 7) == 512
    assert decode_graph_max_tokens(1024, 256, 7) == 1024  # the step's token budget
    assert decode_graph_max_tokens(8192, 512, 7) == 2048  # the bucket list's top
    assert decode_graph_max_tokens(8192, 256, 0) == 256  # no speculation: one token a row
