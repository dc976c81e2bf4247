"""Build the target model on the device: from a checkpoint, or with random weights."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dspark.layers.rotary import rope_inv_freq
from dspark.models.config import ModelConfig
from dspark.models.loader import load_weights
from dspark.models.registry import resolve_model_class


@contextlib.contextmanager
def _no_random_init():
    """Skip nn.Linear / nn.Embedding's random initialization while a model is built on the
    meta device: load_target's allocation discards those values anyway, and the first such
    op on meta tensors imports torch's Python meta kernels (~2 s of every engine process's
    start-up on a 2-core CPU). Process-wide, for as long as the model is being built (nothing
    else builds these modules meanwhile: engines are built one at a time)."""
    saved = {cls: cls.__dict__["reset_parameters"] for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = _skip
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def _skip(self) -> None:
    pass


def load_target(
    model_cfg: ModelConfig, path: str, dtype: torch.dtype, device: torch.device, dummy=False
):
    cls = resolve_model_class(model_cfg.architectures)
    with torch.device("meta"), _no_random_init():
        model = cls(model_cfg)
    # allocated in the model's dtype at once (floating tensors; what .to(dtype) would cast),
    # not built in float32 and then copied; torch.empty, as to_empty's empty_like on meta
    # tensors imports those Python meta kernels too: 0.4-0.7 s of every server's start-up on a
    # 2-core CPU
    model = model._apply(lambda t: torch.empty(
        t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device))
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
