"""ServerLinks (the engine process's pipes to several API servers): events reach the server
that owns their request, broadcasts reach all, and the engine drains / stops only once every
linked server has asked or left; a server that leaves has its requests aborted."""

from __future__ import annotations

import queue
import threading
import time

from dspark.engine.server_links import ServerLinks


class _Evt:  # an event pipe's sending end
    def __init__(self):
        self.sent = []

    def send(self, events):
        self.sent.append(events)


class _Cmd:  # a command pipe's receiving end: EOFError once closed
    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()

    def recv(self):
        cmd = self.q.get()
        if cmd is None:
            raise EOFError
        return cmd


def _delta(rid: str, finished: bool) -> tuple:  # (output_delta.DeltaEncoder.make's layout)
    return (rid, None, -1, "", 0, [1], [1], finished, None, None, None, None)


def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert cond()


def test_events_go_to_their_owner_and_shutdown_waits_for_every_server():
    cmds, evts = [_Cmd(), _Cmd()], [_Evt(), _Evt()]
    links, submitted, lock = ServerLinks(cmds, evts), [], threading.Lock()

    def submit(cmd):
        with lock:
            submitted.append(cmd)

    links.start_readers(submit)
    cmds[0].q.put(("add", "a", "p", None, None, 0.0))
    cmds[1].q.put(("add", "b", "p", None, None, 0.0))
    cmds[1].q.put(("add", "c", "p", None, None, 0.0))
    _until(lambda: len(submitted) == 3)
    links.emit([("accepted", "a"), ("accepted", "b"), ("rejected", "c", ValueError("x")),
                ("snapshot", {"n": 1})])  # fmt: skip
    assert evts[0].sent[-1] == [("accepted", "a"), ("snapshot", {"n": 1})]
    assert evts[1].sent[-1][:2] == [("accepted", "b"), ("rejected", "c", evts[1].sent[-1][1][2])]
    links.emit([("deltas", [_delta("a", False), _delta("b", True)])])
    assert evts[0].sent[-1] == [("deltas", [_delta("a", False)])]
    assert evts[1].sent[-1] == [("deltas", [_delta("b", True)])]
    n1 = len(evts[1].sent)
    links.emit([("deltas", [_delta("b", False)])])  # (b finished: its owner is forgotten)
    assert len(evts[1].sent) == n1
    cmds[0].q.put(("abort", "a"))  # (an abort ends ownership too: no final output follows)
    _until(lambda: ("abort", "a") in submitted)
    _until(lambda: "a" not in links._owner)
    # one server's drain and stop do not reach the engine while the other is linked ...
    cmds[0].q.put(("drain", 5.0))
    cmds[0].q.put(("stop",))
    time.sleep(0.05)
    assert [c for c in submitted if c[0] in ("drain", "stop")] == []
    # ... and when the other leaves, its requests are aborted and the engine drains (with
    # the timeout the remaining server asked for) and stops
    cmds[1].q.put(("add", "d", "p", None, None, 0.0))
    cmds[1].q.put(None)
    _until(lambda: ("stop",) in submitted)
    assert ("abort", "d") in submitted and ("drain", 5.0) in submitted
    assert submitted.index(("drain", 5.0)) < submitted.index(("stop",))
    links.emit([("exited",)])  # (to every server whose pipe is still there)
    assert evts[0].sent[-1] == [("exited",)] and evts[1].sent[-1] == [("exited",)]


def test_a_server_whose_pipe_broke_is_dropped_and_one_server_passes_all_through():
    class _Broken(_Evt):
        def send(self, events):
            raise BrokenPipeError

    links = ServerLinks([_Cmd(), _Cmd()], [_Evt(), _Broken()])
    links.emit([("snapshot", {})])
    links.emit([("snapshot", {})])  # (the broken pipe was dropped: no second attempt)
    assert links._evt[1] is None and len(links._evt[0].sent) == 2
    one, cmd, submitted = _Evt(), _Cmd(), []
    single = ServerLinks([cmd], [one])
    single.start_readers(submitted.append)
    cmd.q.put(("add", "a", "p", None, None, 0.0))
    cmd.q.put(("drain", 2.0))
    cmd.q.put(("stop",))
    _until(lambda: len(submitted) == 3)
    assert [c[0] for c in submitted] == ["add", "drain", "stop"] and single._owner == {}
    single.emit([("accepted", "a"), ("deltas", [_delta("a", True)])])
    assert one.sent == [[("accepted", "a"), ("deltas", [_delta("a", True)])]]
