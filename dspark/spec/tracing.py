"""Measurement helpers of the speculative decoder: region timers, per-step trace records and
its policy metrics."""

from __future__ import annotations

import time

import torch

from dspark.spec.confidence import SAMPLING_MODES


class Timer:
    """Times a region on the device (CUDA events, read lazily) or on the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> DeviceSpan | float:
        """The region's span (CUDA: read later), or its host milliseconds."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            return DeviceSpan(self.start, end)
        return (time.perf_counter() - self.t0) * 1e3


class DeviceSpan:
    """Two recorded CUDA events: `done()` without waiting, `()` the milliseconds (waits)."""

    def __init__(self, start, end) -> None:
        self.start, self.end = start, end

    def done(self) -> bool:
        return self.end.query()

    def __call__(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


PLAN_PARTS = ("decision", "search", "other")


class Overhead:
    """The scheduler's overhead: host ms of planning by part, device ms of allocation.

    Parts of a plan: `decision` (a step that re-ran the drafting decision: its survey,
    its rates and any budget search), `search` (a budget searched over the stale
    confidences), `other` (settled by the bound, a standing plan reused, or nothing to
    plan). Allocation spans are device events, drained without waiting by `snapshot` (for
    /metrics, every ~0.1 s) and with waiting by `totals` (reports)."""

    def __init__(self) -> None:
        self.plan_ms = dict.fromkeys(PLAN_PARTS, 0.0)
        self.plans = dict.fromkeys(PLAN_PARTS, 0)
        # plans and host ms by path: the part, or the short path named (cruise, standing,
        # chunk_standing, idle, search:<why>): where a host-bound engine's planning goes
        self.paths: dict[str, list] = {}
        self.last_part: str | None = None  # the last plan's part (the step log takes it)
        self.last_plan_us = 0.0  # ... and its host µs
        self.alloc_ms = 0.0
        self._spans: list = []  # DeviceSpan / host ms of allocations not yet added

    def add_plan(self, part: str, ms: float, detail: str | None = None) -> None:
        """`detail`: what the step log names the plan (default: its part)."""
        self.plan_ms[part] += ms
        self.plans[part] += 1
        path = self.paths.get(detail or part)
        if path is None:
            path = self.paths[detail or part] = [0, 0.0]
        path[0] += 1
        path[1] += ms
        self.last_part, self.last_plan_us = detail or part, ms * 1e3

    @staticmethod
    def alloc_timer(device: torch.device) -> Timer:
        return Timer(device)

    def add_alloc(self, span) -> None:
        """A DeviceSpan (Timer.stop), or host / already-measured milliseconds."""
        if isinstance(span, float):
            self.alloc_ms += span
            return
        self._spans.append(span)
        if len(self._spans) > 256:  # bounded: fold the finished ones in
            self._drain(wait=False)

    def _drain(self, wait: bool) -> None:
        left = []
        for span in self._spans:
            if wait or span.done():
                self.alloc_ms += span()
            else:
                left.append(span)
        self._spans = left

    def plan_total_ms(self) -> float:
        return sum(self.plan_ms.values())

    def totals(self) -> tuple[float, float]:
        """(planning ms, allocation ms) so far; waits for the device's timers."""
        self._drain(wait=True)
        return self.plan_total_ms(), self.alloc_ms

    def snapshot(self) -> dict:
        """Cumulative totals without waiting (allocations still in flight are left out)."""
        self._drain(wait=False)
        return {"plan_ms": dict(self.plan_ms), "plans": dict(self.plans),
                "alloc_ms": self.alloc_ms}  # fmt: skip


def trace_record(inp, num_out: torch.Tensor, conf: torch.Tensor, conf_logits: torch.Tensor):
    """Host copy of one step's verified blocks (rows that had drafts): slots, calibrated
    conditional confidences, raw head logits, capacities, verify lengths and accepted drafts.
    None when no row had drafts. Synchronizes with the device."""
    has = (inp.samples & (inp.capacities > 0)).cpu().numpy()
    if not has.any():
        return None
    slots = inp.slots
    return {
        "slots": slots.cpu().numpy()[has],
        "conf": conf[slots].cpu().numpy()[has],
        "conf_logits": conf_logits[slots].cpu().numpy()[has],
        "capacities": inp.capacities.cpu().numpy()[has],
        "verified": inp.lengths.cpu().numpy()[has],
        "accepted": (num_out - 1).clamp(min=0).cpu().numpy()[has],
    }


# a step's sampling mode (all rows greedy, or not) by the names STS files use
_MODES = dict(zip((True, False), SAMPLING_MODES))


def decoder_metrics(sd) -> dict:
    """A SpecDecoder's policy state for /metrics and reports: the last plan, the cost table's
    status, the fixed terms learned online at the last planned batch size."""
    d = sd.planner.last_decision if sd.planner is not None else None
    sd.land_periods()  # (the terms below: with every period observed so far)
    cost, reqs = sd.cost, sd._step_reqs
    return {
        "policy": sd._policy,
        "budget": sd.last_budget,
        "predicted_gain": None if d is None else d.predicted_gain,
        "trimmed": None if d is None else d.trimmed,
        "cost_table_status": sd.cost_status,
        "fixed_overhead_ms": None if cost is None else cost.fixed_overhead_ms,
        "plain_fixed_overhead_ms": sd.fixed_costs.get("plain", reqs),
        "trim_penalty_ms": None if cost is None else sd.fixed_costs.trim_penalty_ms(
            cost.fixed_overhead_ms, reqs, sd.eager_trims),
        "confidence_source": "head" if sd.use_head else "online",
        "drafting": sd.draft_enabled,
        # by sampling mode: every learned fixed term, and the decision's acceptance ratio
        "learned_fixed_ms": {_MODES[g]: fc.snapshot() for g, fc in sd._fixed_by_mode.items()},
        "acceptance_ratio": {_MODES[g]: sd.drafting.acceptance_ratio(g) for g in _MODES},
        "step_counts": dict(sd.step_counts),
        "scheduler_overhead": sd.overhead.snapshot(),  # (cumulative; not waiting)
        # the steps the learned terms came from, by kind and batch size, both modes (one
        # table): [steps, period ms, residual ms] (cumulative)
        "observed_steps": sd.fixed_costs.observed_totals(),
        # skip_idle_context_write: target tokens run again to rebuild the drafter's context
        # over skipped writes (context_gaps.py; cumulative)
        "context_rebuilt_tokens": sd.rebuilt_tokens,
    }


STEP_KINDS = ("plain", "draft", "verify", "mixed")


def step_kind(prefill_tokens: int, verifies: bool, drafts: bool) -> str:
    """A planned step's kind for the step counters: mixed (it carries prefill chunks), verify
    (it verifies drafts), draft (it only drafts: a probe, or the first step drafting again),
    plain (neither: what a no-speculation engine runs)."""
    if prefill_tokens > 0:
        return "mixed"
    if verifies:
        return "verify"
    return "draft" if drafts else "plain"
