"""The fused probabilistic draft slot (dspark.sampling.softmax_sample_triton) against the torch
path it replaces in the drafter: processed_probs(float(base) + float(bias), T) and
sample_from_probs at the same uniform. Random logits (never zeros), greedy rows mixed in,
-inf columns, a tie, a uniform at the top edge, many chunks per row (small column blocks
under the interpreter); then the drafter's probabilistic proposals with and without it."""

import functools

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, HAS_CUDA, INTERPRET, cuda_only, ops = (env.DEVICE, env.HAS_CUDA, env.INTERPRET,
                                               env.cuda_only, env.ops)  # fmt: skip

from dspark.sampling.processors import GREEDY_EPS, processed_probs, sample_from_probs  # noqa: E402
from dspark.sampling.softmax_sample_triton import sample_softmax  # noqa: E402

BLOCK = 64 if INTERPRET else 2048


def case(rows, vocab, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, 2, vocab, generator=g) * 3).to(dtype)[:, 1]  # a slot's slice
    bias = torch.randn(rows, vocab, generator=g) if with_bias else None
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    temperature[0] = 0.0  # a greedy row
    u = torch.rand(rows, generator=g, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)
    if rows > 2:
        base[1, : vocab // 2] = float("-inf")  # half the vocabulary impossible
        u[2] = 1 - 1e-15  # the top edge: the last token with mass
    if rows > 3:
        base[3] = 0.0
        base[3, 7] = base[3, 30] = 5.0  # a tie at the top (first index for argmax)
        temperature[3] = 0.0
    return base, bias, temperature, u


def reference(base, bias, temperature, u):
    logits = base.float() if bias is None else base.float() + bias.float()
    probs = processed_probs(logits, temperature)
    return probs, sample_from_probs(probs, u)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 1000), (6, 999), (4, 64), (5, 37)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_the_torch_path(dtype, rows, vocab, with_bias):
    base, bias, temperature, u = case(rows, vocab, dtype, rows * vocab, with_bias)
    want_p, want_tok = reference(base, bias, temperature, u)
    probs = torch.full((rows, 3, vocab), -1.0)[:, 2].to(DEVICE)  # a strided slot, pre-filled
    tokens = torch.full((rows, 2), -1, dtype=torch.int64)[:, 1].to(DEVICE)
    sample_softmax(base.to(DEVICE), None if bias is None else bias.to(DEVICE),
                   temperature.to(DEVICE), u.to(DEVICE), GREEDY_EPS, tokens, probs,
                   block=BLOCK)  # fmt: skip
    torch.testing.assert_close(probs.cpu(), want_p, rtol=2e-5, atol=1e-7)
    assert torch.equal(tokens.cpu(), want_tok)
    p = probs.cpu()
    assert torch.all(p.gather(1, tokens.cpu().unsqueeze(1)) > 0)  # never an impossible token
    assert p[0].max() == 1.0 and p[0].sum() == 1.0  # greedy: one-hot at the argmax
    if rows > 2:
        assert tokens[2].item() == int(torch.nonzero(p[2]).max())  # top edge: last with mass
        assert torch.all(p[1, : vocab // 2] == 0)
    if rows > 3 and bias is None:
        assert tokens[3].item() == 7  # the tie: the first index


@cuda_only  # (4,000 rows: minutes under the interpreter; on CPU the tokens equal torch's above)
def test_tokens_follow_the_law():
    """Many uniforms on one row: the token counts match the stored law (chi-square)."""
    g = torch.Generator().manual_seed(1)
    vocab, n = 40, 4000
    base = (torch.randn(1, vocab, generator=g) * 1.5).expand(n, vocab).contiguous()
    temperature = torch.full((n,), 0.8)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    tokens = torch.empty(n, dtype=torch.int64, device=DEVICE)
    probs = torch.empty(n, vocab, device=DEVICE)
    sample_softmax(base.to(DEVICE), None, temperature.to(DEVICE), u.to(DEVICE), GREEDY_EPS,
                   tokens, probs, block=16)  # fmt: skip
    expected = probs[0].cpu().double() * n
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    keep = expected >= 5
    chi2 = float((((counts - expected) ** 2) / expected)[keep].sum())
    assert chi2 < 80.0, chi2  # ~ chi-square with < 40 degrees of freedom: p < 1e-4 above 80


@torch.no_grad()
def test_drafter_proposals_with_and_without_the_kernel(tmp_path, monkeypatch):
    """The drafter's probabilistic slots take the kernel when fused ops are on and give the
    torch path's tokens and distributions (a greedy row among sampled ones)."""
    from dspark.models.dspark_drafter import DSparkDrafter
    from dspark.testing.checkpoints import TinyShape, make_tiny_target
    from dspark.testing.drafters import make_tiny_drafter
    from tests.unit.test_drafter import Batch, load_target

    if HAS_CUDA:  # the drafter is on CPU here: only the interpreter can run the kernel
        pytest.skip("CPU drafter; on CUDA the engine's sampled identity tests cover it")
    target_dir = make_tiny_target(str(tmp_path / "t"), TinyShape(num_hidden_layers=2), seed=1)
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=1, seed=3)
    drafter = DSparkDrafter.from_pretrained(ddir, load_target(target_dir), torch.float32, "cpu")
    batch = Batch(drafter, ctx_lens=[9, 5, 12], anchor_pos=[9, 3, 12], seed=2)
    args = (5, torch.tensor([0.8, 0.0, 1.3]), torch.tensor([1, 2, 3]),
            torch.zeros(3, dtype=torch.long), "probabilistic", False)  # fmt: skip
    ref = batch.propose(*args)
    calls = []
    import dspark.sampling.softmax_sample_triton as kernel

    real = kernel.sample_softmax
    monkeypatch.setattr(kernel, "sample_softmax", lambda *a, **k: calls.append(1) or real(*a))
    monkeypatch.setattr(ops, "ON_CPU", True)
    fused = batch.propose(*args)
    assert len(calls) == 5  # one fused slot each
    assert torch.equal(fused.token_ids, ref.token_ids)
    torch.testing.assert_close(fused.probs, ref.probs, rtol=2e-5, atol=1e-6)


@cuda_only
def test_qwen_vocabulary_on_cuda():
    base, bias, temperature, u = case(64, 151936, torch.bfloat16, 9, True)
    want_p, want_tok = reference(base, bias, temperature, u)
    probs = torch.empty(64, 151936, device="cuda")
    tokens = torch.empty(64, dtype=torch.int64, device="cuda")
    sample_softmax(base.cuda(), bias.cuda(), temperature.cuda(), u.cuda(), GREEDY_EPS, tokens,
                   probs)  # fmt: skip
    torch.testing.assert_close(probs.cpu(), want_p, rtol=2e-5, atol=1e-9)
    assert torch.equal(tokens.cpu(), want_tok)


class _Counted:
    """kernel[grid](...) through the real kernel, its name noted in `seen`."""

    def __init__(self, real, name, seen):
        self.real, self.name, self.seen = real, name, seen

    def __getitem__(self, grid):
        self.seen.append(self.name)
        return self.real[grid]


def _torch_sample_softmax(base, bias, temperature, u, eps, tokens, probs=None, block=None):
    """The torch path the kernel replaces (its reference in the engine test below)."""
    law, tok = reference(base, bias, temperature, u)
    tokens.copy_(tok)
    if probs is not None:
        probs.copy_(law)


@pytest.mark.parametrize("spec,one_program", [(None, False), ("probabilistic", False),
                                               ("probabilistic", True)])  # fmt: skip
def test_an_engine_samples_the_same_through_the_kernels(tiny_qwen, tmp_path, monkeypatch,
                                                        spec, one_program):  # fmt: skip
    """An engine at T = 1 (plain sampling; or probabilistic drafts, verification with
    residuals) gives the same tokens with the sampling kernels as with the torch paths they
    replace: the engine's buffers, row indices and strides reach the kernels as they expect
    (also the one-program kernel's, DSPARK_ONE_PASS_SAMPLING). Only the sampling call sites
    are opened to the interpreter (the model runs its torch code in both runs)."""
    if HAS_CUDA:
        pytest.skip("CPU engine through the interpreter; CUDA runs the engine tests")
    import dspark.sampling.softmax_sample_triton as kernel

    monkeypatch.setattr(kernel, "ONE_PROGRAM", one_program)
    launched = []  # (the kernels the sampling calls ran: one program, or the chunked three)
    for name in ("_one_program_kernel", "_stats_kernel"):
        monkeypatch.setattr(kernel, name, _Counted(getattr(kernel, name), name, launched))
    import dspark.spec.verify as verify_mod
    from dspark import LLM, SamplingParams
    from dspark.testing.drafters import make_tiny_drafter

    cfg = None
    if spec is not None:
        cfg = {"model": make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=7),
               "num_speculative_tokens": 3, "draft_sample_method": spec}  # fmt: skip
    prompts = [{"prompt_token_ids": list(range(3 + i, 19 + i))} for i in range(3)]
    params = [SamplingParams(temperature=t, max_tokens=10, ignore_eos=True, seed=s)
              for t, s in ((1.0, 1), (0.7, 2), (0.0, 3))]  # fmt: skip
    import dspark.models.dspark_drafter as drafter_mod
    import dspark.sampling.sampler as sampler_mod

    for mod in (sampler_mod, drafter_mod):  # the sampling call sites' gates (verify: sampler's)
        monkeypatch.setattr(mod, "fused_ops", lambda *tensors: ops)
    used = []  # the verification kernels each gate handed out

    def spy(*a, real, name):
        fn = real(*a)
        if fn is not None:
            used.append(name)
        return fn

    for name in ("_fused_row_stats", "_fused_final"):
        monkeypatch.setattr(verify_mod, name, functools.partial(
            spy, real=getattr(verify_mod, name), name=name))  # fmt: skip

    def run():
        llm = LLM(tiny_qwen, speculative_config=cfg, device="cpu", enforce_eager=True)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        accepted = llm.engine.spec_stats.num_accepted_tokens if cfg else None
        llm.shutdown()
        return outs, accepted

    calls, real = [], kernel.sample_softmax
    monkeypatch.setattr(kernel, "sample_softmax", lambda *a, **k: calls.append(1) or real(*a))
    fused = run()
    assert calls  # the sampler (and the drafter) took the kernel
    # every sampling call on the kernel the switch picks (the chunked stats pass also serves
    # verification's per-row reads, draft_prob_and_argmax, either way)
    ones = launched.count("_one_program_kernel")
    assert ones >= len(calls) if one_program else ones == 0 and "_stats_kernel" in launched
    if cfg is not None:  # verification took its kernels, and drafts were accepted
        assert {"_fused_row_stats", "_fused_final"} <= set(used) and fused[1] > 0
    monkeypatch.setattr(kernel, "sample_softmax", _torch_sample_softmax)
    monkeypatch.setattr(kernel, "ONE_PROGRAM", False)  # (draft slots: rng.uniform, then torch)
    monkeypatch.setattr(verify_mod, "_fused_row_stats", lambda *a: None)
    monkeypatch.setattr(verify_mod, "_fused_final", lambda *a: None)
    assert run() == fused
