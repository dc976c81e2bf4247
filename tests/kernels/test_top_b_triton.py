"""The one-launch Triton allocation (dspark/spec/top_b_triton.py) against the torch sort it
replaces: the same verify lengths for random batches with NaN confidences, exact ties
(duplicated rows, confidences of 1 and 0), capacities below K and of 0, budgets from 0 to past
every slot, given as an int or as a 0-dim device tensor (as a whole-step graph passes it).
On CPU through Triton's interpreter at small sizes; on CUDA also at serving sizes and inside a
CUDA graph replayed with a changed budget."""

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, cuda_only = env.DEVICE, env.cuda_only

from dspark.spec import top_b_triton  # noqa: E402
from dspark.spec.allocation import allocate_top_b  # noqa: E402
from tests.kernels.test_fused_ops import fused_path, torch_path  # noqa: E402


def batch(num_reqs: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(num_reqs, k, generator=gen)
    conf[torch.rand(num_reqs, k, generator=gen) < 0.05] = float("nan")
    conf[torch.rand(num_reqs, k, generator=gen) < 0.05] = 1.0
    conf[torch.rand(num_reqs, k, generator=gen) < 0.03] = 0.0
    if num_reqs >= 4:  # identical rows: exact ties broken by request
        conf[num_reqs // 2] = conf[1]
        conf[num_reqs - 1] = conf[0]
    caps = torch.randint(0, k + 1, (num_reqs,), generator=gen)
    caps[0] = k
    return conf, caps


def reference(conf, caps, budget):
    with torch_path():
        return allocate_top_b(conf.cpu(), caps.cpu(), budget)


SIZES = [(1, 7), (3, 5), (17, 7), (12, 8), (20, 1), (9, 16)]  # the interpreter's: ~1 s each
if not env.INTERPRET:
    SIZES += [(64, 8), (133, 1), (40, 16), (256, 7), (1024, 7)]


@pytest.mark.parametrize("num_reqs, k", SIZES)
def test_lengths_match_the_torch_sort(num_reqs, k):
    conf, caps = batch(num_reqs, k, seed=num_reqs * 31 + k)
    total = int(caps.sum())
    budgets = sorted({0, 1, total // 3, total - 1, total, total + 5})
    for budget in budgets:
        ref = reference(conf, caps, budget)
        assert (ref > 0).any() or budget <= 0 or total == 0
        # (the wrapper fills an int budget into a tensor, so the kernel runs one path: the
        # tensor form is checked at two budgets, each launch ~0.3-0.7 s in the interpreter)
        for as_tensor in (False, True) if budget in (0, total // 3) else (False,):
            b = torch.tensor(budget, device=DEVICE) if as_tensor else budget
            got = top_b_triton.allocate_top_b(conf.to(DEVICE), caps.to(DEVICE), b)
            assert got.dtype == torch.int64
            assert got.cpu().tolist() == ref.tolist(), (budget, as_tensor)
            assert int(got.sum()) == min(max(budget, 0), total)  # exactly the budget's slots


def test_allocate_top_b_dispatches_to_the_kernel():
    conf, caps = batch(9, 7, seed=5)
    conf, caps = conf.to(DEVICE), caps.to(DEVICE)
    calls = []
    kernel = top_b_triton.allocate_top_b

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    top_b_triton.allocate_top_b = counted
    try:
        with fused_path():
            fused = allocate_top_b(conf, caps, 20)
        with torch_path():
            plain = allocate_top_b(conf, caps, 20)
    finally:
        top_b_triton.allocate_top_b = kernel
    assert calls == [1] and fused.tolist() == plain.tolist()


@cuda_only
def test_serving_sizes_and_graph_replay_with_a_new_budget():
    conf, caps = batch(512, 7, seed=11)
    conf, caps = conf.cuda(), caps.cuda()
    budget = torch.tensor(900, device="cuda")
    assert top_b_triton.allocate_top_b(conf, caps, budget).cpu().tolist() == reference(
        conf, caps, 900).tolist()  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = top_b_triton.allocate_top_b(conf, caps, budget)
    for b in (0, 37, 1500, 4000):
        budget.fill_(b)
        graph.replay()
        assert out.cpu().tolist() == reference(conf, caps, b).tolist()
