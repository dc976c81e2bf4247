"""A request's prompt as validated token ids: a string (tokenized), a token id list, or a
dict with 'prompt_token_ids' or 'prompt'. Bad input raises ValueError naming the field."""

from __future__ import annotations


def prompt_token_ids(prompt, tokenizer, vocab_size: int, max_model_len: int,
                     max_tokens: int | None) -> tuple[str | None, list[int]]:  # fmt: skip
    """(prompt text or None, token ids) of a prompt that fits the context with max_tokens."""
    text, token_ids = _tokenize(prompt, tokenizer)
    if not token_ids:
        raise ValueError("prompt must not be empty")
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool)]
    if bad or any(t < 0 or t >= vocab_size for t in token_ids):
        raise ValueError(f"prompt_token_ids must be integers in [0, {vocab_size})")
    n = len(token_ids)
    if n >= max_model_len:
        raise ValueError(f"prompt is {n} tokens, which does not fit max_model_len={max_model_len}")
    if max_tokens is not None and n + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={max_tokens} plus the prompt ({n} tokens) exceeds "
            f"max_model_len={max_model_len}"
        )
    return text, token_ids


def _tokenize(prompt, tokenizer) -> tuple[str | None, list[int]]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        return prompt, tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a token id list or a dict, got {prompt!r}")
