"""AsyncLLMEngine: the server's front end to an EngineCore (engine_core.py), which runs the
LLMEngine in a thread of this process or, for serving, in a process of its own
(engine_process.py, `dspark serve`'s default).

    HTTP (event loop)                         EngineCore (thread or process)
    add_request() --submit(command)--------> [ between steps: apply adds / aborts ] -> step()
    RequestStream <--call_soon_threadsafe-- on_events(events) <------------------------'

In a process of its own, the engine's scheduling, commit and output building no longer share
one interpreter lock with the HTTP streaming of every request's chunks: at high concurrency
that streaming takes as long as a step's device work on a slow host, and a speculative step
(which waits for the previous one) left the device idle for it.

The event loop only submits commands and reads per-request asyncio queues, so a slow client
never delays a step and a long step never delays HTTP. If the engine fails, every in-flight
stream gets EngineDeadError at once and every new request is refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from dspark.engine.engine_core import EngineCore, EngineDeadError, EngineStoppedError
from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineStoppedError", "RequestStream"]

logger = logging.getLogger(__name__)


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
    one (intermediate outputs are coalesced; from an engine process they come as the
    request's DeltaStream, built into a RequestOutput only when read); `get()` raises
    EngineDeadError if the engine dies and StopAsyncIteration semantics apply after the
    finished output."""

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
        if not isinstance(out, RequestOutput):  # a DeltaStream (engine process): built now,
            out = out.build()  # once for every step that came in since the last read
        self.finished = out.finished
        return out

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


class ThreadCore:
    """An EngineCore in a thread of this process (`dspark serve --no-engine-process`, tests
    that inspect the engine); `engine` is the LLMEngine itself."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_path = engine.config.model
        self.core: EngineCore | None = None
        self._thread: threading.Thread | None = None

    def start(self, on_events) -> None:
        from dspark.engine.cpu_affinity import cpus_from_env, pin

        cpus = cpus_from_env()  # (DSPARK_ENGINE_CPUS: a bad list fails here, plainly)
        self.core = EngineCore(self.engine, on_events)
        on_events([("snapshot", self.core.snapshot())])  # /metrics has counters at once
        self._thread = threading.Thread(target=self.core.run, name="dspark-engine", daemon=True)
        self._thread.start()
        if cpus is not None:  # the engine's thread alone (the server's threads stay as they are)
            try:
                pin(cpus, self._thread.native_id)
            except ValueError:
                self.core.submit(("stop",))
                self._thread.join(10)
                raise

    def submit(self, cmd: tuple) -> None:
        if self.core is not None:  # (before start: nothing to drain or stop)
            self.core.submit(cmd)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def num_waiting(self) -> int:  # (live: read across threads, approximate)
        return len(self.engine.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def close(self) -> None:
        self.engine.runner.shutdown()  # tensor-parallel workers, if any


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | None = None, core=None):
        """Serve `engine` from a thread of this process, or through `core` (ProcessCore)."""
        self.core = core if core is not None else ThreadCore(engine)
        self.engine = engine  # the LLMEngine when it runs in this process, else None
        self._streams: dict[str, RequestStream] = {}  # in flight (accepted or not)
        self._pending_adds = 0  # submitted, not yet accepted or rejected
        self._lock = threading.Lock()
        self._started = self._draining = self._stop = False
        self._accepting = True
        self._dead: EngineDeadError | None = None
        self._snapshot: dict = {}

    @classmethod
    def from_config(cls, config, engine_process: bool = False) -> AsyncLLMEngine:
        """The engine for `config`; with engine_process, loaded and run in a child process
        (raises RuntimeError with the child's message if it cannot load)."""
        if engine_process:
            from dspark.engine.engine_process import ProcessCore

            return cls(core=ProcessCore(config))
        return cls(LLMEngine(config))

    # -- read-only views (any thread) ---------------------------------------------------------
    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def model_path(self) -> str:
        return self.core.model_path

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.core.is_alive()

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def accepting(self) -> bool:
        return self._accepting and self._dead is None

    def num_waiting(self) -> int:
        """Requests submitted and not yet accepted, or waiting in the scheduler (approximate)."""
        return self._pending_adds + self.core.num_waiting()

    def num_running(self) -> int:
        return self.core.num_running()

    def snapshot(self) -> dict:
        """Cumulative engine counters and gauges, refreshed by the engine at most every
        SNAPSHOT_INTERVAL_S while busy and whenever it goes idle."""
        snap = self._snapshot
        if not snap:
            return snap
        return {**snap, "num_waiting": snap.get("num_waiting", 0) + self._pending_adds}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._started:
            self._started = True
            self.core.start(self._on_events)

    def begin_drain(self, timeout_s: float) -> None:
        """Stop accepting requests; abort those still running after timeout_s (thread-safe)."""
        self._accepting, self._draining = False, True
        self.core.submit(("drain", timeout_s))

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to timeout_s, abort the rest
        (their streams end with finish_reason 'abort'), then stop the engine."""
        if not self._draining:
            self.begin_drain(timeout_s)
        self._request_stop()
        await asyncio.to_thread(self.core.join)

    def stop(self) -> None:
        """Synchronous shutdown: abort everything now and wait for the engine to stop."""
        self.begin_drain(0.0)
        self._request_stop()
        self.core.join()

    def close(self) -> None:
        """Release what the engine holds (after shutdown)."""
        self.core.close()

    def _request_stop(self) -> None:
        self._stop = True
        self.core.submit(("stop",))

    # -- requests (event loop) ----------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
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
        self.start()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._pending_adds += 1
            self._streams[request_id] = stream
        self.core.submit(("add", request_id, prompt, params, cache_salt, arrival_time))
        if self._dead is not None:  # died before it could see our command
            raise self._dead
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
        if not self._started or self._dead is not None:
            return
        self._streams.pop(request_id, None)
        self.core.submit(("abort", request_id))

    # -- events from the engine (its thread, or the reader thread of its process) -------------
    def _on_events(self, events: list[tuple]) -> None:
        by_loop: dict = {}
        for event in events:
            kind = event[0]
            if kind == "outputs":  # RequestOutputs (engine thread) or DeltaStreams (process)
                for out in event[1]:
                    stream = self._streams.get(out.request_id)
                    if stream is None:  # aborted
                        continue
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    by_loop.setdefault(stream.loop, []).append((stream, out))
            elif kind in ("accepted", "rejected"):
                with self._lock:
                    self._pending_adds -= 1
                rid = event[1]
                if kind == "accepted":
                    stream = self._streams.get(rid)
                    if stream is not None:
                        _call_soon(stream.loop, _resolve, stream.accepted)
                else:
                    stream = self._streams.pop(rid, None)
                    if stream is not None:
                        _call_soon(stream.loop, _fail_accept, stream, event[2])
            elif kind == "snapshot":
                self._snapshot = event[1]
            elif kind == "dead":
                self._die(event[1])
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _die(self, message: str) -> None:
        err = EngineDeadError(f"the engine is dead: {message}")
        self._dead = err
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            self._pending_adds = 0
        for stream in streams:  # (accepted or not: _fail_accept resolves what is pending)
            _call_soon(stream.loop, _fail_accept, stream, err)
