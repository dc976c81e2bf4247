"""Which steps the prefill CUDA graphs take (the replay itself is tested on CUDA in
tests/e2e/test_cuda_graphs.py): any step with a prefill chunk up to PREFILL_GRAPH_MAX_TOKENS
tokens, in the smallest bucket that holds it, never one the decode graphs take."""

import pytest

from dspark import LLM
from dspark.engine.cuda_graph import PREFILL_GRAPH_MAX_TOKENS, CudaGraphRunner, prefill_buckets


def test_prefill_buckets_cover_the_batch_limit_with_bounded_padding():
    b = prefill_buckets(8192)
    assert b[0] == 16 and b[-1] == PREFILL_GRAPH_MAX_TOKENS
    assert all(x < y for x, y in zip(b, b[1:]))
    assert prefill_buckets(1000)[-1] == 768 and prefill_buckets(8) == []
    for n in range(1025, PREFILL_GRAPH_MAX_TOKENS + 1):
        t = next(x for x in b if x >= n)
        assert t - n <= n // 4  # padding past 1,024 tokens: at most a quarter of the step


def test_steps_with_prefill_chunks_go_to_the_prefill_graphs(tiny_qwen):
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=8, max_num_batched_tokens=2048)
    runner = llm.engine.runner
    decode = CudaGraphRunner(runner, max_query_len=5, max_tokens=1024)
    prefill = CudaGraphRunner(runner, max_query_len=2048, buckets=prefill_buckets(2048),
                              min_query_len=6)
    # a prefill chunk of 300 tokens and 4 decode rows: not a decode graph's step
    assert decode.bucket_for(304, 5, 300) is None
    assert prefill.bucket_for(304, 5, 300) == 512
    assert prefill.bucket_for(16, 3, 14) == 16 and prefill.bucket_for(17, 3, 14) == 32
    assert prefill.bucket_for(2048, 8, 2000) == 2048
    assert prefill.bucket_for(2049, 8, 2000) is None  # past the largest bucket: eager
    assert prefill.bucket_for(16, 9, 8) is None  # more rows than the bucket's 8 (max_num_seqs)
    # decode/verify steps stay on the decode graphs, and past their buckets run eagerly with
    # the decode block shape, not a prefill graph's
    assert decode.bucket_for(20, 4, 5) == 24 and prefill.bucket_for(20, 4, 5) is None
    assert decode.bucket_for(1030, 8, 5) is None and prefill.bucket_for(1030, 8, 5) is None


def test_nested_capture_guards_collect_garbage_once(monkeypatch):
    """Captures batched under one guard (the whole-step graphs at start) collect garbage once,
    keep the collector off until the outermost guard exits, and restore it after a failure."""
    import gc

    from dspark.engine import cuda_graph

    collections = []
    monkeypatch.setattr(cuda_graph.gc, "collect", lambda: collections.append(1))
    monkeypatch.setattr(cuda_graph.torch.cuda, "synchronize", lambda: None)  # CPU machine
    assert gc.isenabled()
    with cuda_graph.capture_guard():
        for _ in range(3):
            with cuda_graph.capture_guard():
                assert not gc.isenabled()
        assert not gc.isenabled() and len(collections) == 1
    assert gc.isenabled() and len(collections) == 1
    try:
        with cuda_graph.capture_guard():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled() and len(collections) == 2
    with cuda_graph.capture_guard():  # the failed guard left no depth behind: this one collects
        pass
    assert len(collections) == 3


@pytest.mark.parametrize(("prefill", "mixed", "pools"), [("1", "1", 2), ("0", "1", 1),
                                                          ("1", "0", 1), ("0", "0", 0)])
def test_kv_budget_reserves_a_pool_per_set_of_prefill_chunk_graphs(monkeypatch, prefill, mixed,
                                                                   pools):  # fmt: skip
    """The KV cache is sized after reserving activation pools for the graphs over prefill
    chunks' token counts: the per-phase prefill graphs and the whole-step graphs of steps with
    prefill chunks, each switched off by its own variable; none without CUDA graphs."""
    from types import MethodType, SimpleNamespace

    import torch

    from dspark.engine.model_runner import ModelRunner

    monkeypatch.setenv("DSPARK_PREFILL_GRAPHS", prefill)
    monkeypatch.setenv("DSPARK_MIXED_GRAPHS", mixed)
    fake = SimpleNamespace(device=torch.device("cuda"), backend=SimpleNamespace(name="triton"),
                           config=SimpleNamespace(enforce_eager=False), tp=SimpleNamespace(size=1))
    for name in ("_captures_graphs_of_prefill_chunks", "_wants_prefill_graphs"):
        setattr(fake, name, MethodType(getattr(ModelRunner, name), fake))
    assert ModelRunner._graphs_of_prefill_chunks(fake) == pools
    assert ModelRunner._wants_prefill_graphs(fake) == (prefill == "1")
    fake.config.enforce_eager = True
    assert ModelRunner._graphs_of_prefill_chunks(fake) == 0
    assert not ModelRunner._wants_prefill_graphs(fake)
