"""What an engine resolves before it starts: its device, and the checkpoint's tokenizer."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return torch.device(name)


def load_tokenizer(path: str):
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
