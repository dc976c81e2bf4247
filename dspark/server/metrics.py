"""Prometheus metrics of one server (a private registry per app, so tests can build several).

Engine-wide counters are fed from deltas of the engine's cumulative counters (the async
engine's snapshot); per-request histograms are observed by the API when a request ends.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)

from dspark.outputs import RequestOutput

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# snapshot key -> (counter name, help)
_ENGINE_COUNTERS = {
    "prompt_tokens": ("dspark_prompt_tokens", "Prompt tokens processed (prefilled)."),
    "generation_tokens": ("dspark_generation_tokens", "Tokens generated."),
    "steps": ("dspark_engine_steps", "Engine steps executed."),
    "preemptions": ("dspark_preemptions", "Requests preempted (recomputed later)."),
    "followed_steps": ("dspark_engine_followed_steps", "Speculative steps launched before the "
                       "step before them was committed (dspark/engine/follow.py)."),
    "prefix_queries": ("dspark_prefix_cache_queries", "Tokens looked up in the prefix cache."),
    "prefix_hits": ("dspark_prefix_cache_hits", "Tokens found in the prefix cache."),
    "spec_drafted": ("dspark_spec_drafted_tokens", "Draft tokens proposed."),
    "spec_verified": ("dspark_spec_verified_tokens", "Draft tokens sent to the target."),
    "spec_accepted": ("dspark_spec_accepted_tokens", "Draft tokens accepted."),
    "spec_num_steps": ("dspark_spec_num_steps", "Per-request decoding rounds with drafts."),
    "step_time_ms": ("dspark_engine_step_ms", "Wall time of the engine's steps, ms (the "
                     "scheduler overhead's denominator)."),
    "cpu_s": ("dspark_engine_cpu_seconds", "CPU seconds of the process running the engine "
              "loop (the engine process, or the server's own when the engine runs in it)."),
}

# attribute -> (counter name, help, label): counters by kind of step or part
_LABELLED_COUNTERS = {
    "step_kinds": ("dspark_spec_steps", "Steps of a speculative engine by kind: plain (no "
                   "drafts verified or proposed), draft (proposing only), verify, mixed (with "
                   "prefill chunks).", "kind"),
    "clock_steps": ("dspark_step_clock_steps", "Steps timed by DSPARK_STEP_CLOCK=1, by kind (as "
                    "dspark_spec_steps, mixed steps that verify drafts as mixed_verify; without "
                    "speculation plain or mixed).", "kind"),
    "clock_busy": ("dspark_step_device_busy_ms", "Device time from a step's first to its last "
                   "enqueued work (DSPARK_STEP_CLOCK=1), by kind.", "kind"),
    "clock_idle": ("dspark_step_device_idle_ms", "Device idle before a step, waiting for the "
                   "host to enqueue it (DSPARK_STEP_CLOCK=1), by kind.", "kind"),
    "plan_ms": ("dspark_spec_plan_ms", "Host time of the adaptive policy's planning, ms, by "
                "part: decision (steps re-running the drafting decision), search (a budget "
                "searched), other.", "part"),
    "plans": ("dspark_spec_plans", "Steps planned by the adaptive policy, by part (as "
              "dspark_spec_plan_ms).", "part"),
    "host_ms": ("dspark_engine_host_ms", "Host time of the engine's loop, ms, by part (an "
                "engine started with DSPARK_HOST_TIMERS=1; parts nest: engine/host_timers.py).",
                "part"),
}  # fmt: skip


# field of the engine's observed-step totals -> (counter name, help); labels kind, batch
_OBSERVED_COUNTERS = {
    "steps": ("dspark_spec_observed_steps", "Steps the adaptive policy learned its fixed "
              "terms from, by kind (spec, plain, eager) and batch-size range."),
    "ms": ("dspark_spec_observed_step_ms", "Measured periods of those steps, ms (against the "
           "step clock's busy + idle)."),
}  # fmt: skip
# ... and their residuals summed: a gauge, as a sum of residuals falls where a table
# overprices steps (a counter reported 0 for the H200's 8B plain steps, learned at -1.4 ms)
_OBSERVED_RESIDUAL = ("dspark_spec_observed_residual_ms_sum", "Their periods beyond the cost "
                      "table's price (forward, drafter, context read), ms, summed since the "
                      "start: the learned terms' inputs (a term is the median of its last 15).")


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        # the server's own process: process_cpu_seconds_total, memory, open fds (Linux)
        ProcessCollector(registry=r)
        self.model_name = model_name
        self.requests = Counter(
            "dspark_requests", "HTTP requests to /v1 endpoints by status code.",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "dspark_request_finished", "Finished generation requests by finish reason.",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        self.counters = {
            key: Counter(name, doc, registry=r) for key, (name, doc) in _ENGINE_COUNTERS.items()
        }
        for attr, (name, doc, label) in _LABELLED_COUNTERS.items():
            setattr(self, attr, Counter(name, doc, [label], registry=r))
        # the steps the adaptive policy learned its fixed terms from, by kind and batch size
        self.observed = {field: Counter(name, doc, ["kind", "batch"], registry=r)
                         for field, (name, doc) in _OBSERVED_COUNTERS.items()}  # fmt: skip
        self.observed_residual = Gauge(*_OBSERVED_RESIDUAL, ["kind", "batch"], registry=r)
        self.alloc_ms = Counter(
            "dspark_spec_alloc_ms", "Device time of the adaptive policy's allocations, ms.",
            registry=r,
        )  # fmt: skip
        self.rebuilt_tokens = Counter(
            "dspark_spec_context_rebuilt_tokens", "Tokens the target ran again to rebuild the "
            "drafter's context skipped while drafting was off (skip_idle_context_write).",
            registry=r,
        )  # fmt: skip
        self._last: dict[str, float] = {}
        self.ttft = Histogram(
            "dspark_time_to_first_token_seconds", "Time to the first token.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "dspark_time_per_output_token_seconds", "Mean time per output token after the first.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "dspark_e2e_request_latency_seconds", "Arrival to finish of a request.",
            buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_prompt_tokens = Counter(
            "dspark_request_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.request_generation_tokens = Counter(
            "dspark_request_generation_tokens", "Output tokens of finished requests.", registry=r
        )
        self.running = Gauge("dspark_num_requests_running", "Running requests.", registry=r)
        self.waiting = Gauge("dspark_num_requests_waiting", "Waiting requests.", registry=r)
        self.kv_usage = Gauge("dspark_kv_cache_usage_ratio", "KV cache usage (0-1).", registry=r)
        self.prefix_hit_rate = Gauge(
            "dspark_prefix_cache_hit_rate", "Prefix cache token hit rate since start.", registry=r
        )
        self.engine_alive = Gauge("dspark_engine_alive", "1 while the engine is alive.", registry=r)
        self.spec_enabled = Gauge(
            "dspark_spec_enabled", "1 when speculative decoding is on.", registry=r
        )
        self.acceptance = Gauge(
            "dspark_spec_acceptance_per_position",
            "Fraction of decoding rounds accepting a draft at this position (since start).",
            ["position"], registry=r,
        )  # fmt: skip
        self.cond_acceptance = Gauge(
            "dspark_spec_conditional_acceptance_per_position",
            "Acceptance at a position among rounds that verified that position (since start).",
            ["position"], registry=r,
        )  # fmt: skip
        self.mean_acceptance_length = Gauge(
            "dspark_spec_mean_acceptance_length",
            "Tokens emitted per decoding round with drafts (since start).", registry=r,
        )  # fmt: skip
        self.budget = Gauge(
            "dspark_spec_verify_budget", "Verify budget of the scheduler's last step.", registry=r
        )
        self.predicted_gain = Gauge(
            "dspark_spec_predicted_gain", "Predicted gain of the last verify plan.", registry=r
        )
        self.learned_fixed = Gauge(
            "dspark_spec_learned_fixed_ms", "Fixed per-step cost learned online (adaptive "
            "verification), by sampling mode, kind of step and batch-size range.",
            ["mode", "kind", "batch"], registry=r,
        )  # fmt: skip
        self.acceptance_ratio = Gauge(
            "dspark_spec_acceptance_ratio", "Drafts accepted / predicted by the confidences "
            "lately (the drafting decision's correction), by sampling mode.", ["mode"],
            registry=r,
        )  # fmt: skip
        self.drafting = Gauge(
            "dspark_spec_drafting", "1 while the adaptive policy drafts, 0 while it skips.",
            registry=r,
        )  # fmt: skip
        self.cost_table = Info(
            "dspark_spec_cost_table", "Status of the verification cost table.", registry=r
        )
        self._cost_status: str | None = None

    # -- per request ------------------------------------------------------------------------
    def observe_status(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        comp = out.outputs[0]
        self.finished.labels(finish_reason=comp.finish_reason or "unknown").inc()
        m = out.metrics
        n = len(comp.token_ids)
        self.request_prompt_tokens.inc(len(out.prompt_token_ids))
        self.request_generation_tokens.inc(n)
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finished_time is not None and n > 1:
                self.tpot.observe(max(0.0, (m.finished_time - m.first_token_time) / (n - 1)))
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))

    # -- engine-wide ------------------------------------------------------------------------
    def update_from_snapshot(self, snap: dict, alive: bool) -> None:
        """Advance the counters by the growth of the engine's cumulative counters."""
        self.engine_alive.set(1.0 if alive else 0.0)
        if not snap:
            return
        for key, counter in self.counters.items():
            self._grow(counter, key, snap.get(key, 0) or 0)
        self.running.set(snap.get("num_running", 0))
        self.waiting.set(snap.get("num_waiting", 0))
        self.kv_usage.set(snap.get("kv_usage", 0.0))
        queries = snap.get("prefix_queries", 0)
        self.prefix_hit_rate.set(snap.get("prefix_hits", 0) / queries if queries else 0.0)
        self.spec_enabled.set(1.0 if snap.get("spec_enabled") else 0.0)
        steps = snap.get("spec_num_steps", 0)
        accepted = snap.get("spec_accepted_per_pos") or []
        verified = snap.get("spec_verified_per_pos") or []
        for j, a in enumerate(accepted):
            self.acceptance.labels(position=str(j)).set(a / steps if steps else 0.0)
            v = verified[j] if j < len(verified) else 0
            self.cond_acceptance.labels(position=str(j)).set(a / v if v else 0.0)
        if steps:
            self.mean_acceptance_length.set((snap.get("spec_accepted", 0) + steps) / steps)
        runtime = dict(snap.get("spec_runtime") or {})
        for kind, value in (runtime.get("step_counts") or {}).items():
            self._grow(self.step_kinds.labels(kind=kind), f"steps:{kind}", value)
        for kind, t in (snap.get("step_clock") or {}).items():
            for counter, field in ((self.clock_steps, "steps"), (self.clock_busy, "busy_ms"),
                                   (self.clock_idle, "idle_ms")):  # fmt: skip
                self._grow(counter.labels(kind=kind), f"clock:{field}:{kind}", t[field])
        for part, ms in (snap.get("host_ms") or {}).items():
            self._grow(self.host_ms.labels(part=part), f"host_ms:{part}", ms)
        for kind, by_batch in (runtime.get("observed_steps") or {}).items():
            for batch, (steps, ms, residual) in by_batch.items():
                for (field, counter), value in zip(self.observed.items(), (steps, ms),
                                                   strict=True):  # fmt: skip
                    self._grow(counter.labels(kind=kind, batch=batch),
                               f"observed:{field}:{kind}:{batch}", value)  # fmt: skip
                self.observed_residual.labels(kind=kind, batch=batch).set(float(residual))
        over = runtime.get("scheduler_overhead") or {}
        for part, ms in (over.get("plan_ms") or {}).items():
            self._grow(self.plan_ms.labels(part=part), f"plan_ms:{part}", ms)
            self._grow(self.plans.labels(part=part), f"plans:{part}",
                       (over.get("plans") or {}).get(part, 0))  # fmt: skip
        if "alloc_ms" in over:
            self._grow(self.alloc_ms, "alloc_ms", over["alloc_ms"])
        self._grow(self.rebuilt_tokens, "rebuilt_tokens", runtime.get("context_rebuilt_tokens", 0))
        if not snap.get("spec_enabled"):
            runtime.setdefault("cost_table_status", "disabled")
        self._update_runtime(runtime)

    def _grow(self, counter, key: str, value) -> None:
        """Advance `counter` by the growth of the engine's cumulative count `key` (a count
        that went back, as after an engine restart, adds nothing)."""
        value = float(value)
        delta = value - self._last.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._last[key] = max(value, self._last.get(key, 0.0))

    def _update_runtime(self, rt: dict) -> None:
        for gauge, key in ((self.budget, "budget"), (self.predicted_gain, "predicted_gain")):
            value = rt.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(float(value))
        for mode, kinds in (rt.get("learned_fixed_ms") or {}).items():
            for kind, terms in kinds.items():
                for batch, ms in terms.items():
                    self.learned_fixed.labels(mode=mode, kind=kind, batch=batch).set(float(ms))
        for mode, ratio in (rt.get("acceptance_ratio") or {}).items():
            self.acceptance_ratio.labels(mode=mode).set(float(ratio))
        if isinstance(rt.get("drafting"), bool):
            self.drafting.set(1.0 if rt["drafting"] else 0.0)
        status = rt.get("cost_table_status")
        if status is not None and str(status) != self._cost_status:
            self._cost_status = str(status)
            self.cost_table.info({"status": self._cost_status})

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
