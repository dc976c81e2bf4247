"""The host's half of a speculative step (SpecDecoder's mixin): the lagged policy's budget
from stale host confidences, the drafting decision's cadence and every step's kind (what the
online cost model observes of the step once it ran: step_observation.py).

A plan the cost bound settles (verify every draft whatever the confidences: the common step
at low load; also with the learned trim penalty, where trims save nothing), or a searched
verify-all clear of the guard, stands for the next SETTLED_PLANS - 1 plans of its requests
and sampling mode with at most its draft fills and no prefill chunk (a searched verify-all
near the guard: as long as the planner's own standing plan would). Those verify every draft
without re-reading the terms (at most SETTLED_PLANS - 1 plans old: a fenced mean of 15 steps
moves little), the bound or the confidences; on a routine step (no decision or probe due,
the decision's minimum interval included) they take one short path, as do plain steps while
drafting is off and steps with prefill chunks whose plan stands in the planner. Small
host-bound pairs spent 3.5-7% of a 0.5-1.8 ms step planning (26-68 µs a plan in the H200
host's serving loop, twenty-fifth session), most of it on such steps; 1.5-2.5% at c = 1-16
after these paths (thirty-fourth session). Lossless either way: a budget only says how many
drafts are verified.
"""

from __future__ import annotations

import time

from dspark.spec.cruise import Cruise
from dspark.spec.drafting import PROBE_ROWS
from dspark.spec.online_cost import size_bucket
from dspark.spec.plan_reuse import nearby_rows
from dspark.spec.planner import REUSE_CLEAR_PLANS
from dspark.spec.rates import RateMemo, decode_rate
from dspark.spec.step_observation import StepObservation
from dspark.spec.tracing import step_kind

SETTLED_PLANS = REUSE_CLEAR_PLANS  # as long as a searched verify-all clear of the guard stands
# an untrimmed probe (_untrimmed_probe): this many verify-all decode plans, at most once per
# UNTRIMMED_PROBE_EVERY observed steps and batch-size bucket
UNTRIMMED_PROBE_STEPS = 12
UNTRIMMED_PROBE_EVERY = 512
# plans an opportunity rate stays memoized for its request-count group (_opportunity_rate)
RATE_MEMO_PLANS = 2 * SETTLED_PLANS


class StepPlanning(StepObservation):
    """Mixin of SpecDecoder: plan (before launch); what the step is observed by after it
    ran: step_observation.py."""

    settled_plans = SETTLED_PLANS  # (1: every plan re-reads the terms and the bound)
    # (requests, greedy) -> [the plan count it stands until, its draft fills, whether it was
    # a searched verify-all near the guard] (_stand)
    _settled: dict  # (set_cost_model: {})
    _plans_counted = 0  # plans so far (a settled plan's age)
    _untrimmed_left = 0  # verify-all plans an untrimmed probe still runs (set_cost_model: 0)
    _untrimmed_probed: dict  # (greedy, bucket) -> observed steps at its last probe
    last_verifies = False  # whether the step last planned verifies drafts (the step clock)
    # of each row's draft slots, the share that steps with prefill chunks verified last (their
    # plans' own budgets, before any cap): the scheduler charges that share against the
    # token budget (scheduler.py); 1.0 until such a step plans, and for the other policies
    draft_share = 1.0
    _draft_room: int | None = None  # drafts the step planned now may verify (None: all)
    # _opportunity_rate's memo, in the mode (sampling mode, no survival estimate yet)
    rate_memo: RateMemo  # (set_cost_model: RateMemo(RATE_MEMO_PLANS))
    cruise: Cruise  # (set_cost_model: Cruise())

    def plan(self, host, draft_room: int | None = None) -> int | None:
        """The lagged policy's total draft budget for a packed step (HostStep), from stale
        host confidences (no sync); every policy's step is counted by kind here. The step's
        sizes come from its packed scalars (every step, every policy: no array reductions).
        `draft_room`: the most drafts the token budget leaves room for (the scheduler's
        SchedulerOutput.draft_room); a budget above it is cut to it."""
        t0 = time.perf_counter()  # (the lagged policy's planning: all of this method's work)
        self._prediction = None  # (set by a decision step that verifies drafts)
        self.last_stood = False  # (set where a cruise or a standing plan stood)
        self._draft_room = draft_room
        n, total, other, n_sampling, greedy, context = host.plan_scalars()
        self._step_reqs, self._step_other = n, other
        self._plans_counted += 1
        lagged = self._policy == "lagged"
        online, fixed = self._online_cost, self.fixed_costs  # (routine: after_plan's terms)
        if (lagged and total and self.cruise.covers(self._plans_counted, n, other)
                and self.drafting.pays and greedy == fixed.greedy
                and self.drafting.routine(n, online, fixed, n_sampling, other)):  # (last: it
            # counts)
            return self._plan_cruise(host, total, other, context, t0)
        # why a lagged plan that neither searches nor decides took the full path: the step
        # log and the host timers' plans by path name it "other:<why>" (a routine() that
        # answers False changes nothing: the gates are read in the order the paths take them)
        why = None
        if lagged and not other:  # (the routine plans' short paths: _plan_standing, _plan_idle)
            drafting = self.drafting
            if drafting.pays:
                if self._unmarked_slots:
                    why = "unmarked"  # (a new request's first drafts to mark)
                elif not self._stands(n, total, greedy):
                    why = "unsettled"  # (no settled plan of these requests stands)
                elif drafting.routine(n, online, fixed, n_sampling, 0):
                    return self._plan_standing(total, context, t0)
                else:
                    why = "due"  # (a decision or probe due, or running)
            elif total or greedy != fixed.greedy:
                why = "probe" if total else "mode"  # (drafts while drafting is off: a probe's)
            elif drafting.routine(n, online, fixed, n_sampling, 0):
                return self._plan_idle(n, greedy, context, t0)
            else:
                why = "due"
        if self._pending_periods:  # (every path below may read the terms: fresh ones)
            self.land_periods()
        # a step with prefill chunks on a routine step: the decision's bookkeeping at once
        # (DraftingDecision.routine; _after_budget then skips after_plan), its plan as usual
        counted = lagged and other > 0 and self.drafting.routine(n, online, fixed, n_sampling,
                                                                 other)  # fmt: skip
        if counted and total and self.drafting.pays and greedy == fixed.greedy:
            budget = self._plan_chunk_standing(host, n, total, other, n_sampling, greedy,
                                               context, t0)  # fmt: skip
            if budget is not None:
                return budget
            # (the rate's memo expired, or no plan stands for the shape at that rate)
            why = "chunk:rate" if self._memoized_rate(n_sampling) is None else "chunk:shape"
        elif lagged and other:  # (not routine; or no drafts, drafting off, another mode)
            why = ("chunk:due" if not counted else "chunk:mode" if total and self.drafting.pays
                   else "chunk:nodraft")  # fmt: skip
        decide = lagged and not counted and self.drafting.due(n)  # (every few steps, or the
        # batch size moved)
        standing = lagged and not decide and other == 0 and self._stands(n, total, greedy)
        # nothing to verify and no decision due (every step while drafting is off): no budget
        # to search (_plan returns 0 at once), so the terms are not applied; the next plan
        # that reads them applies them first. A change of sampling mode applies them (it
        # reprices the drafter, which step_tag reads)
        idle = lagged and total == 0 and not decide and greedy == self.fixed_costs.greedy
        if self.cost is not None:
            self.cost.set_step_context(context)  # (its KV read, priced: step_tag reads it)
            if not (standing or idle):
                self._apply_terms(n, greedy)
        budget = None
        if standing:
            budget = self._after_budget(total, total, False, n, n_sampling, 0)
            self.last_stood = self.draft_enabled
            self.overhead.add_plan("other", (time.perf_counter() - t0) * 1e3, "standing")
        elif lagged:
            searches = self.planner.searches
            budget = self._plan(host, n, total, other, n_sampling, decide, greedy, counted)
            part = ("decision" if decide
                    else "search" if self.planner.searches > searches else "other")  # fmt: skip
            # (the step log names why a search ran: search:new / spent / rate, plan_reuse.py)
            detail = (f"search:{self.planner.standing.miss}" if part == "search"
                      else f"other:{why}" if part == "other" and why else None)  # fmt: skip
            seconds = time.perf_counter() - t0
            self.overhead.add_plan(part, seconds * 1e3, detail)
            if decide:  # (what spaces routine decisions: DraftingDecision.note_decision_s)
                self.drafting.note_decision_s(seconds)
        return self._count_step(host, budget, total, other)

    def _count_step(self, host, budget: int | None, total: int, other: int) -> int | None:
        """A planned step's kind, counted; its new requests' first drafts marked."""
        if self._unmarked_slots and self.draft_enabled:
            self._mark_first_drafts(host)
        verifies = self.last_verifies = budget != 0 and total > 0
        self.last_kind = step_kind(other, verifies, self.draft_enabled)
        self.step_counts[self.last_kind] += 1
        return budget

    def _plan_standing(self, total: int, context: int, t0: float) -> int:
        """A settled plan standing (_stand) on a routine step (DraftingDecision.routine): what
        plan() and _after_budget do for it, in one call (its cost is the objects a plan
        touches with the caches cold: 17-29 µs in the H200 host's loop at c = 16, against
        fixed K's ~6; thirty-second to thirty-fourth sessions)."""
        budget = self._verify_all(total, context)
        self.last_stood = True
        self.cruise.record(self._plans_counted, True, self._step_reqs, 0)
        self.overhead.add_plan("other", (time.perf_counter() - t0) * 1e3, "standing")
        verifies = self.last_verifies = budget != 0 and total > 0
        kind = self.last_kind = "verify" if verifies else "draft"
        self.step_counts[kind] += 1
        return budget

    def _plan_cruise(self, host, total: int, other: int, context: int, t0: float) -> int:
        """A plan a cruise stands for (cruise.py): every draft verified, within the draft room,
        on a routine step (DraftingDecision.routine made its bookkeeping)."""
        budget = self._verify_all(total, context)
        if other:
            self.draft_share = 1.0  # (what _after_budget records of a verify-all)
        self.cruise.cruised += 1
        self.last_stood = True
        self.overhead.add_plan("other", (time.perf_counter() - t0) * 1e3, "cruise")
        return self._count_step(host, budget, total, other)

    def _verify_all(self, total: int, context: int) -> int:
        """The budget and state of a routine plan verifying every draft (a standing or cruised
        plan): drafting on, no probe, the budget within the draft room."""
        if self.cost is not None:
            self.cost.set_step_context(context)  # (step_tag prices the step's context read)
        room = self._draft_room
        budget = total if room is None or total <= room else room
        self.last_budget = budget
        self._step_trimmed = budget < total
        self.draft_enabled, self.probing = True, False
        return budget

    def _plan_chunk_standing(self, host, n: int, total: int, other: int, n_sampling: int,
                             greedy: bool, context: int, t0: float) -> int | None:  # fmt: skip
        """A step with prefill chunks on a routine step while drafting pays, in the sampling
        mode the terms were last applied in, whose opportunity rate is memoized and for
        whose shape the planner has a plan standing: that plan, without applying the terms
        (the memoized rate was priced on terms at most SETTLED_PLANS plans old, and the next
        plan that reads them applies them first: a standing plan reads none) or gathering
        the search's inputs; None: the full path plans it (~29% of the plans at c = 64 on
        the H200, trained pair, thirty-fifth session)."""
        rate = self._memoized_rate(n_sampling)
        if rate is None:
            return None
        budget = self.planner.take_standing(n, other, total, n_sampling, rate)
        if budget is None:
            return None
        self.cost.set_step_context(context)  # (as plan() does for every plan)
        self._settled.pop((n, greedy), None)  # (as _plan does)
        budget = self._after_budget(budget, total, False, n, n_sampling, other, True)
        self.overhead.add_plan("other", (time.perf_counter() - t0) * 1e3, "chunk_standing")
        return self._count_step(host, budget, total, other)

    def _plan_idle(self, n: int, greedy: bool, context: int, t0: float) -> int:
        """A plain step while drafting is off, on a routine step (DraftingDecision.routine):
        what plan(), _plan and _after_budget do for it, in one call. These are the steps on
        which adaptive runs against no speculation where that wins (the demo pair at T = 1,
        c = 1: its plain steps took 0.41 ms against no-spec's 0.29-0.35, twenty-seventh
        session)."""
        if self.cost is not None:
            self.cost.set_step_context(context)
        s = self._settled.get((n, greedy))  # (a settled plan stands for it as for any plan of
        if s is not None and self._plans_counted >= s[0]:  # its requests: one expired, the
            del self._settled[(n, greedy)]  # full path's _plan drops)
        self.last_budget, self._step_trimmed = 0, False
        self.draft_enabled, self.probing = False, n > PROBE_ROWS  # (as after_plan says)
        self.overhead.add_plan("other", (time.perf_counter() - t0) * 1e3, "idle")
        self.last_verifies, self.last_kind = False, "plain"
        self.step_counts["plain"] += 1
        return 0

    def _apply_terms(self, n: int, greedy: bool) -> None:
        """Price the drafter this step runs (argmax only when every row is greedy: about half
        the sampled drafter's cost at 8B scale) and the learned fixed term at this batch size;
        drop the planner's device tables (and, when the drafter's price changed, its standing
        plans) where either moved."""
        priced = self.cost.use_greedy_drafts(greedy)
        self.fixed_costs = self._fixed_by_mode[greedy]  # (and the fixed terms of the mode)
        moved = self._online_cost and self.fixed_costs.apply(self.cost, n)
        if priced:  # (settled plans priced the other drafter)
            self._settled.clear()
        if abs(self.cost.step_context_ms - self._tables_context_ms) > 0.05:
            self._tables_context_ms, moved = self.cost.step_context_ms, True
        if (priced or moved) and self.planner is not None:
            # device tables embed all three; a standing plan (a few plans at most) outlives
            # the fixed term's small moves, not a change of the drafter's price
            self.planner.invalidate_tables(keep_plans=not priced)

    def _plan(self, host, n: int, total: int, other: int, n_sampling: int, decide: bool,
              greedy: bool, counted: bool = False) -> int:  # fmt: skip
        before = self._settled.pop((n, greedy), None)  # (the last settled plan, if any)
        budget = 0
        if total > 0 and not decide and not other and self.planner.bound_settles(n, total):
            budget = total  # what the full plan returns (a penalty only helps the bound)
            self._stand(n, total, greedy)
        elif total > 0 and not other and not decide and self._untrimmed_probe(n, greedy):
            budget = total  # untrimmed steps measured for the trims' penalty
        elif total > 0:
            rows = host.per_row()  # [8, n] views: capacities row 1, request slots row 4
            caps, slots = rows[1], rows[4]
            # a decode step's trimmed plan pays what trimmed steps were measured to cost
            # beyond untrimmed ones (online_cost.py; 0 until learned), in steps of 0.02 ms (a
            # standing plan's group holds it: the window's term moves on most steps)
            penalty = 0.0 if other else round(50.0 * self.fixed_costs.trim_penalty_ms(
                self.cost.fixed_overhead_ms, n, self.eager_trims)) / 50.0  # fmt: skip
            # with prefill chunks, a draft's marginal time is worth what decoding would earn
            rate = self._opportunity_rate(n_sampling) if other > 0 else None
            # confidences are read only when needed (at low load, a bound settles the plan);
            # their survivals are corrected upwards by the drafts accepted against those
            # predicted. Not downwards: a smaller budget verifies fewer drafts to measure the
            # ratio on (a zero budget, none), so a low ratio could never recover
            ratio = max(self.drafting.acceptance_ratio(self.fixed_costs.greedy), 1.0)
            # (a decision step reads them anyway: once, for both)
            stale = self._stale(slots) if decide else (lambda: self._stale(slots))
            # a step none of whose rows has landed confidences (a request's first verifying
            # step reads none: _stale) takes the survivals surveyed in earlier steps
            self.planner.prior_survival = self.drafting.survival_of(self.fixed_costs.greedy)
            searches = self.planner.searches
            budget = self.planner.plan_cpu(stale, caps, other, n_sampling, penalty, rate, ratio,
                                           total=total)  # fmt: skip
            d = self.planner.last_decision
            searched = self.planner.searches > searches
            if not other and self.settled_plans > 1 and (self.planner.last_settled or (
                    searched and not d.trimmed)):
                # a verify-all the bound settles with the trim penalty (where trimmed steps
                # were measured to save nothing), or a searched one, stands here as a plan the
                # bound settles outright does, instead of in the planner, whose standing plans
                # re-read the terms and the bound first; a searched one near the guard for as
                # few plans as there (StandingPlans.plans_for: at c = 4 on the trained pair
                # 55-143 such searches a level, and the ~7 plans after each took the
                # planner's path, thirty-second session); the second such search in a row
                # for these requests stands as long as a clear one: a trim that stayed short
                # of the guard twice is not one small move away (there, one search per 8 plans
                # was ~1.5% of the step time)
                plans, near = None, False
                if searched:
                    self.planner.retire_standing()
                    plans = self.planner.standing.plans_for(d)
                    near = plans < self.settled_plans
                    if near and before is not None and before[2]:
                        plans = None
                self._stand(n, total, greedy, plans, near)
            if decide:  # the survival estimate feeds the decision only; its prediction is
                # checked against the drafts this step accepts (check_prediction)
                rows_drafting = caps.nonzero()[0]  # (caps is 1-D: flatnonzero, no wrappers)
                self._prediction = self.drafting.survey(
                    rows_drafting, stale[rows_drafting], self.fixed_costs.greedy)
        return self._after_budget(budget, total, decide, n, n_sampling, other, counted)

    def _opportunity_rate(self, n_sampling: int) -> float:
        """Tokens/ms the best decode-only step of `n_sampling` requests would earn (what a
        draft beside a prefill chunk must beat: rates.decode_rate), priced afresh only when
        the mode (sampling mode; whether a survival estimate exists) changed or its
        request-count group (nearby_rows: within ~6%, as standing plans group them) has no
        rate from the last RATE_MEMO_PLANS plans (rates.RateMemo): its fixed terms, survival
        estimate and context read may be that old. Pricing decoding was 35% of such a plan,
        and a prompt arriving in chunks plans several in a row, across group edges and back
        as requests finish (thirty-ninth session)."""
        rate = self._memoized_rate(n_sampling)
        if rate is None:
            greedy = self.fixed_costs.greedy
            rate = decode_rate(self.cost, self.drafting.estimate(greedy), n_sampling,
                               self.fixed_costs.get("plain", n_sampling))  # fmt: skip
            self.rate_memo.put((greedy, self.drafting.survival is None), nearby_rows(n_sampling),
                               rate, self._plans_counted)  # fmt: skip
        return rate

    def _memoized_rate(self, n_sampling: int) -> float | None:
        """_opportunity_rate's memo for this request count, or None (priced afresh)."""
        mode = (self.fixed_costs.greedy, self.drafting.survival is None)
        return self.rate_memo.get(mode, nearby_rows(n_sampling), self._plans_counted)

    def _stand(self, n: int, total: int, greedy: bool, plans: int | None = None,
               near: bool = False) -> None:  # fmt: skip
        """This plan stands for the decode plans of its requests and sampling mode with at
        most its draft fills among the next settled_plans - 1 plans (`plans` - 1 when
        fewer), whatever shapes plan between. In a server the request count moves by one
        and back as requests finish and their successors are admitted: the shape changed at
        23% of the trained pair's verify steps (H200, T = 0, thirty-first session; the draft
        fills alone at 0.8%), and with one exact shape settled each change re-read the
        terms, as did the return to the shape before. Fewer drafts verify in less time
        beside the same rows, so a bound that settled verify-all settles it there too (a
        cost table that grows with tokens). `near`: a searched verify-all near the guard
        (the next such search for these requests then stands the longest: _plan)."""
        if len(self._settled) > 64:
            self._settled.clear()
        plans = self.settled_plans if plans is None else min(plans, self.settled_plans)
        self._settled[(n, greedy)] = [self._plans_counted + plans, total, near]

    def _stands(self, n: int, total: int, greedy: bool) -> bool:
        """Whether a settled plan stands for this decode plan (_stand)."""
        s = self._settled.get((n, greedy))
        return s is not None and self._plans_counted < s[0] and total <= s[1]

    def _untrimmed_probe(self, n: int, greedy: bool) -> bool:
        """Whether this decode plan verifies every draft to measure untrimmed steps: a bucket
        whose steps all trimmed prices its trims against themselves (a penalty of ~0), so
        where the host bounds the step, trims that save no time went on for ever (a CPU
        engine with its device work stubbed: 1,000 plans of 1,000 at 4 requests). A probe's
        UNTRIMMED_PROBE_STEPS plans give the bucket its untrimmed term, and the penalty then
        says what trimming really saves (online_cost.FixedCosts.trim_penalty_ms)."""
        if self._untrimmed_left > 0:
            self._untrimmed_left -= 1
            return True
        fixed = self.fixed_costs
        if not self._online_cost or not fixed.untrimmed_stale(n):
            return False
        key = (greedy, size_bucket(n))
        last = self._untrimmed_probed.get(key)
        if last is not None and fixed.steps - last < UNTRIMMED_PROBE_EVERY:
            return False  # (a probe whose steps went unobserved is not repeated at once)
        self._untrimmed_probed[key] = fixed.steps
        self._untrimmed_left = UNTRIMMED_PROBE_STEPS - 1
        return True

    def _after_budget(self, budget: int, total: int, decide: bool, n: int, n_sampling: int,
                      other: int, counted: bool = False) -> int:  # fmt: skip
        """Record the step's budget (within the step's draft room) and ask the drafting
        decision whether it drafts (`counted`: routine() already made that plan's
        bookkeeping)."""
        if other > 0 and total > 0:  # the share the scheduler charges from now on: the wish
            self.draft_share = budget / total  # (uncapped: a share can grow back)
        verifies_all = budget == total  # (before the room's cap: the plan's own verdict)
        room = self._draft_room
        if room is not None and budget > room:  # (non-anticipating: the room is host-known)
            budget = room
        self.last_budget = budget
        self._step_trimmed = 0 <= budget < total  # (step_tag: a trimmed step's own term)
        if counted:  # (DraftingDecision.routine made after_plan's effects: its answer)
            self.draft_enabled, probe = self.drafting.pays, not self.drafting.pays
        else:
            self.draft_enabled, probe = self.drafting.after_plan(
                decide, self.cost, self.fixed_costs, self._online_cost, n, n_sampling, other)
        # a probe covering every row is an ordinary drafting step (whole-step graphs run it)
        self.probing = probe and n > PROBE_ROWS
        # (cruise.py: a streak of verify-all plans skips the next ones; a plain probe's step,
        # drafting paying but not drafting, is neither)
        if total > 0 and (self.draft_enabled or not self.drafting.pays):
            self.cruise.record(self._plans_counted, self.draft_enabled and not probe
                               and verifies_all, n, other)  # fmt: skip
        return budget
