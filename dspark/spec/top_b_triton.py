"""The lagged policy's device allocation (`allocation.allocate_top_b`) in one Triton launch.

The torch version sorts every slot's survival (a stable radix sort is several launches),
scatters ranks and sums per request: ~12 launches that every trimmed step pays inside its
graph. On the H200 the 33.6 M pair's overhead pass charged 2.5 ms of allocation to 75 steps
of 1.15 ms (fifteenth session): 2.8% of step time, where the goal for planning and
allocation together is 2%.
Here one program per request ranks its own K slots against every slot of the batch by
counting the slots that come before each in the same global order: descending survival,
ties by position, then by request (flat index position * R + request, as the stable sort on
the position-major layout orders them). A slot is admitted when its rank is below the
budget and it is under its request's capacity; the request's verify length is the count of
its admitted slots (a prefix: survivals never increase along a row, and equal ones are
ordered by position). R * K slots compared with R * K: fine for a decode batch (R <= 1024).

Survivals are the running product of the clamped confidences (NaN counts as 0), accumulated
in fp64 and rounded to the input dtype at each position: what torch's CPU cumprod does, so
that the CPU tests are exact. Nothing syncs with the host: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.triton_jit import unspecialized


@triton.jit
def _survival(conf_ptr, rows, offs_k, num_reqs, stride_r, K: tl.constexpr):
    """[rows, BLOCK_K] prefix survivals of `rows` (0 outside the batch)."""
    dt: tl.constexpr = conf_ptr.dtype.element_ty
    mask = (rows < num_reqs)[:, None] & (offs_k < K)[None, :]
    c = tl.load(conf_ptr + rows[:, None].to(tl.int64) * stride_r + offs_k[None, :], mask=mask,
                other=0.0)  # fmt: skip
    c = tl.where(c != c, 0.0, c)  # NaN -> 0
    c = tl.minimum(tl.maximum(c, 0.0), 1.0).to(tl.float64)
    run = tl.full([rows.shape[0]], 1.0, tl.float64)
    surv = tl.zeros(c.shape, dt)
    for j in tl.static_range(K):  # sequential product, each prefix rounded as torch stores it
        at_j = offs_k[None, :] == j
        run = run * tl.sum(tl.where(at_j, c, 0.0), axis=1)
        surv = tl.where(at_j, run.to(dt)[:, None], surv)
    return surv


@triton.jit(**unspecialized("num_reqs"))
def _top_b_kernel(
    conf_ptr, caps_ptr, budget_ptr, out_ptr, num_reqs, stride_r,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    me = r + tl.zeros([1], tl.int32)
    mine = tl.reshape(_survival(conf_ptr, me, offs_k, num_reqs, stride_r, K), [BLOCK_K])
    my_valid = offs_k < tl.load(caps_ptr + r)
    my_valid = my_valid & (offs_k < K)
    my_key = tl.where(my_valid, -mine, float("inf"))
    my_idx = offs_k * num_reqs + r
    rank = tl.zeros([BLOCK_K], tl.int32)
    for r0 in range(0, num_reqs, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        surv = _survival(conf_ptr, rows, offs_k, num_reqs, stride_r, K)
        caps = tl.load(caps_ptr + rows, mask=rows < num_reqs, other=0)
        valid = (offs_k[None, :] < caps[:, None]) & (offs_k < K)[None, :]
        key = tl.reshape(tl.where(valid, -surv, float("inf")), [BLOCK_R * BLOCK_K])
        idx = tl.reshape(offs_k[None, :] * num_reqs + rows[:, None], [BLOCK_R * BLOCK_K])
        # padding (rows past the batch, positions past K) has key +inf: it never comes
        # before a valid slot, and invalid slots are never admitted whatever their rank
        before = (key[None, :] < my_key[:, None]) | (
            (key[None, :] == my_key[:, None]) & (idx[None, :] < my_idx[:, None]))
        rank += tl.sum(before.to(tl.int32), axis=1)
    admitted = my_valid & (rank < tl.load(budget_ptr))
    tl.store(out_ptr + r, tl.sum(admitted.to(tl.int64), axis=0))


def allocate_top_b(conf: torch.Tensor, capacities: torch.Tensor,
                   budget: int | torch.Tensor) -> torch.Tensor:
    """Same contract as `allocation.allocate_top_b` (conf [R, K] with R, K > 0)."""
    num_reqs, k = conf.shape
    if conf.stride(1) != 1:
        conf = conf.contiguous()
    caps = capacities.to(device=conf.device, dtype=torch.int64).contiguous()
    out = torch.empty(num_reqs, dtype=torch.int64, device=conf.device)
    if not isinstance(budget, torch.Tensor):  # (a fill, not a copy: nothing syncs)
        budget = torch.full((), int(budget), dtype=torch.int64, device=conf.device)
    # one compiled variant per K and dtype: the block shapes do not depend on the batch
    block_k = triton.next_power_of_2(k)
    _top_b_kernel[(num_reqs,)](
        conf, caps, budget, out, num_reqs, conf.stride(0),
        K=k, BLOCK_K=block_k, BLOCK_R=max(1, 1024 // block_k), num_warps=4,
    )  # fmt: skip
    return out
