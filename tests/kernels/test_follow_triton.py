"""The following step's input move in one Triton launch (dspark/engine/follow_triton.py)
against the torch code it replaces, on random ragged steps: rows with and without draft
slots, zero-length and padding rows, padding tokens, block tables in random order. Runs on
the CPU through TRITON_INTERPRET=1 and on CUDA when there is one."""

import os
from types import SimpleNamespace

import pytest
import torch

from dspark.attention.base import SENTINEL_SLOT
from dspark.engine import follow

DEVICES = ["cuda"] if torch.cuda.is_available() else []
if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICES.append("cpu")
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")


def _step(seed: int, device: str, num_reqs: int, padding_rows: int, padding_tokens: int,
          block_size: int, k: int = 3):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    r = num_reqs + padding_rows
    caps = torch.randint(0, 2, (r,), generator=g) * k  # rows with drafts, and prompts
    caps[0], caps[num_reqs:] = k, 0
    q_len = torch.where(caps > 0, 1 + caps, torch.randint(1, 9, (r,), generator=g))
    q_len[num_reqs:] = 0  # (padding rows)
    qsl = torch.zeros(r + 1, dtype=torch.int64)
    qsl[1:] = q_len.cumsum(0)
    real = int(qsl[-1])
    t = real + padding_tokens
    start = torch.randint(0, 40, (r,), generator=g)
    width = -(-(40 + 9 + 2 * (k + 1)) // block_size) + 1
    tables = torch.randperm(r * width + 7, generator=g)[: r * width].view(r, width) + 1
    row = torch.repeat_interleave(torch.arange(r), q_len)
    pos = torch.zeros(t, dtype=torch.int64)
    pos[:real] = start[row] + torch.arange(real) - qsl[row]
    slots = torch.full((t,), SENTINEL_SLOT, dtype=torch.int64)
    slots[:real] = tables[row, pos[:real] // block_size] * block_size + pos[:real] % block_size
    req_slot = torch.randperm(64, generator=g)[:r]
    counts = torch.randint(1, k + 2, (65,), generator=g)
    inp = SimpleNamespace(
        num_reqs=r, num_tokens=t, positions=pos, slot_mapping=slots,
        query_start_loc=qsl.to(torch.int32), capacities=caps, slots=req_slot,
        block_tables=tables.to(torch.int32), start_pos=start, seq_lens=(start + q_len).int())
    for name, value in vars(inp).items():
        if isinstance(value, torch.Tensor):
            setattr(inp, name, value.to(device))
    return inp, counts.to(device)


def _copy(inp):
    return SimpleNamespace(**{n: v.clone() if isinstance(v, torch.Tensor) else v
                              for n, v in vars(inp).items()})  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,num_reqs,padding_rows,padding_tokens,block_size", [
    (0, 5, 0, 0, 4), (1, 9, 3, 11, 16), (2, 1, 2, 5, 8), (3, 40, 8, 300, 16), (4, 3, 0, 1, 4),
])  # fmt: skip
@pytest.mark.parametrize("on_device_flag", [False, True])
def test_one_launch_moves_rows_as_the_torch_code(device, seed, num_reqs, padding_rows,
                                                 padding_tokens, block_size, on_device_flag):
    from dspark.engine.follow_triton import follow_inputs_triton

    inp, counts = _step(seed, device, num_reqs, padding_rows, padding_tokens, block_size)
    ref = _copy(inp)
    fused = follow.FUSED
    follow.FUSED = False  # (the torch code, also on CUDA)
    try:
        follow.follow_inputs(ref, counts, block_size, 1)
    finally:
        follow.FUSED = fused
    flag = torch.tensor(1, device=device) if on_device_flag else 1
    before = _copy(inp)
    follow_inputs_triton(inp, counts, block_size, flag)
    assert not torch.equal(inp.positions.cpu(), before.positions.cpu())  # (rows did move)
    for name in ("positions", "slot_mapping", "start_pos", "seq_lens"):
        got, want = getattr(inp, name), getattr(ref, name)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu()), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_that_does_not_follow_is_left_as_it_was(device):
    from dspark.engine.follow_triton import follow_inputs_triton

    inp, counts = _step(5, device, 12, 4, 9, 4)
    before = _copy(inp)
    follow_inputs_triton(inp, counts, 4, torch.tensor(0, device=device))
    for name in ("positions", "slot_mapping", "start_pos", "seq_lens"):
        assert torch.equal(getattr(inp, name).cpu(), getattr(before, name).cpu()), name
    follow_inputs_triton(inp, counts, 4, 1)  # (and the same step following: rows move)
    assert not torch.equal(inp.start_pos.cpu(), before.start_pos.cpu())
