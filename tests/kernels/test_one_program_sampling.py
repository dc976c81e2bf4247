"""The one-program sampling kernel (DSPARK_ONE_PASS_SAMPLING=1) against the three kernels it
stands for, run with a chunk a row: the same probabilities and tokens, bit for bit, for draft
slots (a Markov bias, greedy rows, -inf columns, a tie, the top edge) and for verification's
final tokens (residuals against drafts' laws, point-mass drafts, rows read through an index);
the same tokens as the torch path; and the switch that picks it."""

import pytest
import torch

from tests.kernels import triton_env as env  # first: it sets TRITON_INTERPRET on CPU

DEVICE, INTERPRET = env.DEVICE, env.INTERPRET

from dspark.sampling import softmax_sample_triton as kernels  # noqa: E402
from dspark.sampling.processors import GREEDY_EPS  # noqa: E402
from tests.kernels.test_softmax_sample import _Counted, case, reference  # noqa: E402

BLOCK = 64 if INTERPRET else 2048  # (many loads a row under the interpreter)


def _slot(mode, base, bias, temperature, u, block=BLOCK):
    rows, vocab = base.shape
    probs = torch.full((rows, vocab), -1.0, device=DEVICE)
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    kernels.sample_softmax(base.to(DEVICE), None if bias is None else bias.to(DEVICE),
                           temperature.to(DEVICE), u.to(DEVICE), GREEDY_EPS, tokens, probs,
                           block=block, mode=mode)  # fmt: skip
    return probs.cpu(), tokens.cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 1000), (6, 999), (5, 37)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_a_draft_slot_equals_the_three_kernels_with_a_chunk_a_row(dtype, rows, vocab,
                                                                  with_bias):  # fmt: skip
    base, bias, temperature, u = case(rows, vocab, dtype, 7 * rows + vocab, with_bias)
    got_p, got_tok = _slot("one_program", base, bias, temperature, u)
    want_p, want_tok = _slot("one_chunk", base, bias, temperature, u)
    assert torch.equal(got_p, want_p) and torch.equal(got_tok, want_tok)
    ref_p, ref_tok = reference(base, bias, temperature, u)
    assert torch.equal(got_tok, ref_tok)
    torch.testing.assert_close(got_p, ref_p, rtol=2e-5, atol=1e-7)
    assert torch.all(got_p.gather(1, got_tok.unsqueeze(1)) > 0)  # never an impossible token


@pytest.mark.parametrize("point_mass", [False, True])
def test_final_tokens_equal_the_three_kernels_with_a_chunk_a_row(point_mass):
    """Verification's final draw: some rows rejected (residual max(w p - q, 0), or p without
    the draft token for point-mass drafts), one greedy, one whose residual has no mass (p
    itself), the target rows read through an index."""
    g = torch.Generator().manual_seed(3)
    n, vocab, r = 9, 300, 6
    logits = torch.randn(n, vocab, generator=g) * 2
    rows = torch.tensor([8, 1, 4, 0, 6, 2], dtype=torch.int64)
    temperature = torch.rand(r, generator=g) + 0.3
    temperature[1] = 0.0  # greedy
    u = torch.rand(r, generator=g, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)
    rejected = torch.tensor([True, True, False, True, True, False])
    weight = torch.rand(r, generator=g) + 0.5
    draft = torch.randint(0, vocab, (r,), generator=g)
    q = q_rows = None
    if not point_mass:
        q = torch.softmax(torch.randn(4, vocab, generator=g), dim=-1)
        q_rows = torch.tensor([3, 0, 1, 2, 0, 1], dtype=torch.int64)
        q[2] = 10.0  # row 3's residual max(w p - q, 0) has no mass: it draws from p
    out = {}
    for mode in ("one_chunk", "one_program"):
        tokens = torch.full((r,), -1, dtype=torch.int64, device=DEVICE)
        kernels.sample_final(
            logits.to(DEVICE), rows.to(DEVICE), temperature.to(DEVICE), u.to(DEVICE),
            GREEDY_EPS, tokens, rejected.to(DEVICE), weight.to(DEVICE), draft.to(DEVICE),
            None if q is None else q.to(DEVICE), None if q_rows is None else q_rows.to(DEVICE),
            block=BLOCK, mode=mode)  # fmt: skip
        out[mode] = tokens.cpu()
    assert torch.equal(out["one_program"], out["one_chunk"])
    assert out["one_program"][1] == logits[rows[1]].argmax()  # (the greedy row)
    assert torch.all((out["one_program"] >= 0) & (out["one_program"] < vocab))
    if point_mass:  # a rejected point-mass draft is never drawn again
        assert all(out["one_program"][i] != draft[i] for i in (0, 3, 4))


def test_the_switch_and_the_vocabulary_pick_the_one_program_kernel(monkeypatch):
    """Off by default (not yet measured on a GPU); with DSPARK_ONE_PASS_SAMPLING=1 (the
    module's ONE_PROGRAM) vocabularies up to ONE_PROGRAM_MAX_VOCAB take it, larger ones the
    chunked kernels."""
    launched = []
    for name in ("_one_program_kernel", "_stats_kernel"):
        monkeypatch.setattr(kernels, name, _Counted(getattr(kernels, name), name, launched))
    base, bias, temperature, u = case(3, 200, torch.float32, 1, True)
    assert not kernels.ONE_PROGRAM
    _slot(None, base, bias, temperature, u)
    assert launched == ["_stats_kernel"]
    monkeypatch.setattr(kernels, "ONE_PROGRAM", True)
    launched.clear()
    _slot(None, base, bias, temperature, u)
    assert launched == ["_one_program_kernel"]
    monkeypatch.setattr(kernels, "ONE_PROGRAM_MAX_VOCAB", 100)
    launched.clear()
    _slot(None, base, bias, temperature, u)
    assert launched == ["_stats_kernel"]


@env.cuda_only
@pytest.mark.parametrize("rows,vocab", [(64, 16384), (256, 65536)])
def test_full_sizes_on_cuda(rows, vocab):
    """The demo pair's vocabulary at 64 rows and the largest the switch takes at 256, compiled:
    bit for bit the three kernels with a chunk a row, and the torch path's tokens."""
    base, bias, temperature, u = case(rows, vocab, torch.bfloat16, rows, True)
    got_p, got_tok = _slot("one_program", base, bias, temperature, u, block=2048)
    want_p, want_tok = _slot("one_chunk", base, bias, temperature, u, block=2048)
    assert torch.equal(got_p, want_p) and torch.equal(got_tok, want_tok)
    assert torch.equal(got_tok, reference(base, bias, temperature, u)[1])


def test_a_draft_slot_draws_its_uniform_in_the_kernel(monkeypatch):
    """sample_draft_slot: with the one-program kernel, each row's uniform comes from its keys
    inside the launch, the bits rng.uniform gives (seed, position + offset, round, purpose);
    without it, rng.uniform first and the chunked kernels. Both draw the same tokens."""
    from dspark.sampling import rng

    monkeypatch.setattr(rng, "ON_CPU", True)  # (rng.uniform through its kernel, as on CUDA)
    rows, vocab = 5, 999
    base, bias, _, _ = case(rows, vocab, torch.float32, 4, True)
    temperature = torch.tensor([0.9, 0.0, 1.3, 0.6, 1.0])
    seeds = torch.tensor([3, 1 << 40, 7, 11, 5])
    positions, rounds, offset = torch.tensor([9, 30, 2, 17, 4]), torch.tensor([0, 2, 1, 5, 3]), 3
    u = rng.uniform(seeds.to(DEVICE), (positions + offset).to(DEVICE), rounds.to(DEVICE),
                    rng.DRAFT)  # fmt: skip
    want_p, want_tok = _slot("one_program", base, bias, temperature, u.cpu())
    out = {}
    for on in (True, False):
        monkeypatch.setattr(kernels, "ONE_PROGRAM", on)
        probs = torch.full((rows, vocab), -1.0, device=DEVICE)
        tokens = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
        kernels.sample_draft_slot(
            base.to(DEVICE), bias.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE),
            positions.to(DEVICE), offset, rounds.to(DEVICE), rng.DRAFT, GREEDY_EPS, tokens,
            probs, block=BLOCK)  # fmt: skip
        out[on] = probs.cpu(), tokens.cpu()
    assert torch.equal(out[True][0], want_p) and torch.equal(out[True][1], want_tok)
    assert torch.equal(out[False][1], want_tok)  # (the chunked kernels: the same draw)
    torch.testing.assert_close(out[False][0], want_p, rtol=2e-5, atol=1e-7)
