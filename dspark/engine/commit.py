"""Commit a step: its results applied to the requests (LLMEngine._commit)."""

from __future__ import annotations

import time

from dspark.engine.model_runner import StepResult
from dspark.engine.request import Request, RequestStatus
from dspark.engine.scheduler import SchedulerOutput
from dspark.engine.stopping import append_tokens


def commit_step(engine, sched: SchedulerOutput, result: StepResult, advanced: bool,
                with_drafts: int | float = 0) -> list[tuple[Request, list]]:
    """Apply a step's results to the requests (tokens, stops, freed blocks and slots).
    Returns (request, its new tokens) for each output to build: every sampling row's
    when streaming, else the finished ones'. `advanced`: the step was scheduled ahead of
    the next one, its counters advanced at launch (LLMEngine._advance), and a request may have
    finished (stop token, abort) or been preempted since. Rows below `with_drafts` left
    drafts for the next step (SpecDecoder.rows_with_drafts at launch)."""
    produced: list[tuple[Request, list[int]]] = []
    now, stream = time.time(), engine.stream_outputs
    rounds: list[tuple[int, int, int]] = []  # (drafted, verified, accepted) of this step
    for i, (row, emitted, verified, drafted) in enumerate(zip(
        sched.rows, result.emitted, result.verified, result.drafted
    )):  # fmt: skip
        req = row.req
        if req.is_finished:  # stopped or aborted while this step ran: a wasted row
            continue
        running = req.status is RequestStatus.RUNNING  # (not preempted meanwhile)
        if not row.samples:
            if not advanced:
                req.num_computed_tokens += row.num_new_tokens
            if running:
                engine.block_manager.cache_full_blocks(req)
            continue
        accepted = len(emitted) - 1
        if advanced:
            req.num_pending -= 1
        else:
            req.num_computed_tokens += row.num_non_draft_tokens + accepted
            req.round += 1
        if req.num_output_tokens == 0:
            engine.stats["prompt_tokens"] += req.num_prompt_tokens
        if drafted > 0:
            r = (drafted, verified, accepted)
            rounds.append(r)
            counts = req.spec_rounds  # (Request.spec: a count per kind of round)
            counts[r] = counts.get(r, 0) + 1
        new_tokens = append_tokens(req, emitted, now, engine.detokenizer)
        engine.stats["generation_tokens"] += len(new_tokens)
        finished = req.status.finished
        if finished:
            req.num_pending = 0  # a later step's token still in flight is dropped
            engine.scheduler.remove(req)  # from running (or waiting: preempted); freed
            engine._release_slot(req)
        else:
            # (with_drafts: the drafting state at launch; the spec decoder's may be a
            # later step's by now)
            req.has_drafts = i < with_drafts
            if running:
                engine.block_manager.cache_full_blocks(req)
        if stream or finished:
            produced.append((req, new_tokens))
    if rounds:
        engine.spec_stats.record_many(*zip(*rounds))
    return produced
