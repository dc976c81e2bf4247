"""A small byte-level BPE tokenizer trained offline from a built-in text sample."""

from __future__ import annotations

from dspark.train.tokenizer_train import (  # noqa: F401 (re-exported for tests)
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    token_id,
    train_tokenizer,
)

_SAMPLE = """
def add(a, b):
    return a + b

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

for i in range(10):
    print(i, i * i)

The quick brown fox jumps over the lazy dog. Hello, world! A serving engine schedules
requests, allocates key-value cache blocks and samples tokens from the model's distribution.
import os, sys, json
with open(path) as f:
    data = json.load(f)
"""


def build_tokenizer(out_dir: str, vocab_size: int = 384) -> int:
    """Train and save a tokenizer into out_dir; returns its vocabulary size."""
    return train_tokenizer([_SAMPLE] * 4, out_dir, vocab_size, min_frequency=0)


def special_token_id(out_dir: str, token: str) -> int:
    return token_id(out_dir, token)
