"""Host time of the serving loop by part (opt-in: DSPARK_HOST_TIMERS=1).

The step clock (step_clock.py) tells how long the device waited for the host before each
step; this tells what the host did meanwhile. Each part is a method of the loop wrapped with
a perf_counter accumulator (~1 us per call), so the totals are what that method took in the
serving process, cache misses and GIL waits included: the figures a hot-loop profile cannot
give (on the H200 an adaptive server's verify steps waited 0.74 ms longer for the host than
fixed K's at c = 128, T = 1, and offline only ~0.2 ms of that reproduced).

Parts nest: `launch` includes `plan` and `graph_start` (which includes `conf_copy`);
`wait_commit` is the wait for the device plus `commit`; `outputs` includes `emit` when the
loop hands outputs over as they are built. Totals (ms) go to the engine's snapshot and
/metrics (dspark_engine_host_ms_total); `dspark bench serve` reports them per engine step
and level; the offline sweep's --host-timers, per step by part (install_engine_timers).
"""

from __future__ import annotations

import os
import time

ENV = "DSPARK_HOST_TIMERS"


def host_timers_enabled() -> bool:
    return os.environ.get(ENV, "0").lower() in ("1", "true", "on", "yes")


class HostTimers:
    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def wrap(self, obj, name: str, part: str) -> None:
        """Time every call of `obj.name` into `part` (an instance attribute shadows the
        method; plain callables stored on the instance are replaced the same way)."""
        fn = getattr(obj, name)
        self.ms.setdefault(part, 0.0)
        ms, clock = self.ms, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ms[part] += (clock() - t0) * 1e3

        setattr(obj, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.ms)

    def reset(self) -> None:
        """Zero every part (in place: the wrappers hold this dict)."""
        for part in self.ms:
            self.ms[part] = 0.0


def install_host_timers(core) -> HostTimers:
    """Wrap the parts of an EngineCore's loop and of its engine's steps."""
    timers = HostTimers()
    for obj, name, part in [(core, "_apply_inbox", "inbox"), (core, "snapshot", "snapshot"),
                            (core, "emit", "emit")]:  # fmt: skip
        timers.wrap(obj, name, part)
    return install_engine_timers(core.engine, timers)


def install_engine_timers(eng, timers: HostTimers | None = None) -> HostTimers:
    """Wrap the parts of an LLMEngine's steps (the offline API's engine has no loop of its
    own); `conf_copy` is the adaptive engine's queued confidence copy (inside graph_start)."""
    timers = timers or HostTimers()
    runner = eng.runner
    parts = [(eng, "_schedule", "schedule"), (runner, "launch", "launch"),
             (eng, "_commit_launched", "wait_commit"), (eng, "_commit", "commit"),
             (eng, "_deliver_outputs", "outputs")]  # fmt: skip
    if getattr(runner, "step_graphs", None) is not None:
        parts.append((runner.step_graphs, "start", "graph_start"))
    if runner.spec is not None:
        parts += [(runner.spec, "plan", "plan"), (runner.spec, "observe_step_time", "observe"),
                  (runner.spec, "_copy_conf_to_host", "conf_copy")]
    for obj, name, part in parts:
        timers.wrap(obj, name, part)
    return timers
