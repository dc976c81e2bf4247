"""`rng.uniform` as one Triton kernel (CUDA), bit-identical to the torch code in rng.py.

The torch code runs ~300 elementwise kernels per call (4 keys x 2 halves x two 32-bit mixes,
each split into 16-bit products to stay inside int64); at small batches that is milliseconds
of launch overhead per sampling or verification step. Here every element hashes its keys in
registers. Arithmetic is uint64 with explicit 32-bit masks, so no product can overflow (both
factors are < 2**32) and the result equals the torch code's for every input; tests compare the
two bit for bit (interpreter on CPU, compiled on CUDA). Shapes alone fix the grid: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized

_BLOCK = 1024


@triton.jit
def _mix32(x):
    # x: uint64 < 2**32; lowbias32 finaliser, products reduced mod 2**32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _absorb(h, key, FIRST: tl.constexpr):
    # key: int64 -> its low then high 32 bits, each mixed into h (rng.hash_keys)
    bits = key.to(tl.uint64, bitcast=True)
    lo = bits & 0xFFFFFFFF
    hi = (bits >> 32) & 0xFFFFFFFF
    if FIRST:
        h = _mix32((lo + 0x9E3779B9) & 0xFFFFFFFF)
    else:
        h = _mix32(h ^ _mix32((lo + 0x9E3779B9) & 0xFFFFFFFF))
    return _mix32(h ^ _mix32((hi + 0x9E3779B9) & 0xFFFFFFFF))


@triton.jit
def uniform_of(seed, pos, rnd, purpose):
    """The uniform (fp64) of int64 keys (scalars or blocks alike; rng.uniform's bits), for
    kernels that draw in place (softmax_sample_triton's one-program kernel)."""
    h = _absorb(tl.zeros_like(seed).to(tl.uint64), seed, True)
    h = _absorb(h, pos, False)
    h = _absorb(h, rnd, False)
    h = _absorb(h, tl.zeros_like(seed) + purpose, False)
    h2 = _mix32(h ^ 0x5BD1E995)
    hi = (h >> 8).to(tl.float64)
    lo = (h2 >> 8).to(tl.float64)
    return (hi * 16777216.0 + lo + 0.5) / 281474976710656.0


@triton.jit(**unspecialized("seed_ptr", "pos_ptr", "round_ptr", "n", "purpose"))
def _uniform_kernel(seed_ptr, pos_ptr, round_ptr, out_ptr, n, purpose, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    rnd = tl.load(round_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, uniform_of(seed, pos, rnd, purpose), mask=mask)


def uniform(
    seed: torch.Tensor, position: torch.Tensor, round_: torch.Tensor | int, purpose: int
) -> torch.Tensor:
    """Same contract as `rng.uniform` for int64 tensors on one device."""
    dev = position.device if isinstance(position, torch.Tensor) else seed.device
    # ints become device tensors by a fill (no host->device copy: safe in graph capture)
    keys = [k if isinstance(k, torch.Tensor) else torch.full((), k, device=dev)
            for k in (seed, position, round_)]  # fmt: skip
    keys = [k.to(dev, torch.int64) for k in keys]
    shape = torch.broadcast_shapes(*(k.shape for k in keys))
    flat = [k.expand(shape).contiguous().view(-1) for k in keys]
    out = torch.empty(shape, dtype=torch.float64, device=dev)
    n = out.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _uniform_kernel[grid](flat[0], flat[1], flat[2], out, n, int(purpose), BLOCK=_BLOCK)
    return out
