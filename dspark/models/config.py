"""Model configuration read straight from a checkpoint's config.json.

Parsing the JSON ourselves keeps us independent of the installed `transformers` version (it
changed `rope_theta`/`rope_scaling` into `rope_parameters` in v5; both spellings are read).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def read_config_json(path: str, what: str = "model") -> dict:
    """The parsed config.json of a checkpoint folder, with clear errors."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {what} folder {path!r}")
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use float32, bfloat16 or float16")
    return _DTYPES[key]


@dataclass
class ModelConfig:
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope:
            rope = dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope["type"]
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        is_qwen3 = any("Qwen3" in a for a in archs)
        return cls(
            architectures=list(archs),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            dtype=parse_dtype(dtype_name),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        config = cls.from_dict(read_config_json(path, "model"))
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
            eos = gen.get("eos_token_id")
            if eos is not None:
                ids = [int(eos)] if isinstance(eos, int) else [int(x) for x in eos]
                config.eos_token_ids = sorted(set(config.eos_token_ids) | set(ids))
        return config
