"""A stream of RequestOutputs as deltas, for the engine process's pipe (engine_process.py).

A streamed RequestOutput is cumulative: the prompt, its token ids, every output token id and
the whole text, every step. Pickled for 256 requests per step that is ~200k integers each
way, growing with the outputs; the server's process then spent more time unpickling than the
step took. The engine side sends, per output, only what changed since the request's previous
output (new token ids, the text after the part already sent) and the prompt once; the server
side rebuilds the same cumulative RequestOutput.

Invariant: for each request, the decoder sees every delta the encoder made, in order (one
pipe, one reader), until the finished one; after an abort the engine sends none.
"""

from __future__ import annotations

from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput


class DeltaEncoder:
    """Engine side: RequestOutput -> delta tuple."""

    def __init__(self):
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (text, token count) sent

    def encode(self, out: RequestOutput) -> tuple:
        rid, comp = out.request_id, out.outputs[0]
        prev = self._sent.get(rid)
        text, ids = comp.text, comp.token_ids
        prompt = None
        if prev is None:
            prompt = (out.prompt, out.prompt_token_ids)
            text_at, tail, ids_at, new_ids = 0, text, 0, list(ids)
        else:
            prev_text, prev_n = prev
            # text grows at its end; a rewrite (never expected) resends it whole
            text_at = len(prev_text) if text.startswith(prev_text) else 0
            tail = text[text_at:]
            ids_at = prev_n if len(ids) >= prev_n else 0
            new_ids = ids[ids_at:]
        if out.finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = (text, len(ids))
        m = out.metrics  # (dataclasses.astuple deep-copies: ~10 us per output)
        metrics = (m.arrival_time, m.first_token_time, m.finished_time, m.num_prompt_tokens,
                   m.num_cached_tokens, m.num_preemptions)  # fmt: skip
        return (rid, prompt, text_at, tail, ids_at, new_ids, out.new_token_ids, out.finished,
                comp.finish_reason, comp.stop_reason, metrics, out.spec_decode)  # fmt: skip

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
