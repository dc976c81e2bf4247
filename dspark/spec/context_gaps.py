"""Skipping the drafter's context write while drafting is off; rebuilding it before drafting.

While the drafting decision has drafting off (spec/drafting.py), a speculative engine's plain
decode step still wrote the drafter's context for its tokens, so that drafting could resume
at any step: the target's layer outputs kept, the drafter's fc and K/V projections, the fused
write (~15 small kernels). Where such steps are device-bound that is most of what adaptive's
plain steps cost beyond no speculation's: the trained 33.6 M pair on an H100, T = 1, c = 4,
0.43 ms a step against 0.40 (forty-seventh session), its cost table's 4-token forward 0.38 ms.

With `speculative_config.skip_idle_context_write` those steps write none (the predicate is
`SpecDecoder.skips_context_write`, read by the whole-step graphs' IDLE plain family and the
per-phase path alike), and each request keeps the first position whose context is missing
(`Request.context_gap`, set here at launch). Before a step that drafts for a row with a gap,
the gap is rebuilt (`rebuild_gaps`): the target runs again over the gap's tokens, one ragged
prefill batch that reads its own KV from the cache and writes none (every KV slot the
sentinel: recomputed in another batch shape a value could move in its last bit, and T = 0
outputs with it), and the drafter's context is written from the layer outputs it returns.
A prefill chunk still writes the context (a prompt's context would cost its prefill again),
so a gap only ever covers decoded tokens, and a probe rebuilds the rows it drafts for.

Blocks at or past a gap are not registered in the prefix cache (block_manager.
cache_full_blocks): a block reused by another request lends it its drafter context too.

Lossless either way: drafts decide only what is verified, never what is emitted.

Measured (H100, trained pair, T = 1, fifty-first session): the plain step's device time fell
to no speculation's (438 against 451 µs), but the rebuilds, eager target runs before every
draft probe, left the engine 10.7-17.0% behind no speculation at c = 16-32 against 6.5-12.7%
without the option. Hence off by default.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.attention.base import SENTINEL_SLOT, AttentionMetadata, compute_token_to_req
from dspark.spec.drafting import PROBE_ROWS


def mark_gaps(rows) -> None:
    """The step about to launch writes no context: each row's context is missing from the
    step's first token on, unless a gap already starts earlier (it runs to the end)."""
    for row in rows:
        req = row.req
        if req.context_gap is None:
            req.context_gap = req.num_computed_tokens


def rows_to_rebuild(rows, probing: bool) -> list[int]:
    """Indices of the rows with a gap that the step about to launch drafts for (a probe
    drafts for its first PROBE_ROWS rows)."""
    rows = rows[:PROBE_ROWS] if probing else rows
    return [i for i, row in enumerate(rows) if row.req.context_gap is not None]


@torch.inference_mode()
def rebuild_gaps(runner, rows, block_tables: np.ndarray, idx: list[int]) -> int:
    """Write the drafter's context over the gaps of rows `idx` (block_tables: the step's, row
    i of rows i), in batches of at most max_num_batched_tokens tokens. Returns the tokens
    recomputed. A gap covers the positions from `context_gap` to the row's computed tokens,
    whose KV is in the cache (or being written by a step still in flight, ahead on the
    stream) and whose tokens are on the host: the only tokens not yet there are those a step
    in flight samples, at or past the computed ones. (Were one missing, the gap would stay
    open from it.)"""
    limit = runner.config.max_num_batched_tokens
    batch, size, total = [], 0, 0
    for i in idx:
        req = rows[i].req
        start, end = req.context_gap, min(req.num_computed_tokens, len(req.token_ids))
        req.context_gap = None if end >= req.num_computed_tokens else end
        while start < end:  # (a gap longer than a batch: in pieces, in order)
            n = min(end - start, limit - size)
            batch.append((i, req, start, start + n))
            start, size = start + n, size + n
            if size == limit:
                _rebuild(runner, batch, block_tables)
                total, batch, size = total + size, [], 0
    if batch:
        _rebuild(runner, batch, block_tables)
        total += size
    return total


def _rebuild(runner, batch: list[tuple], block_tables: np.ndarray) -> None:
    """One ragged batch of (row index, request, first position, end position) pieces."""
    device, bs, spec = runner.device, runner.block_size, runner.spec
    lens = np.array([e - s for _, _, s, e in batch], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)])
    pos = np.concatenate([np.arange(s, e, dtype=np.int64) for _, _, s, e in batch])
    ids = np.concatenate([np.asarray(req.token_ids[s:e], dtype=np.int64)
                          for _, req, s, e in batch])  # fmt: skip
    tables = block_tables[[i for i, _, _, _ in batch]]  # [R, B]
    row = np.repeat(np.arange(len(batch)), lens)
    slots = tables[row, pos // bs] * bs + pos % bs
    ends = np.array([e for _, _, _, e in batch], dtype=np.int64)

    def t(a, dtype=torch.int64):
        return torch.as_tensor(a, dtype=dtype).to(device, non_blocking=True)

    qsl_t, num_tokens = t(qsl, torch.int32), int(qsl[-1])
    positions = t(pos)
    md = AttentionMetadata(
        query_start_loc=qsl_t, seq_lens=t(ends, torch.int32), block_tables=t(tables, torch.int32),
        # the target's KV of these tokens is in the cache already: written again, a value
        # recomputed in this batch shape could differ in its last bit
        slot_mapping=torch.full((num_tokens,), SENTINEL_SLOT, dtype=torch.int64, device=device),
        positions=positions, token_to_req=compute_token_to_req(qsl_t, num_tokens),
        max_query_len=int(lens.max()), max_seq_len=int(ends.max()), num_reqs=len(batch),
    )  # fmt: skip
    _, aux = runner.eager_forward(t(ids), md)
    spec.drafter.write_context(aux, positions, t(slots), spec.kv_caches, runner.backend)
