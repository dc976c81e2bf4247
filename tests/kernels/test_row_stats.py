"""The draft probability and argmax of every row (softmax_sample_triton's
draft_prob_and_argmax) against the torch path it replaces in verification:
processed_probs(logits, T) gathered at the draft token, and logits.argmax. Random logits
(never zeros), ragged temperatures with greedy rows, -inf columns, ties, many chunks per row.
Then `verify` and plain sampling with and without their kernels (this one and the module's
final-token and plain draws): identical accepted lengths and tokens on the same keyed
uniforms away from rounding boundaries."""

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, HAS_CUDA, INTERPRET, cuda_only, ops = (env.DEVICE, env.HAS_CUDA, env.INTERPRET,
                                               env.cuda_only, env.ops)  # fmt: skip

from dspark.sampling.processors import GREEDY_EPS, processed_probs  # noqa: E402
from dspark.sampling.softmax_sample_triton import draft_prob_and_argmax  # noqa: E402
from dspark.spec import verify as verify_mod  # noqa: E402

BLOCK = 64 if INTERPRET else 2048


def reference(logits, temperature, tokens):
    probs = processed_probs(logits, temperature)
    return probs.gather(1, tokens.unsqueeze(1)).squeeze(1), logits.argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 1000), (7, 999), (3, 64), (5, 37)])
def test_matches_the_torch_path(dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.1
    temperature[0] = 0.0  # a greedy row
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    tokens[0] = logits[0].float().argmax()  # greedy and accepted ...
    if rows > 2:
        tokens[1] = logits[1].float().argmax()  # ... and a sampled row at its mode
        logits[2, : vocab // 3] = float("-inf")  # masked columns
        tokens[2] = 0  # a draft token of probability zero
    if rows > 3:
        logits[3, 5] = logits[3, 17] = logits[3].max() + 1  # a tie: the first index wins
    want_p, want_arg = reference(logits.float(), temperature, tokens)
    p, arg = draft_prob_and_argmax(logits.to(DEVICE), temperature.to(DEVICE), tokens.to(DEVICE),
                                   GREEDY_EPS, block=BLOCK)  # fmt: skip
    assert torch.equal(arg.cpu(), want_arg)
    torch.testing.assert_close(p.cpu(), want_p, rtol=2e-5, atol=1e-7)
    assert p[0].item() == 1.0 and (rows < 3 or p[2].item() == 0.0)


def _verify_inputs(num_reqs, k, vocab, gen, dev, point_mass=False, buffer=False):
    lengths = torch.randint(0, k + 1, (num_reqs,), generator=gen)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths + 1, 0)
    n = int(cu[-1])
    logits = torch.randn(n + 3, vocab, generator=gen) * 2  # 3 padding rows at the end
    drafts = torch.randint(0, vocab, (num_reqs, k), generator=gen)
    probs = torch.softmax(torch.randn(num_reqs, k, vocab, generator=gen), -1)
    # drafts that the target likes often, so that some are accepted
    for r in range(num_reqs):
        for j in range(int(lengths[r])):
            if torch.rand((), generator=gen) < 0.6:
                drafts[r, j] = logits[int(cu[r]) + j].argmax()
    temperature = torch.rand(num_reqs, generator=gen) + 0.3
    temperature[0] = 0.0
    draft_rows = None
    if buffer:  # the drafts' laws in a per-request buffer of more rows, in another order
        draft_rows = torch.randperm(num_reqs + 3, generator=gen)[:num_reqs]
        full = torch.full((num_reqs + 3, k, vocab), float("nan"))
        full[draft_rows] = probs
        probs = full
    return verify_mod.VerifyInputs(
        target_logits=logits.to(dev), cu_num_logits=cu.to(dev), draft_token_ids=drafts.to(dev),
        draft_probs=None if point_mass else probs.to(dev), temperature=temperature.to(dev),
        top_k=None, top_p=None,
        min_p=None, seeds=torch.arange(num_reqs, dtype=torch.int64, device=dev) * 7 + 3,
        anchor_positions=torch.randint(5, 50, (num_reqs,), generator=gen).to(dev),
        rounds=torch.randint(0, 9, (num_reqs,), generator=gen).to(dev),
        draft_rows=None if draft_rows is None else draft_rows.to(dev),
    )  # fmt: skip


@pytest.mark.parametrize("method,point_mass,buffer", [
    ("standard", False, False), ("standard", True, False), ("standard", False, True),
    ("block", False, False)])  # fmt: skip
def test_verify_takes_the_kernels_and_decides_the_same(monkeypatch, method, point_mass, buffer):
    """`verify` (temperature only) routes its per-row pass (standard method) and its final
    tokens (both methods: residuals against the drafts' laws or point masses, bonus rows)
    through the kernels when fused ops are on, and accepts and emits the same tokens as the
    torch path."""
    calls = []
    real = verify_mod._fused_row_stats

    def spy(logits):
        fn = real(logits)
        calls.append(fn is not None)
        return fn

    monkeypatch.setattr(verify_mod, "_fused_row_stats", spy)
    gen = torch.Generator().manual_seed(11)
    finals = []
    monkeypatch.setattr(verify_mod, "_fused_final",
                        lambda *a, real=verify_mod._fused_final: finals.append(1) or real(*a))
    rejected = 0
    for _ in range(3):
        inp = _verify_inputs(6, 4, 97, gen, DEVICE, point_mass, buffer)
        monkeypatch.setattr(ops, "ON_CPU", False)
        want = verify_mod.verify(inp, method) if DEVICE == "cpu" else None
        monkeypatch.setattr(ops, "ON_CPU", True)
        got = verify_mod.verify(inp, method)
        if want is None:  # CUDA: the torch path with fused ops off
            monkeypatch.setattr(ops, "ENABLED", False)
            want = verify_mod.verify(inp, method)
            monkeypatch.setattr(ops, "ENABLED", True)
        assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(),
                                                                        want[1].cpu())
        assert int(got[1].sum()) > 6  # some drafts were accepted
        lengths = (inp.cu_num_logits[1:] - inp.cu_num_logits[:-1] - 1).cpu()
        rejected += int((got[1].cpu() - 1 < lengths).sum())  # final token from a residual
    assert rejected > 0 and finals
    assert (True in calls and False in calls) or method == "block"  # both paths ran


def test_other_filters_and_block_keep_the_torch_path(monkeypatch):
    monkeypatch.setattr(ops, "ON_CPU", True)
    gen = torch.Generator().manual_seed(5)
    inp = _verify_inputs(3, 3, 50, gen, DEVICE)
    seen = []
    monkeypatch.setattr(verify_mod, "_fused_row_stats",
                        lambda logits: seen.append(1) or None)  # fmt: skip
    inp.top_p = torch.full((3,), 0.9, device=DEVICE)
    verify_mod.verify(inp)
    inp.top_p = None
    verify_mod.verify(inp, method="block")
    assert seen == []  # neither asked for the per-row kernel


def test_plain_sampling_takes_the_kernel_and_draws_the_same(monkeypatch):
    """sample_tokens with temperature alone draws through the fused softmax + inverse CDF
    and gives the torch path's tokens (greedy rows among them)."""
    from dspark.sampling.sampler import sample_tokens

    gen = torch.Generator().manual_seed(2)
    n, r, vocab = 9, 4, 300
    logits = (torch.randn(n, vocab, generator=gen) * 2).to(DEVICE)
    row = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3], device=DEVICE)
    temperature = torch.tensor([0.7, 0.0, 1.0, 1.6], device=DEVICE)
    args = (logits, row, torch.arange(n, device=DEVICE) + 40, temperature, None, None, None,
            torch.arange(r, device=DEVICE) * 5 + 1, torch.zeros(r, dtype=torch.int64,
                                                                device=DEVICE), False)  # fmt: skip
    monkeypatch.setattr(ops, "ON_CPU", False)
    want = sample_tokens(*args)
    monkeypatch.setattr(ops, "ON_CPU", True)
    import dspark.sampling.softmax_sample_triton as kernel

    calls, real = [], kernel.sample_softmax
    monkeypatch.setattr(kernel, "sample_softmax", lambda *a, **k: calls.append(1) or real(*a))
    got = sample_tokens(*args)
    assert calls and torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got[2:5].cpu(), logits[2:5].argmax(-1).cpu())  # request 1 is greedy


@cuda_only
def test_qwen_vocabulary_on_cuda():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(300, 151936, generator=g) * 4).to(torch.bfloat16)
    temperature = torch.rand(300, generator=g) + 0.2
    tokens = torch.randint(0, 151936, (300,), generator=g)
    want_p, want_arg = reference(logits.float(), temperature, tokens)
    p, arg = draft_prob_and_argmax(logits.cuda(), temperature.cuda(), tokens.cuda(), GREEDY_EPS)
    assert torch.equal(arg.cpu(), want_arg)
    torch.testing.assert_close(p.cpu(), want_p, rtol=2e-5, atol=1e-9)
