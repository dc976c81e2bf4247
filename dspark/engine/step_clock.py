"""Device busy and idle time per step, by kind of step (opt-in: DSPARK_STEP_CLOCK=1, CUDA).

Two CUDA events per step: one enqueued right before the step's device work (after the host
packed and planned it), one after all of it. The device reaches them in stream order, so
`after - before` is the step's device span and `before(n) - after(n-1)` how long the device
sat idle waiting for the host to enqueue step n (0 when the host ran ahead). Where a
server's steps are slower than an offline engine's, this tells the host's share from the
device's (H200, 8B shape, twelfth session: the adaptive server's plain steps ran 4-14%
slower than no-speculation's by ITL p50, where offline they matched).

Events are read once both have completed (a step's last event may still be in flight when
its outputs are: the drafter runs after the copy), so nothing here waits for the device.
Totals per kind (`plain`, `draft`, `verify`, `mixed`: spec/tracing.step_kind; here a `mixed`
step whose rows verify drafts is `mixed_verify`, which costs far more than prefill beside plain
rows) go to the engine's stats and /metrics. A gap over MAX_IDLE_MS is the engine waiting for
requests, not a step waiting for the host: not counted.

With DSPARK_STEP_CLOCK_LOG=PATH as well, every step read is also written to PATH as one line
`kind requests forward_tokens prefill_tokens busy_ms idle_ms plan` (idle -1: a gap not
counted; plan: the lagged plan's part, decision / search / other, or "-"),
so that steps of two engines can be compared at the same batch shape (per-kind means mix
batch sizes: an adaptive engine drafts only below some batch size, no-spec at every size).
"""

from __future__ import annotations

import os
from collections import deque

from dspark.spec.tracing import step_kind

ENV = "DSPARK_STEP_CLOCK"
LOG_ENV = "DSPARK_STEP_CLOCK_LOG"
MAX_IDLE_MS = 100.0


def clock_for(device) -> StepClock:
    """The engine's clock: enabled on CUDA with DSPARK_STEP_CLOCK=1."""
    on = os.environ.get(ENV, "0").lower() in ("1", "true", "on", "yes")
    enabled = on and device.type == "cuda"
    path = os.environ.get(LOG_ENV) if enabled else None
    return StepClock(enabled=enabled, log=open(path, "a", buffering=1) if path else None)


class StepClock:
    def __init__(self, enabled: bool = True, event_factory=None, log=None) -> None:
        """`enabled` False: begin() returns None and end(None, ...) does nothing (the engine
        calls both on every step). `event_factory`: makes a timing event with record(),
        query() and elapsed_time() (torch.cuda.Event by default; tests pass a stand-in).
        `log`: a text file every step read is written to (module docstring)."""
        self.enabled = enabled
        self.log = log
        if event_factory is None:
            import torch

            def event_factory():
                return torch.cuda.Event(enable_timing=True)

        self._event = event_factory
        self._pending: deque = deque()  # (kind, before, after), oldest first
        self._last_after = None  # the after-event of the last step read
        self.busy_ms: dict[str, float] = {}
        self.idle_ms: dict[str, float] = {}
        self.steps: dict[str, int] = {}

    def begin(self):
        """Enqueue the before-event of a step about to enqueue its device work."""
        if not self.enabled:
            return None
        before = self._event()
        before.record()
        return before

    def end(self, before, host, spec=None, plan: int | None = None) -> None:
        """Enqueue the after-event of the step begun with `before` (its HostStep; the
        speculative decoder that planned it, which knows its kind; the lagged plan's budget,
        for the log's token count), then read every step whose events have completed."""
        if before is None:
            return
        if spec is None:
            kind = step_kind(host.prefill_tokens(), False, False)
        else:
            kind = "mixed_verify" if spec.last_kind == "mixed" and spec.last_verifies else (
                spec.last_kind)  # fmt: skip
        shape = None
        if self.log is not None:  # (host facts, read now: the HostStep is reused)
            reqs, _, prefill, *_ = host.plan_scalars()
            # the lagged plan's part (decision / search / other: tracing.Overhead) and its
            # host µs; "-" none
            overhead = getattr(spec, "overhead", None)
            part, us = "-", "-"
            if overhead is not None and overhead.last_part is not None:
                part, us = overhead.last_part, f"{overhead.last_plan_us:.0f}"
                overhead.last_part = None
            shape = (reqs, host.forward_tokens(plan), prefill, part, us)
        after = self._event()
        after.record()
        self._pending.append((kind, before, after, shape))
        self.collect()

    def collect(self) -> None:
        while self._pending and self._pending[0][2].query():
            kind, before, after, shape = self._pending.popleft()
            busy = before.elapsed_time(after)
            self.busy_ms[kind] = self.busy_ms.get(kind, 0.0) + busy
            self.steps[kind] = self.steps.get(kind, 0) + 1
            last, self._last_after = self._last_after, after
            idle = -1.0 if last is None else last.elapsed_time(before)
            if 0.0 <= idle <= MAX_IDLE_MS:
                self.idle_ms[kind] = self.idle_ms.get(kind, 0.0) + idle
            else:
                idle = -1.0  # (the first step, or the engine waited for requests)
            if shape is not None:
                self.log.write(f"{kind} {shape[0]} {shape[1]} {shape[2]} {busy:.3f} {idle:.3f} "
                               f"{shape[3]} {shape[4]}\n")

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{kind: {"steps", "busy_ms", "idle_ms"}} of the steps read so far."""
        return {kind: {"steps": n, "busy_ms": self.busy_ms.get(kind, 0.0),
                       "idle_ms": self.idle_ms.get(kind, 0.0)}
                for kind, n in self.steps.items()}  # fmt: skip
