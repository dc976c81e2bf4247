"""DSpark drafter: paged propose() vs a dense plain-torch reference, context masking,
DeepSpec-layout loading, compatibility checks and the law of probabilistic drafts.

Tolerances (fp32, CPU): identical tokens; |probs - ref| <= 1e-5, |max_probs - ref| <= 1e-5,
|conf_logits - ref| <= 1e-4.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dspark.attention.torch_ref import TorchAttentionBackend
from dspark.models.config import ModelConfig
from dspark.models.dspark_drafter import (
    DrafterConfig,
    DSparkDrafter,
    check_compatible,
)
from dspark.models.loader import load_weights
from dspark.models.qwen3 import CausalLM
from dspark.sampling import rng
from dspark.testing.checkpoints import TinyShape, make_tiny_target
from dspark.testing.drafters import make_tiny_drafter

PAGE = 4  # KV-cache page size (not the drafter's block_size)
NUM_PAGES = 40
BACKEND = TorchAttentionBackend()


# ------------------------------------------------------------------ fixtures and helpers


def load_target(path: str) -> CausalLM:
    cfg = ModelConfig.from_pretrained(path)
    model = CausalLM(cfg)
    load_weights(model, path, CausalLM.checkpoint_name_to_param, CausalLM.packed_modules,
                 model.shard_sizes)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target(str(tmp_path_factory.mktemp("target")),
                            TinyShape(num_hidden_layers=4), seed=1)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def small_vocab_target_dir(tmp_path_factory):
    shape = TinyShape(vocab_size=16, num_hidden_layers=2)
    return make_tiny_target(str(tmp_path_factory.mktemp("target16")), shape, seed=2,
                            with_tokenizer=False, init_scale=1.5)


def new_caches(drafter: DSparkDrafter):
    shape = (NUM_PAGES, PAGE, drafter.num_kv_heads, drafter.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(drafter.num_layers)]


class Batch:
    """Requests with random contexts in a paged cache with non-contiguous random pages.

    Each request r has context features for positions 0..ctx_len[r]-1 written to the cache;
    positions >= anchor_pos[r] are stale (e.g. rejected drafts) and must be ignored.
    """

    def __init__(self, drafter, ctx_lens, anchor_pos, seed=0, max_pages=5):
        gen = torch.Generator().manual_seed(seed)
        cfg = drafter.config
        num_reqs = len(ctx_lens)
        self.ctx_lens, self.anchor_pos = list(ctx_lens), torch.tensor(anchor_pos)
        pages = torch.randperm(NUM_PAGES - 1, generator=gen)[: num_reqs * max_pages] + 1
        self.block_tables = pages.view(num_reqs, max_pages).to(torch.int32)
        self.aux = [torch.randn(n, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
                    for n in ctx_lens]
        self.anchor_ids = torch.randint(0, cfg.vocab_size, (num_reqs,), generator=gen)
        self.caches = new_caches(drafter)
        self.drafter = drafter
        for r in range(num_reqs):
            self.write(r, torch.arange(ctx_lens[r]))

    def slots(self, r, positions):
        return self.block_tables[r, positions // PAGE].long() * PAGE + positions % PAGE

    def write(self, r, positions):
        self.drafter.write_context(self.aux[r][positions], positions, self.slots(r, positions),
                                   self.caches, BACKEND)

    def propose(self, k, temperature, seeds, rounds, method, need_max_probs=True):
        return self.drafter.propose(
            self.anchor_ids, self.anchor_pos, self.block_tables, max(self.ctx_lens),
            self.caches, BACKEND, k, temperature, seeds, rounds, method, need_max_probs)


# ------------------------------------------------------------------ dense reference


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [N, H, D], pos [N]
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos + rot * sin


def reference_propose(drafter_dir, target_dir, batch, k_max, temperature, seeds, rounds, method):
    """DeepSpec's Qwen3DSparkModel at inference, written from the raw safetensors with plain
    torch ops: full (unpaged) context, a dense mask (context < anchor, whole block)."""
    cfg = json.load(open(os.path.join(drafter_dir, "config.json")))
    w = load_file(os.path.join(drafter_dir, "model.safetensors"))
    tw = load_file(os.path.join(target_dir, "model.safetensors"))
    embed = tw["model.embed_tokens.weight"]
    head_w = tw.get("lm_head.weight", embed)
    eps, heads, kvh = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["head_dim"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
    block, rank = cfg["block_size"], cfg["markov_rank"]
    htype = cfg.get("markov_head_type")
    tokens, probs, confs, maxps = [], [], [], []
    for r in range(len(batch.ctx_lens)):
        a = int(batch.anchor_pos[r])
        ctx = _rms(batch.aux[r] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [S, d]
        ctx_pos = torch.arange(ctx.shape[0])
        blk_pos = a + torch.arange(block)
        visible = torch.cat([ctx_pos < a, torch.ones(block, dtype=torch.bool)])  # [S + G]
        ids = torch.full((block,), cfg["mask_token_id"])
        ids[0] = batch.anchor_ids[r]
        x = embed[ids]
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            xn = _rms(x, w[p + "input_layernorm.weight"], eps)

            def proj(inp, name, n, p=p):
                return (inp @ w[f"{p}self_attn.{name}.weight"].T).view(-1, n, dim)

            q = _rope(_rms(proj(xn, "q_proj", heads), w[p + "self_attn.q_norm.weight"], eps),
                      blk_pos, theta)
            kn = w[p + "self_attn.k_norm.weight"]
            keys = torch.cat([_rope(_rms(proj(ctx, "k_proj", kvh), kn, eps), ctx_pos, theta),
                              _rope(_rms(proj(xn, "k_proj", kvh), kn, eps), blk_pos, theta)])
            vals = torch.cat([proj(ctx, "v_proj", kvh), proj(xn, "v_proj", kvh)])
            keys = keys.repeat_interleave(heads // kvh, dim=1)
            vals = vals.repeat_interleave(heads // kvh, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) / dim**0.5
            scores = scores.masked_fill(~visible[None, None], float("-inf"))
            att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).reshape(block, -1)
            x = x + att @ w[p + "self_attn.o_proj.weight"].T
            xn = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            gate, up = xn @ w[p + "mlp.gate_proj.weight"].T, xn @ w[p + "mlp.up_proj.weight"].T
            mlp = F.silu(gate) * up
            x = x + mlp @ w[p + "mlp.down_proj.weight"].T
        h = _rms(x, w["norm.weight"], eps)
        prev, state = batch.anchor_ids[r], torch.zeros(rank)
        row_t, row_p, row_c, row_m = [], [], [], []
        for k in range(k_max):
            logits = h[k] @ head_w.T
            e = w["markov_head.markov_w1.weight"][prev] if rank else None
            if rank:
                w2 = w["markov_head.markov_w2.weight"]
                if htype == "vanilla":
                    logits = logits + w2 @ e
                elif htype == "gated":
                    g = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h[k], e])
                                      + w["markov_head.gate_proj.bias"])
                    logits = logits + w2 @ (g * e)
                else:
                    z = (w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h[k]])
                         + w["markov_head.joint_proj.bias"])
                    gate, cand, out = torch.sigmoid(z[:rank]), z[rank:2 * rank], z[2 * rank:]
                    state = gate * state + (1 - gate) * torch.tanh(cand)
                    logits = logits + w2 @ torch.tanh(out)
            if cfg["enable_confidence_head"]:
                feats = torch.cat([h[k], e]) if cfg["confidence_head_with_markov"] else h[k]
                row_c.append(w["confidence_head.proj.weight"][0] @ feats
                             + w["confidence_head.proj.bias"][0])
            row_m.append(logits.softmax(-1).max())
            t = float(temperature[r])
            if method == "greedy" or t <= 1e-5:
                tok = int(logits.argmax())
                dist = F.one_hot(torch.tensor(tok), logits.shape[0]).float()
            else:
                dist = (logits / t).softmax(-1)
                u = rng.uniform(seeds[r:r + 1], torch.tensor([a + k + 1]), rounds[r:r + 1],
                                rng.DRAFT)
                cdf = dist.double().cumsum(-1)
                tok = int((cdf <= u * cdf[-1]).sum().clamp(max=logits.shape[0] - 1))
            row_t.append(tok)
            row_p.append(dist)
            prev = torch.tensor(tok)
        tokens.append(row_t)
        probs.append(torch.stack(row_p))
        confs.append(torch.stack(row_c) if row_c else None)
        maxps.append(torch.stack(row_m))
    conf = None if confs[0] is None else torch.stack(confs)
    return torch.tensor(tokens), torch.stack(probs), conf, torch.stack(maxps)


VARIANTS = {  # name: make_tiny_drafter kwargs
    "vanilla": dict(markov_head_type="vanilla"),
    "gated": dict(markov_head_type="gated"),
    "rnn": dict(markov_head_type="rnn"),
    "vanilla-conf-h-only": dict(markov_head_type="vanilla", confidence_head_with_markov=False),
    "vanilla-no-conf": dict(markov_head_type="vanilla", enable_confidence_head=False),
    "dflash": dict(markov_rank=0, enable_confidence_head=False),
    "rank0-conf": dict(markov_rank=0, confidence_head_with_markov=False),
}


@pytest.mark.parametrize("variant, k_max", [(v, 7) for v in VARIANTS]
                         + [("vanilla", 5), ("rnn", 5), ("dflash", 5)])
def test_propose_matches_dense_reference(tmp_path, target_dir, target, variant, k_max):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=2, block_size=7,
                             seed=3, **VARIANTS[variant])
    drafter = DSparkDrafter.from_pretrained(ddir, target, torch.float32, "cpu")
    assert drafter.config.target_layer_ids == [1, 2]  # two layers: fc sees a concatenation
    batch = Batch(drafter, ctx_lens=[13, 9, 17, 6], anchor_pos=[10, 9, 3, 1], seed=5)
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.6])
    seeds, rounds = torch.tensor([11, 12, 13, 2**40 + 7]), torch.tensor([0, 3, 1, 9])
    with_head = drafter.confidence_head is not None
    for method in ("greedy", "probabilistic"):
        out = batch.propose(k_max, temperature, seeds, rounds, method)
        ref_t, ref_p, ref_c, ref_m = reference_propose(
            ddir, target_dir, batch, k_max, temperature, seeds, rounds, method)
        assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (4, k_max)
        assert torch.equal(out.token_ids, ref_t), method
        assert len(out.token_ids.unique()) > 4  # not degenerate: the comparison means something
        torch.testing.assert_close(out.max_probs, ref_m, atol=1e-5, rtol=0)
        if with_head:
            torch.testing.assert_close(out.conf_logits, ref_c, atol=1e-4, rtol=0)
        else:
            assert out.conf_logits is None
        if method == "greedy":
            assert out.probs is None
            greedy_tokens = out.token_ids
        else:
            assert out.probs.shape == (4, k_max, drafter.config.vocab_size)
            torch.testing.assert_close(out.probs, ref_p, atol=1e-5, rtol=0)
            # Temperature-0 rows are argmax drafts with one-hot probabilities.
            assert torch.equal(out.token_ids[2], greedy_tokens[2])
            assert torch.equal(out.probs[2].max(-1).values, torch.ones(k_max))


def test_context_strictly_before_anchor(tmp_path, target_dir, target):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=2, markov_rank=8,
                             markov_head_type="rnn", seed=4)
    drafter = DSparkDrafter.from_pretrained(ddir, target, torch.float32, "cpu")
    batch = Batch(drafter, ctx_lens=[14, 12], anchor_pos=[8, 12], seed=6)
    args = (7, torch.tensor([1.0, 1.0]), torch.tensor([1, 2]), torch.tensor([0, 0]),
            "probabilistic")
    base = batch.propose(*args)
    before = [(k.clone(), v.clone()) for k, v in batch.caches]
    # Rewrite the stale context at positions >= anchor of request 0: nothing may change.
    stale = torch.arange(8, 14)
    batch.aux[0][stale] = 5 * torch.randn(len(stale), batch.aux[0].shape[1])
    batch.write(0, stale)
    assert not torch.equal(batch.caches[0][0], before[0][0])  # the cache did change
    # without the max-probability pass (the confidence head serves): the same drafts
    lean = batch.propose(*args, need_max_probs=False)
    assert lean.max_probs is None and base.max_probs is not None
    assert torch.equal(lean.token_ids, base.token_ids) and torch.equal(lean.probs, base.probs)
    assert torch.equal(lean.conf_logits, base.conf_logits)
    again = batch.propose(*args)
    assert torch.equal(again.token_ids, base.token_ids)
    assert torch.equal(again.probs, base.probs)
    assert torch.equal(again.conf_logits, base.conf_logits)
    # propose() never writes block K/V into the cache.
    after = [(k.clone(), v.clone()) for k, v in batch.caches]
    batch.propose(*args)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(after, batch.caches, strict=True))
    # Changing the feature right before the anchor changes request 0 only.
    batch.aux[0][7] = torch.randn(batch.aux[0].shape[1])
    batch.write(0, torch.tensor([7]))
    changed = batch.propose(*args)
    assert (changed.conf_logits[0] - base.conf_logits[0]).abs().max() > 1e-3
    assert (changed.probs[0, 0] - base.probs[0, 0]).abs().max() > 1e-4
    assert torch.equal(changed.probs[1], base.probs[1])


def test_batch_independence(tmp_path, target_dir, target):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, markov_head_type="gated", seed=7)
    drafter = DSparkDrafter.from_pretrained(ddir, target, torch.float32, "cpu")
    batch = Batch(drafter, ctx_lens=[11, 7, 15], anchor_pos=[11, 5, 9], seed=8)
    temp, seeds, rounds = torch.tensor([0.9, 1.0, 0.5]), torch.tensor([5, 6, 7]), torch.zeros(
        3, dtype=torch.long)
    full = batch.propose(6, temp, seeds, rounds, "probabilistic")
    for r in range(3):
        one = drafter.propose(batch.anchor_ids[r:r + 1], batch.anchor_pos[r:r + 1],
                              batch.block_tables[r:r + 1], batch.ctx_lens[r], batch.caches,
                              BACKEND, 6, temp[r:r + 1], seeds[r:r + 1], rounds[r:r + 1],
                              "probabilistic")
        assert torch.equal(one.token_ids[0], full.token_ids[r])
        torch.testing.assert_close(one.probs[0], full.probs[r], atol=1e-6, rtol=0)
        torch.testing.assert_close(one.conf_logits[0], full.conf_logits[r], atol=1e-6, rtol=0)
    # A new round re-drafts with fresh uniforms: some token changes.
    other = batch.propose(6, temp, seeds, rounds + 1, "probabilistic")
    assert not torch.equal(other.token_ids, full.token_ids)
    empty = drafter.propose(batch.anchor_ids[:0], batch.anchor_pos[:0], batch.block_tables[:0],
                            1, batch.caches, BACKEND, 3, temp[:0], seeds[:0], rounds[:0],
                            "probabilistic")
    assert empty.token_ids.shape == (0, 3) and empty.probs.shape == (0, 3, 384)


def _chisquare_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs.double() * len(tokens)
    big = expected >= 5  # merge sparse bins into one
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def test_probabilistic_drafts_follow_returned_probs(tmp_path, small_vocab_target_dir):
    target = load_target(small_vocab_target_dir)
    ddir = make_tiny_drafter(str(tmp_path / "d"), small_vocab_target_dir, block_size=4,
                             markov_rank=4, seed=9)
    drafter = DSparkDrafter.from_pretrained(ddir, target, torch.float32, "cpu")
    n = 6000
    one = Batch(drafter, ctx_lens=[9], anchor_pos=[9], seed=10)
    # n rows with the same anchor and context (sharing the pages), different seeds.
    out = drafter.propose(one.anchor_ids.expand(n), one.anchor_pos.expand(n),
                          one.block_tables.expand(n, -1), 9, one.caches, BACKEND, 2,
                          torch.full((n,), 0.8), torch.arange(n) * 7919 + 3,
                          torch.zeros(n, dtype=torch.long), "probabilistic")
    p1 = out.probs[0, 0]
    assert torch.allclose(out.probs[:, 0], p1.expand(n, -1))
    assert p1.max() < 0.6 and (p1 > 0.02).sum() >= 4  # a spread-out law: the test has power
    assert _chisquare_pvalue(out.token_ids[:, 0], p1) > 1e-3
    # Negative control: the same samples are rejected against the T = 2 law.
    logits_t1 = torch.log(p1) * 0.8
    assert _chisquare_pvalue(out.token_ids[:, 0], torch.softmax(logits_t1 / 2.0, -1)) < 1e-6
    # Slot 2 follows the chain: given the sampled slot-1 token, its law is probs[:, 1].
    top = int(torch.bincount(out.token_ids[:, 0]).argmax())
    rows = out.token_ids[:, 0] == top
    p2 = out.probs[rows, 1][0]
    assert torch.allclose(out.probs[rows, 1], p2.expand(int(rows.sum()), -1))
    assert _chisquare_pvalue(out.token_ids[rows, 1], p2) > 1e-3
    other = out.probs[out.token_ids[:, 0] != top, 1][0]
    assert (other - p2).abs().max() > 1e-3  # the Markov bias depends on the drawn token


# ------------------------------------------------------------------ loading


def _rewrite(src_dir, dst_dir, edit):
    shutil.copytree(src_dir, dst_dir)
    file = os.path.join(dst_dir, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return dst_dir


def test_load_deepspec_layout(tmp_path, target_dir, target, caplog):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=2,
                             markov_head_type="rnn", seed=11)
    with caplog.at_level(logging.WARNING):
        drafter = DSparkDrafter.from_pretrained(ddir, target, "float32", "cpu")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    file_tensors = load_file(os.path.join(ddir, "model.safetensors"))
    own = set(file_tensors) - {"embed_tokens.weight", "lm_head.weight"}
    assert set(drafter.expected_checkpoint_names()) == own
    # Every parameter holds exactly the file's values (packed ones shard by shard).
    params = dict(drafter.named_parameters())
    for name, t in file_tensors.items():
        if name not in own:
            continue
        for frag, (packed, idx) in DSparkDrafter.packed_modules.items():
            if f".{frag}." in f".{name}":
                pname = name.replace(frag, packed)
                sizes = drafter.shard_sizes(pname)
                value = params[pname].narrow(0, sum(sizes[:idx]), sizes[idx])
                break
        else:
            value = params[name]
        assert torch.equal(value, t), name
    # The embedding and LM head are the target's modules, not drafter parameters.
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head
    assert not any("embed_tokens" in n or "lm_head" in n for n in drafter.state_dict())
    assert drafter.num_layers == 2 and drafter.num_kv_heads == 2 and drafter.head_dim == 16


@pytest.mark.parametrize("name", ["layers.1.self_attn.k_proj.weight", "layers.0.mlp.up_proj.weight",
                                  "markov_head.markov_w2.weight", "confidence_head.proj.bias",
                                  "hidden_norm.weight"])
def test_load_missing_tensor(tmp_path, target_dir, target, name):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, num_layers=2, seed=12)
    bad = _rewrite(ddir, str(tmp_path / "bad"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        DSparkDrafter.from_pretrained(bad, target, "float32", "cpu")


def test_load_unexpected_or_misshaped_tensor(tmp_path, target_dir, target):
    ddir = make_tiny_drafter(str(tmp_path / "d"), target_dir, seed=13)
    extra = _rewrite(ddir, str(tmp_path / "extra"),
                     lambda t: t.update({"markov_head.bonus.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"markov_head\.bonus\.weight"):
        DSparkDrafter.from_pretrained(extra, target, "float32", "cpu")
    shaped = _rewrite(ddir, str(tmp_path / "shape"),
                      lambda t: t.update({"fc.weight": torch.zeros(64, 64 * 3)}))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        DSparkDrafter.from_pretrained(shaped, target, "float32", "cpu")


def test_embedding_copies_that_differ_warn_and_are_ignored(tmp_path, target_dir, target, caplog):
    plain = make_tiny_drafter(str(tmp_path / "plain"), target_dir, seed=14,
                              include_embedding_copies=False)
    ref = DSparkDrafter.from_pretrained(plain, target, "float32", "cpu")

    def scramble(t):
        t["embed_tokens.weight"] = torch.randn_like(t["embed_tokens.weight"])
        t["lm_head.weight"] = torch.randn_like(t["lm_head.weight"])

    copies = make_tiny_drafter(str(tmp_path / "copies"), target_dir, seed=14)
    bad = _rewrite(copies, str(tmp_path / "bad"), scramble)
    with caplog.at_level(logging.WARNING, logger="dspark.models.dspark_drafter"):
        drafter = DSparkDrafter.from_pretrained(bad, target, "float32", "cpu")
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "embed_tokens.weight" in text and "lm_head.weight" in text and "differs" in text
    args = dict(ctx_lens=[8, 10], anchor_pos=[8, 6], seed=15)
    outs = [Batch(d, **args).propose(5, torch.tensor([1.0, 0.5]), torch.tensor([1, 2]),
                                     torch.tensor([0, 0]), "probabilistic") for d in (ref, drafter)]
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert torch.equal(outs[0].probs, outs[1].probs)


# ------------------------------------------------------------------ config and compatibility


@pytest.fixture(scope="module")
def drafter_cfg_dict(tmp_path_factory, target_dir):
    ddir = make_tiny_drafter(str(tmp_path_factory.mktemp("cfg")), target_dir, num_layers=2)
    return json.load(open(os.path.join(ddir, "config.json")))


def test_check_compatible(drafter_cfg_dict, target):
    dcfg = DrafterConfig.from_dict(drafter_cfg_dict)
    tcfg = target.config
    check_compatible(dcfg, tcfg, 7)
    check_compatible(dcfg, tcfg, 1)
    cases = [
        ((dcfg, tcfg, 8), "num_speculative_tokens"),
        ((dcfg, tcfg, 0), "num_speculative_tokens"),
        ((dcfg, dataclasses.replace(tcfg, vocab_size=385), 7), "vocab_size"),
        ((dcfg, dataclasses.replace(tcfg, hidden_size=128), 7), "hidden_size"),
        ((dcfg, dataclasses.replace(tcfg, num_hidden_layers=6), 7), "num_target_layers"),
        ((dataclasses.replace(dcfg, target_layer_ids=[1, 3]), tcfg, 7), "target_layer_ids"),
        ((dataclasses.replace(dcfg, target_layer_ids=[-1, 1]), tcfg, 7), "target_layer_ids"),
    ]
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            check_compatible(*args)
    with pytest.raises(ValueError, match="block_size"):
        check_compatible(dcfg, tcfg, 8)


@pytest.mark.parametrize("edit, field", [
    ({"block_size": None}, "block_size"),
    ({"target_layer_ids": None}, "target_layer_ids"),
    ({"target_layer_ids": []}, "target_layer_ids"),
    ({"num_target_layers": None}, "num_target_layers"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"mask_token_id": 384}, "mask_token_id"),
    ({"markov_rank": None}, "markov_rank"),
    ({"markov_rank": -1}, "markov_rank"),
    ({"markov_head_type": None}, "markov_head_type"),
    ({"markov_head_type": "lstm"}, "markov_head_type"),
    ({"enable_confidence_head": None}, "enable_confidence_head"),
    ({"enable_confidence_head": "yes"}, "enable_confidence_head"),
    ({"confidence_head_with_markov": None}, "confidence_head_with_markov"),
    ({"markov_rank": 0}, "confidence_head_with_markov"),
    ({"architectures": ["DFlashDraftModel"]}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_config_errors_name_the_field(drafter_cfg_dict, edit, field):
    cfg = dict(drafter_cfg_dict)
    for key, value in edit.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    with pytest.raises(ValueError, match=field):
        DrafterConfig.from_dict(cfg)


def test_dflash_config_without_optional_keys(drafter_cfg_dict):
    cfg = dict(drafter_cfg_dict, markov_rank=0, enable_confidence_head=False)
    cfg.pop("markov_head_type")
    cfg.pop("confidence_head_with_markov")
    dcfg = DrafterConfig.from_dict(cfg)
    assert dcfg.markov_head_type is None and not dcfg.confidence_head_with_markov
