"""A stream of RequestOutputs as deltas, for the engine process's pipe (engine_process.py).

A streamed RequestOutput is cumulative: the prompt, its token ids, every output token id and
the whole text, every step. Pickled for 256 requests per step that is ~200k integers each
way, growing with the outputs; the server's process then spent more time unpickling than the
step took. The engine side makes, per output, only what changed since the request's previous output
(new token ids, the text after the part already sent) and the prompt once, straight from the
request (no RequestOutput is built in the engine process); the server side rebuilds the same
cumulative RequestOutput.

Invariant: for each request, the decoder sees every delta the encoder made, in order (one
pipe, one reader), until the finished one; after an abort the engine sends none.
"""

from __future__ import annotations

from dspark.engine.output_builder import output_fields, settle_text
from dspark.engine.request import Request
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput


class DeltaEncoder:
    """Engine side: the engine's output maker in delta mode (make_output's counterpart)."""

    def __init__(self):
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (text, token count) sent

    def make(self, req: Request, new_tokens: list[int], detokenizer, stream: bool,
             with_spec: bool, detokenized: bool = False) -> tuple:  # fmt: skip
        settle_text(req, detokenizer, stream, detokenized)
        finished, finish, spec, metrics = output_fields(req, with_spec)
        rid, text, ids = req.request_id, req.output_text, req.output_token_ids
        prev = self._sent.get(rid)
        prompt = None
        if prev is None:
            prompt = (req.prompt, req.prompt_token_ids)
            text_at, tail, ids_at, new_ids = 0, text, 0, list(ids)
        else:
            prev_text, prev_n = prev
            # text grows at its end; a rewrite (a stop string cutting it) resends it whole
            text_at = len(prev_text) if text.startswith(prev_text) else 0
            tail = text[text_at:]
            ids_at = prev_n if len(ids) >= prev_n else 0
            new_ids = ids[ids_at:]
        if finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = (text, len(ids))
        return (rid, prompt, text_at, tail, ids_at, new_ids, new_tokens, finished, finish,
                req.stop_reason, metrics, spec)  # fmt: skip

    def forget(self, request_id: str) -> None:
        """The request was aborted: no more outputs of it."""
        self._sent.pop(request_id, None)


class DeltaDecoder:
    """Server side: delta tuple -> the cumulative RequestOutput (None: an aborted request's)."""

    def __init__(self):
        self._state: dict[str, list] = {}  # request id -> [prompt, prompt ids, ids, text]

    def decode(self, delta: tuple) -> RequestOutput | None:
        (rid, prompt, text_at, tail, ids_at, new_ids, step_ids, finished, finish_reason,
         stop_reason, metrics, spec_decode) = delta  # fmt: skip
        state = self._state.get(rid)
        if prompt is not None:
            state = self._state[rid] = [prompt[0], prompt[1], [], ""]
        elif state is None:
            return None  # aborted here while its output was in the pipe
        ids = state[2]
        del ids[ids_at:]
        ids.extend(new_ids)
        state[3] = state[3][:text_at] + tail
        if finished:
            self._state.pop(rid, None)
        return RequestOutput(
            request_id=rid, prompt=state[0], prompt_token_ids=state[1],
            outputs=[CompletionOutput(0, state[3], ids, finish_reason, stop_reason)],
            finished=finished, metrics=RequestMetrics(*metrics), spec_decode=spec_decode,
            new_token_ids=step_ids,
        )  # fmt: skip

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
