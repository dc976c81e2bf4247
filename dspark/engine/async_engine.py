"""AsyncLLMEngine: the LLMEngine in its own thread, asyncio streams in front of it.

    HTTP (event loop)                     engine thread
    add_request() --inbox--> [ between steps: apply adds / aborts ] -> step() -> dispatch
    RequestStream  <--loop.call_soon_threadsafe(batch of outputs)--------------'

(step() hands each batch of outputs to dispatch as soon as it is built: a step's outputs are
built and delivered while the next step runs on the device.)

The engine thread alone touches the LLMEngine. The event loop only puts commands into the
inbox and reads per-request asyncio queues, so a slow client never delays a step and a long
step never delays HTTP. If step() raises, the engine is marked dead: every in-flight stream
gets EngineDeadError at once and every new request is refused.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can be served any more."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and accepts no new requests."""


def _resolve(fut: asyncio.Future, exc: BaseException | None = None) -> None:
    if not fut.done():
        if exc is None:
            fut.set_result(True)
        else:
            fut.set_exception(exc)


def _deliver(batch: list) -> None:
    """Runs in the event loop: hand each item to its stream."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass


def _fail_accept(stream: RequestStream, exc: BaseException) -> None:
    _resolve(stream.accepted, exc)
    stream.queue.put_nowait(exc)


class RequestStream:
    """Outputs of one request. Outputs are cumulative, so a slow reader only sees the latest
    one (intermediate outputs are coalesced); `get()` raises EngineDeadError if the engine
    dies and StopAsyncIteration semantics apply after the finished output."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.finished = False

    async def get(self) -> RequestOutput:
        if self.finished:
            raise RuntimeError(f"request {self.request_id} has already finished")
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
        out = items[-1]
        self.finished = out.finished
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.on_outputs = self._dispatch  # called in the engine thread, inside step()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._accepting = True
        self._stop = False
        self._drain_deadline: float | None = None
        self._snapshot: dict = {}
        self._last_snapshot = 0.0
        self._last_steps = -1

    @classmethod
    def from_config(cls, config) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    # -- read-only views (any thread) ---------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    def num_waiting(self) -> int:
        """Requests queued in the inbox or the scheduler's waiting queue (approximate)."""
        return self._pending_adds + len(self.engine.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def snapshot(self) -> dict:
        """Cumulative engine counters and gauges, refreshed by the engine thread at most every
        SNAPSHOT_INTERVAL_S while busy and whenever it goes idle."""
        return self._snapshot

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def begin_drain(self, timeout_s: float) -> None:
        """Stop accepting requests; abort those still running after timeout_s (thread-safe)."""
        self._accepting = False
        self._drain_deadline = time.monotonic() + max(0.0, timeout_s)
        self._wake.set()

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to timeout_s, abort the rest
        (their streams end with finish_reason 'abort'), then stop the engine thread."""
        if self._drain_deadline is None:
            self.begin_drain(timeout_s)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def stop(self) -> None:
        """Synchronous shutdown: abort everything now and join the engine thread."""
        self.begin_drain(0.0)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    # -- requests (event loop) ----------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead!r}")
        if not self._accepting or self._stop:
            raise EngineStoppedError("the server is shutting down")

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine has accepted it (between two steps).
        Raises ValueError for invalid input, EngineDeadError / EngineStoppedError."""
        self._check_alive()
        if self._thread is None:
            self.start()
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._pending_lock:
            self._pending_adds += 1
        self._inbox.put(("add", stream, prompt, params, cache_salt, arrival_time))
        self._wake.set()
        if self._dead is not None:  # died before it could see our command
            raise EngineDeadError(f"the engine is dead: {self._dead!r}")
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Convenience: add a request and yield its (coalesced, cumulative) outputs; the
        request is aborted if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its KV blocks are freed between steps."""
        if self._thread is None or self._dead is not None:
            return
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
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
                self._dispatch(outputs)
                self._maybe_snapshot()
                if eng.idle and not outputs:
                    eng.mark_idle()
                    self._wake.wait(0.005)  # nothing schedulable: do not spin
                    self._wake.clear()
            self._take_snapshot()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            self._die(e)

    def _apply_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._apply_add(*cmd[1:])
            else:
                self._apply_abort(cmd[1])

    def _apply_add(self, stream: RequestStream, prompt, params, cache_salt, arrival) -> None:
        with self._pending_lock:
            self._pending_adds -= 1
        loop, rid = stream.loop, stream.request_id
        if not self._accepting or self._stop:
            _call_soon(loop, _fail_accept, stream, EngineStoppedError("shutting down"))
            return
        try:
            self.engine.add_request(rid, prompt, params, cache_salt, arrival)
        except ValueError as e:
            _call_soon(loop, _fail_accept, stream, ValueError(str(e)))
            return
        except BaseException as e:
            _call_soon(loop, _fail_accept, stream, EngineDeadError(repr(e)))
            raise
        self._streams[rid] = stream
        _call_soon(loop, _resolve, stream.accepted)

    def _apply_abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _abort_all(self) -> None:
        """Abort every request; streams still being read get a final 'abort' output."""
        eng = self.engine
        batch = []
        for rid in list(eng.requests):
            req = eng.requests[rid]
            eng.abort_request(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                batch.append((stream, eng.abort_output(req)))
        self._send(batch)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, out))
        self._send(batch)

    def _send(self, batch: list) -> None:
        by_loop: dict = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _die(self, exc: BaseException) -> None:
        self._dead = exc
        logger.error("engine thread failed; the engine is dead", exc_info=exc)
        err = EngineDeadError(f"the engine is dead: {exc!r}")
        batch = [(s, err) for s in self._streams.values()]
        self._streams.clear()
        while True:  # requests that were never added
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                with self._pending_lock:
                    self._pending_adds -= 1
                _call_soon(cmd[1].loop, _fail_accept, cmd[1], err)
        self._send(batch)

    # -- metrics snapshot ---------------------------------------------------------------------
    def _maybe_snapshot(self, idle: bool = False) -> None:
        age = time.monotonic() - self._last_snapshot
        if age >= (1.0 if idle else SNAPSHOT_INTERVAL_S) or (
            idle and self.engine.stats["steps"] != self._last_steps
        ):
            self._take_snapshot()

    def _take_snapshot(self) -> None:
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
        self._snapshot = {
            **eng.stats,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) + self._pending_adds,
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
        }
        clock = getattr(eng.runner, "step_clock", None)
        if clock is not None and clock.enabled:  # DSPARK_STEP_CLOCK=1: device busy / idle
            self._snapshot["step_clock"] = clock.snapshot()
