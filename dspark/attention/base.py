"""Attention backend interface and the per-step attention metadata.

The metadata describes one ragged token stream of T tokens (T may include padding at the
end): request r owns tokens `query_start_loc[r]:query_start_loc[r+1]` (zero-length rows are
allowed, e.g. padding rows or requests whose drafts were all trimmed away). The device tensors
are the source of truth; the CPU only knows upper bounds (`max_query_len`, `max_seq_len`).

KV cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A token's slot is `block_id * block_size + offset`. Block 0 is never handed out by
the block manager: its slots are the sentinel that padding tokens write to.

Causal rule of the target: a query token at position p sees every key at positions <= p of
its own request (its cached prefix plus the tokens of this step written before attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SENTINEL_SLOT = 0  # slot of block 0, reserved for padding tokens


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, cu_seqlens_q; last entry == number of real tokens
    seq_lens: torch.Tensor  # [R] int32, KV length of each request after this step's writes
    block_tables: torch.Tensor  # [R, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [T] int64, SENTINEL_SLOT for padding tokens
    positions: torch.Tensor  # [T] int64, absolute position of each token (0 for padding)
    token_to_req: torch.Tensor  # [T] int32, owning request (R for padding tokens)
    max_query_len: int  # CPU upper bound of any row's query length
    max_seq_len: int  # CPU upper bound of any seq_len
    num_reqs: int  # R (rows, including zero-length padding rows)
    # CPU bound of this step's decode / verify rows' query length, for the paged attention's
    # short launch; None: the engine's (the backend's short_query_len, 1 + K). A speculative
    # step whose rows verify nothing says 1: its decode rows then take no-spec's 1-token tile
    short_query_len: int | None = None


def compute_token_to_req(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Map each token index to its request by binary search over the device query_start_loc.

    Tokens at or beyond query_start_loc[-1] (padding) map to R. No host sync.
    """
    tokens = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return (torch.searchsorted(query_start_loc, tokens, right=True) - 1).to(torch.int32)


class AttentionBackend:
    """What the model layers need from an attention implementation.

    `forward` writes the step's K/V into the paged cache at `slot_mapping`, then attends
    causally over each request's cache. `draft_forward` is the DSpark drafter's attention: the
    block queries see the drafter's cached context (positions < ctx_len) and every key of their
    own block (bidirectional); block K/V are not written to the cache.
    """

    name = "base"
    # `attend` is implemented: a layer may write the step's K/V itself (the fused q/k-norm +
    # RoPE kernel stores keys and values straight into the cache) and attend apart
    attends_written_kv = False
    # the longest query a decode / verify row of this engine has (1 + K; 0: unknown): steps
    # that mix such rows with prefill chunks may attend them apart (the Triton backend does)
    short_query_len = 0

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> int:
        """Compile what a kernel-compiling backend would otherwise compile on first use in the
        middle of serving; returns the number of variants compiled (none here)."""
        return 0

    def write_kv(
        self,
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               md: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
        """`forward` with the step's K/V already in the cache (nothing written here)."""
        raise NotImplementedError

    def draft_forward(
        self,
        q: torch.Tensor,  # [R, G, H, D] block queries (G = block length)
        k: torch.Tensor,  # [R, G, Hkv, D] block keys
        v: torch.Tensor,  # [R, G, Hkv, D] block values
        k_cache: torch.Tensor,  # drafter's context cache, same paging as the target
        v_cache: torch.Tensor,
        ctx_lens: torch.Tensor,  # [R] int32: keys at positions < ctx_len are visible
        block_tables: torch.Tensor,  # [R, max_blocks] int32
        max_ctx_len: int,  # CPU upper bound of ctx_lens
        scale: float,
    ) -> torch.Tensor:  # [R, G, H, D]
        raise NotImplementedError
