"""Seeded sampling: reproducible, batch-independent, and distributed as the softmax."""

import numpy as np
import pytest
import torch
import transformers
from scipy.stats import chisquare

from dspark import LLM, SamplingParams
from dspark.sampling import rng
from dspark.sampling.processors import processed_probs, sample_from_probs
from dspark.testing.checkpoints import TinyShape, make_tiny_target


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v16"))
    shape = TinyShape(vocab_size=16, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    return make_tiny_target(path, shape, seed=3, with_tokenizer=False, init_scale=0.3)


def test_uniforms_are_uniform_and_keyed():
    seeds = torch.arange(200_000, dtype=torch.int64)
    u = rng.uniform(seeds, torch.tensor(5), 0, rng.SAMPLE)
    assert 0 < u.min() and u.max() < 1
    counts = np.histogram(u.numpy(), bins=20, range=(0, 1))[0]
    assert chisquare(counts).pvalue > 1e-3
    again = rng.uniform(seeds, torch.tensor(5), 0, rng.SAMPLE)
    assert torch.equal(u, again)
    other = rng.uniform(seeds, torch.tensor(5), 0, rng.ACCEPT)
    assert abs(np.corrcoef(u.numpy(), other.numpy())[0, 1]) < 0.01


def test_hash_ints_equals_hash_keys_on_int64_keys():
    """The engine's default request seeds come from hash_ints: the bits hash_keys gives."""
    gen = np.random.default_rng(3)
    keys = gen.integers(-(2**63), 2**63 - 1, size=(64, 2), dtype=np.int64).tolist()
    keys += [[0, 0], [-1, 1], [2**63 - 1, -(2**63)], [12345, 2**40 + 7]]
    for a, b in keys:
        want = int(rng.hash_keys(torch.tensor(a), torch.tensor(b)))
        assert rng.hash_ints(a, b) == want, (a, b)
    assert rng.hash_ints(7) == int(rng.hash_keys(torch.tensor(7)))


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.7, 0.0),
                                               (0, 1.0, 0.2), (4, 0.8, 0.05)])
def test_sampler_law_matches_processed_softmax(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 8) * 1.5
    n = 60_000
    temp = torch.full((n,), 0.8)
    probs = processed_probs(
        logits.expand(n, 8), temp, torch.full((n,), top_k), torch.full((n,), top_p),
        torch.full((n,), min_p),
    )  # fmt: skip
    u = rng.uniform(torch.arange(n), torch.tensor(3), 0, rng.SAMPLE)
    tokens = sample_from_probs(probs, u)
    # the expected law, computed independently with numpy
    p = np.exp(logits[0].double().numpy() / 0.8)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k:  # top-k first, then top-p on the renormalised survivors (HF / vLLM order)
        p = np.where(np.isin(np.arange(8), order[:top_k]), p, 0)
        p /= p.sum()
    keep = np.zeros(8, bool)
    cum = 0.0
    for t in order:
        if cum >= top_p or p[t] == 0:
            break
        keep[t] = True
        cum += p[t]
    q = np.where(keep, p, 0)
    q /= q.sum()
    q = np.where(q < min_p * q.max(), 0, q)
    q /= q.sum()
    counts = np.bincount(tokens.numpy(), minlength=8)
    assert counts[q == 0].sum() == 0
    nz = q > 0
    assert chisquare(counts[nz], q[nz] * n).pvalue > 1e-3


def test_engine_first_token_law_matches_hf_softmax(small_vocab):
    prompt = [3, 1, 4, 1, 5]
    hf = transformers.AutoModelForCausalLM.from_pretrained(small_vocab, dtype=torch.float32)
    with torch.no_grad():
        p = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / 1.3, -1).numpy()
    n = 3000
    llm = LLM(small_vocab, device="cpu", max_num_seqs=512, max_num_batched_tokens=4096)
    params = [SamplingParams(temperature=1.3, max_tokens=1, seed=s) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=16)
    assert chisquare(counts, p * n).pvalue > 1e-3


def test_seeded_outputs_reproducible_and_batch_independent(small_vocab):
    llm = LLM(small_vocab, device="cpu", max_num_batched_tokens=64)
    target = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=1234)
    alone = llm.generate([{"prompt_token_ids": [1, 2, 3]}], target)[0].outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": [1, 2, 3]}], target)[0].outputs[0].token_ids
    assert alone == again
    neighbours = [{"prompt_token_ids": list(range(1, 2 + i))} for i in range(7)]
    params = [SamplingParams(temperature=1.0, max_tokens=5 + i, seed=i) for i in range(7)]
    outs = llm.generate(
        neighbours[:3] + [{"prompt_token_ids": [1, 2, 3]}] + neighbours[3:],
        params[:3] + [target] + params[3:],
    )
    assert outs[3].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=99)
    different = llm.generate([{"prompt_token_ids": [1, 2, 3]}], other_seed)[0]
    assert different.outputs[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(small_vocab):
    llm = LLM(small_vocab, device="cpu")
    free = llm.generate(
        [{"prompt_token_ids": [2, 3]}], SamplingParams(temperature=0, max_tokens=30)
    )[0].outputs[0]
    assert len(free.token_ids) == 30 and free.finish_reason == "length"
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate(
        [{"prompt_token_ids": [2, 3]}],
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
    )[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def _full_cdf_sample(probs, u):
    """The one-level reference: a float64 cumsum over the whole vocabulary."""
    cdf = probs.double().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    return idx.squeeze(1).clamp(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("vocab", [7, 1024, 1025, 4099, 151_936])
def test_two_level_inverse_cdf_picks_the_full_cdf_token(vocab):
    """Block sums, then the prefix inside one block: the token of a full float64 cumsum, and
    never a zero-probability one (sparse rows, one-hot rows, mass only in the first or the
    last block, u at 0 and just below 1)."""
    gen = torch.Generator().manual_seed(vocab)
    rows = []
    for scale in (0.3, 2.0, 6.0):
        rows.append(torch.softmax(torch.randn(16, vocab, generator=gen) * scale, dim=-1))
    sparse = rows[1] * (torch.rand(16, vocab, generator=gen) < 0.3)
    rows.append(sparse / sparse.sum(dim=-1, keepdim=True).clamp(min=1e-30))
    one_hot = torch.zeros(4, vocab)
    one_hot[torch.arange(4), torch.tensor([0, vocab - 1, vocab // 2, min(5, vocab - 1)])] = 1.0
    edge = torch.zeros(2, vocab)
    edge[0, :3], edge[1, -3:] = 1 / 3, 1 / 3  # mass in the first / last block only
    probs = torch.cat(rows + [one_hot, edge])
    probs = probs[probs.sum(dim=-1) > 0]
    n = probs.shape[0]
    f64 = torch.float64
    for u in (torch.rand(n, generator=gen, dtype=f64), torch.zeros(n, dtype=f64),
              torch.full((n,), 1.0 - 2.0**-53, dtype=f64)):  # fmt: skip
        got = sample_from_probs(probs, u)
        assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())
        if u[0] < 1.0 - 1e-12:  # (at the very top edge either summation order may round up)
            assert torch.equal(got, _full_cdf_sample(probs, u))
