"""Reference attention over the paged KV cache in plain torch (any device).

Vectorized over requests and tokens (no per-request Python loop and no host sync): each
request's keys are gathered through its block table up to the CPU upper bound
`max_seq_len`, then masked by the device-side positions and lengths. Memory grows with
tokens x max_seq_len, so queries are processed in chunks. This backend is the ground truth for
the Triton kernels and the path used on the CPU.
"""

from __future__ import annotations

import torch

from dspark.attention.base import AttentionBackend, AttentionMetadata

_CHUNK_ELEMS = 1 << 26  # bound on score elements materialised at once


def gather_paged(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [R, max_blocks]
    num_positions: int,
) -> torch.Tensor:  # [R, num_positions, Hkv, D]
    block_size = cache.shape[1]
    pos = torch.arange(num_positions, device=cache.device)
    blocks = block_tables[:, (pos // block_size).clamp(max=block_tables.shape[1] - 1)].long()
    slots = blocks * block_size + (pos % block_size)
    return cache.reshape(-1, *cache.shape[2:])[slots]


def _attend(q, keys, values, mask, scale):
    # q [N, Lq, H, D]; keys/values [N, Lk, Hkv, D]; mask [N, Lq, Lk] (True = visible)
    num_heads, num_kv = q.shape[2], keys.shape[2]
    group = num_heads // num_kv
    keys = keys.repeat_interleave(group, dim=2).float()
    values = values.repeat_interleave(group, dim=2).float()
    scores = torch.einsum("nqhd,nkhd->nhqk", q.float(), keys) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
    return torch.einsum("nhqk,nkhd->nqhd", probs, values)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    attends_written_kv = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def forward(self, q, k, v, k_cache, v_cache, md: AttentionMetadata, scale):
        self.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        return self.attend(q, k_cache, v_cache, md, scale)

    def attend(self, q, k_cache, v_cache, md: AttentionMetadata, scale):
        num_tokens = q.shape[0]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if num_tokens == 0 or md.num_reqs == 0:
            return out.to(q.dtype)
        seq = max(md.max_seq_len, 1)
        keys = gather_paged(k_cache, md.block_tables, seq)  # [R, S, Hkv, D]
        values = gather_paged(v_cache, md.block_tables, seq)
        key_pos = torch.arange(seq, device=q.device)
        req = md.token_to_req.long()
        valid = req < md.num_reqs
        req = req.clamp(max=md.num_reqs - 1)
        chunk = max(1, _CHUNK_ELEMS // (seq * q.shape[1] * max(1, q.shape[2] // 8)))
        for start in range(0, num_tokens, chunk):
            sl = slice(start, min(num_tokens, start + chunk))
            r = req[sl]
            mask = (key_pos.unsqueeze(0) <= md.positions[sl].unsqueeze(1)) & (
                key_pos.unsqueeze(0) < md.seq_lens.long()[r].unsqueeze(1)
            )
            mask &= valid[sl].unsqueeze(1)
            o = _attend(q[sl].unsqueeze(1), keys[r], values[r], mask.unsqueeze(1), scale)
            out[sl] = o.squeeze(1)
        return out.to(q.dtype)

    def draft_forward(
        self, q, k, v, k_cache, v_cache, ctx_lens, block_tables, max_ctx_len, scale
    ):
        num_reqs, block_len = q.shape[0], q.shape[1]
        if num_reqs == 0:
            return torch.zeros_like(q)
        ctx = max(max_ctx_len, 1)
        ctx_k = gather_paged(k_cache, block_tables, ctx)
        ctx_v = gather_paged(v_cache, block_tables, ctx)
        keys = torch.cat([ctx_k, k.to(ctx_k.dtype)], dim=1)  # [R, S+G, Hkv, D]
        values = torch.cat([ctx_v, v.to(ctx_v.dtype)], dim=1)
        key_pos = torch.arange(ctx, device=q.device)
        ctx_mask = key_pos.unsqueeze(0) < ctx_lens.long().unsqueeze(1)  # [R, S]
        block_mask = torch.ones(num_reqs, block_len, dtype=torch.bool, device=q.device)
        mask = torch.cat([ctx_mask, block_mask], dim=1).unsqueeze(1).expand(-1, block_len, -1)
        return _attend(q, keys, values, mask, scale).to(q.dtype)
