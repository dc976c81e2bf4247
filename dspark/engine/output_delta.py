"""A stream of RequestOutputs as deltas, for the engine process's pipe (engine_process.py).

A streamed RequestOutput is cumulative: the prompt, its token ids, every output token id and
the whole text, every step. Pickled for 256 requests per step that is ~200k integers each
way, growing with the outputs; the server's process then spent more time unpickling than the
step took. The engine side makes, per output, only what changed since the request's previous output
(new token ids, the text after the part already sent) and the prompt once, straight from the
request (no RequestOutput is built in the engine process); the server side rebuilds the same
cumulative RequestOutput. Text: the engine detokenizes only requests with stop strings (it
must match them); the server's process makes the others' text with the same incremental
Detokenizer (text_at = -1 in the delta), off the engine's critical path.

Invariant: for each request, the decoder sees every delta the encoder made, in order (one
pipe, one reader), until the finished one; after an abort the engine sends none.
"""

from __future__ import annotations

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.output_builder import needs_text, output_fields, settle_text
from dspark.engine.request import Request
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput


class DeltaEncoder:
    """Engine side: the engine's output maker in delta mode (make_output's counterpart)."""

    def __init__(self):
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (text, token count) sent

    def attach(self, engine) -> None:
        """Make `engine`'s outputs as deltas from now on, their text only where stop strings
        need it."""
        engine.output_maker, engine.output_text_for = self.make, self.text_for

    @staticmethod
    def text_for(req: Request, stream: bool) -> bool:
        """Whether the engine makes this output's text: only to match stop strings; the
        server's process detokenizes the other requests (DeltaDecoder), off the engine's
        critical path."""
        return bool(req.params.stop_strings) and needs_text(req, stream)

    def make(self, req: Request, new_tokens: list[int], detokenizer, stream: bool,
             with_spec: bool, detokenized: bool = False) -> tuple:  # fmt: skip
        engine_text = bool(req.params.stop_strings)
        if engine_text:
            settle_text(req, detokenizer, stream, detokenized)
        finished, finish, spec, metrics = output_fields(req, with_spec)
        rid, ids = req.request_id, req.output_token_ids
        text = req.output_text if engine_text else ""
        prev = self._sent.get(rid)
        prompt = None
        if prev is None:
            prompt = (req.prompt, req.prompt_token_ids)
            text_at, tail, ids_at, new_ids = 0, text, 0, ids  # (ids: a fresh copy)
        else:
            prev_text, prev_n = prev
            # text grows at its end; a rewrite (a stop string cutting it) resends it whole
            text_at = len(prev_text) if text.startswith(prev_text) else 0
            tail = text[text_at:]
            ids_at = prev_n if len(ids) >= prev_n else 0
            new_ids = ids[ids_at:]
        if not engine_text:
            text_at = -1  # the decoder detokenizes
        if finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = (text, len(ids))
        return (rid, prompt, text_at, tail, ids_at, new_ids, new_tokens, finished, finish,
                req.stop_reason, metrics, spec)  # fmt: skip

    def forget(self, request_id: str) -> None:
        """The request was aborted: no more outputs of it."""
        self._sent.pop(request_id, None)


class _Stream:
    """What the server's process keeps of a request in flight: its prompt, output ids and
    text, and the offsets the Detokenizer keeps on a Request (its windows never reach into
    the prompt, so the output ids alone are enough: num_prompt_tokens 0)."""

    num_prompt_tokens = 0

    def __init__(self, prompt: str | None, prompt_token_ids: list[int]):
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.token_ids: list[int] = []  # the output ids
        self.output_text = ""
        self.prefix_offset = self.read_offset = 0


class DeltaDecoder:
    """Server side: delta tuples -> the cumulative RequestOutputs (an aborted request's:
    dropped). Text the engine did not make is detokenized here, incrementally, with the same
    Detokenizer and the same windows as the engine would use: the same text."""

    def __init__(self, tokenizer=None):
        self.detokenizer = Detokenizer(tokenizer)
        self._state: dict[str, _Stream] = {}  # request id -> its stream

    def decode_many(self, deltas: list[tuple]) -> list[RequestOutput]:
        """The outputs of one batch of deltas (one batched detokenization for all)."""
        rows = [row for row in map(self._apply, deltas) if row is not None]
        self.detokenizer.update_many([s for delta, s in rows if delta[2] < 0])
        return [self._output(*row) for row in rows]

    def decode(self, delta: tuple) -> RequestOutput | None:
        outs = self.decode_many([delta])
        return outs[0] if outs else None

    def _apply(self, delta: tuple) -> tuple[tuple, _Stream] | None:
        """Update a request's ids and engine-made text (text_at >= 0)."""
        rid, prompt, text_at, tail, ids_at, new_ids = delta[:6]
        s = self._state.get(rid)
        if prompt is not None:
            s = self._state[rid] = _Stream(*prompt)
        elif s is None:
            return None  # aborted here while its output was in the pipe
        del s.token_ids[ids_at:]
        s.token_ids.extend(new_ids)
        if text_at >= 0:
            s.output_text = s.output_text[:text_at] + tail
        return delta, s

    def _output(self, delta: tuple, s: _Stream) -> RequestOutput:
        (rid, _, text_at, _, _, _, step_ids, finished, finish_reason, stop_reason, metrics,
         spec_decode) = delta  # fmt: skip
        if text_at < 0 and finished and s.read_offset < len(s.token_ids):
            s.output_text = self.detokenizer.decode(s.token_ids)  # (as settle_text: the tail)
        if finished:
            self._state.pop(rid, None)
        # (a copy of the ids, as the engine's RequestOutputs carry: the list grows in place)
        return RequestOutput(
            request_id=rid, prompt=s.prompt, prompt_token_ids=s.prompt_token_ids,
            outputs=[CompletionOutput(0, s.output_text, list(s.token_ids), finish_reason,
                                      stop_reason)],
            finished=finished, metrics=RequestMetrics(*metrics), spec_decode=spec_decode,
            new_token_ids=step_ids,
        )  # fmt: skip

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
