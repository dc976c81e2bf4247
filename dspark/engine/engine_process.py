"""The engine in a process of its own: ProcessCore (the server's side) and the child's main.

The child loads the LLMEngine (it alone touches the GPU) and runs EngineCore; two one-way
pipes carry the core's commands in and its event batches out (engine_core.py), pickled. The
server's process keeps the tokenizer (chat templates, prompt checks) and HTTP. A reader thread
there hands each event batch to the front end. The child ends after a "stop" command has
drained its requests, also when the server's process is gone (its command pipe closes); if
the child dies, the front end hears a "dead" event.

Handshake: the child sends [("ready", info)] once loaded, or [("failed", message)]; its last
batch is [("exited",)].
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - mp.util.Finalize
import signal
import threading

from dspark.engine.loading import load_tokenizer
from dspark.engine.output_delta import DeltaDecoder

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def ignore_group_signals() -> None:
    """For a process whose lifetime another process decides (this engine process: its
    servers, through its pipes; a tensor-parallel worker: rank 0): a signal to the whole
    process group (Ctrl-C; systemd's SIGTERM to every process of a unit) must not end it
    before the servers have drained their requests through it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def core_process_main(config, cmd_conns, evt_conns, log_level: int, setup=None) -> None:
    """The child: load, announce, serve until stopped (or orphaned). `cmd_conns` /
    `evt_conns`: one pipe end each, or a list with one per API-server process
    (server_links.py)."""
    ignore_group_signals()  # (shutdown is the servers' call; its lifetime follows its pipes)
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    from dspark.engine.cpu_affinity import pin_from_env
    from dspark.engine.engine_core import EngineCore
    from dspark.engine.llm_engine import LLMEngine
    from dspark.engine.server_links import ServerLinks

    if not isinstance(cmd_conns, list):
        cmd_conns, evt_conns = [cmd_conns], [evt_conns]
    links = ServerLinks(cmd_conns, evt_conns)
    try:
        pin_from_env()  # DSPARK_ENGINE_CPUS (before loading: the loader's threads inherit it)
        engine = LLMEngine(config)
        if setup is not None:
            setup(engine)
    except Exception as e:  # noqa: BLE001 - report any loading failure plainly
        logger.debug("cannot load the engine", exc_info=True)
        links.emit([("failed", f"{type(e).__name__}: {e}")])
        return
    core = EngineCore(engine, links.emit, deltas=True)
    links.emit([("ready", {"max_model_len": engine.max_model_len})])
    links.start_readers(core.submit)
    try:
        core.run()
    finally:
        engine.runner.shutdown()  # tensor-parallel workers, if any
        links.emit([("exited",)])


class ProcessCore:
    """The server's handle on an engine process (the same interface as ThreadCore)."""

    # with an engine process started elsewhere (attached): the most seconds join() waits for
    # it to exit (None: as long as it takes); its pipes are then closed, which aborts this
    # server's requests still there (server_links.py)
    join_timeout_s: float | None = None

    def __init__(self, config, log_level: int | None = None, setup=None, pipes=None):
        """Start the engine process for `config` and wait until it has loaded. `setup`: a
        picklable callable the child applies to its LLMEngine before serving (benchmarks:
        scripts/server_host_ceiling.py stubs the device work with it). `pipes`: (command
        pipe's sending end, event pipe's receiving end) of an engine process already started
        for several API servers (multi_server.py): attach to it instead."""
        if pipes is not None:
            (self._cmd, self._evt), self.proc = pipes, None
        else:
            ctx = mp.get_context("spawn")  # (never fork a process that may hold CUDA state)
            cmd_r, self._cmd = ctx.Pipe(duplex=False)
            self._evt, evt_w = ctx.Pipe(duplex=False)
            level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
            # not a daemon: a tensor-parallel engine starts worker processes of its own
            self.proc = ctx.Process(target=core_process_main, name="dspark-engine-core",
                                    args=(config, cmd_r, evt_w, level, setup))  # fmt: skip
            self.proc.start()
            cmd_r.close()
            evt_w.close()
        # at interpreter exit, before multiprocessing joins its children: close the command
        # pipe, so that a child not stopped yet drains and exits instead of waiting forever
        mp.util.Finalize(self, self._cmd.close, exitpriority=10)
        # (the server's own tokenizer loads while the child loads the engine)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        info = self._wait_ready()
        self.max_model_len = info["max_model_len"]
        self.model_path = config.model
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._exited = False
        self._counts = (0, 0)  # (waiting, running) of the latest snapshot
        self._decoder = DeltaDecoder(self.tokenizer)  # (makes most requests' text)

    def _wait_ready(self) -> dict:
        while True:
            if self._evt.poll(0.5):
                try:
                    (kind, *rest), = self._evt.recv()
                except EOFError:
                    kind, rest = "exited", []
                if kind == "ready":
                    return rest[0]
                if self.proc is not None:
                    self.proc.join(10)
                if kind == "failed":
                    raise RuntimeError(rest[0])
                if self.proc is None:
                    raise RuntimeError("the engine process exited while loading")
            if self.proc is not None and not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited while loading (exit code "
                                   f"{self.proc.exitcode})")  # fmt: skip

    def start(self, on_events) -> None:
        self._reader = threading.Thread(target=self._read, args=(on_events,),
                                        name="dspark-engine-events", daemon=True)  # fmt: skip
        self._reader.start()

    def _read(self, on_events) -> None:
        while True:
            try:
                events = self._evt.recv()
            except (EOFError, OSError):
                break
            if events[-1][0] == "exited":
                self._exited = True
                events = events[:-1]
            try:
                self._hand_over(events, on_events)
            except Exception:  # noqa: BLE001 - keep reading: other requests still stream
                logger.exception("engine events dropped: %s", [e[0] for e in events])
            if self._exited:
                return
        code = "unknown"
        if self.proc is not None:
            self.proc.join(5)  # the pipe closed without "exited": the child died
            code = self.proc.exitcode
        on_events([("dead", f"the engine process exited unexpectedly (exit code {code})")])

    def _hand_over(self, events: list[tuple], on_events) -> None:
        for i, event in enumerate(events):
            if event[0] == "snapshot":
                self._counts = (event[1]["num_waiting"], event[1]["num_running"])
            elif event[0] == "deltas":  # applied here, built when read (DeltaStream)
                events[i] = ("outputs", self._decoder.apply_many(event[1]))
        if events:
            on_events(events)

    def submit(self, cmd: tuple) -> None:
        if cmd[0] == "abort":
            self._decoder.forget(cmd[1])
        try:
            with self._send_lock:
                self._cmd.send(cmd)
        except (OSError, ValueError):  # the child is gone: the reader reports it
            logger.debug("engine process gone; command %r dropped", cmd[0])

    def is_alive(self) -> bool:
        if self.proc is None:
            return not self._exited and self._reader is not None and self._reader.is_alive()
        return not self._exited and self.proc.is_alive()

    def join(self) -> None:
        if self._reader is not None:
            self._reader.join(self.join_timeout_s if self.proc is None else None)
        if self.proc is not None:
            self.proc.join()

    def num_waiting(self) -> int:  # (of the latest snapshot: at most ~0.1 s old while busy)
        return self._counts[0]

    def num_running(self) -> int:
        return self._counts[1]

    def close(self) -> None:
        if self.proc is None:  # (attached: the engine process is its starter's to end)
            self._cmd.close()
            self._evt.close()
            return
        self.proc.join(30)
        if self.proc.is_alive():  # (it ignores SIGTERM: core_process_main)
            logger.warning("the engine process did not exit: killing it")
            self.proc.kill()
            self.proc.join(10)
        self._cmd.close()
