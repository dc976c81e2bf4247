"""CUDA-graph replay equals eager, token for token, across changing ragged boundaries."""

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.attention.base import AttentionMetadata, compute_token_to_req
from dspark.testing.drafters import make_tiny_drafter


def CudaLLM(path, **kwargs):  # noqa: N802 - a small KV cache: several engines share the GPU
    kwargs.setdefault("max_num_seqs", 16)
    return LLM(path, device="cuda", num_kv_blocks=4096, **kwargs)


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _ragged(runner, q_lens, context):
    bs, dev = runner.block_size, runner.device
    n = sum(q_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    nblk = -(-(context + max(q_lens)) // bs)
    bt = 1 + torch.arange(len(q_lens) * nblk, device=dev, dtype=torch.int32).view(-1, nblk)
    lens = torch.tensor(q_lens, device=dev)
    row = torch.repeat_interleave(torch.arange(len(q_lens), device=dev), lens)
    pos = context + torch.arange(n, device=dev) - qsl.long()[row]
    slots = bt.long()[row, pos // bs] * bs + pos % bs
    md = AttentionMetadata(
        query_start_loc=qsl, seq_lens=(context + torch.tensor(q_lens, device=dev)).int(),
        block_tables=bt, slot_mapping=slots, positions=pos,
        token_to_req=compute_token_to_req(qsl, n), max_query_len=max(q_lens),
        max_seq_len=context + max(q_lens), num_reqs=len(q_lens),
    )  # fmt: skip
    return torch.randint(0, 300, (n,), device=dev), md


def test_graph_replay_equals_eager_with_changing_boundaries(ckpt_dir, tmp_path):
    path = ckpt_dir("qwen3_gqa2")
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path), "num_speculative_tokens": 4}
    llm = CudaLLM(path, dtype="float32", max_num_seqs=16, speculative_config=spec)
    runner = llm.engine.runner
    assert runner.graphs is not None
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        q_lens = torch.randint(1, 6, (int(torch.randint(1, 12, (1,), generator=gen)),),
                               generator=gen).tolist()  # fmt: skip
        ids, md = _ragged(runner, q_lens, context=int(torch.randint(3, 40, (1,), generator=gen)))
        n = ids.shape[0]
        t = runner.graphs.bucket_for(n, md.num_reqs, md.max_query_len)
        assert t is not None
        graph_hidden = runner.graphs.run_raw(ids, md, n, t)[0].clone()
        eager_hidden = runner.eager_forward(ids, md)[0]
        torch.testing.assert_close(graph_hidden, eager_hidden, rtol=1e-5, atol=1e-5)


def test_prefill_graph_replay_equals_eager(ckpt_dir, tmp_path):
    """Steps mixing prefill chunks (tens to hundreds of tokens, over a cached prefix) with
    decode/verify rows replay the prefill graphs: hidden and drafter features equal eager's."""
    path = ckpt_dir("qwen3_gqa2")
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path), "num_speculative_tokens": 4}
    llm = CudaLLM(path, dtype="float32", max_num_seqs=16, max_num_batched_tokens=1024,
                  speculative_config=spec)  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.buckets[-1] == 1024
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        rows = int(torch.randint(1, 12, (1,), generator=gen))
        q_lens = torch.randint(1, 6, (rows,), generator=gen)
        chunks = int(torch.randint(1, 3, (1,), generator=gen))
        q_lens[:chunks] = torch.randint(6, 400, (chunks,), generator=gen)  # prefill chunks
        q_lens = q_lens[torch.randperm(rows, generator=gen)].tolist()
        ids, md = _ragged(runner, q_lens, context=int(torch.randint(0, 90, (1,), generator=gen)))
        n = ids.shape[0]
        assert runner.graphs.bucket_for(n, md.num_reqs, md.max_query_len) is None
        t = graphs.bucket_for(n, md.num_reqs, md.max_query_len)
        assert t is not None and t >= n
        before = graphs.replays
        graph_out = [x.clone() for x in runner.forward(ids, md, n)]
        assert graphs.replays == before + 1
        eager_out = runner.eager_forward(ids, md)
        for got, want in zip(graph_out, eager_out, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_verify_graphs_with_adaptive_lengths_match_enforce_eager(ckpt_dir, tmp_path):
    path = ckpt_dir("qwen3_gqa2")
    drafter = make_tiny_drafter(str(tmp_path / "d"), path, seed=2)
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "threshold",
            "confidence_threshold": 0.5}  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17, 33, 5, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graph = CudaLLM(path, dtype="float32", speculative_config=spec)
    eager = CudaLLM(path, dtype="float32", speculative_config=spec, enforce_eager=True)
    assert graph.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    a = graph.generate(prompts, params)
    b = eager.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    st = graph.engine.spec_stats
    assert st.num_verified_tokens < st.num_drafted_tokens  # lengths really varied per row


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("policy", [None, "fixed", "lagged", "synthetic"])
def test_whole_step_graphs_match_enforce_eager(ckpt_dir, tmp_path, policy, temperature):
    path = ckpt_dir("qwen3_gqa2")
    spec = None
    if policy is not None:
        spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path, seed=4),
                "num_speculative_tokens": 4, "draft_sample_method": "probabilistic",
                "adaptive_policy": "fixed" if policy == "synthetic" else policy}  # fmt: skip
        if policy == "synthetic":
            spec.update(rejection_sample_method="synthetic",
                        synthetic_acceptance_rates=[0.9, 0.8, 0.7, 0.6])  # fmt: skip
        if policy == "fixed":  # STS calibration: its temperatures are read inside the graph
            from dspark.spec.confidence import save_sts  # (a fit per sampling mode: per row)

            save_sts(tmp_path / "sts.json", [1.5, 0.8, 1.2, 2.0],
                     by_mode={"greedy": [0.7, 1.1, 2.0, 0.9], "sampled": [1.3, 0.6, 1.0, 3.0]})
            spec["confidence_calibration_path"] = str(tmp_path / "sts.json")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17, 33, 5, 12, 7)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate((24, 9, 17, 30, 3, 12, 20))]  # fmt: skip
    graph = CudaLLM(path, dtype="float32", speculative_config=spec)
    a = [o.outputs[0].token_ids for o in graph.generate(prompts, params)]
    sg = graph.engine.runner.step_graphs
    assert sg is not None and len(sg.graphs) > 0 and sum(sg.steps.values()) >= 5, sg.steps
    # the prompts' steps (no drafts yet): whole-step graphs too, compacted to a token bucket
    assert sum(n for key, n in sg.steps.items() if key[0] == "mixed_plain") > 0, sg.steps
    graph.shutdown()
    eager = CudaLLM(path, dtype="float32", speculative_config=spec, enforce_eager=True)
    assert eager.engine.runner.step_graphs is None and eager.engine.runner.prefill_graphs is None
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    if policy == "lagged" and temperature > 0:
        # plans follow measured step times, so the verified drafts (and samples) differ
        assert [len(t) for t in a] == [len(t) for t in b]
    else:
        assert a == b


def _synthetic_lagged(tmp_path, target: str, seed: int, **table) -> dict:
    """A lagged speculative config with SYNTHETIC acceptance and a loaded cost table (never
    corrected online, so two engines plan alike)."""
    from dspark.spec.cost_model import CostModel

    cost = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, draft_ms_per_req=0.0,
                       **table).to_json(cost)  # fmt: skip
    return {"model": make_tiny_drafter(str(tmp_path / "d"), target, seed=seed),
            "num_speculative_tokens": 4, "adaptive_policy": "lagged", "cost_table_path": cost,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.9, 0.6, 0.3, 0.1]}  # fmt: skip


def test_trimmed_whole_step_graphs_match_enforce_eager(ckpt_dir, tmp_path):
    """Lagged plans that trim (a loaded table with costly tokens, never corrected online, so
    both engines plan alike): allocation and compaction run inside graphs captured on first
    use; tokens equal the eager engine's."""
    path = ckpt_dir("qwen3_gqa2")
    spec = _synthetic_lagged(tmp_path, path, 5, ms_per_token=0.08, draft_base_ms=0.1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 17, 33, 5, 12, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    graph = CudaLLM(path, dtype="float32", speculative_config=spec)
    a = [o.outputs[0].token_ids for o in graph.generate(prompts, params)]
    sg = graph.engine.runner.step_graphs
    trims = [key for key in sg.steps if key[0] == "trim"]
    assert trims and all(key in sg.graphs for key in trims) and not sg.failed, sg.steps
    assert sg.alloc_ms and all(0 < ms < 50 for ms in sg.alloc_ms.values()), sg.alloc_ms
    st = graph.engine.spec_stats
    assert 0 < st.num_verified_tokens < st.num_drafted_tokens
    graph.shutdown()
    eager = CudaLLM(path, dtype="float32", speculative_config=spec, enforce_eager=True)
    b = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert a == b
    assert eager.engine.spec_stats.num_verified_tokens == st.num_verified_tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_async_scheduling_on_graphs_matches_synchronous_eager(ckpt_dir, temperature):
    """Two steps in flight on the GPU (double-buffered pinned inputs and outputs, pending
    tokens fed on the device) give the tokens of one-at-a-time eager steps."""
    path = ckpt_dir("qwen3_gqa2")
    prompts = [{"prompt_token_ids": list(range(5 + i, 5 + i + n))}
               for i, n in enumerate((4, 9, 17, 33, 5, 12, 7, 21, 3, 15, 8, 26))]  # fmt: skip
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate((24, 9, 17, 30, 3, 12, 20, 40, 1, 28, 6, 35))]  # fmt: skip
    fast = CudaLLM(path, dtype="float32")
    assert fast.engine.async_scheduling and fast.engine.runner.step_graphs is not None
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    assert sum(n for key, n in fast.engine.runner.step_graphs.steps.items()
               if key[0] == "plain") >= 20  # fmt: skip
    fast.shutdown()
    slow = CudaLLM(path, dtype="float32", enforce_eager=True, async_scheduling=False)
    b = [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
    assert a == b


@pytest.mark.parametrize("mixed_graphs", [True, False])
@pytest.mark.parametrize("speculative", [False, True])
def test_chunked_prefill_beside_decode_rows_on_graphs(ckpt_dir, tmp_path, monkeypatch,
                                                      speculative, mixed_graphs):  # fmt: skip
    """Long prompts chunked 64 tokens at a time into steps that also carry decode (and verify)
    rows replay whole-step graphs of steps with prefill chunks (DSPARK_MIXED_GRAPHS=0: the
    per-phase path's prefill graphs); tokens equal the eager engine's."""
    monkeypatch.setenv("DSPARK_MIXED_GRAPHS", "1" if mixed_graphs else "0")
    path = ckpt_dir("qwen3_gqa2")
    spec = None
    if speculative:
        spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path, seed=6),
                "num_speculative_tokens": 4}
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 290 + 5 for j in range(n)]}
               for i, n in enumerate((3, 70, 5, 130, 9, 95, 4))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fast = CudaLLM(path, dtype="float32", max_num_batched_tokens=64, speculative_config=spec)
    graphs = fast.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16, 32, 64]
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    steps = fast.engine.runner.step_graphs.steps
    mixed = sum(n for key, n in steps.items() if key[0] in ("mixed", "mixed_plain"))
    if mixed_graphs:  # (rows verifying drafts beside the chunks, under speculation)
        assert mixed >= 5 and (not speculative or any(key[0] == "mixed" for key in steps))
        assert {key[3] for key in steps if key[0].startswith("mixed")} <= {16, 32, 64}
    else:
        assert mixed == 0 and graphs.replays >= 5
    fast.shutdown()
    slow = CudaLLM(path, dtype="float32", max_num_batched_tokens=64, speculative_config=spec,
                   enforce_eager=True)  # fmt: skip
    assert [o.outputs[0].token_ids for o in slow.generate(prompts, params)] == a


@pytest.mark.parametrize("capture_trims", [False, True])
def test_speculative_schedule_ahead_and_startup_trims_on_graphs(ckpt_dir, tmp_path, monkeypatch,
                                                                capture_trims):  # fmt: skip
    """A lagged engine skipping drafts schedules ahead; trimmed-step graphs are captured at
    start-up (DSPARK_CAPTURE_TRIMS=0: on first use): tokens equal one-at-a-time eager steps.
    Two tables: drafting skipped (probes every 4 steps) and drafting with trims."""
    import dspark.spec.drafting as drafting_mod
    from dspark.spec.cost_model import CostModel

    monkeypatch.setattr(drafting_mod, "_PROBE_EVERY", 4)
    monkeypatch.setattr(drafting_mod, "_PROBE_BACKOFF_MAX", 1)  # (a probe every 4 steps)
    # a following step's plan reads one acceptance check fewer than a waited-for one's, so
    # sampled tokens of trimmed plans may differ (following steps: test_cuda_follow.py)
    monkeypatch.setenv("DSPARK_FOLLOW", "0")
    path = ckpt_dir("qwen3_gqa2")
    drafter = make_tiny_drafter(str(tmp_path / "d"), path, seed=6)
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))}
               for i, n in enumerate((4, 9, 17, 33, 5, 12, 7, 21, 3))]  # fmt: skip
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate((24, 9, 17, 30, 3, 12, 20, 40, 1))]  # fmt: skip
    synthetic = dict(rejection_sample_method="synthetic",
                     synthetic_acceptance_rates=[0.9, 0.6, 0.3, 0.1])  # fmt: skip
    for name, kw, extra in [
        ("skip", dict(ms_per_token=0.001, draft_base_ms=20.0), {}),
        ("trim", dict(ms_per_token=0.08, draft_base_ms=0.1), synthetic),
    ]:  # fmt: skip
        table = str(tmp_path / f"{name}.json")
        CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, draft_ms_per_req=0.0,
                           **kw).to_json(table)  # fmt: skip
        spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
                "cost_table_path": table, "draft_sample_method": "probabilistic", **extra}
        monkeypatch.setenv("DSPARK_CAPTURE_TRIMS", "1" if capture_trims else "0")
        fast = CudaLLM(path, dtype="float32", speculative_config=spec)
        assert fast.engine.async_scheduling
        a = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
        sg = fast.engine.runner.step_graphs
        assert not sg.failed, sg.failed
        if capture_trims and name == "trim":
            assert all(key in sg.graphs for key in sg.steps if key[0] == "trim")
        fast.shutdown()
        slow = CudaLLM(path, dtype="float32", speculative_config=spec, enforce_eager=True,
                       async_scheduling=False)
        b = [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
        slow.shutdown()
        assert a == b, name


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_synthetic_plain_steps_on_graphs_match_eager(ckpt_dir, tmp_path, temperature):
    """SYNTHETIC acceptance with drafting skipped (a loaded table: the drafter costs 20 ms):
    greedy plain steps sample plainly (one-token-wide packed outputs), sampled ones go through
    the synthetic verifier; tokens equal the eager engine's."""
    path = ckpt_dir("qwen3_gqa2")
    spec = _synthetic_lagged(tmp_path, path, 6, ms_per_token=0.001, draft_base_ms=20.0)
    prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))}
               for i, n in enumerate((4, 9, 17, 33, 5))]  # fmt: skip
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate((24, 9, 17, 30, 12))]  # fmt: skip
    fast = CudaLLM(path, dtype="float32", speculative_config=spec)
    a = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    sg = fast.engine.runner.step_graphs
    plain = [key for key in sg.steps if key[0] == "plain"]
    assert plain and not sg.failed, sg.steps
    assert {sg.width(key) for key in plain} == ({1} if temperature == 0 else {5})
    fast.shutdown()
    slow = CudaLLM(path, dtype="float32", speculative_config=spec, enforce_eager=True)
    assert a == [o.outputs[0].token_ids for o in slow.generate(prompts, params)]


def test_planner_reads_landed_confidences_on_graphs(ckpt_dir, tmp_path):
    """The lagged planner's stale confidences come from copies that land while the next step
    is planned (on the H200 a single re-recorded event hid every landed copy: the planner saw
    the initial 1.0 for the whole run). With synthetic acceptance the confidences are the
    rates: the reads must show them, never more than two copies behind."""
    from dspark.spec.cost_model import CostModel

    path = ckpt_dir("qwen3_gqa2")
    table = str(tmp_path / "cost.json")
    CostModel.analytic(fixed_overhead_ms=0.0, weight_read_ms=1.0, ms_per_token=0.02,
                       draft_base_ms=0.1, draft_ms_per_req=0.0).to_json(table)  # fmt: skip
    rates = [0.9, 0.6, 0.3, 0.1]
    spec = {"model": make_tiny_drafter(str(tmp_path / "d"), path, seed=5),
            "num_speculative_tokens": 4, "adaptive_policy": "lagged", "cost_table_path": table,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates}
    llm = CudaLLM(path, speculative_config=spec)
    sd = llm.engine.runner.spec
    reads, stale = [], sd._stale

    def spy(slots):
        conf = stale(slots)
        reads.append((sd.host_confs.lag, conf.copy()))
        return conf

    sd._stale = spy
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    steady = reads[len(reads) // 4:]
    assert steady and all(lag <= 2 for lag, _ in steady), [lag for lag, _ in steady]
    landed = [c for _, c in steady if np.allclose(c, rates, atol=1e-6)]
    assert len(landed) >= len(steady) // 2, (len(landed), len(steady))
    llm.shutdown()
