"""Train a small Qwen3-architecture target from scratch (Hugging Face `Qwen3ForCausalLM`).

bf16 autocast on CUDA (float32 master weights, fused AdamW), fp32 on the CPU; optional
`torch.compile` of the decoder; the LM-head cross-entropy is computed in checkpointed chunks,
so the [tokens, vocab] logits never exist at once. The result is written with
`save_pretrained` (plus tokenizer and generation config), which the engine loads directly.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def lr_factor(progress: float, warmup_frac: float, min_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine from 1 to min_frac; progress in [0, 1]."""
    if progress < warmup_frac:
        return (progress + 1e-9) / warmup_frac
    t = min(1.0, (progress - warmup_frac) / max(1e-9, 1.0 - warmup_frac))
    return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * t))


class Pace:
    """Training progress in [0, 1] for the LR schedule (1: stop). The step fraction, unless
    the time budget `max_time_s` binds: then the larger of it and the time fraction, so the
    schedule still decays to its end (at the cost of exact determinism). The time fraction
    counts from the end of the first WARM_STEPS steps against the budget left then, so a
    machine that can finish its steps in time (whatever its compile or start took) gets
    exactly the step-driven schedule: with the time fraction from step 0, a slower start
    moved the schedule of the first ~200 steps (tests/unit/test_train_pace.py)."""

    WARM_STEPS = 20

    def __init__(self, steps: int, max_time_s: float | None):
        self.steps, self.max_time_s = steps, max_time_s
        self.warm_at: float | None = None  # elapsed s when the warm-up steps were done

    def progress(self, step: int, elapsed: float) -> float:
        p = step / self.steps
        if not self.max_time_s or self.max_time_s <= 0:
            return p
        if elapsed >= self.max_time_s:
            return max(p, 1.0)
        if step < self.WARM_STEPS:
            return p
        if self.warm_at is None:
            self.warm_at = elapsed
        left = self.max_time_s - self.warm_at  # (> 0: elapsed < max_time_s above)
        return max(p, (elapsed - self.warm_at) / left)


def autocast(device: torch.device):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          enabled=device.type == "cuda")


@dataclass
class TargetShape:
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    intermediate_size: int = 1536
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0


@dataclass
class TargetTrainConfig:
    seq_len: int = 1024
    batch_size: int = 32
    steps: int = 2000
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 50
    seed: int = 0
    compile: bool = False
    ce_chunk_tokens: int = 8192
    max_time_s: float | None = None
    save_dtype: str = "bfloat16"  # "float32" | "bfloat16"


def build_model(shape: TargetShape, vocab_size: int, eos_id: int, seed: int = 0):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings, rms_norm_eps=1e-6,
        rope_theta=shape.rope_theta, eos_token_id=eos_id, bos_token_id=None, pad_token_id=eos_id,
        initializer_range=0.02, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config)


def count_params(model, exclude_embeddings: bool = False) -> int:
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embeddings and "embed" in name):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          chunk: int = 8192) -> torch.Tensor:
    """Mean CE of lm_head(hidden) [N, d] x [V, d] against labels [N] (-100 = ignored), one
    checkpointed chunk of rows at a time (logits are recomputed in the backward pass)."""

    def part(h, y):
        return F.cross_entropy(F.linear(h, weight).float(), y, ignore_index=-100,
                               reduction="sum")

    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        h, y = hidden[i:i + chunk], labels[i:i + chunk]
        total = total + (checkpoint(part, h, y, use_reentrant=False) if h.requires_grad
                         else part(h, y))
    return total / (labels != -100).sum().clamp(min=1)


def lm_loss(model, decoder, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    hidden = decoder(input_ids=ids[:, :-1], use_cache=False).last_hidden_state
    d = hidden.shape[-1]
    return chunked_cross_entropy(hidden.reshape(-1, d), model.lm_head.weight,
                                 ids[:, 1:].reshape(-1), chunk)


def _param_groups(model, weight_decay: float):
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def evaluate_lm(model, batches: list[np.ndarray], device: torch.device, chunk: int) -> float:
    """Mean next-token loss (nats) over fixed held-out windows."""
    was_training = model.training
    model.eval()
    losses = []
    for ids in batches:
        with autocast(device):
            losses.append(float(lm_loss(model, model.model, torch.as_tensor(ids, device=device),
                                        chunk)))
    model.train(was_training)
    return float(np.mean(losses)) if losses else float("nan")


def train_target(
    shape: TargetShape,
    cfg: TargetTrainConfig,
    next_batch: Callable[[int], np.ndarray],
    tokenizer_dir: str,
    out_dir: str,
    vocab_size: int,
    eos_id: int,
    device: torch.device,
    eval_batches: list[np.ndarray] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Train from scratch, save to out_dir; returns a summary (losses, throughput, params)."""
    from tqdm import tqdm

    model = build_model(shape, vocab_size, eos_id, cfg.seed).to(device).train()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    decoder = torch.compile(model.model) if cfg.compile else model.model
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr,
                            betas=(0.9, 0.95), fused=device.type == "cuda")
    n_params = count_params(model)
    log(f"target: {n_params / 1e6:.1f} M params ({count_params(model, True) / 1e6:.1f} M "
        f"non-embedding), {cfg.batch_size} x {cfg.seq_len} tokens/step, {cfg.steps} steps, "
        f"compile={cfg.compile}")
    bar = tqdm(total=cfg.steps, desc="train-target", disable=not sys.stderr.isatty())
    t0, history, tokens, done = time.time(), [], 0, 0
    pace = Pace(cfg.steps, cfg.max_time_s)
    for step in range(cfg.steps):
        progress = pace.progress(step, time.time() - t0)
        if progress >= 1.0:
            log(f"WARNING: target training stopped at step {step}/{cfg.steps}: time budget "
                f"{cfg.max_time_s:.0f}s reached")
            break
        lr = cfg.lr * lr_factor(progress + 1.0 / cfg.steps, cfg.warmup_frac, cfg.min_lr_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        ids = torch.as_tensor(next_batch(step), device=device)
        with autocast(device):
            loss = lm_loss(model, decoder, ids, cfg.ce_chunk_tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        done = step + 1
        tokens += ids.numel()
        last = step + 1 == cfg.steps
        if step % cfg.log_every == 0 or last:
            val = float(loss.detach())
            elapsed = time.time() - t0
            history.append({"step": step, "loss": val, "elapsed_s": elapsed})
            bar.set_postfix(loss=f"{val:.3f}")
            log(f"  step {step:5d}/{cfg.steps} loss {val:.4f} lr {lr:.2e} "
                f"{tokens / max(elapsed, 1e-9) / 1e3:.0f}k tok/s ({elapsed:.0f}s)")
        bar.update(1)
    bar.close()
    train_s = time.time() - t0
    summary = {"params": n_params, "steps": done, "tokens": tokens, "train_s": train_s,
               "tokens_per_s": tokens / max(train_s, 1e-9), "history": history,
               "final_train_loss": history[-1]["loss"] if history else float("nan")}
    if eval_batches:
        summary["val_loss"] = evaluate_lm(model, eval_batches, device, cfg.ce_chunk_tokens)
        log(f"target held-out loss {summary['val_loss']:.4f} nats/token "
            f"(ppl {math.exp(min(summary['val_loss'], 50)):.2f})")
    save_target(model, out_dir, cfg.save_dtype, tokenizer_dir, eos_id,
                {"shape": asdict(shape), "train_config": asdict(cfg),
                 "summary": {k: v for k, v in summary.items() if k != "history"}})
    return summary


def save_target(model, out_dir: str, dtype: str, tokenizer_dir: str, eos_id: int,
                extra: dict | None = None) -> None:
    from dspark.train.tokenizer_train import copy_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.config.use_cache = True
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_id}, f)
    copy_tokenizer(tokenizer_dir, out_dir)
    if extra is not None:
        with open(os.path.join(out_dir, "training_args.json"), "w") as f:
            json.dump(extra, f, indent=1, default=str)
