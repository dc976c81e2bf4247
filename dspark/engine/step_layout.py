"""The host layout of a whole-step CUDA graph's inputs and outputs (see step_graph.py).

One flat int64 buffer per request bucket R and token count T: per-row segments first, so the
drafter's graph (rows only) reads the same offsets whatever T, then the token stream. The host
fills it from a HostStep (`fill_host`), padding rows with zero length, the scratch draft row
and neutral sampling parameters, padding tokens with the sentinel KV slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention.base import SENTINEL_SLOT
from dspark.engine.input_batch import HostStep

# per-row int64 segments of the layout, in this order (HostStep.ints keeps the same order)
ROW_FIELDS = ("samples", "caps", "nd", "start", "slots", "seeds", "rounds", "top_k")
_PAD_FLOATS = np.array([1.0, 1.0, 0.0], dtype=np.float32)  # temperature, top_p, min_p
_PAD_FLOAT_BITS = _PAD_FLOATS.view(np.int32).astype(np.int64)[:, None]
_PAD_ROWS = np.zeros((len(ROW_FIELDS), 1), dtype=np.int64)  # then slots -> the scratch row
_PAD_STREAM = np.array([[0], [0], [SENTINEL_SLOT]], dtype=np.int64)  # id, position, KV slot


@dataclass(frozen=True)
class Layout:
    """Offsets of one bucket's step in the flat int64 buffer. Per-row segments come first so
    that graph B (rows only) reads the same offsets whatever A's token count."""

    rows: int  # R (bucket)
    tokens: int  # T (bucket)
    blocks: int  # block-table width

    @property
    def floats(self) -> int:  # [3, R] float32 bits (temperature, top_p, min_p)
        return 8 * self.rows

    @property
    def qsl(self) -> int:
        return self.floats + 3 * self.rows

    @property
    def seq_lens(self) -> int:
        return self.qsl + self.rows + 1

    @property
    def block_tables(self) -> int:
        return self.seq_lens + self.rows

    @property
    def stream(self) -> int:  # [4, T]: input ids, positions, slot mapping, draft source
        return self.block_tables + self.rows * self.blocks

    @property
    def budget(self) -> int:  # one slot: the lagged plan's draft budget (-1: none)
        return self.stream + 4 * self.tokens

    @property
    def follows(self) -> int:  # one slot: 1 if the step follows the one in flight (follow.py)
        return self.budget + 1

    @property
    def size(self) -> int:
        return self.budget + 2


def fill_host(host: HostStep, lay: Layout, buf: np.ndarray, scratch_slot: int, k: int,
              budget: int | None = None) -> None:
    """Write `host` (and the draft budget) into buf[:lay.size], laid out and padded for the
    bucket `lay`."""
    r, t, b = host.get("num_reqs"), host.get("num_tokens"), host.get("max_blocks")
    rb, tb = lay.rows, lay.tokens
    ints = host.ints  # [ids t, positions t, slots t, qsl r+1, seq lens r, tables r*b, rows 8r]
    o_qsl, o_tables = 3 * t, 3 * t + 2 * r + 1
    rows = buf[: 8 * rb].reshape(8, rb)
    rows[:, :r] = ints[o_tables + r * b :].reshape(8, r)
    rows[:, r:] = _PAD_ROWS
    rows[ROW_FIELDS.index("slots"), r:] = scratch_slot
    floats = buf[lay.floats : lay.qsl].reshape(3, rb)  # float32 bits
    floats[:, :r] = host.floats.view(np.int32)
    floats[:, r:] = _PAD_FLOAT_BITS
    buf[lay.qsl : lay.qsl + r + 1] = ints[o_qsl : o_qsl + r + 1]
    buf[lay.qsl + r + 1 : lay.seq_lens] = t  # zero-length padding rows
    buf[lay.seq_lens : lay.seq_lens + r] = ints[o_qsl + r + 1 : o_tables]
    buf[lay.seq_lens + r : lay.block_tables] = 0
    tables = buf[lay.block_tables : lay.stream].reshape(rb, lay.blocks)
    tables[:] = 0
    tables[:r, :b] = ints[o_tables : o_tables + r * b].reshape(r, b)
    stream = buf[lay.stream : lay.budget].reshape(4, tb)
    stream[:3, :t] = ints[: 3 * t].reshape(3, t)
    stream[:3, t:] = _PAD_STREAM
    stream[3] = -1  # draft source: row * K + slot in the draft buffer, -1 = not a draft
    dst, src_row, src_k = host.draft_fill
    stream[3, dst] = src_row * k + src_k
    buf[lay.budget] = -1 if budget is None else budget
    buf[lay.follows] = host.get("follows")


def pack_outputs(out: torch.Tensor, num_out: torch.Tensor, lengths: torch.Tensor):
    """A step's outputs as one int64 tensor (one device->host copy): tokens [R, width] row by
    row, emitted [R], verified [R]; `unpack_outputs` reads it back."""
    return torch.cat([out.flatten(), num_out.long(), lengths.long()])


def unpack_outputs(host: np.ndarray, num_reqs: int, rows: int, width: int):
    """(tokens [R, width], emitted [R], verified [R]) of the real rows of a bucket layout."""
    out = host[: rows * width].reshape(rows, width)[:num_reqs]
    num_out = host[rows * width : rows * width + num_reqs]
    lengths = host[rows * (width + 1) : rows * (width + 1) + num_reqs]
    return out, num_out, lengths
