"""Triton attention kernels against the torch reference backend.

On CPU the kernels run through Triton's interpreter at tiny sizes (TRITON_INTERPRET must be
set before the kernels are imported, hence the setdefault at the top); on CUDA the same
cases run compiled, plus full-size cases (head_dim 128, 32/8 heads, contexts up to 4096) and
a CUDA-graph replay check. Every case draws fresh random inputs, poisons all outputs and
scratch buffers with NaN and checks every element against the reference.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark.attention.base import (  # noqa: E402
    SENTINEL_SLOT,
    AttentionMetadata,
    compute_token_to_req,
)
from dspark.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from dspark.attention.triton import draft_attention as da  # noqa: E402
from dspark.attention.triton import launch_config  # noqa: E402
from dspark.attention.triton import paged_attention as pa  # noqa: E402
from dspark.attention.triton_backend import TritonAttentionBackend, triton_interpreting  # noqa: E402

INTERPRET = triton_interpreting()
if not HAS_CUDA and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device")
SMALL_SPLIT = 16 if INTERPRET else 64  # key segments a short context has several of
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
REF = TorchAttentionBackend()


@pytest.fixture(autouse=True)
def _poison_scratch(monkeypatch):
    """Every buffer the kernels allocate (outputs, split partials) starts as NaN."""

    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(pa, "_empty", nan_empty)
    monkeypatch.setattr(da, "_empty", nan_empty)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def check_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


def build_tables(gen, ctx_lens, page, device):
    """Random block tables over fresh blocks (block 0 stays the sentinel), junk in spare columns."""
    num_reqs = len(ctx_lens)
    blocks = [-(-n // page) for n in ctx_lens]
    max_blocks = max(blocks, default=0) + 1
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.randint(1, num_blocks, (max(num_reqs, 1), max_blocks), generator=gen)
    used = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = perm[used : used + n]
        used += n
    return tables[:num_reqs].to(torch.int32).to(device), num_blocks


def make_step(gen, q_lens, prefix_lens, page, num_heads, num_kv, head_dim, dtype, num_pad=0,
              slack=(0, 0)):
    """A ragged step: request r has prefix_lens[r] cached tokens and q_lens[r] new ones."""
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens, strict=True)]
    tables, num_blocks = build_tables(gen, seq_lens, page, "cpu")
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    num_tokens = cu[-1] + num_pad
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    slots = torch.full((num_tokens,), SENTINEL_SLOT, dtype=torch.int64)
    for r, (p0, n) in enumerate(zip(prefix_lens, q_lens, strict=True)):
        pos = torch.arange(p0, p0 + n)
        positions[cu[r] : cu[r] + n] = pos
        slots[cu[r] : cu[r] + n] = tables[r, pos // page].long() * page + pos % page
    cu_q = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    md = AttentionMetadata(
        query_start_loc=cu_q,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        slot_mapping=slots.to(DEVICE),
        positions=positions.to(DEVICE),
        token_to_req=compute_token_to_req(cu_q, num_tokens),
        max_query_len=max(q_lens, default=0) + slack[0],
        max_seq_len=max(seq_lens, default=0) + slack[1],
        num_reqs=len(q_lens),
    )

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    q, k, v = rnd(num_tokens, num_heads, head_dim), rnd(num_tokens, num_kv, head_dim), rnd(
        num_tokens, num_kv, head_dim
    )
    cache_shape = (num_blocks, page, num_kv, head_dim)
    return md, q, k, v, rnd(*cache_shape), rnd(*cache_shape)


def run_forward(gen, q_lens, prefix_lens, page, num_heads, num_kv, head_dim, dtype, num_pad=0,
                num_splits=None, backend=None, slack=(0, 0), **kw):
    md, q, k, v, k_cache, v_cache = make_step(
        gen, q_lens, prefix_lens, page, num_heads, num_kv, head_dim, dtype, num_pad, slack
    )
    scale = head_dim**-0.5
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ref = REF.forward(q, k, v, kc_ref, vc_ref, md, scale)
    if backend is not None:
        out = backend.forward(q, k, v, k_cache, v_cache, md, scale)
    else:
        TritonAttentionBackend().write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        out = pa.paged_attention(q, k_cache, v_cache, md, scale, num_splits=num_splits, **kw)
    # the cache equals the reference's except block 0 (padding writes there are skipped)
    assert torch.equal(k_cache[1:], kc_ref[1:]) and torch.equal(v_cache[1:], vc_ref[1:])
    check_close(out, ref, dtype)
    if num_pad:
        assert (out[int(md.query_start_loc[-1]) :] == 0).all()  # padding tail
    return out, ref


# ---------------------------------------------------------------- small cases (interpreter)


def test_write_kv_skips_sentinel_only():
    gen = torch.Generator().manual_seed(1)
    num_blocks, page, num_kv, head_dim = 6, 4, 2, 16
    k_cache = torch.randn(num_blocks, page, num_kv, head_dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, page, num_kv, head_dim, generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * page - page, generator=gen)[:9] + page
    slots = torch.cat([slots, torch.full((3,), SENTINEL_SLOT)]).to(DEVICE)
    k = torch.randn(12, num_kv, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(12, num_kv, head_dim, generator=gen).to(DEVICE)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    REF.write_kv(k, v, kc_ref, vc_ref, slots)
    block0 = k_cache[0].clone()
    TritonAttentionBackend().write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1:], kc_ref[1:]) and torch.equal(v_cache[1:], vc_ref[1:])
    assert torch.equal(k_cache[0], block0)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("page", [4, 16])
def test_forward_ragged_mixed(group, page):
    """Decode, verify, prefix-extending prefill chunks, zero-length rows, padding tail."""
    gen = torch.Generator().manual_seed(100 * group + page)
    q_lens = [5, 0, 1, 3, 9, 0]
    prefix = [7, 4, 0, 21, 13, 0]
    run_forward(gen, q_lens, prefix, page, 2 * group, 2, 16, torch.float32, num_pad=3)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_forward_short_rows_with_a_long_padding_tail(num_splits):
    """A graph bucket's padding tail can be many tiles long; with a short launch (one program
    per request, none for the tail) the long launch still zeroes all of it, and when the step
    splits, both launches write partials and the one fold after them covers every token."""
    gen = torch.Generator().manual_seed(31 + num_splits)
    q_lens, prefix = [1, 2, 0, 1, 3, 24], [9, 30, 4, 0, 17, 5]
    plan = launch_config.launch_plan(2, max(q_lens), 16, HAS_CUDA and not INTERPRET, 1)
    assert [launch.pass_ for launch in plan] == [2, 1] and 150 > 2 * plan[0].block_q
    run_forward(gen, q_lens, prefix, 4, 4, 2, 16, torch.float32, num_pad=150,
                num_splits=num_splits, short_query_len=1, split_len=SMALL_SPLIT)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_forward_split_kv(num_splits):
    """Rows of 1 to 5 key segments; fewer splits than segments (a split takes every
    num_splits-th segment); the padding tail."""
    gen = torch.Generator().manual_seed(7 + num_splits)
    q_lens, prefix = [1, 4, 0, 2], [40, 3, 9, 70]
    out, _ = run_forward(gen, q_lens, prefix, 4, 4, 1, 32, torch.float32, num_pad=2,
                         num_splits=num_splits, split_len=SMALL_SPLIT)
    again, _ = run_forward(torch.Generator().manual_seed(7 + num_splits), q_lens, prefix, 4, 4,
                           1, 32, torch.float32, num_pad=2, num_splits=1,
                           split_len=SMALL_SPLIT)  # fmt: skip
    assert torch.equal(out, again)  # split or not: the same bits
    folded, _ = run_forward(torch.Generator().manual_seed(7 + num_splits), q_lens, prefix, 4,
                            4, 1, 32, torch.float32, num_pad=2, num_splits=1, partials=True,
                            split_len=SMALL_SPLIT)  # fmt: skip
    assert torch.equal(out, folded)  # unsplit rows' partials, folded after: the same bits


def test_a_step_splits_while_its_partials_fit_and_the_bits_never_change(monkeypatch):
    """The heuristic splits few programs over long contexts (an H200's SM count patched in);
    a loose CPU bound (many segments: the graphs' max_model_len) that would make the partials
    outgrow PARTIALS_MAX_BYTES keeps the step unsplit. Either way, the same output bits."""
    monkeypatch.setattr(launch_config, "num_sms", lambda device: 132)
    monkeypatch.setattr(pa, "PARTIALS_MAX_BYTES", 4 * 4 * 16 * 4 * 64)  # 64 segments of 4 tokens
    splits, real = [], pa._launch

    def spy(*args):
        splits.append(args[7])  # (q, k, v, md, scale, out, launch, num_splits, ...)
        return real(*args)

    monkeypatch.setattr(pa, "_launch", spy)
    outs = []
    for slack in (0, 64 * SMALL_SPLIT):
        gen = torch.Generator().manual_seed(5)
        out, _ = run_forward(gen, [1, 2, 1], [70, 33, 5], 4, 4, 2, 16, torch.float32,
                             num_pad=0, slack=(0, slack), split_len=SMALL_SPLIT)  # fmt: skip
        outs.append(out)
    assert splits[0] > 1 and splits[-1] == 1, splits
    assert torch.equal(outs[0], outs[1])


def test_forward_prefill_many_blocks_bf16():
    """Query rows spanning several q blocks, loose CPU bounds, non-power-of-2 group."""
    gen = torch.Generator().manual_seed(3)
    run_forward(gen, [37, 2], [5, 30], 16, 6, 2, 32, torch.bfloat16, num_pad=1, slack=(3, 9))


def test_forward_all_padding_and_head_dims():
    gen = torch.Generator().manual_seed(4)
    run_forward(gen, [0, 0, 0], [0, 5, 0], 4, 2, 1, 64, torch.float32, num_pad=4)
    run_forward(gen, [2], [3], 4, 2, 1, 64, torch.float32)
    run_forward(gen, [3, 1], [6, 2], 4, 3, 3, 24, torch.float32, num_pad=1)  # padded head_dim


def test_forward_backend_heuristics():
    gen = torch.Generator().manual_seed(5)
    run_forward(gen, [3, 1, 0, 6], [11, 0, 2, 17], 4, 4, 2, 16, torch.float32, num_pad=2,
                backend=TritonAttentionBackend())


@pytest.mark.parametrize("short_query_len", [1, 3])
def test_forward_two_launches_for_short_and_long_requests(short_query_len):
    """A step mixing decode / verify rows with prefill chunks attends its short requests with
    the decode tile and the rest with the prefill tile: every row written once, by the right
    launch, whatever its length (rows of SHORT_MAX and SHORT_MAX + 1 tokens included)."""
    gen = torch.Generator().manual_seed(11 + short_query_len)
    group, page, head_dim = 2, 4, 16
    on_gpu = HAS_CUDA and not INTERPRET
    plan = launch_config.launch_plan(group, 37, head_dim, on_gpu, short_query_len)
    assert [launch.pass_ for launch in plan] == [2, 1], plan  # two launches, long first
    short_max = plan[1].short_max
    q_lens = [1, 37, 0, short_max, short_max + 1, 2, 1, 20, 0]
    prefix = [19, 0, 6, 11, 3, 40, 0, 9, 0]
    run_forward(gen, q_lens, prefix, page, 2 * group, 2, head_dim, torch.float32, num_pad=5,
                short_query_len=short_query_len)
    backend = TritonAttentionBackend()
    backend.short_query_len = short_query_len
    run_forward(gen, q_lens, prefix, page, 2 * group, 2, head_dim, torch.bfloat16, num_pad=2,
                backend=backend)


def test_two_launches_with_an_odd_group_and_a_padded_head_dim():
    """Three query heads per KV head (the tile pads the group to 4) and head_dim 24 (padded
    to 32), fp16, with the step split (both launches)."""
    gen = torch.Generator().manual_seed(17)
    plan = launch_config.launch_plan(4, 30, 24, HAS_CUDA and not INTERPRET, 2)
    assert [launch.pass_ for launch in plan] == [2, 1], plan
    q_lens, prefix = [2, 30, 1, 0, plan[1].short_max + 1], [33, 5, 60, 2, 0]
    run_forward(gen, q_lens, prefix, 4, 6, 2, 24, torch.float16, num_pad=3, num_splits=2,
                short_query_len=2, split_len=SMALL_SPLIT)


def run_draft(gen, ctx_lens, block_len, page, num_heads, num_kv, head_dim, dtype,
              num_splits=None, backend=None):
    tables, num_blocks = build_tables(gen, ctx_lens, page, DEVICE)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    num_reqs = len(ctx_lens)
    q = rnd(num_reqs, block_len, num_heads, head_dim)
    k, v = (rnd(num_reqs, block_len, num_kv, head_dim) for _ in range(2))
    k_cache, v_cache = (rnd(num_blocks, page, num_kv, head_dim) for _ in range(2))
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)
    args = (q, k, v, k_cache, v_cache, ctx, tables, max(ctx_lens), head_dim**-0.5)
    ref = REF.draft_forward(*args)
    if backend is not None:
        out = backend.draft_forward(*args)
    else:
        out = da.draft_attention(*args, num_splits=num_splits)
    check_close(out, ref, dtype)


@pytest.mark.parametrize("group,block_len,num_splits", [(1, 4, 1), (4, 7, 1), (2, 16, 3)])
def test_draft_attention(group, block_len, num_splits):
    gen = torch.Generator().manual_seed(group * 31 + block_len)
    run_draft(gen, [9, 0, 26], block_len, 4, 2 * group, 2, 16, torch.float32, num_splits)


def test_draft_attention_backend_bf16():
    gen = torch.Generator().manual_seed(11)
    run_draft(gen, [5, 33], 8, 16, 8, 2, 32, torch.bfloat16, backend=TritonAttentionBackend())


# ---------------------------------------------------------------- full sizes (CUDA only)


def _random_rows(gen, num_rows, max_q, max_prefix):
    q_lens = torch.randint(0, max_q + 1, (num_rows,), generator=gen).tolist()
    prefix = torch.randint(0, max_prefix + 1, (num_rows,), generator=gen).tolist()
    return q_lens, prefix


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,head_dim", [((32, 8), 128), ((16, 8), 64), ((32, 32), 128)])
def test_cuda_verify_batch_full(dtype, heads, head_dim):
    """Many decode/verify rows (0..8 tokens) over contexts up to 4096, plus padding."""
    gen = torch.Generator().manual_seed(heads[0] * heads[1] + head_dim + dtype.itemsize)
    q_lens, prefix = _random_rows(gen, 96 if heads[0] != heads[1] else 40, 8, 4088)
    for splits in (None, 1):
        run_forward(gen, q_lens, prefix, 16, *heads, head_dim, dtype, num_pad=13,
                    num_splits=splits)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_prefill_full(dtype):
    """Long prefill chunks with and without cached prefix, mixed with decode rows."""
    gen = torch.Generator().manual_seed(21)
    q_lens, prefix = [4096, 1, 700, 0, 5, 1500], [0, 4000, 2500, 100, 300, 1]
    run_forward(gen, q_lens, prefix, 16, 32, 8, 128, dtype, num_pad=7)
    run_forward(gen, [1, 8], [4095, 4088], 32, 32, 8, 128, dtype, backend=TritonAttentionBackend())
    for short in (1, 8):  # the decode / verify rows attended apart from the prefill chunks
        for splits in (None, 4):  # (a split long launch combines over every token)
            run_forward(gen, q_lens, prefix, 16, 32, 8, 128, dtype, num_pad=7,
                        short_query_len=short, num_splits=splits)


@cuda_only
@pytest.mark.parametrize("num_reqs", [1, 64])
def test_cuda_draft_full(num_reqs):
    gen = torch.Generator().manual_seed(num_reqs)
    ctx = torch.randint(0, 4096, (num_reqs,), generator=gen).tolist()
    for dtype in (torch.bfloat16, torch.float32):
        run_draft(gen, ctx, 16, 16, 32, 8, 128, dtype, backend=TritonAttentionBackend())
        run_draft(gen, ctx, 7, 16, 16, 4, 64, dtype, num_splits=1)


@cuda_only
@pytest.mark.parametrize("max_q,short_query_len", [(4, 0), (40, 2)])
def test_cuda_graph_replay_matches_reference(max_q, short_query_len):
    """Capture once for (T, R, max_query_len); replay with other device boundaries (with
    short_query_len, rows move between the short and the long launch from step to step)."""
    gen = torch.Generator().manual_seed(99 + max_q)
    num_rows, pad = 24, 10
    backend = TritonAttentionBackend()
    backend.short_query_len = short_query_len
    plan = launch_config.launch_plan(4, max_q, 128, True, short_query_len)
    assert len(plan) == (2 if max_q > 4 else 1)
    steps = []
    for _ in range(3):
        q_lens, prefix = _random_rows(gen, num_rows, max_q, 2000)
        num_pad = num_rows * max_q + pad - sum(q_lens)  # same T every step
        steps.append(make_step(gen, q_lens, prefix, 16, 32, 8, 128, torch.bfloat16, num_pad))
    md0, q0, k0, v0, kc0, vc0 = steps[0]
    # block tables / caches differ in size between steps: capture over the largest shapes
    num_blocks = max(s[4].shape[0] for s in steps)
    width = max(s[0].block_tables.shape[1] for s in steps)
    static = {
        "q": q0.clone(), "k": k0.clone(), "v": v0.clone(),
        "kc": torch.empty(num_blocks, *kc0.shape[1:], dtype=kc0.dtype, device="cuda"),
        "vc": torch.empty(num_blocks, *kc0.shape[1:], dtype=kc0.dtype, device="cuda"),
        "bt": torch.zeros(num_rows, width, dtype=torch.int32, device="cuda"),
    }
    md_static = AttentionMetadata(
        md0.query_start_loc.clone(), md0.seq_lens.clone(), static["bt"],
        md0.slot_mapping.clone(), md0.positions.clone(), md0.token_to_req.clone(),
        max_query_len=max_q, max_seq_len=2000 + max_q, num_reqs=num_rows,
    )
    scale = 128**-0.5

    def load(step):
        md, q, k, v, kc, vc = step
        for name, src in (("q", q), ("k", k), ("v", v)):
            static[name].copy_(src)
        static["kc"][: kc.shape[0]].copy_(kc)
        static["vc"][: vc.shape[0]].copy_(vc)
        static["bt"].zero_()
        static["bt"][:, : md.block_tables.shape[1]].copy_(md.block_tables)
        for f in ("query_start_loc", "seq_lens", "slot_mapping", "positions", "token_to_req"):
            getattr(md_static, f).copy_(getattr(md, f))

    load(steps[0])
    fwd = lambda: backend.forward(  # noqa: E731
        static["q"], static["k"], static["v"], static["kc"], static["vc"], md_static, scale
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fwd()  # warm-up compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fwd()
    for step in steps:
        load(step)
        md, q, k, v, kc, vc = step
        md_ref = AttentionMetadata(**{**md.__dict__, "block_tables": static["bt"].clone()})
        ref = REF.forward(q, k, v, static["kc"].clone(), static["vc"].clone(), md_ref, scale)
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out_static, ref, torch.bfloat16)
