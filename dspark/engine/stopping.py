"""Committing a row's emitted tokens to its request, up to the one that finishes it: an EOS
or stop token, a stop string (the text is detokenized incrementally to find it), or the length
limit (max_tokens or the context)."""

from __future__ import annotations

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.request import Request, RequestStatus


def append_tokens(req: Request, emitted: list[int], now: float,
                  detokenizer: Detokenizer) -> list[int]:  # fmt: skip
    """Append a row's emitted tokens up to the one that finishes the request; returns those
    appended. Without a stop token among them, stop strings or the length limit in reach, that
    is all of them at once (no per-token checks: the common case)."""
    if emitted and req.first_token_time is None:
        req.first_token_time = now
    if (len(req.token_ids) + len(emitted) < req.max_total_tokens
            and not req.params.stop_strings and req.eos_token_ids.isdisjoint(emitted)
            and req.stop_token_ids.isdisjoint(emitted)):  # fmt: skip
        req.token_ids.extend(emitted)
        return emitted
    new_tokens = []
    for tok in emitted:
        req.token_ids.append(tok)
        new_tokens.append(tok)
        if check_stop(req, tok, detokenizer):
            break
    return new_tokens


def check_stop(req: Request, tok: int, detokenizer: Detokenizer) -> bool:
    """Whether the token just appended finishes the request (then it is marked finished)."""
    if tok in req.eos_token_ids:
        req.stop_reason = None
    elif tok in req.stop_token_ids:
        req.stop_reason = tok
    elif not (req.params.stop_strings and detokenizer.find_stop(req, detokenizer.update(req))):
        if len(req.token_ids) < req.max_total_tokens:
            return False
        req.finish(RequestStatus.FINISHED_LENGTH)  # max_tokens or max_model_len
        return True
    req.finish(RequestStatus.FINISHED_STOPPED)
    return True
