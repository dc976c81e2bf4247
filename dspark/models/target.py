"""Build the target model on the device: from a checkpoint, or with random weights."""

from __future__ import annotations

import torch

from dspark.layers.rotary import rope_inv_freq
from dspark.models.config import ModelConfig
from dspark.models.loader import load_weights
from dspark.models.registry import resolve_model_class


def load_target(
    model_cfg: ModelConfig, path: str, dtype: torch.dtype, device: torch.device, dummy=False
):
    cls = resolve_model_class(model_cfg.architectures)
    with torch.device("meta"):
        model = cls(model_cfg)
    model = model.to_empty(device=device).to(dtype)
    # non-persistent buffer: recompute it (in float32) after the meta-device construction
    model.rotary.inv_freq = rope_inv_freq(model_cfg.head_dim, model_cfg.rope).to(device)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if dummy:  # random weights for benchmarks (load_format="dummy")
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
        return model.eval().requires_grad_(False)
    load_weights(
        model,
        path,
        cls.checkpoint_name_to_param,
        cls.packed_modules,
        model.shard_sizes,
    )
    # inference only: the fused kernels decline tensors that autograd tracks (layers/norm.py)
    return model.eval().requires_grad_(False)
