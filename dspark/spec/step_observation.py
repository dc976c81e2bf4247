"""What the online cost model and the drafting decision observe of a speculative step
(SpecDecoder's mixin, under StepPlanning): its tag, read at launch; its period, after commit;
the scheduler-overhead accounting."""

from __future__ import annotations

from dspark.spec.stale_confidences import StaleConfidences

# step periods queued before they land in the online cost model (observe_step_time)
OBSERVE_BATCH = 16


class StepObservation(StaleConfidences):
    """step_tag / take_prediction (at launch), observe_step_time (after commit),
    count_allocation_ms and scheduler_overhead_ms. The attributes read are StepPlanning's
    and SpecDecoder's."""

    def step_tag(self) -> tuple[str, float, bool] | None:
        """What the online cost model needs of the step just launched, read at launch (with
        async scheduling it is observed after the next one is planned): its kind, the
        price of its drafter and context read, and its sampling mode (greedy). None: not
        observed (no online correction, prefill chunks, or a probe's drafts verified while
        drafting is off: online_cost.py)."""
        if not self._online_cost or self._step_other > 0:
            return None
        context_ms = self.cost.step_context_ms
        if not self.draft_enabled:
            return ("plain", context_ms, self.fixed_costs.greedy) if self._no_drafts else None
        kind = ("trim" if self._step_trimmed
                else "eager" if self.graph_steps and not self.ran_as_graph else "spec")  # fmt: skip
        return kind, self.cost.draft_lookup(self._step_reqs) + context_ms, self.fixed_costs.greedy

    def take_prediction(self) -> tuple | None:
        """Read at launch: the step just planned decided on its rows' confidences; what they
        predicted, for DraftingDecision.check_prediction once the step is committed (None:
        not a decision step with drafts)."""
        prediction, self._prediction = self._prediction, None
        return prediction

    def observe_step_time(self, step_ms: float, num_tokens: int, num_reqs: int,
                          tag: tuple[str, float, bool] | None) -> None:
        """Queue one step's period for the online cost model (online_cost.py). The queue
        lands (land_periods) at the next plan that reads the terms, before it reads them,
        or once OBSERVE_BATCH periods wait: landed one at a time between steps, with its
        objects out of the caches, an observation took ~5.7 µs a step on the development
        machine against ~1 µs in a loop, and the observation part of an adaptive engine's
        step read 15-19 µs more than fixed K's in the H100 host's loop (fifty-seventh
        session, demo pair, offline --host-timers, the step log's wrapper included)."""
        if tag is None or num_reqs == 0:
            return
        pending = self._pending_periods
        pending.append((step_ms, num_tokens, num_reqs, tag))
        if len(pending) >= OBSERVE_BATCH:
            self.land_periods()

    def land_periods(self) -> None:
        """Feed the queued step periods to the online cost model, oldest first (a step's
        residual: step_residual_ms, on the table it was priced on: the queue is dropped when
        the cost model is replaced)."""
        if not self._pending_periods:  # (fixed K, or none queued: no cost model to read)
            return
        pending, self._pending_periods = self._pending_periods, []
        residual, by_mode = self.step_residual_ms, self._fixed_by_mode
        for step_ms, num_tokens, num_reqs, tag in pending:
            by_mode[tag[2]].observe(tag[0], residual(step_ms, num_tokens, tag), num_reqs, step_ms)

    def step_residual_ms(self, step_ms: float, num_tokens: int,
                         tag: tuple[str, float, bool]) -> float:  # fmt: skip
        """A step's period beyond the table's price of its forward (dense table: every step)
        and the tag's of its drafter and context read: what the fixed term learns from."""
        return step_ms - self.cost.verify_lookup(num_tokens) - tag[1]

    def count_allocation_ms(self, ms: float) -> None:
        """Allocation time measured elsewhere (inside a whole-step graph)."""
        self.overhead.add_alloc(float(ms))

    def scheduler_overhead_ms(self) -> tuple[float, float]:
        """(planning ms, allocation ms) accumulated so far. Reading the device timers waits
        for them, so call this from reports, not from the step (/metrics reads
        `overhead.snapshot()`, which does not wait)."""
        return self.overhead.totals()
