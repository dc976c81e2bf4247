"""Continuous-batching scheduler (FCFS, chunked prefill, preemption by recompute).

Phase-less: each request asks for `num_tokens + pending draft slots - num_computed_tokens`
tokens; prefill chunks, decodes and verify blocks are the same thing. Running requests are
served first, in arrival order; when KV blocks run out the most recently arrived running
request is preempted (its blocks freed, its counters reset, its tokens recomputed later).
Waiting requests are admitted in order while token budget, sequence slots and blocks allow.

Draft slots: a row with drafts lays out all K of them, but the lagged plan verifies only some
(beside prefill chunks, drafts are worth only what decoding would earn in their time:
planner.py). `draft_share` (set by the engine from the plans of earlier steps with prefill) is
the fraction of a row's slots charged against the budget, so that prefill chunks get the
tokens the plan would leave unverified; the plan then verifies at most `draft_room` drafts
(what was charged plus the budget nobody took), so the forward stays within the budget.
(H200, 8B shape, 256 requests arriving at once, drafting on: charging every slot left ~13k
tokens of the burst's 8k-token prefill steps unused, ~2% of the level's time.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dspark.engine.block_manager import BlockManager
from dspark.engine.request import Request, RequestStatus


@dataclass
class ScheduledRow:
    req: Request
    num_new_tokens: int  # tokens to compute (upper bound: includes all pending draft slots)
    num_draft_slots: int  # draft slots among them (verify capacity; 0 = plain decode/prefill)
    samples: bool  # the row produces a token at the end (its sequence is fully computed)

    @property
    def num_non_draft_tokens(self) -> int:
        return self.num_new_tokens - self.num_draft_slots


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    draft_room: int = 0  # drafts the step may verify within the token budget (module doc)
    num_draft_slots: int = 0  # draft slots laid out over all rows
    follows: bool = False  # scheduled while the step before is in flight (schedule_follow)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.rows


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead_slots: int = 0,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_lookahead_slots = num_lookahead_slots  # K draft slots per decoding request
        self.draft_share = 1.0  # of each row's draft slots, charged against the budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a finished or aborted request out (running, or waiting after a preemption)
        and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.bm.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _num_wanted(self, req: Request) -> tuple[int, int]:
        drafts = self.num_lookahead_slots if req.has_drafts else 0
        return req.num_tokens + drafts - req.num_computed_tokens, drafts

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.bm.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.has_drafts = False
        victim.context_gap = None  # (recomputed from its prompt, the context with it)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        room = 0  # draft tokens charged
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens >= req.max_total_tokens:  # its last token is still in flight
                i += 1
                continue
            wanted, drafts = self._num_wanted(req)
            charged = math.ceil(self.draft_share * drafts) if drafts else 0
            if wanted - drafts + charged <= budget:
                num_new, cost = wanted, wanted - drafts + charged
            else:  # fewer draft slots if over budget, each one charged
                num_new = cost = min(wanted, budget)
                drafts = charged = max(0, drafts - (wanted - num_new))
            while not self.bm.allocate(req, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req preempted itself; self.running shrank, do not advance i
            samples = req.num_computed_tokens + num_new >= req.num_tokens
            out.rows.append(ScheduledRow(req, num_new, drafts, samples))
            budget -= cost
            room += charged
            out.num_draft_slots += drafts
            i += 1
        # Rows of requests preempted after being scheduled this step must be dropped.
        out.rows = [r for r in out.rows if r.req.status is RequestStatus.RUNNING]
        if out.preempted:
            out.num_draft_slots = out.draft_room = sum(r.num_draft_slots for r in out.rows)
            return out  # no admissions while memory is short (the budget does not bind)
        return self._admit(out, budget, room)

    def _admit(self, out: SchedulerOutput, budget: int, room: int) -> SchedulerOutput:
        """Admit waiting requests in order while the budget, seats and blocks allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.bm.find_cached_prefix(req)
            num_cached = len(cached) * self.bm.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.bm.allocate(req, num_cached + num_new, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            self.running.append(req)
            samples = num_cached + num_new >= req.num_tokens
            out.rows.append(ScheduledRow(req, num_new, 0, samples))
            budget -= num_new
        out.draft_room = room + budget
        return out

    def schedule_follow(self, extra: int) -> SchedulerOutput | None:
        """The next step after a speculative step still in flight whose rows were every
        running request, each sampling, and which drafts for every row (follow.py): each
        running request a decode row of 1 + K tokens from its last known token (its anchor
        is that step's last emitted token, its position moved on the device), its blocks
        covering `extra` tokens more (that step's longest outcome); then admissions as
        usual. None where the step cannot follow: the budget or blocks are short for a
        running request (no preemption here: blocks allocated so far stay with their
        requests, which need them next anyway). A row that step ends (a stop token, its
        length) is scheduled all the same (the step does not know it): a wasted row."""
        out = SchedulerOutput(follows=True)
        budget, k = self.max_num_batched_tokens, self.num_lookahead_slots
        charged = math.ceil(self.draft_share * k)
        room = 0
        for req in self.running:
            if 1 + charged > budget or not self.bm.allocate(req, req.num_tokens + k + extra):
                return None
            out.rows.append(ScheduledRow(req, 1 + k, k, True))
            budget -= 1 + charged
            room += charged
        out.num_draft_slots = k * len(out.rows)
        return self._admit(out, budget, room)
