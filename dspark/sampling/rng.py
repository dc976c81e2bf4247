"""Counter-based random numbers keyed by (seed, position, round, purpose).

Every random decision of a request (sampling a token, accepting a draft, drawing a
residual, sampling a probabilistic draft) takes its uniform from a hash of the request's
seed, the absolute position of the token being decided, the request's decoding round and a
purpose tag. Consequences:
  * a request's randomness never depends on its batch neighbours (no shared generator);
  * no host sync and no generator state on the device: it is pure integer arithmetic;
  * a (seed, position, round, purpose) key is used for exactly one decision, so uniforms
    are never reused across steps (the round counter separates re-drafts of a position).

The mixing is the 32-bit "lowbias32" finaliser applied over int64 tensors; multiplications
are split into 16-bit halves so that no intermediate exceeds 2**49 (no signed overflow).
"""

from __future__ import annotations

import torch

from dspark.config import env_switch

_M32 = 0xFFFFFFFF

# Purpose tags: one independent stream per kind of decision.
SAMPLE = 1  # a token sampled from the target (plain decoding, bonus, correction)
ACCEPT = 2  # the accept/reject test of a draft token
RESIDUAL = 3  # a token drawn from a residual distribution after a rejection
DRAFT = 4  # a probabilistic draft token drawn from the drafter
BLOCK = 5  # the per-prefix uniforms of block verification


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def hash_keys(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash int64 keys (broadcast together) to 32-bit values in int64 tensors.

    Each key contributes its low and high 32 bits, so 64-bit seeds are fully used.
    """
    h: torch.Tensor | None = None
    for k in keys:
        kt = k if isinstance(k, torch.Tensor) else torch.tensor(k, dtype=torch.int64)
        kt = kt.to(torch.int64)
        for part in (kt & _M32, (kt >> 32) & _M32):
            h = _mix32(part + 0x9E3779B9) if h is None else _mix32(h ^ _mix32(part + 0x9E3779B9))
    assert h is not None
    return h


def _mix32_int(x: int) -> int:
    x &= _M32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & _M32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_ints(*keys: int) -> int:
    """hash_keys of Python ints, on Python ints: the same value, without the ~60 scalar tensor
    operations hash_keys takes for one key pair (a request's default seed, drawn on the
    engine's thread for every request it admits). Keys are int64 values."""
    h = None
    for k in keys:
        k &= 0xFFFFFFFFFFFFFFFF  # (a negative int64 key: its two's-complement bits)
        for part in (k & _M32, k >> 32):
            h = _mix32_int(part + 0x9E3779B9) if h is None else _mix32_int(
                h ^ _mix32_int(part + 0x9E3779B9))  # fmt: skip
    assert h is not None
    return h


# DSPARK_FUSED_OPS=0 keeps the torch code on CUDA too. Tests set ON_CPU to run the Triton
# kernel through the interpreter on CPU tensors.
_TRITON = env_switch("DSPARK_FUSED_OPS")
ON_CPU = False
_kernel = None


def _fused(t: torch.Tensor):
    """`rng_triton` if its one-kernel uniform should take tensors on t's device, else None."""
    global _kernel
    if not (_TRITON and (t.is_cuda or ON_CPU)):
        return None
    if _kernel is None:
        try:
            from dspark.sampling import rng_triton as _kernel
        except ImportError:  # pragma: no cover - no triton on this platform
            _kernel = False
    return _kernel or None


def uniform(
    seed: torch.Tensor, position: torch.Tensor, round_: torch.Tensor | int, purpose: int
) -> torch.Tensor:
    """Uniforms in the open interval (0, 1) as float64, one per broadcast element.

    48 bits of resolution (two 24-bit halves), enough for inverse-CDF sampling over large
    vocabularies. All inputs are int64 tensors (or ints) on the same device. On CUDA one
    Triton kernel computes exactly these bits (`rng_triton`).
    """
    kernel = _fused(position if isinstance(position, torch.Tensor) else seed)
    if kernel is not None:
        return kernel.uniform(seed, position, round_, purpose)
    return uniform_torch(seed, position, round_, purpose)


def uniform_torch(
    seed: torch.Tensor, position: torch.Tensor, round_: torch.Tensor | int, purpose: int
) -> torch.Tensor:
    """The reference (and CPU) code of `uniform`."""
    h1 = hash_keys(seed, position, round_, purpose)
    h2 = _mix32(h1 ^ 0x5BD1E995)
    hi = (h1 >> 8).to(torch.float64)
    lo = (h2 >> 8).to(torch.float64)
    return (hi * 16777216.0 + lo + 0.5) / 281474976710656.0
