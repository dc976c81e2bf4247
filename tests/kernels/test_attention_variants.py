"""The attention kernels' compile-time launch variants form a small, known set, and the
start-up warm-up compiles all of them: a variant first met in the middle of serving is a
Triton compile (~1 s) inside a step. (Suspected cause of the 0.7-1 s stalls of the H200
serving sweeps.)"""

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark.attention.triton import launch_config  # noqa: E402
from dspark.attention.triton import paged_attention as pa  # noqa: E402
from dspark.attention.triton import paged_attention_warmup as paw  # noqa: E402
from dspark.attention.triton_backend import TritonAttentionBackend  # noqa: E402


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("short_query_len", [0, 1, 8])
def test_every_reachable_launch_is_warmed(monkeypatch, group, head_dim, short_query_len):
    monkeypatch.setattr(launch_config, "num_sms", lambda device: 132)  # an H200
    gp = 1 << (group - 1).bit_length()
    variants = paw.launch_variants(gp, head_dim, max_splits=16, short_query_len=short_query_len)
    seen = set()
    dev = torch.device("cuda")  # only read by num_sms, patched above
    for qlen in [*range(1, 80), 128, 500, 1024, 4096]:
        for launch in launch_config.launch_plan(gp, qlen, head_dim, True, short_query_len):
            for programs in [1, 2, 3, 5, 8, 13, 40, 100, 131, 132, 1000]:
                for kv_len in [1, 100, 128, 300, 700, 1500, 2048, 5000, 40000]:
                    segments = -(-kv_len // launch_config.SPLIT_LEN)
                    splits = launch_config.pick_num_splits(dev, programs, segments, 16)
                    assert splits & (splits - 1) == 0  # a power of two
                    stages = launch_config.num_stages(True, launch.block_q * gp, splits)
                    key = (*launch, splits, stages)
                    assert key in variants, key
                    seen.add(key)
    assert seen == set(variants)  # and nothing is compiled that serving never uses
    # steps with prefill chunks: 1-token decode rows get a decode tile (16 rows, not 128);
    # 8-token verify rows of 8 heads a group fill 64 rows, half the prefill tile: one launch
    two = short_query_len == 1 or (short_query_len == 8 and group < 8)
    assert {key[3] for key in variants} == ({0, 1, 2} if two else {0})


@pytest.mark.parametrize("short_query_len", [0, 2])
def test_warmup_runs_every_variant(short_query_len):
    # the interpreter on CPU; compiled kernels (which need device tensors) on a GPU machine
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 16, 2, 16, generator=gen).to(dev)  # [blocks, page, Hkv, D]
    v_cache = torch.randn(6, 16, 2, 16, generator=gen).to(dev)
    # segments: a multiple of BLOCK_N (16 interpreted, 64 compiled; 16 failed on an H100)
    backend = TritonAttentionBackend(max_splits=4, split_len=16 if dev == "cpu" else 64)
    backend.short_query_len = short_query_len
    calls = []
    real = pa.paged_attention

    def spy(q, k, v, md, scale, num_splits=None, **kw):
        out = real(q, k, v, md, scale, num_splits=num_splits, **kw)
        assert torch.isfinite(out).all()
        calls.append((md.max_query_len, num_splits, kw["short_query_len"]))
        return out

    pa.paged_attention = spy
    try:
        n = backend.warmup(k_cache, v_cache, num_heads=4)
    finally:
        pa.paged_attention = real
    # the engine's short length and, past 1, the prefill launches with 1: a speculative step
    # with prefill chunks whose rows verify nothing attends its decode rows with the 1-token
    # tile (AttentionMetadata.short_query_len)
    runs = [(short_query_len, False)] + ([(1, True)] if short_query_len > 1 else [])
    variants = {short: paw.launch_variants(2, 16, 4, short, only) for short, only in runs}
    assert n == sum(len(v) for v in variants.values())
    assert sorted(calls) == sorted((q, s, short) for short, v in variants.items()
                                   for q, s in set(v.values()))  # fmt: skip
    assert {s for _, s, _ in calls} == {1, 2, 4}


@pytest.mark.parametrize("md_short,used", [(None, 8), (1, 1)])
def test_attend_takes_the_steps_own_short_query_len(md_short, used):
    """A step's metadata may bound its decode rows' length below the engine's (None: the
    engine's): the paged attention is called with that bound."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, 16, 2, 16, generator=gen).to(dev)
    v_cache = torch.randn(4, 16, 2, 16, generator=gen).to(dev)
    backend = TritonAttentionBackend(max_splits=1)
    backend.short_query_len = 8
    md = pa.AttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 21], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([9, 20], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev),
        slot_mapping=torch.arange(21, dtype=torch.int64, device=dev),
        positions=torch.cat([torch.tensor([8]), torch.arange(20)]).to(dev),
        token_to_req=torch.tensor([0] + [1] * 20, dtype=torch.int32, device=dev),
        max_query_len=20, max_seq_len=20, num_reqs=2, short_query_len=md_short,
    )  # fmt: skip
    q = torch.randn(21, 4, 16, generator=gen).to(dev)
    calls, real = [], pa.paged_attention

    def spy(*args, **kw):
        calls.append(kw["short_query_len"])
        return real(*args, **kw)

    backend._paged_attention = spy  # (bound at construction)
    out = backend.attend(q, k_cache, v_cache, md, 0.25)
    ref = real(q, k_cache, v_cache, md, 0.25, max_splits=1, short_query_len=0)
    assert calls == [used]
    torch.testing.assert_close(out, ref)  # one launch or two: the same attention


def _compiled(kernel) -> int:
    """Compiled variants of a Triton kernel (Triton 3.x keeps one cache per device)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches: cannot count compiled variants")
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("short_query_len", [0, 1, 8])
def test_no_compile_in_serving_after_warmup_on_cuda(short_query_len):
    """After the warm-up, ragged batches of every kind (decode, verify, prefill, mixed; short
    and long contexts; 1 to 300 rows; odd token counts; a misaligned positions view) compile
    nothing new."""
    torch.manual_seed(0)
    page, kv_heads, heads, dim, blocks = 16, 8, 32, 128, 2048
    k_cache = torch.randn(blocks, page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    backend = TritonAttentionBackend()
    backend.short_query_len = short_query_len
    backend.warmup(k_cache, v_cache, heads)
    kernels = (pa._paged_attention_kernel, pa._fold_partials_kernel)
    before = [_compiled(k) for k in kernels]
    for num_reqs, qlen, ctx in [(1, 1, 40), (1, 1, 3000), (3, 8, 900), (40, 1, 2000),
                                (300, 1, 100), (2, 300, 500), (64, 8, 64), (5, 17, 1500)]:
        q_lens = torch.randint(1, qlen + 1, (num_reqs,))
        seq_lens = q_lens + torch.randint(0, ctx, (num_reqs,))
        cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
        cu[1:] = q_lens.cumsum(0)
        tokens = int(cu[-1])
        md = pa.AttentionMetadata(
            query_start_loc=cu.cuda(), seq_lens=seq_lens.int().cuda(),
            block_tables=torch.randint(1, blocks, (num_reqs, -(-ctx - qlen) // page + 1),
                                       dtype=torch.int32, device="cuda"),
            slot_mapping=torch.zeros(tokens, dtype=torch.int64, device="cuda"),
            # a view 8 bytes into a buffer, as the packed step's positions can be
            positions=torch.cat([torch.zeros(1, dtype=torch.int64)] + [
                torch.arange(int(s) - int(n), int(s)) for n, s in zip(q_lens, seq_lens)
            ]).cuda()[1:],
            token_to_req=torch.repeat_interleave(torch.arange(num_reqs), q_lens).int().cuda(),
            max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()), num_reqs=num_reqs,
        )  # fmt: skip
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        out = backend.attend(q, k_cache, v_cache, md, dim**-0.5)
        assert torch.isfinite(out).all()
        if short_query_len > 1:  # a step with prefill chunks whose rows verify nothing: the
            # 1-token short tile, under the prefill graphs' promise (the token budget)
            # (a row of 2-8 tokens moves to the long launch, whose KV tiles and splits differ:
            # bf16 rounding, not exactness, is what the two launches share)
            md1 = replace(md, short_query_len=1, max_query_len=8192)
            other = backend.attend(q, k_cache, v_cache, md1, dim**-0.5).float()
            assert ((other - out.float()).norm() / out.float().norm()).item() < 1e-2
    assert [_compiled(k) for k in kernels] == before
