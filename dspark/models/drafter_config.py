"""DSpark drafter configuration (DeepSpec `Qwen3DSparkModel` config.json) and the checks that
a drafter fits its target."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark.models.config import ModelConfig, read_config_json
from dspark.models.markov_heads import MARKOV_HEAD_TYPES

DRAFTER_ARCHITECTURES = ("Qwen3DSparkModel",)


def _require(cfg: dict, key: str, kind: type, what: str):
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"drafter config.json is missing required field {key!r} ({what})")
    value = cfg[key]
    ok = isinstance(value, bool) if kind is bool else (
        isinstance(value, kind) and not isinstance(value, bool)
    )
    if not ok:
        raise ValueError(
            f"drafter config field {key!r} must be {kind.__name__} ({what}), got {value!r}"
        )
    return value


@dataclass
class DrafterConfig:
    architectures: list[str]
    block_size: int  # G: draft slots per round (anchor + G-1 masks); K <= G
    num_hidden_layers: int
    target_layer_ids: list[int]  # target decoder layers whose outputs feed `fc`, in order
    num_target_layers: int
    mask_token_id: int
    markov_rank: int  # 0: no Markov head (DFlash)
    markov_head_type: str | None  # "vanilla" | "gated" | "rnn" (None when markov_rank == 0)
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    dtype: torch.dtype
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict) -> DrafterConfig:
        archs = cfg.get("architectures") or []
        if not any(a in DRAFTER_ARCHITECTURES for a in archs):
            raise ValueError(
                f"drafter config field 'architectures' is {archs!r}; supported: "
                f"{list(DRAFTER_ARCHITECTURES)}"
            )
        dims = ModelConfig.from_dict(cfg)  # Qwen3 dims, RoPE and dtype parsing
        block_size = _require(cfg, "block_size", int, "draft slots per round")
        ids = _require(cfg, "target_layer_ids", list, "captured target layers")
        num_target = _require(cfg, "num_target_layers", int, "target depth")
        mask_id = _require(cfg, "mask_token_id", int, "token id of the MASK slots")
        rank = _require(cfg, "markov_rank", int, "0 disables the Markov head")
        conf = _require(cfg, "enable_confidence_head", bool, "confidence head present")
        if block_size < 1:
            raise ValueError(f"drafter config field 'block_size' must be >= 1, got {block_size}")
        if dims.num_hidden_layers < 1:
            raise ValueError("drafter config field 'num_hidden_layers' must be >= 1")
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(
                f"drafter config field 'target_layer_ids' must be a non-empty list of ints, "
                f"got {ids!r}"
            )
        if num_target < 1:
            raise ValueError("drafter config field 'num_target_layers' must be >= 1")
        if not 0 <= mask_id < dims.vocab_size:
            raise ValueError(
                f"drafter config field 'mask_token_id' {mask_id} is outside the vocabulary "
                f"[0, {dims.vocab_size})"
            )
        if rank < 0:
            raise ValueError(f"drafter config field 'markov_rank' must be >= 0, got {rank}")
        head_type = None
        if rank > 0:
            head_type = _require(cfg, "markov_head_type", str, "needed when markov_rank > 0")
            if head_type.lower() not in MARKOV_HEAD_TYPES:
                raise ValueError(
                    f"drafter config field 'markov_head_type' is {head_type!r}; supported: "
                    f"{list(MARKOV_HEAD_TYPES)}"
                )
            head_type = head_type.lower()
        with_markov = False
        if conf:
            with_markov = _require(
                cfg, "confidence_head_with_markov", bool, "needed with a confidence head"
            )
            if with_markov and rank == 0:
                raise ValueError(
                    "drafter config field 'confidence_head_with_markov' is true but "
                    "'markov_rank' is 0 (the head's input W1[x_prev] needs a Markov head)"
                )
        layer_types = cfg.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"drafter config field 'layer_types' must be all 'full_attention', "
                f"got {layer_types!r}"
            )
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab not in (None, dims.vocab_size):
            raise ValueError(
                f"drafter config field 'draft_vocab_size' ({draft_vocab}) differs from "
                f"'vocab_size' ({dims.vocab_size}); pruned draft vocabularies are not supported"
            )
        return cls(
            architectures=list(archs),
            block_size=block_size,
            num_hidden_layers=dims.num_hidden_layers,
            target_layer_ids=list(ids),
            num_target_layers=num_target,
            mask_token_id=mask_id,
            markov_rank=rank,
            markov_head_type=head_type,
            enable_confidence_head=conf,
            confidence_head_with_markov=with_markov,
            vocab_size=dims.vocab_size,
            hidden_size=dims.hidden_size,
            intermediate_size=dims.intermediate_size,
            num_attention_heads=dims.num_attention_heads,
            num_key_value_heads=dims.num_key_value_heads,
            head_dim=dims.head_dim,
            rms_norm_eps=dims.rms_norm_eps,
            rope=dims.rope,
            attention_bias=dims.attention_bias,
            mlp_bias=dims.mlp_bias,
            max_position_embeddings=dims.max_position_embeddings,
            dtype=dims.dtype,
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str) -> DrafterConfig:
        return cls.from_dict(read_config_json(path, "drafter"))


def check_compatible(
    dcfg: DrafterConfig, target_cfg: ModelConfig, num_speculative_tokens: int
) -> None:
    """Raise ValueError (naming the field) if the drafter cannot serve this target and K."""
    k = num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
    if k > dcfg.block_size:
        raise ValueError(
            f"num_speculative_tokens ({k}) exceeds the drafter's block_size "
            f"({dcfg.block_size}); a DSpark drafter proposes at most block_size tokens"
        )
    if dcfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"drafter vocab_size ({dcfg.vocab_size}) != target vocab_size "
            f"({target_cfg.vocab_size}); the drafter shares the target's embedding and LM head"
        )
    if dcfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"drafter hidden_size ({dcfg.hidden_size}) != target hidden_size "
            f"({target_cfg.hidden_size})"
        )
    depth = target_cfg.num_hidden_layers
    if dcfg.num_target_layers != depth:
        raise ValueError(
            f"drafter num_target_layers ({dcfg.num_target_layers}) != the target's "
            f"num_hidden_layers ({depth}); the drafter was trained for another target"
        )
    for i in dcfg.target_layer_ids:
        if i == -1:
            raise ValueError(
                "drafter target_layer_ids contains -1 (the embedding output), which this "
                "engine does not capture"
            )
        if not 0 <= i < depth - 1:
            raise ValueError(
                f"drafter target_layer_ids entry {i} is out of range: must be in "
                f"[0, {depth - 2}] (the target's final layer {depth - 1} is not allowed: "
                f"its Hugging Face hidden state is the normed one)"
            )


