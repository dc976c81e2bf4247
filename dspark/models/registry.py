"""Model classes by the Hugging Face `architectures` name of a checkpoint."""

from __future__ import annotations

from dspark.models.qwen3 import CausalLM

_REGISTRY = {
    "Qwen3ForCausalLM": CausalLM,
    "LlamaForCausalLM": CausalLM,
}


def resolve_model_class(architectures: list[str]):
    for arch in architectures:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    supported = ", ".join(sorted(_REGISTRY))
    raise ValueError(
        f"unsupported model architecture {architectures!r}; supported: {supported}"
    )
