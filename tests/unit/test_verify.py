"""Tests of dspark.spec.verify: losslessness of standard and block verification.

The statistical tests use toy prefix-dependent target and draft "models" over a tiny vocabulary
(lookup tables indexed by the prefix since the anchor). The law that verification should
produce is computed here by exact enumeration of all draft sequences, independently of the
implementation, and the implementation's empirical law (one request per seed, all in one
vectorized call) is compared with it and with the target law by chi-square tests. All seeds
are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from scipy import stats

from dspark.sampling import rng
from dspark.sampling.processors import processed_probs, sample_from_probs
from dspark.spec.verify import VerifyInputs, verify

P_THRESHOLD = 1e-3


# --------------------------------------------------------------------------------------------
# Toy models and batch construction
# --------------------------------------------------------------------------------------------


def _ref_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """Numpy reference of the processed target law (temperature, top-k, top-p, min-p)."""
    out = np.zeros_like(logits, dtype=np.float64)
    for n, row in enumerate(logits.astype(np.float64) / temperature):
        order = np.argsort(-row, kind="stable")
        keep = np.zeros(len(row), dtype=bool)
        p = np.exp(row - row.max())
        p /= p.sum()
        k = len(row) if top_k <= 0 else min(top_k, len(row))
        pk = np.zeros_like(p)
        pk[order[:k]] = p[order[:k]]
        pk /= pk.sum()
        before = 0.0
        for tok in order[:k]:  # keep while the mass strictly before the token is < top_p
            if before < top_p:
                keep[tok] = True
            before += pk[tok]
        q = np.where(keep, p, 0.0)
        q /= q.sum()
        q = np.where(q < min_p * q.max(), 0.0, q)
        out[n] = q / q.sum()
    return out


class Toy:
    """Target / draft laws as tables over prefixes (of length 0..K) since the anchor."""

    def __init__(
        self,
        vocab,
        k,
        seed,
        *,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        target_logits=None,
        draft_probs=None,
        scale=1.3,
    ):
        gen = np.random.RandomState(seed)
        self.V, self.K = vocab, k
        self.offsets = np.cumsum([0] + [vocab**m for m in range(k + 1)])  # by prefix length
        n_prefix = int(self.offsets[-1])
        if target_logits is None:
            target_logits = gen.normal(size=(n_prefix, vocab)) * scale
        self.t_logits = np.broadcast_to(target_logits, (n_prefix, vocab)).astype(np.float32)
        if draft_probs is None:
            z = gen.normal(size=(n_prefix, vocab)) * scale
            draft_probs = np.exp(z) / np.exp(z).sum(1, keepdims=True)
        self.q = np.broadcast_to(draft_probs, (n_prefix, vocab)).astype(np.float32)
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        # The target law, computed independently of dspark, checked against processed_probs.
        self.pt = _ref_filter(self.t_logits, temperature, top_k, top_p, min_p)
        n = n_prefix
        impl = (
            processed_probs(
                torch.from_numpy(self.t_logits),
                torch.full((n,), temperature),
                torch.full((n,), top_k),
                torch.full((n,), top_p),
                torch.full((n,), min_p),
            )
            .double()
            .numpy()
        )
        np.testing.assert_allclose(impl, self.pt, atol=1e-6)

    def code(self, prefix) -> int:
        v = 0
        for tok in prefix:
            v = v * self.V + tok
        return int(self.offsets[len(prefix)] + v)

    def target_joint(self, seq) -> float:
        return float(np.prod([self.pt[self.code(seq[:i])][seq[i]] for i in range(len(seq))]))


def _sample_rows(probs: np.ndarray, gen: np.random.RandomState) -> np.ndarray:
    cdf = probs.cumsum(1)
    u = gen.random_sample(len(probs)) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(1), probs.shape[1] - 1)


def toy_batch(toy: Toy, lens, seed, *, greedy_drafts=False, seed0=0):
    """One request per entry of `lens`, drafts drawn from the toy draft law."""
    gen = np.random.RandomState(seed)
    lens = np.asarray(lens)
    m, k, v = len(lens), toy.K, toy.V
    drafts = np.full((m, k), -1, dtype=np.int64)
    dprobs = np.full((m, k, v), np.nan, dtype=np.float32)  # ignored slots: garbage
    codes = np.zeros((m, k + 1), dtype=np.int64)
    value = np.zeros(m, dtype=np.int64)
    for j in range(k + 1):
        codes[:, j] = toy.offsets[j] + value
        if j < k:
            q = toy.q[codes[:, j]]
            d = _sample_rows(q.astype(np.float64), gen)
            use = lens > j
            drafts[use, j] = d[use]
            dprobs[use, j] = q[use]
            value = value * v + d
    cu = np.concatenate([[0], np.cumsum(lens + 1)])
    logits = np.zeros((cu[-1], v), dtype=np.float32)
    for j in range(k + 1):
        use = lens >= j
        logits[cu[:-1][use] + j] = toy.t_logits[codes[use, j]]
    temp = np.full(m, toy.temperature, np.float32)
    return VerifyInputs(
        target_logits=torch.from_numpy(logits),
        cu_num_logits=torch.from_numpy(cu),
        draft_token_ids=torch.from_numpy(drafts),
        draft_probs=None if greedy_drafts else torch.from_numpy(dprobs),
        temperature=torch.as_tensor(temp, dtype=torch.float32),
        top_k=torch.full((m,), toy.top_k, dtype=torch.int64),
        top_p=torch.full((m,), toy.top_p, dtype=torch.float32),
        min_p=torch.full((m,), toy.min_p, dtype=torch.float32),
        seeds=torch.arange(m, dtype=torch.int64) + seed0,
        anchor_positions=torch.from_numpy(gen.randint(0, 10_000, size=m).astype(np.int64)),
        rounds=torch.from_numpy(gen.randint(0, 50, size=m).astype(np.int64)),
    )


def emitted(out: torch.Tensor, num: torch.Tensor) -> list[tuple[int, ...]]:
    out, num = out.numpy(), num.numpy()
    rows = [tuple(int(x) for x in out[r, : num[r]]) for r in range(len(num))]
    assert all(-1 not in t for t in rows)
    assert (out[np.arange(out.shape[1])[None, :] >= num[:, None]] == -1).all()
    return rows


# --------------------------------------------------------------------------------------------
# Reference laws by exact enumeration (independent of the implementation)
# --------------------------------------------------------------------------------------------


def _normalised_residual(w, fallback):
    w = np.maximum(w, 0.0)
    return w / w.sum() if w.sum() > 1e-15 else fallback


def _standard_law(pts, pds, d):
    law, reach = defaultdict(float), 1.0
    for j in range(len(d)):
        a = min(1.0, pts[j][d[j]] / pds[j][d[j]])
        res = _normalised_residual(pts[j] - pds[j], pts[j])
        for y in range(len(res)):
            law[d[:j] + (y,)] += reach * (1 - a) * res[y]
        reach *= a
    for y in range(len(pts[-1])):
        law[d + (y,)] += reach * pts[-1][y]
    return law


def _block_law(pts, pds, d):
    l = len(d)
    big_p = [1.0]
    for i in range(1, l + 1):
        big_p.append(min(big_p[-1] * pts[i - 1][d[i - 1]] / pds[i - 1][d[i - 1]], 1.0))
    h = [None]
    for i in range(1, l):
        r = np.maximum(big_p[i] * pts[i] - pds[i], 0).sum()
        den = r + 1 - big_p[i]
        h.append(r / den if den > 0 else 1.0)
    if l:
        h.append(big_p[l])
    law = defaultdict(float)
    for tau in range(l + 1):
        p_tau = (h[tau] if tau else 1.0) * np.prod([1 - h[j] for j in range(tau + 1, l + 1)])
        if tau == l:
            dist = pts[l]
        else:
            dist = _normalised_residual(big_p[tau] * pts[tau] - pds[tau], pts[tau])
        for y in range(len(dist)):
            law[d[:tau] + (y,)] += p_tau * dist[y]
    return law


def reference_law(toy: Toy, l: int, method: str, greedy_drafts: bool) -> dict:
    """Law of the emitted tuple for a request with l drafts, drafts drawn from toy.q."""
    law = defaultdict(float)
    rule = _standard_law if method == "standard" else _block_law
    for d in itertools.product(range(toy.V), repeat=l):
        qs = [toy.q[toy.code(d[:j])].astype(np.float64) for j in range(l)]
        qs = [q / q.sum() for q in qs]
        weight = float(np.prod([qs[j][d[j]] for j in range(l)]))
        pts = [toy.pt[toy.code(d[:j])] for j in range(l + 1)]
        pds = [np.eye(toy.V)[d[j]] for j in range(l)] if greedy_drafts else qs
        for tup, p in rule(pts, pds, d).items():
            law[tup] += weight * p
    return dict(law)


def complete_law(toy: Toy, law: dict) -> dict:
    """Law of the length-(K+1) sequence: emitted tuple completed by target sampling."""
    out = defaultdict(float)
    for tup, p in law.items():
        for rest in itertools.product(range(toy.V), repeat=toy.K + 1 - len(tup)):
            seq = tup + rest
            cond = np.prod([toy.pt[toy.code(seq[:i])][seq[i]] for i in range(len(tup), len(seq))])
            out[seq] += p * cond
    return dict(out)


def complete_samples(toy: Toy, tuples, seed) -> list[tuple[int, ...]]:
    """Complete each emitted tuple to length K+1 by sampling the target (vectorized)."""
    gen = np.random.RandomState(seed)
    m, length = len(tuples), toy.K + 1
    seqs = np.zeros((m, length), dtype=np.int64)
    n = np.array([len(t) for t in tuples])
    for r, t in enumerate(tuples):
        seqs[r, : len(t)] = t
    value = np.zeros(m, dtype=np.int64)
    for i in range(length):
        fill = n <= i
        probs = toy.pt[toy.offsets[i] + value]
        seqs[fill, i] = _sample_rows(probs, gen)[fill]
        value = value * toy.V + seqs[:, i]
    return [tuple(int(x) for x in row) for row in seqs]


def chisq_pvalue(observed: Counter, expected: dict) -> float:
    """Chi-square p-value; cells with expected count < 5 are pooled. Impossible cells fail."""
    impossible = [key for key in observed if expected.get(key, 0.0) <= 0.0]
    assert not impossible, f"outcomes with zero probability were emitted: {impossible[:5]}"
    keys = sorted(key for key, p in expected.items() if p > 0.0)
    e = np.array([expected[key] for key in keys])
    o = np.array([observed.get(key, 0) for key in keys], dtype=np.float64)
    e *= o.sum() / e.sum()
    small = e < 5
    if small.any():
        e = np.append(e[~small], e[small].sum())
        o = np.append(o[~small], o[small].sum())
    assert len(e) > 2
    return float(stats.chisquare(o, e).pvalue)


# --------------------------------------------------------------------------------------------
# 1 / 5 / 6: exact-enumeration checks of each rule (standard, block; greedy, probabilistic)
# --------------------------------------------------------------------------------------------

CONFIGS = {
    # plain sampling at temperature 1 over V=3
    "plain": dict(vocab=3, seed=11),
    # temperature + top-k + top-p + min-p: the verified law must be the filtered law
    "filtered": dict(vocab=4, seed=0, temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, scale=1.0),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["prob_drafts", "greedy_drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_law_matches_enumeration_and_target(method, greedy_drafts, config):
    cfg = dict(CONFIGS[config])
    toy = Toy(cfg.pop("vocab"), 2, cfg.pop("seed"), **cfg)
    if config == "filtered":  # the filters remove tokens everywhere, the draft keeps them
        assert (toy.pt == 0).any(1).all() and (toy.pt[0] > 0).sum() == 3
        assert (toy.q > 0).all()
    lens = np.tile([0, 1, 2], 8000)
    inp = toy_batch(toy, lens, seed=1, greedy_drafts=greedy_drafts, seed0=12345)
    tuples = emitted(*verify(inp, method))

    laws = {l: reference_law(toy, l, method, greedy_drafts) for l in (0, 1, 2)}
    counts = Counter(lens.tolist())
    for l, law in laws.items():
        assert abs(sum(law.values()) - 1) < 1e-9
        # the reference rule itself is lossless (exact, deterministic)
        completed = complete_law(toy, law)
        for seq, p in completed.items():
            assert abs(p - toy.target_joint(seq)) < 1e-9, (l, seq)
        assert max(len(t) for t in law) == l + 1

    # empirical law of (l, emitted tuple), including the number of accepted drafts
    obs = Counter(zip(lens.tolist(), tuples))
    exp = {(l, t): counts[l] * p for l, law in laws.items() for t, p in law.items()}
    assert chisq_pvalue(obs, exp) > P_THRESHOLD

    # emitted tuples completed by target sampling follow the target's joint law
    seqs = complete_samples(toy, tuples, seed=3)
    obs = Counter(zip(lens.tolist(), seqs))
    exp = {
        (l, seq): counts[l] * toy.target_joint(seq)
        for l in counts
        for seq in itertools.product(range(toy.V), repeat=toy.K + 1)
    }
    assert chisq_pvalue(obs, exp) > P_THRESHOLD

    # first emitted token ~ target row 0, for every l (l = 0: plain sampling)
    for l in counts:
        first = Counter(t[0] for t, ll in zip(tuples, lens) if ll == l)
        assert chisq_pvalue(first, {y: counts[l] * toy.pt[0][y] for y in range(toy.V)}) > (
            P_THRESHOLD
        )


def test_block_accepts_more_than_standard():
    # Sun et al.'s example: i.i.d. draft (1/3, 2/3) vs target (2/3, 1/3).
    k = 3
    pt = np.array([2 / 3, 1 / 3])
    toy = Toy(2, k, 0, target_logits=np.log(pt), draft_probs=np.array([1 / 3, 2 / 3]))
    exact = {
        m: sum(len(t) * p for t, p in reference_law(toy, k, m, False).items())
        for m in ("standard", "block")
    }
    assert exact["block"] > exact["standard"] + 0.05
    lens = np.full(20000, k)
    inp = toy_batch(toy, lens, seed=2, seed0=777)
    means = {}
    for m in ("standard", "block"):
        out, num = verify(inp, m)
        n = num.double().numpy()
        means[m] = n.mean()
        assert abs(means[m] - exact[m]) < 5 * n.std() / np.sqrt(len(n)), (m, means[m], exact[m])
        tuples = emitted(out, num)
        law = reference_law(toy, k, m, False)
        assert chisq_pvalue(Counter(tuples), {t: len(n) * p for t, p in law.items()}) > P_THRESHOLD
    assert means["block"] > means["standard"]


# --------------------------------------------------------------------------------------------
# 2: greedy rows equal argmax decoding
# --------------------------------------------------------------------------------------------


def random_batch(
    seed,
    *,
    r=40,
    k=4,
    v=37,
    greedy_frac=0.3,
    greedy_drafts=False,
    padding=True,
    dtype=torch.float32,
    match_prob=0.6,
    extra_rows=0,
):
    """Random ragged batch: some padding requests, mixed temperatures and filters."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, k + 1, (r,), generator=g)
    rows = lens + 1
    if padding:
        rows = torch.where(torch.rand(r, generator=g) < 0.15, 0, rows)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), rows.cumsum(0)])
    n = int(cu[-1])
    logits = (torch.randn(n + extra_rows, v, generator=g) * 2).to(dtype)
    if extra_rows:
        logits[n:] = float("nan")  # trailing padding rows hold garbage
    # drafts: often the row's argmax (so that greedy rows accept some), else random
    argmax = logits[:n].argmax(-1)
    drafts = torch.randint(0, v, (r, k), generator=g)
    for j in range(k):  # loop over slots (test code)
        row = (cu[:-1] + j).clamp(max=max(n - 1, 0))
        take = (torch.rand(r, generator=g) < match_prob) | (j >= rows - 1)
        drafts[:, j] = torch.where(take, argmax[row], drafts[:, j])
    dprobs = torch.softmax(torch.randn(r, k, v, generator=g) * 2, -1)
    dprobs = dprobs.scatter_add(2, drafts[..., None], torch.full((r, k, 1), 0.3))
    dprobs = dprobs / dprobs.sum(-1, keepdim=True)
    # Ignored slots (>= l) hold garbage: -1, or a token that the next row would accept.
    ignored = torch.arange(k)[None] >= (rows - 1)[:, None]
    drafts = torch.where(ignored & (torch.rand(r, k, generator=g) < 0.5), -1, drafts)
    dprobs = torch.where(ignored[..., None], float("nan"), dprobs)
    temp = torch.rand(r, generator=g) * 1.2 + 0.3
    temp = torch.where(torch.rand(r, generator=g) < greedy_frac, 0.0, temp)
    top_k = torch.where(torch.rand(r, generator=g) < 0.3, torch.randint(1, v, (r,), generator=g), 0)
    top_p = torch.where(torch.rand(r, generator=g) < 0.3, torch.rand(r, generator=g), 1.0)
    min_p = torch.where(torch.rand(r, generator=g) < 0.2, torch.rand(r, generator=g) * 0.2, 0.0)
    return VerifyInputs(
        target_logits=logits,
        cu_num_logits=cu,
        draft_token_ids=drafts,
        draft_probs=None if greedy_drafts else dprobs,
        temperature=temp.float(),
        top_k=top_k.long(),
        top_p=top_p.float(),
        min_p=min_p.float(),
        seeds=torch.randint(0, 2**62, (r,), generator=g),
        anchor_positions=torch.randint(0, 100_000, (r,), generator=g),
        rounds=torch.randint(0, 1000, (r,), generator=g),
    )


def greedy_reference(inp: VerifyInputs):
    """Plain greedy decoding, request by request (test code)."""
    cu = inp.cu_num_logits.tolist()
    out = []
    for r in range(len(cu) - 1):
        if cu[r + 1] == cu[r]:
            out.append(())
            continue
        l = cu[r + 1] - cu[r] - 1
        toks = []
        for j in range(l + 1):
            a = int(inp.target_logits[cu[r] + j].argmax())
            toks.append(a)
            if j == l or int(inp.draft_token_ids[r, j]) != a:
                break
        out.append(tuple(toks))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["prob_drafts", "greedy_drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_greedy_rows_equal_argmax_decoding(method, greedy_drafts, dtype):
    inp = random_batch(7, r=120, k=5, greedy_frac=0.5, greedy_drafts=greedy_drafts, dtype=dtype)
    greedy = (inp.temperature <= 1e-5).tolist()
    got = emitted(*verify(inp, method))
    ref = greedy_reference(inp)
    checked = [r for r in range(len(ref)) if greedy[r] and ref[r]]
    assert len(checked) > 30
    assert any(len(ref[r]) > 3 for r in checked) and any(len(ref[r]) == 1 for r in checked)
    for r in checked:
        assert got[r] == ref[r], r


# --------------------------------------------------------------------------------------------
# Request-by-request loop reference with the documented RNG keys
# --------------------------------------------------------------------------------------------


def loop_reference(inp: VerifyInputs, method: str) -> list[tuple[int, ...]]:
    """Scalar, one request at a time; same uniforms (seed, position, round, purpose)."""
    cu = inp.cu_num_logits.tolist()
    v = inp.target_logits.shape[1]
    out = []
    for r in range(len(cu) - 1):
        l = cu[r + 1] - cu[r] - 1
        if l < 0:
            out.append(())
            continue
        n_rows = l + 1

        def per_row(x, r=r, n_rows=n_rows):
            return None if x is None else x[r : r + 1].expand(n_rows)

        probs = processed_probs(
            inp.target_logits[cu[r] : cu[r + 1]],
            per_row(inp.temperature),
            per_row(inp.top_k),
            per_row(inp.top_p),
            per_row(inp.min_p),
        ).double()
        d = [int(x) for x in inp.draft_token_ids[r, :l]]
        if inp.draft_probs is None:
            pds = [torch.eye(v, dtype=torch.float64)[t] for t in d]
        else:
            pds = [inp.draft_probs[r, j].double() for j in range(l)]
        anchor = int(inp.anchor_positions[r])

        def u(pos, purpose, r=r):
            return rng.uniform(
                inp.seeds[r : r + 1], torch.tensor([pos]), inp.rounds[r : r + 1], purpose
            )

        if float(inp.temperature[r]) <= 1e-5:
            n = 0
            while n < l and d[n] == int(probs[n].argmax()):
                n += 1
            out.append(tuple(d[:n]) + (int(probs[n].argmax()),))
            continue
        big_p = [1.0]
        if method == "standard":
            n = 0
            while n < l and float(u(anchor + n + 1, rng.ACCEPT)) * float(pds[n][d[n]]) < float(
                probs[n][d[n]]
            ):
                n += 1
            big_p = [1.0] * (l + 1)
        else:
            for i in range(1, l + 1):
                ratio_num = big_p[-1] * float(probs[i - 1][d[i - 1]])
                big_p.append(min(ratio_num / float(pds[i - 1][d[i - 1]]), 1.0))
            n = 0
            for i in range(1, l + 1):
                if i < l:
                    res = float((big_p[i] * probs[i] - pds[i]).clamp(min=0).sum())
                    den = res + 1 - big_p[i]
                    h = min(res / den, 1.0) if den > 0 else 1.0
                else:
                    h = big_p[l]
                if float(u(anchor + i, rng.BLOCK)) <= h:
                    n = i
        if n < l:
            dist = (big_p[n] * probs[n] - pds[n]).clamp(min=0)
            if float(dist.sum()) <= 0:
                dist = probs[n]
            key = u(anchor + n + 1, rng.RESIDUAL)
        else:
            dist, key = probs[n], u(anchor + n + 1, rng.SAMPLE)
        out.append(tuple(d[:n]) + (int(sample_from_probs(dist[None], key)[0]),))
    return out


@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["prob_drafts", "greedy_drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_matches_loop_reference_with_documented_keys(method, greedy_drafts):
    inp = random_batch(12, r=80, k=4, v=23, greedy_drafts=greedy_drafts, match_prob=0.8)
    got = emitted(*verify(inp, method))
    ref = loop_reference(inp, method)
    assert got == ref
    assert sum(len(t) >= 3 for t in got) >= 10  # not vacuous: long accepted runs occur


# --------------------------------------------------------------------------------------------
# 3 / 4 / 5: batch independence, chunking, padding and l = 0 rows
# --------------------------------------------------------------------------------------------


def subset(inp: VerifyInputs, reqs: list[int], extra_rows: int = 0) -> VerifyInputs:
    """The same requests, alone or in another order, rebuilt as their own ragged batch."""
    cu = inp.cu_num_logits
    pieces = [inp.target_logits[cu[r] : cu[r + 1]] for r in reqs] + [inp.target_logits[:0]]
    if extra_rows:
        pieces.append(torch.full((extra_rows, inp.target_logits.shape[1]), float("nan")))
    sizes = torch.tensor([int(cu[r + 1] - cu[r]) for r in reqs], dtype=torch.int64)
    idx = torch.tensor(reqs, dtype=torch.int64)

    def pick(x):
        return None if x is None else x[idx]

    return VerifyInputs(
        target_logits=torch.cat(pieces).to(inp.target_logits.dtype),
        cu_num_logits=torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]),
        draft_token_ids=pick(inp.draft_token_ids),
        draft_probs=pick(inp.draft_probs),
        temperature=pick(inp.temperature),
        top_k=pick(inp.top_k),
        top_p=pick(inp.top_p),
        min_p=pick(inp.min_p),
        seeds=pick(inp.seeds),
        anchor_positions=pick(inp.anchor_positions),
        rounds=pick(inp.rounds),
    )


@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["prob_drafts", "greedy_drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_batch_independence(method, greedy_drafts):
    inp = random_batch(3, r=40, greedy_drafts=greedy_drafts, match_prob=0.8)
    out, num = verify(inp, method)
    r = len(inp.seeds)
    # alone
    for q in (0, 5, 11, 23, 39):
        o1, n1 = verify(subset(inp, [q]), method)
        assert torch.equal(o1[0], out[q]) and n1[0] == num[q]
    # among other neighbours, in another order, with trailing garbage rows
    g = torch.Generator().manual_seed(9)
    others = random_batch(4, r=30, greedy_drafts=greedy_drafts)
    perm = torch.randperm(r, generator=g).tolist()
    mixed = subset(inp, perm, extra_rows=5)
    mo, mn = verify(mixed, method)
    assert torch.equal(mo, out[perm]) and torch.equal(mn, num[perm])
    # concatenated with a different batch in front
    both = _concat(others, inp)
    bo, bn = verify(both, method)
    assert torch.equal(bo[30:], out) and torch.equal(bn[30:], num)
    # the test is not vacuous: many drafts accepted, several sampled rows, and other rounds differ
    assert (num >= 2).sum() >= 10
    moved = VerifyInputs(**{**inp.__dict__, "rounds": inp.rounds + 1})
    assert not torch.equal(verify(moved, method)[0], out)


def _concat(a: VerifyInputs, b: VerifyInputs) -> VerifyInputs:
    def cat(x, y):
        return None if x is None else torch.cat([x, y])

    return VerifyInputs(
        target_logits=torch.cat([a.target_logits[: int(a.cu_num_logits[-1])], b.target_logits]),
        cu_num_logits=torch.cat([a.cu_num_logits, b.cu_num_logits[1:] + a.cu_num_logits[-1]]),
        **{
            f: cat(getattr(a, f), getattr(b, f))
            for f in (
                "draft_token_ids",
                "draft_probs",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "seeds",
                "anchor_positions",
                "rounds",
            )
        },
    )


@pytest.mark.parametrize("greedy_drafts", [False, True], ids=["prob_drafts", "greedy_drafts"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_chunking_does_not_change_results(method, greedy_drafts):
    inp = random_batch(5, r=30, greedy_drafts=greedy_drafts, extra_rows=4, match_prob=0.8)
    ref = verify(inp, method, None)
    assert (ref[1] > 2).sum() > 5
    for chunk in (1, 3, 7):
        got = verify(inp, method, chunk)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), chunk


@pytest.mark.parametrize("method", ["standard", "block"])
def test_padding_rows_and_zero_draft_rows(method):
    inp = random_batch(6, r=60, greedy_frac=0.2, padding=True, extra_rows=3)
    cu = inp.cu_num_logits
    sizes = cu[1:] - cu[:-1]
    assert (sizes == 0).sum() >= 3 and (sizes == 1).sum() >= 3
    out, num = verify(inp, method)
    pad = sizes == 0
    assert (num[pad] == 0).all() and (out[pad] == -1).all()
    # same results as the batch without its padding requests
    live = [r for r in range(len(sizes)) if sizes[r] > 0]
    lo, ln = verify(subset(inp, live), method)
    assert torch.equal(lo, out[live]) and torch.equal(ln, num[live])
    # l = 0: exactly one token, the one plain sampling draws from the processed target row
    zero = (sizes == 1).nonzero().flatten()
    assert (num[zero] == 1).all() and (out[zero, 1:] == -1).all()
    rows = inp.target_logits[cu[zero]]
    probs = processed_probs(
        rows, inp.temperature[zero], inp.top_k[zero], inp.top_p[zero], inp.min_p[zero]
    )
    u = rng.uniform(inp.seeds[zero], inp.anchor_positions[zero] + 1, inp.rounds[zero], rng.SAMPLE)
    assert torch.equal(out[zero, 0], sample_from_probs(probs, u))
    greedy = inp.temperature[zero] <= 1e-5
    assert torch.equal(out[zero, 0][greedy], rows[greedy].argmax(-1))


def test_all_padding_and_empty_batches():
    inp = random_batch(8, r=4)
    inp.cu_num_logits = torch.zeros(5, dtype=torch.int64)
    for m in ("standard", "block"):
        out, num = verify(inp, m)
        assert out.shape == (4, 5) and (out == -1).all() and (num == 0).all()
    no_rows = VerifyInputs(**{**inp.__dict__, "target_logits": inp.target_logits[:0]})
    out, num = verify(no_rows, "standard")
    assert out.shape == (4, 5) and (out == -1).all() and (num == 0).all()
    empty = subset(random_batch(8, r=4), [])
    out, num = verify(empty, "block")
    assert out.shape == (0, 5) and num.shape == (0,)


def test_rejects_unknown_method():
    with pytest.raises(ValueError, match="rejection_sample_method"):
        verify(random_batch(1, r=2), "typical")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["standard", "block"])
def test_cuda_no_host_sync_and_matches_cpu(method):
    inp = random_batch(2, r=64, v=1000, extra_rows=5)
    ref = verify(inp, method)
    dev = VerifyInputs(
        **{f: (x.cuda() if isinstance(x, torch.Tensor) else x) for f, x in inp.__dict__.items()}
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, num = verify(dev, method, max_chunk_rows=16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # argmax / ties may differ across devices only with exactly equal logits: compare
    assert torch.equal(num.cpu(), ref[1]) and torch.equal(out.cpu(), ref[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_fast_path_equals_general_verify(seed):
    from dspark.spec.verify import verify_greedy

    gen = torch.Generator().manual_seed(seed)
    num_reqs, k, vocab = 9, 4, 6
    lens = torch.randint(-1, k + 1, (num_reqs,), generator=gen)  # -1: padding request
    cu = torch.zeros(num_reqs + 1, dtype=torch.int64)
    cu[1:] = (lens + 1).cumsum(0)
    logits = torch.randn(int(cu[-1]) + 3, vocab, generator=gen)  # 3 junk rows at the end
    # drafts that often match the target argmax, so acceptance runs vary
    rows = torch.arange(num_reqs).unsqueeze(1) * 0 + cu[:-1].unsqueeze(1) + torch.arange(k)
    best = logits[rows.clamp(max=logits.shape[0] - 1)].argmax(-1)
    noise = torch.randint(0, vocab, (num_reqs, k), generator=gen)
    drafts = torch.where(torch.rand(num_reqs, k, generator=gen) < 0.7, best, noise)
    inp = VerifyInputs(
        target_logits=logits, cu_num_logits=cu, draft_token_ids=drafts, draft_probs=None,
        temperature=torch.zeros(num_reqs), top_k=None, top_p=None, min_p=None,
        seeds=torch.arange(num_reqs), anchor_positions=torch.full((num_reqs,), 5),
        rounds=torch.zeros(num_reqs, dtype=torch.int64),
    )  # fmt: skip
    want_out, want_n = verify(inp)
    got_out, got_n = verify_greedy(logits, cu, drafts)
    assert torch.equal(got_n, want_n) and torch.equal(got_out, want_out)
    assert (want_n > 1).any()  # some drafts were accepted


@pytest.mark.parametrize("method", ["standard", "block"])
def test_draft_rows_of_a_buffer_equal_gathered_draft_probs(method):
    """A per-request buffer [S, K, V] with each request's row index verifies exactly like the
    gathered [R, K, V] distributions (the engine never materialises that gather)."""
    inp = random_batch(11, r=24, extra_rows=3, match_prob=0.7)
    ref = verify(inp, method, 5)
    g = torch.Generator().manual_seed(3)
    rows = torch.randperm(40, generator=g)[: inp.draft_probs.shape[0]]
    buffer = torch.rand(40, *inp.draft_probs.shape[1:], generator=g)  # other rows: garbage
    buffer[rows] = inp.draft_probs
    got = verify(VerifyInputs(**{**inp.__dict__, "draft_probs": buffer, "draft_rows": rows}),
                 method, 5)  # fmt: skip
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert (ref[1] > 1).sum() > 3  # some drafts accepted: the gathered entries mattered
