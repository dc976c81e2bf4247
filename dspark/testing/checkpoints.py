"""Tiny random Hugging Face checkpoints, built offline and deterministically from a seed.

Weights are written by `transformers` itself (`save_pretrained`), so the files have exactly
the layout real checkpoints have, and parity tests can load the same folder into HF.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from dspark.testing.tokenizer import build_tokenizer, special_token_id


@dataclass
class TinyShape:
    arch: str = "qwen3"  # "qwen3" | "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = 16
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    vocab_size: int = 384  # tokenizer vocab when with_tokenizer, else the model's vocab
    max_position_embeddings: int = 2048
    attention_bias: bool = False


def make_tiny_target(
    path: str,
    shape: TinyShape | None = None,
    seed: int = 0,
    dtype: str = "float32",
    with_tokenizer: bool = True,
    max_shard_size: str | None = None,
    init_scale: float = 0.6,
) -> str:
    """Write a tiny random Qwen3 or Llama checkpoint (config, safetensors, tokenizer) to path.

    `init_scale` widens the usual 0.02 init so that logits are spread out and greedy
    decoding has no near-ties (which would make exact-token parity tests flaky).
    """
    import transformers

    shape = shape or TinyShape()
    os.makedirs(path, exist_ok=True)
    vocab = shape.vocab_size
    eos_id = None
    if with_tokenizer:
        vocab = build_tokenizer(path, shape.vocab_size)
        eos_id = special_token_id(path, "<|endoftext|>")
    common = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim or shape.hidden_size // shape.num_attention_heads,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=eos_id,
        attention_bias=shape.attention_bias,
        initializer_range=0.02,
    )
    if shape.rope_scaling:
        common["rope_scaling"] = dict(shape.rope_scaling)
    if shape.arch == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    elif shape.arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown tiny arch {shape.arch!r}")
    torch.manual_seed(seed)
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                # tied embeddings: strengthen the layers, or logits just echo the input token
                scale = init_scale * (3.0 if shape.tie_word_embeddings else 1.0)
                std = scale / fan_in**0.5 if p.dim() > 1 else 0.1
                if "embed_tokens" in name:
                    std = init_scale
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    gen_cfg = {"eos_token_id": eos_id} if eos_id is not None else {}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen_cfg, f)
    return path
