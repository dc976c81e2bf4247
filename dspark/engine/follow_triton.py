"""`follow.follow_inputs` in one Triton launch (CUDA; the torch code is the reference).

The torch version is ~25 small kernels (the token->row search, the gathers, the KV-slot
lookup, the row updates) that every speculative whole-step graph replays, following or not:
a few µs each on a step of ~1.3 ms. Here each program moves a block of tokens (the row found
by binary search over the packed query_start_loc, as searchsorted(right) - 1: padding tokens
map to R and keep their sentinel slot) and a block of rows, in place. Nothing syncs with the
host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized

_SEARCH_STEPS = 14  # binary-search halvings: rows + 1 <= 2 ** 14
_BLOCK = 256


@triton.jit(**unspecialized("num_tokens", "num_reqs", "table_width"))
def _follow_kernel(
    pos_ptr, slot_map_ptr, qsl_ptr, caps_ptr, req_slot_ptr, counts_ptr, tables_ptr,
    start_ptr, seq_lens_ptr, follows_ptr, follows_val, num_tokens, num_reqs, table_width,
    BLOCK_SIZE: tl.constexpr, FOLLOWS_PTR: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    follows = tl.load(follows_ptr) if FOLLOWS_PTR else follows_val
    # tokens: the last row r with qsl[r] <= t (R for padding tokens)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    in_stream = t < num_tokens
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + num_reqs + 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.load(qsl_ptr + mid, mask=in_stream, other=0) <= t
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    valid = in_stream & (lo < num_reqs)
    row = tl.where(valid, lo, 0)
    moves = tl.load(caps_ptr + row, mask=valid, other=0) > 0
    count = tl.load(counts_ptr + tl.load(req_slot_ptr + row, mask=valid, other=0), mask=valid,
                    other=0)  # fmt: skip
    shift = tl.where(valid & moves, count * follows, 0)
    pos = tl.load(pos_ptr + t, mask=in_stream, other=0) + shift
    tl.store(pos_ptr + t, pos, mask=in_stream)
    block = tl.load(tables_ptr + row.to(tl.int64) * table_width + pos // BLOCK_SIZE, mask=valid,
                    other=0)  # fmt: skip
    tl.store(slot_map_ptr + t, block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE, mask=valid)
    # rows: their start and sequence length
    r = pid * BLOCK + tl.arange(0, BLOCK)
    is_row = r < num_reqs
    r_moves = tl.load(caps_ptr + r, mask=is_row, other=0) > 0
    r_count = tl.load(counts_ptr + tl.load(req_slot_ptr + r, mask=is_row, other=0), mask=is_row,
                      other=0)  # fmt: skip
    r_shift = tl.where(is_row & r_moves, r_count * follows, 0)
    tl.store(start_ptr + r, tl.load(start_ptr + r, mask=is_row, other=0) + r_shift, mask=is_row)
    seq = tl.load(seq_lens_ptr + r, mask=is_row, other=0)
    tl.store(seq_lens_ptr + r, seq + r_shift.to(seq.dtype), mask=is_row)


def follow_inputs_triton(inp, last_counts: torch.Tensor, block_size: int, follows) -> None:
    """follow.follow_inputs, in place on inp's positions, slot mapping, starts and sequence
    lengths (each contiguous)."""
    t, r = inp.num_tokens, inp.num_reqs
    if r + 1 > 2**_SEARCH_STEPS:
        raise ValueError(f"{r} rows: more than the search covers")
    tables = inp.block_tables
    grid = (triton.cdiv(max(t, r, 1), _BLOCK),)
    on_device = isinstance(follows, torch.Tensor)
    _follow_kernel[grid](
        inp.positions, inp.slot_mapping, inp.query_start_loc, inp.capacities, inp.slots,
        last_counts, tables, inp.start_pos, inp.seq_lens,
        follows if on_device else last_counts, 0 if on_device else int(follows),
        t, r, tables.stride(0), BLOCK_SIZE=block_size, FOLLOWS_PTR=on_device,
        SEARCH_STEPS=_SEARCH_STEPS, BLOCK=_BLOCK,
    )  # fmt: skip
