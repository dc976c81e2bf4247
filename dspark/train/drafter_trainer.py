"""Train a DSpark drafter for a frozen target (paper §3.3, DeepSpec recipe).

The drafter is the engine's own `DSparkDrafter` module, so a trained checkpoint loads in the
engine by construction. Per batch of token windows [B, S]:

  target (frozen)   outputs of `target_layer_ids` [B, S, m*d] and the final normed hidden
                    [B, S, d], computed on the fly under no_grad (no feature caches on disk)
  anchors           N random positions a per sequence; block [x_a, MASK x (G-1)] at positions
                    a + 0..G-1; slot k is labelled x_{a+k+1}
  masked forward    all blocks in one pass (SDPA, explicit boolean mask): a block sees context
                    positions strictly < a and its own block (bidirectional), no other block
  heads             teacher forced: slot k's previous token is the ground truth (k=0: anchor)
  loss              0.1 CE + 0.9 L1(p_d, p_t) + 1.0 BCE(conf, c* = sum min(p_d, p_t), detached),
                    weighted means with w_k = exp(-k/4) * eval_mask (a contiguous valid prefix)
  proxy             tau = 1 + sum_k prod_{i<=k} c*_i, the expected acceptance length
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

from dspark.models.dspark_drafter import DrafterConfig, DSparkDrafter
from dspark.testing.drafters import default_target_layer_ids
from dspark.train.target_trainer import Pace, autocast, lr_factor

Batch = tuple[np.ndarray, np.ndarray | None]  # token ids [B, S], loss mask [B, S] or None


@dataclass
class DrafterTrainConfig:
    num_layers: int = 2
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    target_layer_ids: list[int] | None = None  # default: spread over the target
    num_anchors: int = 32
    seq_len: int = 512
    batch_size: int = 16
    steps: int = 1000
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    loss_decay_gamma: float = 4.0
    save_every: int = 0  # 0: only at the end
    log_every: int = 20
    seed: int = 0
    max_time_s: float | None = None  # time budget: the schedule ends when it is spent
    save_dtype: str = "float32"


# --------------------------------------------------------------------------- target


class FrozenTarget:
    """A Hugging Face causal LM, frozen; exposes what the drafter needs from it."""

    def __init__(self, path: str, device: torch.device, dtype: torch.dtype | None = None):
        from transformers import AutoModelForCausalLM

        with open(os.path.join(path, "config.json")) as f:
            self.config = json.load(f)
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
        self.hf = hf.to(device).eval().requires_grad_(False)
        self.path, self.device = path, device
        self.embed_tokens = self.hf.get_input_embeddings()
        self.lm_head = self.hf.get_output_embeddings()

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, layer_ids: list[int]):
        """aux [B, S, m*d] (decoder-layer outputs = HF hidden_states[l+1]), final [B, S, d]."""
        got: dict[int, torch.Tensor] = {}
        def hook(i):
            return lambda _m, _i, out: got.__setitem__(i, out[0] if isinstance(out, tuple)
                                                       else out)

        hooks = [self.hf.model.layers[i].register_forward_hook(hook(i)) for i in layer_ids]
        try:
            final = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([got[i] for i in layer_ids], dim=-1), final


def drafter_config_dict(target_cfg: dict, cfg: DrafterTrainConfig, mask_token_id: int) -> dict:
    """DeepSpec `build_draft_config`: a copy of the target config with the drafter fields."""
    n_target = int(target_cfg["num_hidden_layers"])
    ids = cfg.target_layer_ids or default_target_layer_ids(n_target, max(cfg.num_layers, 3))
    out = {k: v for k, v in target_cfg.items() if k not in ("torch_dtype", "auto_map")}
    out.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3", num_target_layers=n_target,
        num_hidden_layers=cfg.num_layers, block_size=cfg.block_size, tie_word_embeddings=False,
        layer_types=["full_attention"] * cfg.num_layers, mask_token_id=int(mask_token_id),
        target_layer_ids=list(ids), num_anchors=cfg.num_anchors, markov_rank=cfg.markov_rank,
        enable_confidence_head=cfg.confidence_head, dtype=cfg.save_dtype,
    )  # fmt: skip
    if cfg.markov_rank > 0:
        out["markov_head_type"] = cfg.markov_head_type
    if cfg.confidence_head:
        out["confidence_head_with_markov"] = cfg.markov_rank > 0
    return out


def new_drafter(cfg_dict: dict, target: FrozenTarget, seed: int = 0) -> DSparkDrafter:
    """A freshly initialised drafter (float32 master weights) on the target's device."""
    torch.manual_seed(seed)
    shim = SimpleNamespace(embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    with torch.device(target.device):
        model = DSparkDrafter(DrafterConfig.from_dict(cfg_dict), shim).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("markov_w2.weight") or name.startswith("confidence_head"):
                p.zero_()  # Markov bias and confidence logit start at 0
            elif name.endswith("markov_w1.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


# --------------------------------------------------------------------------- masked forward


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, gen: torch.Generator):
    """Up to N distinct sorted anchors per row among positions p >= 1 with loss_mask[p] and
    loss_mask[p+1] (anchor and first label supervised). Returns anchors [B, N], keep [B, N]."""
    b, s = loss_mask.shape
    cand = torch.zeros_like(loss_mask)
    cand[:, 1:-1] = loss_mask[:, 1:-1] & loss_mask[:, 2:]
    n = min(num_anchors, s - 2)
    score = torch.rand(b, s, generator=gen, device=gen.device).to(loss_mask.device)
    top = score.masked_fill(~cand, -1.0).topk(n, dim=1)
    anchors = top.indices.sort(dim=1).values
    return anchors, cand.gather(1, anchors)


def _block_attention(attn, x, positions, h_ctx, rotary, mask):
    # x [B, L, d] block hiddens; positions [B, L]; h_ctx [B, S, d]; mask [B, L, S + L]
    b, length, _ = x.shape
    s = h_ctx.shape[1]
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.q_norm(q.view(b, length, attn.num_heads, attn.head_dim))
    k = attn.k_norm(k.view(b, length, attn.num_kv_heads, attn.head_dim))
    v = v.view(b, length, attn.num_kv_heads, attn.head_dim)
    q, k = rotary(positions, q, k)
    ctx_pos = torch.arange(s, device=x.device).repeat(b)
    kc, vc = attn.context_kv(h_ctx.reshape(b * s, -1), ctx_pos, rotary)  # [B*S, Hkv, D]
    group = attn.num_heads // attn.num_kv_heads
    keys = torch.cat([kc.view(b, s, attn.num_kv_heads, -1).to(k.dtype), k], dim=1)
    values = torch.cat([vc.view(b, s, attn.num_kv_heads, -1).to(v.dtype), v], dim=1)
    dt = v.dtype  # the projections' compute dtype (bf16 under autocast): one dtype for SDPA
    keys = keys.to(dt).repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, S+L, D]
    values = values.repeat_interleave(group, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.to(dt).transpose(1, 2), keys, values, attn_mask=mask.unsqueeze(1), scale=attn.scale
    )  # [B, H, L, D]
    return attn.o_proj(out.transpose(1, 2).reshape(b, length, attn.q_size))


def block_hidden(drafter: DSparkDrafter, aux: torch.Tensor, input_ids: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Backbone over all anchor blocks at once -> final-normed hiddens [B, N, G, d]."""
    cfg = drafter.config
    b, s = input_ids.shape
    n, g = anchors.shape[1], cfg.block_size
    h_ctx = drafter.hidden_norm(drafter.fc(aux))  # [B, S, d]
    ids = torch.full((b, n, g), cfg.mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    positions = (anchors.unsqueeze(-1) + torch.arange(g, device=anchors.device)).view(b, n * g)
    anchor_of = anchors.repeat_interleave(g, dim=1)  # [B, L]
    ctx_mask = torch.arange(s, device=anchors.device) < anchor_of.unsqueeze(-1)  # strictly <
    blk = torch.arange(n, device=anchors.device).repeat_interleave(g)
    blk_mask = (blk.unsqueeze(1) == blk.unsqueeze(0)).expand(b, -1, -1)
    mask = torch.cat([ctx_mask, blk_mask], dim=-1)  # [B, L, S + L]
    x = drafter.embed_tokens(ids).view(b, n * g, -1)
    for layer in drafter.layers:
        x = x + _block_attention(layer.self_attn, layer.input_layernorm(x), positions, h_ctx,
                                 drafter.rotary, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(b, n, g, -1)


def head_logits(drafter: DSparkDrafter, h: torch.Tensor, prev_ids: torch.Tensor):
    """Teacher-forced draft logits [B, N, G, V] (float32) and confidence logits [B, N, G]."""
    b, n, g, d = h.shape
    base = drafter.lm_head(h).float()
    head, conf_head = drafter.markov_head, drafter.confidence_head
    state = None if head is None else head.init_state(b * n, h)
    biases, confs = [], []
    for k in range(g):
        h_k = h[:, :, k].reshape(b * n, d)
        prev_emb = None
        if head is not None:
            prev_emb = head.prev_embedding(prev_ids[:, :, k].reshape(-1))
            bias, state = head.step(prev_emb, h_k, state)
            biases.append(bias.float().view(b, n, -1))
        if conf_head is not None:
            use = prev_emb is not None and drafter.config.confidence_head_with_markov
            feats = torch.cat([h_k, prev_emb.to(h_k.dtype)], -1) if use else h_k
            confs.append(conf_head(feats).view(b, n))
    logits = base + torch.stack(biases, dim=2) if biases else base
    return logits, (torch.stack(confs, dim=2) if confs else None)


def dspark_losses(draft_logits, conf_logits, target_logits, labels, eval_mask,
                  cfg: DrafterTrainConfig) -> dict[str, torch.Tensor]:
    g = draft_logits.shape[2]
    decay = torch.exp(-torch.arange(g, device=labels.device) / cfg.loss_decay_gamma)
    w = decay * eval_mask.float()  # [B, N, G]
    denom = w.sum().clamp(min=1e-6)
    logp = torch.log_softmax(draft_logits, dim=-1)
    p_d, p_t = logp.exp(), torch.softmax(target_logits.float(), dim=-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    l1 = (p_d - p_t).abs().sum(-1)
    c_star = torch.minimum(p_d, p_t).sum(-1).clamp(0.0, 1.0).detach()
    out = {"ce": (w * ce).sum() / denom, "l1": (w * l1).sum() / denom}
    loss = cfg.ce_weight * out["ce"] + cfg.l1_weight * out["l1"]
    if conf_logits is not None:
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        out["conf"] = (w * bce).sum() / denom
        loss = loss + cfg.conf_weight * out["conf"]
    out["loss"] = loss
    kept = eval_mask[:, :, 0]
    tau = 1.0 + torch.cumprod(c_star * eval_mask.float(), dim=-1).sum(-1)
    out["tau"] = (tau * kept).sum() / kept.sum().clamp(min=1)
    return out


def step_losses(drafter, target: FrozenTarget, input_ids, loss_mask, cfg: DrafterTrainConfig,
                gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Anchors, target features/logits (no_grad), masked forward, heads and losses."""
    dcfg = drafter.config
    b, s = input_ids.shape
    g = dcfg.block_size
    anchors, keep = sample_anchors(loss_mask, cfg.num_anchors, gen)
    aux, final = target.features(input_ids, dcfg.target_layer_ids)
    pos = anchors.unsqueeze(-1) + torch.arange(g, device=anchors.device)  # [B, N, G]
    label_pos = (pos + 1).clamp(max=s - 1)
    labels = input_ids.gather(1, label_pos.view(b, -1)).view(pos.shape)
    valid = (pos + 1 < s) & loss_mask.gather(1, label_pos.view(b, -1)).view(pos.shape)
    eval_mask = torch.cumprod((valid & keep.unsqueeze(-1)).int(), dim=-1).bool()
    with torch.no_grad():
        hid = final.gather(1, pos.clamp(max=s - 1).view(b, -1, 1).expand(-1, -1, final.shape[-1]))
        target_logits = target.lm_head(hid).view(*pos.shape, -1)
    h = block_hidden(drafter, aux, input_ids, anchors)
    prev = torch.cat([input_ids.gather(1, anchors).unsqueeze(-1), labels[:, :, :-1]], dim=-1)
    draft_logits, conf_logits = head_logits(drafter, h, prev)
    return dspark_losses(draft_logits, conf_logits, target_logits, labels, eval_mask, cfg)


# --------------------------------------------------------------------------- checkpoint


def export_state_dict(drafter: DSparkDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our packed parameters -> DeepSpec tensor names (q/k/v_proj, gate/up_proj)."""
    unpack = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
              "mlp.gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for name, p in drafter.state_dict().items():
        t = p.detach().to("cpu", dtype)
        for packed, parts in unpack.items():
            if f".{packed}." in f".{name}":
                prefix = packed.split(".")[0]
                for part, chunk in zip(parts, t.split(drafter.shard_sizes(name), dim=0)):
                    out[name.replace(packed, f"{prefix}.{part}")] = chunk.contiguous()
                break
        else:
            out[name] = t.contiguous()
    return out


def save_drafter(drafter: DSparkDrafter, cfg_dict: dict, out_dir: str, dtype: str,
                 extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = export_state_dict(drafter, getattr(torch, dtype))
    save_file(tensors, os.path.join(out_dir, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(out_dir, "model.safetensors.tmp"),
               os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(dict(cfg_dict, dtype=dtype), f, indent=1)
    if extra is not None:
        with open(os.path.join(out_dir, "training_args.json"), "w") as f:
            json.dump(extra, f, indent=1, default=str)


# --------------------------------------------------------------------------- training loop


def _losses(drafter, target: FrozenTarget, batch: Batch, cfg: DrafterTrainConfig, gen):
    ids = torch.as_tensor(batch[0], device=target.device)
    mask = (torch.ones_like(ids, dtype=torch.bool) if batch[1] is None
            else torch.as_tensor(batch[1], device=target.device))
    with autocast(target.device):
        return step_losses(drafter, target, ids, mask, cfg, gen)


def train_drafter(
    target: FrozenTarget,
    next_batch: Callable[[int], Batch],
    out_dir: str,
    cfg: DrafterTrainConfig,
    mask_token_id: int,
    eval_batches: list[Batch] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Train and write a DeepSpec-layout checkpoint to out_dir; returns a summary."""
    from tqdm import tqdm

    device = target.device
    cfg_dict = drafter_config_dict(target.config, cfg, mask_token_id)
    drafter = new_drafter(cfg_dict, target, cfg.seed).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    n_params = sum(p.numel() for p in params)
    log(f"drafter: {n_params / 1e6:.2f} M trainable params, target layers "
        f"{cfg_dict['target_layer_ids']}, block {cfg.block_size}, {cfg.num_anchors} anchors x "
        f"{cfg.batch_size} x {cfg.seq_len} tokens, {cfg.steps} steps")
    extra = {"train_config": asdict(cfg), "target": target.path}
    bar = tqdm(total=cfg.steps, desc="train-drafter", disable=not sys.stderr.isatty())
    t0, history, done = time.time(), [], 0
    pace = Pace(cfg.steps, cfg.max_time_s)
    for step in range(cfg.steps):
        progress = pace.progress(step, time.time() - t0)
        if progress >= 1.0:
            log(f"WARNING: drafter training stopped at step {step}/{cfg.steps}: time budget "
                f"{cfg.max_time_s:.0f}s reached")
            break
        lr = cfg.lr * lr_factor(progress + 1.0 / cfg.steps, cfg.warmup_frac)
        for group in opt.param_groups:
            group["lr"] = lr
        out = _losses(drafter, target, next_batch(step), cfg, gen)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        done = step + 1
        bar.update(1)
        if step % cfg.log_every == 0 or done == cfg.steps:
            vals = {k: float(v.detach()) for k, v in out.items()}
            history.append({"step": step, **vals})
            bar.set_postfix(loss=f"{vals['loss']:.3f}", tau=f"{vals['tau']:.2f}")
            log(f"  step {step:5d}/{cfg.steps} " + " ".join(f"{k} {v:.4f}" for k, v in
                vals.items()) + f" lr {lr:.2e} ({time.time() - t0:.0f}s)")
        if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
            save_drafter(drafter, cfg_dict, out_dir, cfg.save_dtype, extra)
    bar.close()
    summary = {"steps": done, "train_s": time.time() - t0, "params": n_params,
               "history": history}
    if eval_batches:
        summary["eval"] = evaluate_drafter(drafter, target, eval_batches, cfg)
        log("drafter held-out: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["eval"].items()))
    extra["summary"] = {k: v for k, v in summary.items() if k != "history"}
    save_drafter(drafter, cfg_dict, out_dir, cfg.save_dtype, extra)
    return summary


@torch.no_grad()
def evaluate_drafter(drafter, target: FrozenTarget, batches: list[Batch],
                     cfg: DrafterTrainConfig) -> dict[str, float]:
    """Mean losses and tau proxy over fixed batches (anchors from a fixed seed)."""
    was_training = drafter.training
    drafter.eval()
    gen = torch.Generator(device=target.device).manual_seed(cfg.seed + 1)
    sums: dict[str, float] = {}
    for batch in batches:
        for k, v in _losses(drafter, target, batch, cfg, gen).items():
            sums[k] = sums.get(k, 0.0) + float(v) / len(batches)
    drafter.train(was_training)
    return sums
