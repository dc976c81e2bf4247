"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) for a target model.

Writes `tokenizer.json` and `tokenizer_config.json` that `transformers.AutoTokenizer` loads as
a `PreTrainedTokenizerFast`: eos / pad `<|endoftext|>`, chat markers `<|im_start|>` /
`<|im_end|>`, and `<|mask|>`, the DSpark drafter's MASK slot token. Special tokens get the
first ids (0..3) and never occur in encoded text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
MASK_TOKEN = "<|mask|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(
    texts: Iterable[str], out_dir: str, vocab_size: int = 16384, min_frequency: int = 2
) -> int:
    """Train on `texts` and save into out_dir; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_tokenizer(tok, out_dir)
    return tok.get_vocab_size()


def save_tokenizer(tok, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def copy_tokenizer(src_dir: str, dst_dir: str) -> None:
    import shutil

    os.makedirs(dst_dir, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(dst_dir, name))


def token_id(tokenizer_dir: str, token: str) -> int:
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json")).token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer in {tokenizer_dir!r} has no token {token!r}")
    return tid
