"""Launch shapes of the paged attention kernels, from CPU numbers only: tile sizes, warps,
pipelining depth, flash-decoding splits, and the one- or two-launch plan of a step.

Nothing here reads a device tensor, so a plan is the same at capture and at replay of a CUDA
graph whatever the device-side query boundaries.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# the paged kernel sums a row's keys in segments of this many positions, whatever the step
# (see paged_attention): a multiple of every BLOCK_N (64 / 32 on a GPU, 16 interpreted)
SPLIT_LEN = 256
# a split step's partials ([segments, tokens, heads, head_dim] fp32) stay under this; past
# it the step does not split (the graphs' bound is max_model_len: many segments)
PARTIALS_MAX_BYTES = 128 << 20


def pick_num_splits(
    device: torch.device, num_programs: int, max_chunks: int, max_splits: int
) -> int:
    """Split the KV range only when the grid cannot fill the chip and some context spans
    several chunks (`max_chunks`: the most a row's keys make). The count is a power of two:
    NUM_SPLITS is a compile-time constant, so every distinct value is a kernel compiled on
    first use (~1 s in the middle of serving); `warmup` compiles them all at start-up."""
    sms = num_sms(device)
    if max_splits <= 1 or num_programs >= sms or max_chunks <= 1:
        return 1
    splits = min(max_splits, triton.cdiv(3 * sms, num_programs), max_chunks)
    return 1 << (max(1, splits).bit_length() - 1)  # round down to a power of two


def split_counts(max_splits: int) -> list[int]:
    """Every count `pick_num_splits` can return."""
    return [1 << i for i in range(max(1, max_splits).bit_length())]


DECODE_WARPS = 4  # warps of the decode / verify tile (<= 64 rows)
DECODE_MAXNREG: int | None = None  # a register cap for that tile (None: the compiler's)


def _launch_config(group_pad: int, max_query_len: int, head_dim: int, on_gpu: bool):
    """(BLOCK_Q, BLOCK_N, num_warps) from CPU-side numbers only."""
    rows = max(1, max_query_len) * group_pad
    if not on_gpu:  # interpreter: few, fat programs run fastest
        block_m = max(16, min(64, triton.next_power_of_2(rows)))
        return max(1, block_m // group_pad), 16, 1
    block_n = 64 if head_dim <= 128 else 32
    if rows <= 64:  # decode / verify rows: memory bound, all of a row's tokens in one tile
        block_m, warps = max(16, triton.next_power_of_2(rows)), DECODE_WARPS
    else:  # prefill
        block_m, warps = 128, 8
    block_m = max(block_m, group_pad)
    return block_m // group_pad, block_n, warps


TWO_PASS_MIN_RATIO = 4  # the prefill tile this many times the decode tile: two launches


class Launch(NamedTuple):
    """One kernel launch's compile-time shape and role."""

    block_q: int
    block_n: int
    warps: int
    pass_: int  # 0: every request; 1: requests of at most short_max tokens; 2: the others
    short_max: int


@functools.cache  # every eager attention call asks (once per layer): a few shapes repeat
def launch_plan(group_pad: int, max_query_len: int, head_dim: int, on_gpu: bool,
                short_query_len: int = 0) -> tuple[Launch, ...]:  # fmt: skip
    """The launches of one call: one over every request, or, when rows of up to
    `short_query_len` tokens may ride in a step whose longest query needs a much taller tile,
    a prefill-tile launch for the long requests and a decode-tile launch for the rest (CPU
    numbers only)."""
    bq, bn, warps = _launch_config(group_pad, max_query_len, head_dim, on_gpu)
    if 0 < short_query_len < max_query_len:
        sq, sn, sw = _launch_config(group_pad, short_query_len, head_dim, on_gpu)
        if bq >= TWO_PASS_MIN_RATIO * sq:
            # long first: when it splits, its combine writes every token's row (the short
            # rows from partials it never wrote); the short launch then writes those rows
            return Launch(bq, bn, warps, 2, sq), Launch(sq, sn, sw, 1, sq)
    return (Launch(bq, bn, warps, 0, 0),)


def num_stages(on_gpu: bool, rows: int, num_splits: int) -> int:
    """Pipelining depth. Measured on H200 (bf16, D=128, 2048 keys): a 16-row decode tile
    streams at 100% of copy bandwidth with 2 stages vs 73% with 3 when the grid is full (no
    splits), while split grids prefer 3; prefill (128 rows) prefers 2."""
    if not on_gpu:
        return 1
    return 3 if (num_splits > 1 and rows <= 64) else 2
