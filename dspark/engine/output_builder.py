"""RequestOutputs from committed requests: the text (one batched detokenization per step),
the token ids, the finish reason, metrics and speculation stats. The engine builds a step's
outputs while the next step runs on the device (llm_engine.py). `make_output` is the
engine's default output maker; an engine process makes deltas instead (output_delta.py),
from the same `settle_text` and `output_fields`."""

from __future__ import annotations

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.request import Request
from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput


def needs_text(req: Request, stream: bool) -> bool:
    # (a stop string has already fixed the text)
    return (stream or req.status.finished) and not isinstance(req.stop_reason, str)


def build_outputs(produced: list[tuple[Request, list[int]]], detokenizer: Detokenizer,
                  stream: bool, with_spec: bool, make, text_for) -> list:  # fmt: skip
    """Outputs of (request, its new tokens) pairs: the text of every request that needs it
    (`text_for`: needs_text, or a delta maker's) at once (one batched decode), then the
    output objects (made by `make`: make_output, or deltas)."""
    detokenizer.update_many([req for req, _ in produced if text_for(req, stream)])
    return [make(req, toks, detokenizer, stream, with_spec, detokenized=True)
            for req, toks in produced]  # fmt: skip


def settle_text(req: Request, detokenizer: Detokenizer, stream: bool,
                detokenized: bool = False) -> None:  # fmt: skip
    """Bring req.output_text up to date for an output (incremental; whole at the finish)."""
    if needs_text(req, stream):
        if not detokenized:
            detokenizer.update(req)
        if req.status.finished:
            detokenizer.flush(req)


def output_fields(req: Request, with_spec: bool) -> tuple:
    """(finished, finish reason, speculation stats, metrics fields) of a request's output."""
    finished = req.status.finished
    finish = req.status.value if finished else None
    # per-request speculation stats are reported with the final output
    spec = req.spec.as_dict() if finished and with_spec else None
    metrics = (req.arrival_time, req.first_token_time, req.finished_time,
               req.num_prompt_tokens, req.num_cached_tokens, req.num_preemptions)  # fmt: skip
    return finished, finish, spec, metrics


def make_output(req: Request, new_tokens: list[int], detokenizer: Detokenizer, stream: bool,
                with_spec: bool, detokenized: bool = False) -> RequestOutput:  # fmt: skip
    settle_text(req, detokenizer, stream, detokenized)
    finished, finish, spec, metrics = output_fields(req, with_spec)
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[
            CompletionOutput(0, req.output_text, req.output_token_ids, finish, req.stop_reason)
        ],
        finished=finished,
        metrics=RequestMetrics(*metrics),
        spec_decode=spec,
        new_token_ids=new_tokens,
    )
