"""`triton` attention backend: paged attention, KV write and drafter attention in Triton.

The kernels are imported lazily (on construction) so that `dspark.attention` imports on
machines without triton. Everything is CUDA-graph capturable: launch grids and block shapes
come from CPU-side numbers only (token count, `num_reqs`, `max_query_len`, `max_seq_len`),
and correctness never depends on those bounds being tight.
"""

from __future__ import annotations

import os

import torch

from dspark.attention.base import AttentionBackend, AttentionMetadata


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    attends_written_kv = True

    def __init__(self, max_splits: int = 16, min_split_len: int = 128,
                 split_len: int | None = None) -> None:  # fmt: skip
        """max_splits bounds flash-decoding's KV splits (1 disables them); the paged
        attention sums keys in segments of split_len (default SPLIT_LEN) with or without
        splits, so they change its speed, never its bits; min_split_len bounds the drafter's
        chunks."""
        # lazy: importing the kernels imports triton
        from dspark.attention.triton import draft_attention, kv_write, paged_attention
        from dspark.attention.triton.launch_config import SPLIT_LEN

        self._write_kv = kv_write.write_kv
        self._paged_attention = paged_attention.paged_attention
        self._draft_attention = draft_attention.draft_attention
        self.max_splits = max_splits
        self.min_split_len = min_split_len
        self.split_len = split_len or SPLIT_LEN

    @staticmethod
    def is_available(device: torch.device | str | None = None) -> bool:
        """Compiled kernels need CUDA; the interpreter (TRITON_INTERPRET=1) runs on CPU."""
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        device = torch.device(device) if device is not None else None
        if triton_interpreting():
            return device is None or device.type == "cpu"
        return torch.cuda.is_available() and (device is None or device.type == "cuda")

    def warmup(self, k_cache, v_cache, num_heads: int) -> int:
        """Compile every launch variant of the paged attention kernels (see paged_attention)
        for the engine's short query length; past 1, also those of steps with prefill chunks
        whose rows verify nothing (AttentionMetadata.short_query_len 1)."""
        from dspark.attention.triton import paged_attention_warmup as paw

        n = paw.warmup(k_cache, v_cache, num_heads, self.max_splits, self.split_len,
                       self.short_query_len)  # fmt: skip
        if self.short_query_len > 1:
            n += paw.warmup(k_cache, v_cache, num_heads, self.max_splits, self.split_len,
                            1, prefill_only=True)  # fmt: skip
        return n

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self._write_kv(k, v, k_cache, v_cache, slot_mapping)

    def forward(
        self, q, k, v, k_cache, v_cache, md: AttentionMetadata, scale: float
    ) -> torch.Tensor:  # [T, H, D]
        self._write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        return self.attend(q, k_cache, v_cache, md, scale)

    def attend(self, q, k_cache, v_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._paged_attention(
            q, k_cache, v_cache, md, scale,
            max_splits=self.max_splits, split_len=self.split_len,
            short_query_len=(self.short_query_len if md.short_query_len is None
                             else md.short_query_len),
        )

    def draft_forward(
        self, q, k, v, k_cache, v_cache, ctx_lens, block_tables, max_ctx_len, scale
    ) -> torch.Tensor:  # [R, G, H, D]
        return self._draft_attention(
            q, k, v, k_cache, v_cache, ctx_lens, block_tables, max_ctx_len, scale,
            max_splits=self.max_splits, min_chunk=self.min_split_len,
        )
