"""EngineCore: the serving loop on the side that owns the LLMEngine (a thread of the server's
process, or a process of its own: engine_process.py).

It talks to the front end (AsyncLLMEngine) in two plain-data streams, so that the same loop
serves both transports:

  commands in:  ("add", rid, prompt, params, cache_salt, arrival_time)  ("abort", rid)
                ("drain", timeout_s)  ("stop",)
  events out:   ("accepted", rid)  ("rejected", rid, exception)  ("outputs", [RequestOutput])
                ("snapshot", counters)  ("dead", message)
                (across a process: ("deltas", [tuple]) instead of "outputs", output_delta.py)

Commands are applied between steps. Events go out in order, in batches (`emit(list)`): a
step's outputs as soon as they are built (while the next step runs on the device). Every add
is answered by exactly one "accepted" or "rejected" (or, if the engine dies first, "dead").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from dspark.engine.host_timers import host_timers_enabled, install_host_timers
from dspark.engine.llm_engine import LLMEngine
from dspark.engine.output_delta import DeltaEncoder

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine failed; no request can be served any more."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


class EngineCore:
    def __init__(self, engine: LLMEngine, emit: Callable[[list[tuple]], None],
                 deltas: bool = False):  # fmt: skip
        self.engine = engine
        self.emit = emit
        self.encoder = None
        if deltas:  # outputs as deltas (across a pipe), made straight from the requests
            self.encoder = DeltaEncoder()
            self.encoder.attach(engine)
        engine.on_outputs = self._outputs  # called inside step(), as soon as they are built
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._accepting = True
        self._stop = False
        self._drain_deadline: float | None = None
        self._last_snapshot = 0.0
        self._last_steps = -1
        self.host_timers = None  # DSPARK_HOST_TIMERS=1: host time of the loop by part
        if host_timers_enabled():
            self.host_timers = install_host_timers(self)

    def submit(self, cmd: tuple) -> None:
        """Queue a command (any thread); it is applied before the next step."""
        self._inbox.put(cmd)
        self._wake.set()

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until a "stop" command and no request is left. A failure of the engine ends
        the loop with a "dead" event (and every command still queued answered by it)."""
        eng = self.engine
        try:
            self.emit([("snapshot", self.snapshot())])
            while True:
                self._apply_inbox()
                if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                    self._abort_all()
                if self._stop and not eng.has_unfinished_requests():
                    break
                if not eng.has_unfinished_requests():
                    self._maybe_snapshot(idle=True)
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs = eng.step()
                self._outputs(outputs)
                self._maybe_snapshot()
                if eng.idle and not outputs:
                    eng.mark_idle()
                    self._wake.wait(0.005)  # nothing schedulable: do not spin
                    self._wake.clear()
            self.emit([("snapshot", self.snapshot())])
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.error("engine loop failed; the engine is dead", exc_info=e)
            self.emit([("dead", repr(e))])

    def _apply_inbox(self) -> None:
        events = []
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            kind = cmd[0]
            if kind == "add":
                events.append(self._add(*cmd[1:]))
            elif kind == "abort":
                self.engine.abort_request(cmd[1])
                if self.encoder is not None:
                    self.encoder.forget(cmd[1])
            elif kind == "drain":
                self._accepting = False
                self._drain_deadline = time.monotonic() + max(0.0, cmd[1])
            elif kind == "stop":
                self._accepting, self._stop = False, True
        if events:
            self.emit(events)

    def _add(self, rid: str, prompt, params, cache_salt, arrival) -> tuple:
        if not self._accepting:
            return "rejected", rid, EngineStoppedError("the server is shutting down")
        try:
            self.engine.add_request(rid, prompt, params, cache_salt, arrival)
        except ValueError as e:  # bad input: this request only
            return "rejected", rid, ValueError(str(e))
        return "accepted", rid

    def _abort_all(self) -> None:
        """Abort every request; each ends with a final 'abort' output."""
        eng = self.engine
        outs = []
        for rid in list(eng.requests):
            req = eng.requests[rid]
            eng.abort_request(rid)
            outs.append(eng.abort_output(req))
        self._outputs(outs)

    def _outputs(self, outputs: list) -> None:
        if outputs:
            self.emit([("deltas" if self.encoder is not None else "outputs", outputs)])

    # -- counters for /metrics ----------------------------------------------------------------
    def _maybe_snapshot(self, idle: bool = False) -> None:
        age = time.monotonic() - self._last_snapshot
        if age >= (1.0 if idle else SNAPSHOT_INTERVAL_S) or (
            idle and self.engine.stats["steps"] != self._last_steps
        ):
            self.emit([("snapshot", self.snapshot())])

    def snapshot(self) -> dict:
        """Cumulative engine counters and gauges (plain data)."""
        eng = self.engine
        bm, sched, spec = eng.block_manager, eng.scheduler, eng.spec_stats
        runtime = {}
        spec_runner = getattr(eng.runner, "spec", None)
        if spec_runner is not None and hasattr(spec_runner, "metrics"):
            try:
                runtime = dict(spec_runner.metrics() or {})
            except Exception:  # noqa: BLE001 - metrics must never break the engine
                logger.debug("spec metrics() failed", exc_info=True)
        self._last_snapshot = time.monotonic()
        self._last_steps = eng.stats["steps"]
        snap = {
            **eng.stats,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_usage": bm.usage,
            "prefix_queries": bm.num_prefix_queries,
            "prefix_hits": bm.num_prefix_hits,
            "spec_enabled": spec_runner is not None,
            "spec_num_steps": spec.num_steps,
            "spec_drafted": spec.num_drafted_tokens,
            "spec_verified": spec.num_verified_tokens,
            "spec_accepted": spec.num_accepted_tokens,
            "spec_accepted_per_pos": list(spec.accepted_per_pos),
            "spec_verified_per_pos": list(spec.verified_per_pos),
            "spec_runtime": runtime,
            # CPU seconds of the process running this loop (all its threads; with the engine
            # in the server's process, the server's too): a saturated host shows up here
            "cpu_s": time.process_time(),
        }
        clock = getattr(eng.runner, "step_clock", None)
        if clock is not None and clock.enabled:  # DSPARK_STEP_CLOCK=1: device busy / idle
            snap["step_clock"] = clock.snapshot()
        if self.host_timers is not None:
            snap["host_ms"] = self.host_timers.snapshot()
        return snap
