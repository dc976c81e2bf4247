"""Incremental detokenization and stop-string matching.

Decoding a request's whole output every step costs O(n) per token. Instead each request keeps
two offsets into its output tokens: text is produced by decoding a short window that starts a
few tokens back (`prefix_offset`), so byte-level BPE pieces that only form a character
together are decoded correctly; a window that still ends in an incomplete character (U+FFFD)
is held back until the next token completes it.
"""

from __future__ import annotations

import functools

from dspark.engine.request import Request

_REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode_batch = _batch_decoder(tokenizer)
        # the Rust decoder's own `decode` where it gives the same text: ~2 us a call against
        # ~5 us through the tokenizer's Python wrapper (one request's windows: two calls)
        self._decode_one = (None if self._decode_batch is None else functools.partial(
            tokenizer.backend_tokenizer.decode, skip_special_tokens=True))  # fmt: skip

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        if self._decode_one is not None:
            return self._decode_one(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @staticmethod
    def _windows(req: Request) -> tuple[list[int], list[int]]:
        start = req.num_prompt_tokens + req.prefix_offset
        return req.token_ids[start : req.num_prompt_tokens + req.read_offset], req.token_ids[start:]

    @staticmethod
    def _advance(req: Request, prefix: str, full: str) -> str:
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing printable yet (an incomplete multi-byte character)
        delta = full[len(prefix) :]
        req.output_text += delta
        req.prefix_offset = req.read_offset
        req.read_offset = len(req.token_ids) - req.num_prompt_tokens
        return delta

    def update(self, req: Request) -> str:
        """Append the text of req's new output tokens to req.output_text; return the delta."""
        if self.tokenizer is None:
            return ""
        prefix, full = self._windows(req)
        return self._advance(req, self.decode(prefix), self.decode(full))

    def flush(self, req: Request) -> None:
        """At the finish: the whole output's text where a tail was held back (e.g. an
        incomplete character at the very end)."""
        n = req.num_prompt_tokens
        if req.read_offset < len(req.token_ids) - n:
            req.output_text = self.decode(req.token_ids[n:])

    def update_many(self, reqs: list[Request]) -> None:
        """`update` for every request of a step with one call into the tokenizer's Rust
        decoder (per-request `decode` calls cost microseconds each in Python)."""
        if self.tokenizer is None or not reqs:
            return
        if self._decode_batch is None or len(reqs) == 1:
            for req in reqs:
                self.update(req)
            return
        windows = [self._windows(req) for req in reqs]
        texts = self._decode_batch([w for pair in windows for w in pair])
        for i, req in enumerate(reqs):
            self._advance(req, texts[2 * i], texts[2 * i + 1])

    def find_stop(self, req: Request, delta: str) -> bool:
        """Check req's stop strings against the newly added text; on a hit, truncate
        output_text (keeping the stop string only if asked) and set stop_reason."""
        if not delta:
            return False
        stops = req.params.stop_strings
        text = req.output_text
        longest = max(len(s) for s in stops)
        start = max(0, len(text) - len(delta) - longest + 1)  # a match may straddle the delta
        best = None
        for stop in stops:
            i = text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return False
        i, stop = best
        keep = i + len(stop) if req.params.include_stop_str_in_output else i
        req.output_text = text[:keep]
        req.stop_reason = stop
        return True


def _batch_decoder(tokenizer):
    """The Rust tokenizer's `decode_batch`, when it gives exactly `tokenizer.decode`'s text:
    a fast (Rust-backed) tokenizer without Python-side clean-up of spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch"):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return lambda seqs: backend.decode_batch(seqs, skip_special_tokens=True)
