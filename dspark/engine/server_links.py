"""The engine process's links to its API-server processes (engine_process.core_process_main):
one command pipe in and one event pipe out per server (`dspark serve --api-server-count N`;
one with the default single server).

- Commands: each pipe has a reader thread. An "add" records which server owns the request
  before the engine sees it, so the answer finds its way back. "drain" and "stop" reach the
  engine once every server still linked has asked: one server's shutdown must not stop the
  others' requests. When a server's pipe closes (the process is gone), its requests are
  aborted and it counts as stopped.
- Events (ServerLinks.emit, the EngineCore's `emit`): the answers to an add and the outputs
  of a request go to its owner only; snapshots, "ready", "dead" and "exited" go to every
  server. A pipe whose server is gone is dropped, and the others keep being served.

Invariant: a request id is owned by at most one server, from its "add" until its final
output, its rejection or its abort.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_BROADCAST = ("snapshot", "ready", "failed", "dead", "exited")
_FINISHED = 7  # a delta's "finished" field (output_delta.DeltaEncoder.make; its request id: 0)


class ServerLinks:
    def __init__(self, cmd_conns: list, evt_conns: list):
        assert len(cmd_conns) == len(evt_conns) >= 1
        self._cmd, self._evt = list(cmd_conns), list(evt_conns)
        self._owner: dict[str, int] = {}  # request id -> server index
        self._lock = threading.Lock()  # (server states and the engine's shutdown commands)
        self._linked = set(range(len(cmd_conns)))  # servers whose command pipe is open
        self._drain: dict[int, float] = {}  # server -> drain timeout it asked for
        self._stop: set[int] = set()  # servers that asked to stop
        self._forwarded: set[str] = set()  # shutdown commands the engine has been given

    # -- commands -----------------------------------------------------------------------------
    def start_readers(self, submit) -> None:
        """A reader thread per command pipe, handing commands to `submit` (EngineCore's)."""
        for i, conn in enumerate(self._cmd):
            threading.Thread(target=self._read, args=(i, conn, submit), daemon=True,
                             name=f"dspark-commands-{i}").start()  # fmt: skip

    def _read(self, i: int, conn, submit) -> None:
        try:
            while True:
                cmd = conn.recv()
                kind = cmd[0]
                if kind == "add":
                    if len(self._evt) > 1:
                        self._owner[cmd[1]] = i  # (before the engine can answer it)
                    submit(cmd)
                elif kind == "abort":  # (no final output follows an abort: forget it now)
                    submit(cmd)
                    self._owner.pop(cmd[1], None)
                elif kind == "drain":
                    self._ask(i, submit, drain=float(cmd[1]))
                elif kind == "stop":
                    self._ask(i, submit, stop=True)
        except (EOFError, OSError):  # the server's process is gone: its requests with it
            for rid in [r for r, owner in list(self._owner.items()) if owner == i]:
                submit(("abort", rid))
                self._owner.pop(rid, None)
            self._ask(i, submit, gone=True)

    def _ask(self, i: int, submit, drain: float | None = None, stop: bool = False,
             gone: bool = False) -> None:  # fmt: skip
        """Server i asked to drain / stop, or left; the engine drains (with the longest
        timeout asked) once every linked server has asked or left, and stops likewise."""
        with self._lock:
            if drain is not None:
                self._drain[i] = drain
            if stop:
                self._stop.add(i)
            if gone:
                self._linked.discard(i)
            live = self._linked
            if "drain" not in self._forwarded and live <= set(self._drain):
                self._forwarded.add("drain")
                submit(("drain", max([self._drain[j] for j in live], default=0.0)))
            if "stop" not in self._forwarded and live <= self._stop:
                self._forwarded.add("stop")
                submit(("stop",))

    # -- events -------------------------------------------------------------------------------
    def emit(self, events: list[tuple]) -> None:
        """Send a batch of the engine's events, each to the servers it concerns."""
        if len(self._evt) == 1:
            self._send(0, events)
            return
        batches: list[list] = [[] for _ in self._evt]
        for ev in events:
            kind = ev[0]
            if kind in _BROADCAST:
                for b in batches:
                    b.append(ev)
            elif kind in ("accepted", "rejected"):
                owner = self._owner.get(ev[1])
                if kind == "rejected":
                    self._owner.pop(ev[1], None)
                if owner is not None:
                    batches[owner].append(ev)
            elif kind == "deltas":  # (an engine process sends its outputs as deltas)
                split: dict[int, list] = {}
                for delta in ev[1]:
                    rid = delta[0]
                    owner = self._owner.get(rid)
                    if owner is None:  # (its server left: nobody to tell)
                        continue
                    split.setdefault(owner, []).append(delta)
                    if delta[_FINISHED]:
                        self._owner.pop(rid, None)
                for owner, items in split.items():
                    batches[owner].append((kind, items))
        for i, batch in enumerate(batches):
            if batch:
                self._send(i, batch)

    def _send(self, i: int, events: list) -> None:
        conn = self._evt[i]
        if conn is None:
            return
        try:
            conn.send(events)
        except OSError:  # its server is gone (the reader aborts its requests)
            logger.warning("API server %d is gone; its events are dropped", i)
            self._evt[i] = None
