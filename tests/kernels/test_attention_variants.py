"""The attention kernels' compile-time launch variants form a small, known set, and the
start-up warm-up compiles all of them: a variant first met in the middle of serving is a
Triton compile (~1 s) inside a step. (Suspected cause of the 0.7-1 s stalls of the H200
serving sweeps.)"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark.attention.triton import paged_attention as pa  # noqa: E402
from dspark.attention.triton_backend import TritonAttentionBackend  # noqa: E402


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_reachable_launch_is_warmed(monkeypatch, group, head_dim):
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)  # an H200
    gp = 1 << (group - 1).bit_length()
    variants = pa.launch_variants(gp, head_dim, max_splits=16)
    seen = set()
    dev = torch.device("cuda")  # only read by num_sms, patched above
    for qlen in [*range(1, 80), 128, 500, 1024, 4096]:
        bq, bn, warps = pa._launch_config(gp, qlen, head_dim, True)
        for programs in [1, 2, 3, 5, 8, 13, 40, 100, 131, 132, 1000]:
            for kv_len in [1, 100, 128, 300, 700, 1500, 2048, 5000, 40000]:
                splits = pa.pick_num_splits(dev, programs, kv_len, 16, 128)
                assert splits & (splits - 1) == 0  # a power of two
                key = (bq, bn, warps, splits, pa.num_stages(True, bq * gp, splits))
                assert key in variants, key
                seen.add(key)
    assert seen == set(variants)  # and nothing is compiled that serving never uses


def test_warmup_runs_every_variant():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 16, 2, 16, generator=gen)  # [blocks, page, Hkv, D]
    v_cache = torch.randn(6, 16, 2, 16, generator=gen)
    backend = TritonAttentionBackend(max_splits=4, min_split_len=16)
    calls = []
    real = pa.paged_attention

    def spy(q, k, v, md, scale, num_splits=None, **kw):
        out = real(q, k, v, md, scale, num_splits=num_splits, **kw)
        assert torch.isfinite(out).all()
        calls.append((md.max_query_len, num_splits))
        return out

    pa.paged_attention = spy
    try:
        n = backend.warmup(k_cache, v_cache, num_heads=4)
    finally:
        pa.paged_attention = real
    assert n == len(pa.launch_variants(2, 16, 4)) == len(calls)
    assert {s for _, s in calls} == {1, 2, 4}
