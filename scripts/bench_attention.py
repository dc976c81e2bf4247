"""Microbenchmark of the Triton attention kernels against the machine's own ceilings (CUDA).

Measures, in one run: device-to-device copy bandwidth (bytes read + written) and a bf16
matmul rate; then steps mixing decode / verify rows with prefill chunks (one launch
against the short/long pair of `short_query_len`); then decode/verify attention (batch
1/16/64/256 x context 512/2048, 1 and 4 query tokens per request), the drafter's block
attention and a 4096-token causal prefill.
Each attention case is captured in a CUDA graph of `INNER` launches that rotate over several
disjoint cache/table sets (so small cases do not run from L2), timed with
`triton.testing.do_bench` (median) and reported per launch, as achieved bandwidth over the
KV bytes that must be read (decode) or TFLOP/s (prefill), and as a ratio to the ceilings.

    python scripts/bench_attention.py [--heads 32 --kv-heads 8 --head-dim 128]
        [--decode-only] [--split-len 256] [--decode-warps 8] [--decode-stages 3]
        [--decode-maxnreg 128] [--partials]

The last lines list the paged kernel's compiled variants with their registers and spills.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
from dspark.attention.base import AttentionMetadata, compute_token_to_req  # noqa: E402
from dspark.attention.triton import draft_attention as da  # noqa: E402
from dspark.attention.triton import launch_config  # noqa: E402
from dspark.attention.triton import paged_attention as pa  # noqa: E402

PAGE = 16
INNER = 16  # launches per captured graph
SPLIT_LEN = launch_config.SPLIT_LEN  # the paged kernel's key segment (--split-len)
MIN_FOOTPRINT = 512 << 20  # rotate over enough sets to overflow L2 (50 MB on H200)


def copy_bandwidth() -> float:
    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def matmul_rate() -> float:
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def graph_time_ms(calls) -> float:
    """Median time of one call, from replays of a graph that runs all `calls` INNER times."""
    for call in calls:  # compile / warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(INNER):
            calls[i % len(calls)]()
    ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms / INNER


def make_sets(num_sets, num_reqs, q_len, ctx, num_kv, head_dim):
    """Disjoint random block tables per set over one cache; KV of each set is `ctx` long."""
    blocks_per_req = triton.cdiv(ctx, PAGE)
    num_blocks = num_sets * num_reqs * blocks_per_req + 1
    shape = (num_blocks, PAGE, num_kv, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    perm = (torch.randperm(num_blocks - 1, device="cuda") + 1).to(torch.int32)
    tables = perm.view(num_sets, num_reqs, blocks_per_req)
    mds = []
    for s in range(num_sets):
        cu = torch.arange(0, num_reqs + 1, device="cuda", dtype=torch.int32) * q_len
        num_tokens = num_reqs * q_len
        positions = (ctx - q_len + torch.arange(num_tokens, device="cuda") % q_len).long()
        mds.append(AttentionMetadata(
            query_start_loc=cu,
            seq_lens=torch.full((num_reqs,), ctx, device="cuda", dtype=torch.int32),
            block_tables=tables[s].contiguous(),
            slot_mapping=torch.zeros(num_tokens, device="cuda", dtype=torch.int64),
            positions=positions,
            token_to_req=compute_token_to_req(cu, num_tokens),
            max_query_len=q_len, max_seq_len=ctx, num_reqs=num_reqs,
        ))
    return k_cache, v_cache, mds


PARTIALS = None  # --partials: per-segment partials and the fold kernel, split or not


def attend(*args, **kwargs):
    """The paged attention with this run's key segment."""
    return pa.paged_attention(*args, split_len=SPLIT_LEN, partials=PARTIALS, **kwargs)


def bench_decode(batch, ctx, q_len, args, splits=None):
    kv_bytes = batch * ctx * args.kv_heads * args.head_dim * 2 * 2
    num_sets = max(1, min(8, triton.cdiv(MIN_FOOTPRINT, kv_bytes)))
    k_cache, v_cache, mds = make_sets(num_sets, batch, q_len, ctx, args.kv_heads, args.head_dim)
    q = torch.randn(batch * q_len, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5
    calls = [
        lambda md=md: attend(q, k_cache, v_cache, md, scale, out=out,
                                         num_splits=splits)
        for md in mds
    ]
    ms = graph_time_ms(calls)
    num_q_progs = batch * args.kv_heads  # what the split heuristic sees
    segments = triton.cdiv(ctx, SPLIT_LEN)
    used = splits or launch_config.pick_num_splits(q.device, num_q_progs, segments, 16)
    return ms, kv_bytes + 2 * q.numel() * q.element_size(), used


def bench_draft(batch, ctx, block_len, args):
    kv_bytes = batch * ctx * args.kv_heads * args.head_dim * 2 * 2
    num_sets = max(1, min(8, triton.cdiv(MIN_FOOTPRINT, kv_bytes)))
    k_cache, v_cache, mds = make_sets(num_sets, batch, 1, ctx, args.kv_heads, args.head_dim)
    shape = (batch, block_len, args.heads, args.head_dim)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, block_len, args.kv_heads, args.head_dim, device="cuda",
                        dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    calls = [
        lambda md=md: da.draft_attention(q, k, v, k_cache, v_cache, md.seq_lens,
                                         md.block_tables, ctx, args.head_dim**-0.5, out=out)
        for md in mds
    ]
    return graph_time_ms(calls), kv_bytes


def bench_prefill(num_tokens, args):
    k_cache, v_cache, mds = make_sets(1, 1, num_tokens, num_tokens, args.kv_heads, args.head_dim)
    md = mds[0]
    q = torch.randn(num_tokens, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ms = graph_time_ms([lambda: attend(q, k_cache, v_cache, md,
                                                   args.head_dim**-0.5, out=out)])
    pairs = num_tokens * (num_tokens + 1) / 2
    return ms, 4 * args.heads * args.head_dim * pairs


def ragged_step(rows, num_kv, head_dim):
    """One step of (query tokens, context) rows over fresh random blocks: decode rows and
    prefill chunks side by side, as a step with prefill chunks carries them."""
    q_lens = [q for q, _ in rows]
    ctxs = [c for _, c in rows]
    blocks = [triton.cdiv(c, PAGE) for c in ctxs]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, PAGE, num_kv, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    perm = (torch.randperm(num_blocks - 1) + 1).to(torch.int32)
    tables = torch.zeros(len(rows), max(blocks), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = perm[used : used + n]
        used += n
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c - q, c) for q, c in rows])
    num_tokens = int(cu[-1])
    cu = cu.cuda()
    md = AttentionMetadata(
        query_start_loc=cu, seq_lens=torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(), positions=positions.cuda(),
        slot_mapping=torch.zeros(num_tokens, device="cuda", dtype=torch.int64),
        token_to_req=compute_token_to_req(cu, num_tokens),
        max_query_len=max(q_lens), max_seq_len=max(ctxs), num_reqs=len(rows),
    )  # fmt: skip
    return k_cache, v_cache, md


def bench_mixed(rows, args, short_query_len):
    """Time of one step's attention (one launch, or two with `short_query_len`)."""
    k_cache, v_cache, md = ragged_step(rows, args.kv_heads, args.head_dim)
    num_tokens = int(md.query_start_loc[-1])
    q = torch.randn(num_tokens, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    return graph_time_ms([lambda: attend(
        q, k_cache, v_cache, md, args.head_dim**-0.5, out=out, short_query_len=short_query_len)])


MIXED_CASES = (  # (label, decode rows (query, context), prefill chunks (tokens, context))
    ("c=256 mixed: 240 decode x ctx 640 + 8 x 512 prefill", (240, 1, 640), (8, 512, 512)),
    ("c=256 mixed: 240 verify q=8 x ctx 640 + 8 x 512", (240, 8, 640), (8, 512, 512)),
    ("c=64 mixed: 60 decode x ctx 2048 + 2 x 512 prefill", (60, 1, 2048), (2, 512, 512)),
    ("prefill only: 16 x 512", (0, 1, 1), (16, 512, 512)),
)


def mixed_rows(args) -> list[str]:
    """Steps with prefill chunks: one launch against the short/long pair, and their parts."""
    out = []
    for label, (nd, qd, cd), (npf, qp, cp) in MIXED_CASES:
        rows = [(qd, cd)] * nd + [(qp, cp)] * npf
        one = bench_mixed(rows, args, 0)
        two = bench_mixed(rows, args, qd)
        dec = bench_mixed([(qd, cd)] * nd, args, 0) if nd else 0.0
        pre = bench_mixed([(qp, cp)] * npf, args, 0)
        out.append(f"mixed   {label:<52s} one launch {one * 1e3:8.1f} us  two {two * 1e3:8.1f}"
                   f" us  (decode rows alone {dec * 1e3:7.1f} + prefill alone {pre * 1e3:7.1f})")
        if nd and qd == 1:  # 1-token rows under a K = 7 engine's short tile (8 tokens a row):
            # what a speculative step whose rows verify nothing ran before 2564938
            wide = bench_mixed(rows, args, 8)
            out.append(f"mixed   {label:<52s} two, short tile of 8 tokens {wide * 1e3:8.1f} us")
        torch.cuda.empty_cache()
    return out


def override_decode_tile(warps: int, stages: int, maxnreg: int = 0) -> None:
    """Launch options of the decode / verify tile other than the engine's (an experiment:
    the engine's own choice lives in launch_config)."""
    if warps:
        launch_config.DECODE_WARPS = warps
        launch_config.launch_plan.cache_clear()
    if maxnreg:
        launch_config.DECODE_MAXNREG = maxnreg
    if stages:
        engine_stages = pa.num_stages
        pa.num_stages = lambda on_gpu, rows, splits: stages if rows <= 64 else engine_stages(
            on_gpu, rows, splits)  # fmt: skip


def kernel_resources(kernel) -> list[str]:
    """Registers and spills of every compiled variant of a Triton kernel (Triton 3.x keeps
    one cache per device), with its launch options: where a variant runs short of registers."""
    rows = []
    for entry in getattr(kernel, "device_caches", {}).values():
        for key, compiled in entry[0].items():
            md = compiled.metadata
            consts = {k: v for k, v in getattr(getattr(compiled, "src", None), "constants",
                                               {}).items() if isinstance(v, (int, str))}
            rows.append(f"{compiled.name}: regs {getattr(compiled, 'n_regs', '?')} spills "
                        f"{getattr(compiled, 'n_spills', '?')} warps {md.num_warps} stages "
                        f"{md.num_stages} shared {md.shared} | {consts or str(key)[:160]}")
    return sorted(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mixed-only", action="store_true",
                        help="only the steps with prefill chunks (one launch against two)")
    parser.add_argument("--decode-only", action="store_true",
                        help="only decode / verify rows (heuristic splits and none) and prefill")
    parser.add_argument("--decode-warps", type=int, default=0,
                        help="warps of the decode / verify tile (<= 64 rows; 0: the engine's)")
    parser.add_argument("--decode-stages", type=int, default=0,
                        help="pipelining depth of that tile (0: the engine's)")
    parser.add_argument("--decode-maxnreg", type=int, default=0,
                        help="register cap of that tile (0: the compiler's choice)")
    parser.add_argument("--partials", action="store_true",
                        help="unsplit rows too write per-segment partials, folded after")
    parser.add_argument("--split-len", type=int, default=launch_config.SPLIT_LEN,
                        help="the paged kernel's key segment (a multiple of 64)")
    args = parser.parse_args()
    global SPLIT_LEN, PARTIALS
    SPLIT_LEN, PARTIALS = args.split_len, args.partials or None
    override_decode_tile(args.decode_warps, args.decode_stages, args.decode_maxnreg)
    assert torch.cuda.is_available(), "needs a CUDA device"
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    bw, flops = copy_bandwidth(), matmul_rate()
    rows = [] if args.decode_only else mixed_rows(args)
    if args.mixed_only:
        print("\n".join(rows))
        return
    for q_len in (1, 4):
        for ctx in (512, 2048):
            for batch in (1, 16, 64, 256):
                ms, nbytes, splits = bench_decode(batch, ctx, q_len, args)
                ms1, _, _ = bench_decode(batch, ctx, q_len, args, splits=1)
                gbs = nbytes / (ms * 1e-3) / 1e9
                # the heuristic's split count against the others, where it splits at all
                others = "".join(
                    f"; {s} splits: {bench_decode(batch, ctx, q_len, args, splits=s)[0] * 1e3:.1f}"
                    for s in (2, 4, 8, 16)
                    if splits > 1 and s != splits and not args.decode_only)  # fmt: skip
                rows.append(f"decode  B={batch:<4d}ctx={ctx:<5d}q={q_len}  splits={splits:<3d}"
                            f"{ms * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs * 1e9 / bw:6.1%}"
                            f"   (1 split: {ms1 * 1e3:7.1f} us{others})")
                torch.cuda.empty_cache()
    for batch in () if args.decode_only else (1, 64):
        ms, nbytes = bench_draft(batch, 2048, 16, args)
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append(f"draft   B={batch:<4d}ctx=2048 G=16            "
                    f"{ms * 1e3:8.1f} us {gbs:7.0f} GB/s {gbs * 1e9 / bw:6.1%}")
    ms, fl = bench_prefill(4096, args)
    rows.append(f"prefill T=4096 causal                  {ms * 1e3:8.1f} us "
                f"{fl / (ms * 1e-3) / 1e12:7.1f} TFLOP/s {fl / (ms * 1e-3) / flops:6.1%}")
    print(f"\n{name} | torch {torch.__version__} | triton {triton.__version__} | "
          f"H={args.heads} Hkv={args.kv_heads} D={args.head_dim} bf16 page={PAGE} "
          f"key segment {SPLIT_LEN}, decode tile warps / stages "
          f"{args.decode_warps or 'engine'} / {args.decode_stages or 'engine'}"
          f"{f', register cap {args.decode_maxnreg}' if args.decode_maxnreg else ''}"
          f"{', partials unsplit too' if args.partials else ''}")
    print(f"ceilings: copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} "
          f"TFLOP/s; decode bytes = KV read once; times per launch inside a CUDA graph")
    print("\n".join(rows))
    try:  # (Triton's cache layout is not an API: a diagnostic, never the run's failure)
        print("\n".join(kernel_resources(pa._paged_attention_kernel)))
    except (AttributeError, TypeError, IndexError) as err:
        print(f"kernel resources unavailable: {err!r}")


if __name__ == "__main__":
    main()
