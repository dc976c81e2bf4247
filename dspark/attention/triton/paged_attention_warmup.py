"""The paged attention kernel's compile-time launch variants, and their start-up compile.

Every distinct constexpr combination is a Triton compile (~1 s) on first use: met in the
middle of serving, that is a stall inside a step. The variants a CUDA call can take form a
small set known from CPU numbers alone, so `warmup` compiles them all before serving.
"""

from __future__ import annotations

import torch
import triton

from dspark.attention.base import SENTINEL_SLOT, AttentionMetadata
from dspark.attention.triton import launch_config as lc
from dspark.attention.triton import paged_attention as pa


def launch_variants(group_pad: int, head_dim: int, max_splits: int,
                    short_query_len: int = 0, prefill_only: bool = False) -> dict:  # fmt: skip
    """Every compile-time launch variant (a `Launch`, splits, stages) a CUDA call can take,
    mapped to a (max_query_len, num_splits) call that compiles it (`prefill_only`: calls
    whose longest query takes the prefill tile)."""
    variants = {}
    longest = 64 // group_pad + 1  # past 64 rows every length is "prefill"
    for qlen in range(longest if prefill_only else 1, longest + 1):
        for launch in lc.launch_plan(group_pad, qlen, head_dim, True, short_query_len):
            for splits in lc.split_counts(max_splits):
                stages = lc.num_stages(True, launch.block_q * group_pad, splits)
                variants.setdefault((*launch, splits, stages), (qlen, splits))
    return variants


def warmup(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, max_splits: int,
           split_len: int, short_query_len: int = 0,
           prefill_only: bool = False) -> int:  # fmt: skip
    """Compile every launch variant of the attention and fold kernels now, on a one-row
    batch attending to block 0 (outputs discarded), so no request meets a compile. Returns the
    number of variants."""
    _, page, num_kv_heads, head_dim = k_cache.shape
    dev, dtype = k_cache.device, k_cache.dtype
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    variants = launch_variants(group_pad, head_dim, max_splits, short_query_len, prefill_only)
    for qlen, splits in sorted(set(variants.values())):
        ctx = max(qlen, splits * split_len)
        md = AttentionMetadata(
            query_start_loc=torch.tensor([0, qlen], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
            block_tables=torch.zeros((1, triton.cdiv(ctx, page)), dtype=torch.int32, device=dev),
            slot_mapping=torch.full((qlen,), SENTINEL_SLOT, dtype=torch.int64, device=dev),
            positions=torch.arange(ctx - qlen, ctx, device=dev),
            token_to_req=torch.zeros(qlen, dtype=torch.int32, device=dev),
            max_query_len=qlen, max_seq_len=ctx, num_reqs=1,
        )  # fmt: skip
        q = torch.randn(qlen, num_heads, head_dim, device=dev).to(dtype)
        pa.paged_attention(q, k_cache, v_cache, md, 1.0, num_splits=splits,
                           split_len=split_len, short_query_len=short_query_len)  # fmt: skip
    return len(variants)
