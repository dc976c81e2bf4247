"""RequestOutputs from committed requests: the text (one batched detokenization per step),
the token ids, the finish reason, metrics and speculation stats. The engine builds a step's
outputs while the next step runs on the device (llm_engine.py)."""

from __future__ import annotations

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.request import Request
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput


def needs_text(req: Request, stream: bool) -> bool:
    # (a stop string has already fixed the text)
    return (stream or req.status.finished) and not isinstance(req.stop_reason, str)


def build_outputs(produced: list[tuple[Request, list[int]]], detokenizer: Detokenizer,
                  stream: bool, with_spec: bool) -> list[RequestOutput]:  # fmt: skip
    """Outputs of (request, its new tokens) pairs: the text of every request at once (one
    batched decode), then the output objects."""
    detokenizer.update_many([req for req, _ in produced if needs_text(req, stream)])
    return [make_output(req, toks, detokenizer, stream, with_spec, detokenized=True)
            for req, toks in produced]  # fmt: skip


def make_output(req: Request, new_tokens: list[int], detokenizer: Detokenizer, stream: bool,
                with_spec: bool, detokenized: bool = False) -> RequestOutput:  # fmt: skip
    finished = req.status.finished
    if needs_text(req, stream):
        if not detokenized:
            detokenizer.update(req)
        if finished and req.read_offset < req.num_output_tokens:
            # flush a held-back tail (e.g. an incomplete character at the very end)
            req.output_text = detokenizer.decode(req.output_token_ids)
    finish = req.status.value if finished else None
    # per-request speculation stats are reported with the final output
    spec = req.spec.as_dict() if finished and with_spec else None
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[
            CompletionOutput(0, req.output_text, req.output_token_ids, finish, req.stop_reason)
        ],
        finished=finished,
        metrics=RequestMetrics(
            req.arrival_time, req.first_token_time, req.finished_time,
            req.num_prompt_tokens, req.num_cached_tokens, req.num_preemptions,
        ),  # fmt: skip
        spec_decode=spec,
        new_token_ids=new_tokens,
    )
