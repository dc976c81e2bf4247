"""A small byte-level BPE tokenizer trained offline from a built-in text sample."""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_SAMPLE] * 4, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "unk_token": None,
                "model_max_length": 1 << 20,
                "chat_template": CHAT_TEMPLATE,
            },
            f,
            indent=1,
        )
    return tok.get_vocab_size()


def special_token_id(out_dir: str, token: str) -> int:
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json")).token_to_id(token)
    if tid is None:
        raise KeyError(token)
    return tid
