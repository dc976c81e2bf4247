"""Tiny random DSpark drafter checkpoints in the DeepSpec layout, for any tiny target.

The tensor list is written from the DeepSpec layout (`deepspec_tensor_shapes`), independently
of `DSparkDrafter`, so loading tests check that the model consumes exactly that layout.
"""

from __future__ import annotations

import json
import os

import torch

from dspark.testing.tokenizer import special_token_id


def default_target_layer_ids(num_target_layers: int, num_ids: int) -> list[int]:
    """Spread `num_ids` layers over the target, never its final layer (z-lab/DeepSpec style:
    from layer 1 to L-3 when the target is deep enough)."""
    if num_target_layers < 2:
        raise ValueError("a drafter needs a target with at least 2 layers")
    lo = 1 if num_target_layers >= 4 else 0
    hi = num_target_layers - 3 if num_target_layers >= 5 else num_target_layers - 2
    num = max(1, min(num_ids, hi - lo + 1))
    if num == 1:
        return [hi]
    return sorted({round(lo + i * (hi - lo) / (num - 1)) for i in range(num)})


def deepspec_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Qwen3DSparkModel checkpoint (without the embedding/LM-head copies)."""
    d, v, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    inter, bias = cfg["intermediate_size"], cfg.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (d, len(cfg["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        for name, out_dim, in_dim in (("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d),
                                      ("o_proj", d, q)):
            shapes[f"{p}self_attn.{name}.weight"] = (out_dim, in_dim)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out_dim,)
        shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
        shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, d)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, d)
        shapes[f"{p}mlp.down_proj.weight"] = (d, inter)
        shapes[f"{p}input_layernorm.weight"] = (d,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d,)
    if r > 0:
        shapes["markov_head.markov_w1.weight"] = (v, r)
        shapes["markov_head.markov_w2.weight"] = (v, r)
        if cfg["markov_head_type"] == "gated":
            shapes["markov_head.gate_proj.weight"] = (r, d + r)
            shapes["markov_head.gate_proj.bias"] = (r,)
        elif cfg["markov_head_type"] == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + d)
            shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if cfg["enable_confidence_head"]:
        extra = r if cfg["confidence_head_with_markov"] else 0
        shapes["confidence_head.proj.weight"] = (1, d + extra)
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def _target_shared_weights(target_path: str) -> tuple[torch.Tensor, torch.Tensor]:
    from dspark.models.loader import iter_tensors

    tensors = {}
    for name, t in iter_tensors(target_path):
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            tensors["embed" if "embed" in name else "head"] = t
    embed = tensors["embed"]
    return embed, tensors.get("head", embed)  # tied targets store no lm_head


def make_tiny_drafter(
    path: str,
    target_path: str,
    *,
    num_layers: int = 1,
    block_size: int = 7,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    dtype: str = "float32",
    include_embedding_copies: bool = True,
    init_scale: float = 0.6,
) -> str:
    """Write config.json + model.safetensors of a random DSpark drafter for the target at
    target_path. markov_rank 0 with enable_confidence_head=False gives a DFlash drafter."""
    from safetensors.torch import save_file

    with open(os.path.join(target_path, "config.json")) as f:
        target_cfg = json.load(f)
    num_target = int(target_cfg["num_hidden_layers"])
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target, num_layers)
    vocab = int(target_cfg["vocab_size"])
    if os.path.isfile(os.path.join(target_path, "tokenizer.json")):
        mask_id = special_token_id(target_path, "<|mask|>")
    else:
        mask_id = vocab - 1
    cfg = dict(target_cfg)  # DeepSpec deep-copies the target config, then overrides
    cfg.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        num_target_layers=num_target,
        num_hidden_layers=num_layers,
        block_size=block_size,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_layers,
        mask_token_id=mask_id,
        target_layer_ids=list(target_layer_ids),
        num_anchors=512,
        enable_confidence_head=enable_confidence_head,
        markov_rank=markov_rank,
        dtype=dtype,
    )
    cfg.pop("torch_dtype", None)
    if enable_confidence_head:
        cfg["confidence_head_with_markov"] = confidence_head_with_markov
    if markov_rank > 0:
        cfg["markov_head_type"] = markov_head_type

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in deepspec_tensor_shapes(cfg).items():
        if "norm" in name:
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        elif name == "markov_head.markov_w1.weight":  # embedding rows: O(1) entries
            t = torch.randn(shape, generator=gen)
        else:
            t = init_scale / shape[-1] ** 0.5 * torch.randn(shape, generator=gen)
        tensors[name] = t.to(getattr(torch, dtype)).contiguous()
    if include_embedding_copies:
        embed, head = _target_shared_weights(target_path)
        tensors["embed_tokens.weight"] = embed.to(getattr(torch, dtype)).contiguous()
        tensors["lm_head.weight"] = head.to(getattr(torch, dtype)).clone().contiguous()
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
