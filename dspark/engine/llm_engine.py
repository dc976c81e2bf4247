"""LLMEngine: requests in, tokens out, one step at a time.

    step():  schedule -> runner.launch (pack, plan, allocate, forward, verify, draft)
             -> outputs of the last commit (built while the device runs) -> wait -> commit

The engine owns the CPU side (tokenizer, scheduler, block manager, request state) and the
model runner owns the device side.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from dspark.config import EngineConfig
from dspark.engine.block_manager import BlockManager, BlockTableMirror
from dspark.engine.commit import commit_step
from dspark.engine.detokenizer import Detokenizer
from dspark.engine.follow import follow_extra
from dspark.engine.loading import load_tokenizer, resolve_device
from dspark.engine.model_runner import ModelRunner, StepResult
from dspark.engine.output_builder import build_outputs, make_output, needs_text
from dspark.engine.prompt_input import prompt_token_ids
from dspark.engine.request import Request, RequestStatus, SpecStats
from dspark.engine.scheduler import Scheduler, SchedulerOutput
from dspark.models.config import ModelConfig, parse_dtype
from dspark.outputs import RequestOutput
from dspark.sampling.rng import hash_ints
from dspark.sampling_params import SamplingParams
from dspark.spec.tracing import STEP_KINDS

logger = logging.getLogger(__name__)
# engines freeze their start-up objects (LLMEngine.__init__): let the interpreter's last
# collection see them again
atexit.register(gc.unfreeze)


_MAX_GAP_S = 0.1  # a longer gap between two steps is idling, not per-step work


class Launched(NamedTuple):
    """A launched step, until its commit."""

    sched: SchedulerOutput
    wait: Callable[[], StepResult]
    tag: tuple | None  # the speculative decoder's, for the online cost model
    prediction: tuple | None  # ... and its drafting decision's acceptance check
    advanced: bool  # scheduled ahead as a plain step: its counters advanced at launch
    with_drafts: int | float  # its rows below this leave drafts for the next step


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_pretrained(config.model)
        self.device = resolve_device(config.device)
        if config.dtype == "auto":
            self.dtype = self.model_config.dtype if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = parse_dtype(config.dtype)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = list(self.model_config.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None:
            if self.tokenizer.eos_token_id is not None:
                self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.runner = ModelRunner(config, self.model_config, self.device, self.dtype)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.block_tables = BlockTableMirror(self.block_manager, config.max_num_seqs,
                                             self.runner.max_blocks_per_seq)  # fmt: skip
        self.max_model_len = self.runner.max_model_len
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            num_lookahead_slots=self.num_spec_tokens,
        )
        self.requests: dict[str, Request] = {}
        self._counter = itertools.count()
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.spec_stats = SpecStats()
        # outputs (with text) of unfinished requests every step: servers stream them. The
        # offline API only needs finished outputs, so it turns this off: step() then returns
        # finished requests only, without per-step detokenization or output objects
        self.stream_outputs = True
        # what an output is: a RequestOutput (make_output), or an engine process's delta
        # (output_delta.py), and whose text the engine makes (needs_text: every output's)
        self.output_maker, self.output_text_for = make_output, needs_text
        # steps launched and their periods (ms) by kind (STEP_KINDS; for reports)
        self.step_kinds = {kind: [0, 0.0] for kind in STEP_KINDS}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0,
                      "followed_steps": 0, "step_time_ms": 0.0}  # fmt: skip
        # What exists now (libraries, modules, tensors, tokenizer: ~300k objects) lives as long
        # as the engine. A full collection walks all of it (~150 ms on a 2-core CPU) and Python
        # starts one every so often under the allocation churn of serving: a stall in the
        # middle of a step. Frozen objects are skipped (release_memory unfreezes).
        gc.collect()
        gc.freeze()
        # end of the last step while busy; None after idling (see _step_period_ms)
        self._last_step_end: float | None = None
        # (request, new tokens) committed by the last step whose outputs are not built yet
        self._unbuilt: list[tuple[Request, list[int]]] = []
        self.on_outputs = None  # a callable taking each batch of outputs, or None
        # async scheduling (config.schedules_ahead): the step launched last and not yet
        # committed; a speculative one only where the next step follows it (follow.py)
        self.async_scheduling = self.runner.feeds_pending
        self.follows = self.runner.last_counts is not None  # (the runner's: follow.py)
        self._in_flight: Launched | None = None
        # the last committed step's period for the online cost model (observed: _step)
        self._unobserved: tuple | None = None
        self.idle = True  # whether the last step() neither launched nor committed a step

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not self.scheduler.has_unfinished():
            self.mark_idle()  # the time since the last step was idle, not a step's cost
        text, token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size,
                                           self.max_model_len, params.max_tokens)  # fmt: skip
        n = len(token_ids)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        counter = next(self._counter)
        seed = params.seed
        if seed is None:
            seed = hash_ints(self.config.seed, counter)
        req = Request(
            request_id, token_ids, params, self.eos_token_ids, seed, text, cache_salt,
            arrival_time,
        )  # fmt: skip
        # the request ends by length at this many tokens (prompt + max_tokens, or the context)
        limit = self.max_model_len if params.max_tokens is None else n + params.max_tokens
        req.max_total_tokens = min(limit, self.max_model_len)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> None:
        """Stop a request; no output of it comes out after this (not even one of an earlier
        step that is not built yet)."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if self._unbuilt:
            self._unbuilt = [(r, toks) for r, toks in self._unbuilt if r is not req]
        if req.is_finished:  # finished, its output dropped just now
            self.requests.pop(request_id, None)
            return
        self.scheduler.remove(req)
        req.finish(RequestStatus.FINISHED_ABORTED)
        self._release_slot(req)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        # (a step in flight and outputs not yet built count: a step() call finishes them)
        return (self.scheduler.has_unfinished() or bool(self._unbuilt)
                or self._in_flight is not None)  # fmt: skip

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step. Outputs are built while a later step runs on the device, so a call
        returns those of an earlier step: with async scheduling, of the step it committed
        (the one launched by the previous call); without, of the previous call's step (and
        its own when nothing is left to schedule). `on_outputs`, when set, receives each
        batch as soon as it is built instead (step() then returns [])."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats["step_time_ms"] += (time.perf_counter() - t0) * 1e3

    def _schedule(self, follow: bool = False) -> SchedulerOutput | None:
        """The next step; with `follow`, one following the speculative step in flight
        (follow.py: that step had every running request's row, and the running requests
        have only dwindled since, as admissions come with schedules), or None where the
        scheduler cannot make one."""
        spec = self.runner.spec
        if spec is not None:  # draft slots charged as steps with prefill have verified them
            self.scheduler.draft_share = spec.draft_share
        if follow:
            sched = self.scheduler.schedule_follow(follow_extra(self.num_spec_tokens))
            if sched is None:
                return None
        else:
            sched = self.scheduler.schedule()
        self.stats["preemptions"] += len(sched.preempted)
        for req in sched.preempted:
            self._release_slot(req)
        for row in sched.rows:
            if row.req.slot < 0:
                row.req.slot = self._free_slots.pop()
                if spec is not None:  # (its confidences there are the last request's)
                    spec.slot_assigned(row.req.slot)
        return sched

    def _launch(self, sched: SchedulerOutput):
        return self.runner.launch(sched, self.block_tables.rows([r.req for r in sched.rows]),
                                  sched.follows)  # fmt: skip

    def _step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then build the outputs of the last commit while it runs
        on the device (the previous call's), then commit.

        Async scheduling: step N+1 is scheduled and launched while step N is still on the
        device; then N is waited for, committed and its outputs delivered while N+1 runs,
        so the device never waits for the host's scheduling, packing or commit. N+1 is
        scheduled as if N's rows had advanced (`_advance`): a sampled token not yet known is
        a PENDING_TOKEN input that the device takes from what N sampled. A request that N
        finishes (a stop token) has a wasted row in N+1, dropped at its commit; one that N
        finishes by length is not scheduled again. Blocks freed while a step is in flight
        are only reused by later steps, which run after it on the same stream. A step stays
        in flight where its outcome is one token per sampling row (`_predictable`), or where
        it drafts for every decode row: the next then follows it (follow.py: scheduled from
        the counters before it, its rows moved on the device), or, where it cannot, is
        scheduled once the step in flight is waited for and committed. Any other step (it
        verifies without drafting for all, or has prefill chunks; every step without async
        scheduling) is waited for and committed in the call that launched it, after the step
        before it; its outputs are built in the next call, after that call's launch."""
        t0 = time.perf_counter()
        captures = self.runner.num_graph_captures()
        previous, committed, outputs = self._in_flight, [], []
        # (a speculative step in flight is one the next may follow: see _followable)
        follow = previous is not None and not previous.advanced
        sched = self._schedule(follow=True) if follow else None
        if sched is None and follow:
            self._in_flight = None  # its outcome decides the next step: committed first
            outputs = self._deliver_outputs()
            committed.append(self._commit_launched(previous))
            previous = None
        if sched is None:
            sched = self._schedule()
        launched, ahead = None, False
        if not sched.is_empty:
            wait = self._launch(sched)
            self.stats["followed_steps"] += sched.follows
            spec = self.runner.spec  # what the online cost model must know of this step
            advanced = self.async_scheduling and self._predictable(sched)
            ahead = advanced or (self.follows and self._followable(sched))
            launched = Launched(sched, wait, None if spec is None else spec.step_tag(),
                                None if spec is None else spec.take_prediction(), advanced,
                                0 if advanced or spec is None else spec.rows_with_drafts())
            if advanced:
                self._advance(sched)
        self._observe()  # (the last call's step, while this one runs)
        self._in_flight = None
        self.idle = launched is None and previous is None and not committed
        # the previous call's outputs: built while `launched` runs (reads only request state
        # fixed by that commit and touches nothing the device reads)
        outputs += self._deliver_outputs()
        if previous is not None:
            committed.append(self._commit_launched(previous))
            outputs += self._deliver_outputs()  # (one commit's outputs at a time)
        if launched is not None:
            if ahead:
                self._in_flight = launched
            else:
                committed.append(self._commit_launched(launched))
                # left for the next call to build after its launch, while its step runs (built
                # here, they would sit between two steps with the device idle: 0.1-0.45 ms a
                # speculative step on the H200), unless no step follows
                if not self.scheduler.has_unfinished():
                    outputs += self._deliver_outputs()
        period_ms = self._step_period_ms(t0)
        if launched is not None:  # (a call's period: its launched step's)
            spec = self.runner.spec
            kind = self.step_kinds[self.runner.last_kind if spec is None else spec.last_kind]
            kind[0] += 1
            kind[1] += period_ms
        # the whole step, host work included, is the cost: observed only when this call's
        # period is one step's (it committed one; a call committing two spans both: the switch
        # from steps scheduled ahead to one waited for) and no graph was captured
        if (len(committed) == 1 and self.runner.spec is not None
                and self.runner.num_graph_captures() == captures):  # fmt: skip
            sched, result, tag = committed[0]
            # observed by the next call after its launch, off the path between two steps
            # (11-14 µs a step in the H200 host's loop, trained pair; fixed K's: 1 µs)
            self._unobserved = (period_ms, result.num_tokens, len(sched.rows), tag)
            if not self.scheduler.has_unfinished():
                self._observe()  # (no step follows to overlap it with)
        if self.runner.spec is not None and not self.scheduler.has_unfinished():
            self.runner.spec.land_periods()  # (no plan follows to land the queue: now)
        return outputs

    def _observe(self) -> None:
        """Feed the online cost model the step period kept by the last call (if any)."""
        pending, self._unobserved = self._unobserved, None
        if pending is not None:  # (period ms, tokens, requests, tag)
            self.runner.spec.observe_step_time(*pending)

    def _predictable(self, sched: SchedulerOutput) -> bool:
        """Whether every sampling row of this launched step emits exactly one token and it
        drafts nothing (always, without speculation), so the next step can be scheduled
        before its results are known."""
        spec = self.runner.spec
        return spec is None or (not spec.draft_enabled and sched.num_draft_slots == 0)

    def _followable(self, sched: SchedulerOutput) -> bool:
        """Whether the speculative step just launched may stay in flight, the next one
        following it (follow.py): its rows are every running request's, each samples, and it
        drafts for every one."""
        spec = self.runner.spec
        return (spec.draft_enabled and not spec.probing and self.runner.last_all_sample
                and len(sched.rows) == len(self.scheduler.running))  # fmt: skip

    def _commit_launched(self, launched: Launched) -> tuple:
        """Wait for a launched step and commit it; returns (schedule, result, tag)."""
        result = launched.wait()
        self.stats["steps"] += 1
        self._unbuilt += self._commit(launched.sched, result, launched.advanced,
                                      launched.with_drafts)  # fmt: skip
        if launched.prediction is not None:  # (the drafting decision's acceptance check)
            self.runner.spec.drafting.check_prediction(launched.prediction, result.emitted,
                                                       result.verified)  # fmt: skip
        return launched.sched, result, launched.tag

    @staticmethod
    def _advance(sched: SchedulerOutput) -> None:
        """What the next schedule must see of a launched step without drafts: every row
        computes its new tokens and a sampling row's token is pending (its RNG round used)."""
        for row in sched.rows:
            req = row.req
            req.num_computed_tokens += row.num_new_tokens
            if row.samples:
                req.num_pending += 1
                req.round += 1

    def _deliver_outputs(self) -> list[RequestOutput]:
        """Build the outputs of the last commit; hand them to `on_outputs` if set."""
        produced, self._unbuilt = self._unbuilt, []
        if not produced:
            return []
        outputs = build_outputs(produced, self.detokenizer, self.stream_outputs,
                                self.runner.spec is not None, self.output_maker,
                                self.output_text_for)  # fmt: skip
        for req, _ in produced:
            if req.status.finished:
                self.requests.pop(req.request_id, None)
        if self.on_outputs is None:
            return outputs
        self.on_outputs(outputs)
        return []

    def mark_idle(self) -> None:
        """The driver waits for work now: the time until the next step is no step's cost."""
        self._last_step_end = None

    def _step_period_ms(self, t0: float) -> float:
        """What this call's step cost: from the end of the previous call while busy (so the
        driver's per-step work between steps counts: a server's streaming of every request's
        output, the GIL its event loop holds), else from this call's start. Every call ends a
        period, also one that commits nothing (it launched a step left in flight: the first
        after a step waited for), so a period never spans two calls. A gap over _MAX_GAP_S is
        a pause, not per-step work."""
        now, last = time.perf_counter(), self._last_step_end
        self._last_step_end = now
        start = t0 if last is None or t0 - last > _MAX_GAP_S else last
        return (now - start) * 1e3

    def _commit(self, sched: SchedulerOutput, result: StepResult, advanced: bool,
                with_drafts: int | float = 0) -> list[tuple[Request, list]]:  # fmt: skip
        return commit_step(self, sched, result, advanced, with_drafts)

    def _release_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self._free_slots.append(req.slot)
            req.slot = -1

    def decode(self, token_ids: list[int]) -> str:
        return self.detokenizer.decode(token_ids)

    def abort_output(self, req: Request):
        """The final output of an aborted request (made by `output_maker`)."""
        self.requests.pop(req.request_id, None)
        return self.output_maker(req, [], self.detokenizer, self.stream_outputs,
                                 self.runner.spec is not None)  # fmt: skip
