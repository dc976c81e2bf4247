"""The one-kernel Triton `rng.uniform` (dspark.sampling.rng_triton) against the torch code it
replaces: bit-identical float64 uniforms for random 64-bit keys (negative and huge seeds
included), broadcast shapes, int and tensor rounds, and every purpose. On CPU the kernel runs
through Triton's interpreter; on CUDA compiled, plus a CUDA-graph replay."""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark.sampling import rng, rng_triton  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
PURPOSES = (rng.SAMPLE, rng.ACCEPT, rng.RESIDUAL, rng.DRAFT, rng.BLOCK)


def _keys(n: int, gen: torch.Generator):
    full = torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64)
    small = torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int64)
    seeds = torch.cat([full[: n // 2], small[n // 2 :]])
    seeds[:3] = torch.tensor([0, -1, 2**63 - 1])
    pos = torch.randint(0, 1 << 40, (n,), generator=gen, dtype=torch.int64)
    rounds = torch.randint(0, 1 << 20, (n,), generator=gen, dtype=torch.int64)
    return seeds.to(DEVICE), pos.to(DEVICE), rounds.to(DEVICE)


@pytest.mark.parametrize("purpose", PURPOSES)
def test_bit_identical_flat(purpose):
    seeds, pos, rounds = _keys(3000, torch.Generator().manual_seed(purpose))
    got = rng_triton.uniform(seeds, pos, rounds, purpose)
    ref = rng.uniform_torch(seeds, pos, rounds, purpose)
    assert got.dtype == torch.float64 and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert bool(((got > 0) & (got < 1)).all())
    assert got.unique().numel() > 2990  # not a constant or a short cycle


def test_bit_identical_broadcast_and_int_round():
    seeds, pos, rounds = _keys(37, torch.Generator().manual_seed(9))
    slots = torch.arange(7, device=DEVICE)
    args = (seeds.unsqueeze(1), pos.unsqueeze(1) + 1 + slots, rounds.unsqueeze(1), rng.ACCEPT)
    got = rng_triton.uniform(*args)
    assert got.shape == (37, 7) and torch.equal(got, rng.uniform_torch(*args))
    got = rng_triton.uniform(seeds, pos, 3, rng.SAMPLE)  # round as a Python int
    assert torch.equal(got, rng.uniform_torch(seeds, pos, 3, rng.SAMPLE))
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert rng_triton.uniform(empty, empty, empty, rng.SAMPLE).shape == (0,)


def test_dispatch_routes_through_the_kernel(monkeypatch):
    """rng.uniform takes the kernel path when allowed (CUDA, or ON_CPU under the interpreter)
    and gives the same bits as the reference."""
    monkeypatch.setattr(rng, "ON_CPU", True)
    seeds, pos, rounds = _keys(64, torch.Generator().manual_seed(1))
    assert rng._fused(pos) is rng_triton
    assert torch.equal(rng.uniform(seeds, pos, rounds, rng.DRAFT),
                       rng.uniform_torch(seeds, pos, rounds, rng.DRAFT))
    monkeypatch.setattr(rng, "_TRITON", False)
    assert rng._fused(pos) is None


@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA device")
def test_cuda_graph_replay_matches():
    seeds, pos, rounds = _keys(256, torch.Generator().manual_seed(2))
    out = torch.empty(256, dtype=torch.float64, device="cuda")
    rng_triton.uniform(seeds, pos, rounds, rng.SAMPLE)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(rng_triton.uniform(seeds, pos, 5, rng.SAMPLE))
    pos.add_(17)  # new keys in the same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rng.uniform_torch(seeds, pos, 5, rng.SAMPLE))
