"""StepClock (DSPARK_STEP_CLOCK=1): device busy and idle time per kind of step from two events
per step, read only once completed; here with host-clock stand-ins for CUDA events."""

from types import SimpleNamespace

import pytest
import torch

from dspark.engine.step_clock import MAX_IDLE_MS, StepClock


class FakeDevice:
    """A stream: an event recorded at host time t is reached at max(t, when the work queued
    before it ends); `work(ms)` queues device work; `now` advances the host's clock."""

    def __init__(self):
        self.now, self.free_at = 0.0, 0.0

    def work(self, ms):
        self.free_at = max(self.free_at, self.now) + ms

    def event(self):
        dev = self

        class Event:
            at = None

            def record(self):
                self.at = max(dev.now, dev.free_at)

            def query(self):
                return self.at is not None and self.at <= dev.now

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()


def step(clock, dev, host_ms, device_ms, kind, verifies=False):
    dev.now += host_ms  # the host packs and plans
    before = clock.begin()
    dev.work(device_ms)
    clock.end(before, None, SimpleNamespace(last_kind=kind, last_verifies=verifies))


def test_busy_and_idle_per_kind_are_read_once_complete():
    dev = FakeDevice()
    clock = StepClock(event_factory=dev.event)
    step(clock, dev, 1.0, 5.0, "verify")  # device idle before the first: not counted
    assert clock.snapshot() == {}  # its events are not reached yet: nothing read
    dev.now = 6.0  # the step is done; the host took 1 ms more than the device's end
    step(clock, dev, 1.0, 5.0, "plain")  # enqueued at 7: the device sat idle 1 ms
    assert clock.snapshot() == {"verify": {"steps": 1, "busy_ms": 5.0, "idle_ms": 0.0}}
    step(clock, dev, 0.5, 5.0, "plain")  # scheduled ahead at 7.5: queued behind the last
    dev.now = 100.0
    clock.collect()
    snap = clock.snapshot()
    assert snap["plain"] == {"steps": 2, "busy_ms": 10.0, "idle_ms": 1.0}
    # an engine that waited for requests: the gap is not a step waiting for the host
    dev.now += 2 * MAX_IDLE_MS
    step(clock, dev, 0.0, 5.0, "plain")
    dev.now += 10.0
    clock.collect()
    assert clock.snapshot()["plain"] == {"steps": 3, "busy_ms": 15.0, "idle_ms": 1.0}


def test_steps_with_prefill_that_verify_drafts_are_their_own_kind():
    """A `mixed` step whose rows verify drafts is `mixed_verify`: beside a prefill chunk, the
    drafts add up to K tokens a row (the 8B shape at 256 requests: ~2k tokens)."""
    dev = FakeDevice()
    clock = StepClock(event_factory=dev.event)
    step(clock, dev, 0.0, 3.0, "mixed", verifies=False)
    step(clock, dev, 0.0, 7.0, "mixed", verifies=True)
    step(clock, dev, 0.0, 1.0, "verify", verifies=True)
    dev.now = 100.0
    clock.collect()
    assert {k: v["busy_ms"] for k, v in clock.snapshot().items()} == {
        "mixed": 3.0, "mixed_verify": 7.0, "verify": 1.0}


def test_a_disabled_clock_records_nothing():
    dev = FakeDevice()
    clock = StepClock(enabled=False, event_factory=dev.event)
    assert clock.begin() is None
    clock.end(None, None, SimpleNamespace(last_kind="plain"))
    assert clock.snapshot() == {}


def test_kind_without_speculation():
    """Without a speculative decoder a step is `mixed` when prefill chunks add tokens beyond
    one per row (HostStep.prefill_tokens), else `plain`."""
    dev = FakeDevice()
    clock = StepClock(event_factory=dev.event)
    for extra in (0, 63, 0):
        before = clock.begin()
        dev.work(2.0)
        clock.end(before, SimpleNamespace(prefill_tokens=lambda extra=extra: extra), spec=None)
    dev.now = 10.0
    clock.collect()
    assert clock.snapshot() == {"plain": {"steps": 2, "busy_ms": 4.0, "idle_ms": 0.0},
                                "mixed": {"steps": 1, "busy_ms": 2.0, "idle_ms": 0.0}}


class ShapedHost:
    """The HostStep facts the log reads: R requests, prefill tokens, draft slots."""

    def __init__(self, reqs, prefill, slots):
        self.reqs, self.prefill, self.slots = reqs, prefill, slots

    def plan_scalars(self):
        return (self.reqs, self.slots, self.prefill, self.reqs, True, 0)

    def prefill_tokens(self):
        return self.prefill

    def forward_tokens(self, budget):
        return self.reqs + self.prefill + (self.slots if budget is None else min(budget,
                                                                                 self.slots))


def test_the_step_log_writes_each_step_with_its_shape():
    """DSPARK_STEP_CLOCK_LOG: one line per step read, in order, with the requests, the tokens
    the forward ran (a trimmed plan's budget, not the packed slots), the prefill tokens, busy
    and idle ms (-1: a gap that is not the host's), and the lagged plan's part and host µs
    ("-": none)."""
    import io

    dev, log = FakeDevice(), io.StringIO()
    clock = StepClock(event_factory=dev.event, log=log)
    shapes = [(ShapedHost(4, 0, 28), 10, "verify", 3.0), (ShapedHost(4, 100, 28), None,
              "mixed", 5.0), (ShapedHost(6, 0, 0), 0, "plain", 2.0)]  # fmt: skip
    for host, plan, kind, ms in shapes:
        dev.now += 1.0
        before = clock.begin()
        dev.work(ms)
        overhead = SimpleNamespace(last_part="search" if kind == "verify" else None,
                                   last_plan_us=251.4)
        clock.end(before, host, SimpleNamespace(last_kind=kind, last_verifies=plan != 0,
                                                overhead=overhead), plan)  # fmt: skip
        assert overhead.last_part is None  # (taken: a later step without a plan logs "-")
        dev.now += 2 * MAX_IDLE_MS if kind == "mixed" else 0.0
    assert "plain" not in log.getvalue()  # not read yet: its events are pending
    dev.now += 100.0
    clock.collect()
    assert log.getvalue().splitlines() == [
        "verify 4 14 0 3.000 -1.000 search 251",  # the first step: no gap before it
        "mixed_verify 4 132 100 5.000 0.000 - -",  # enqueued behind the first: no idle
        "plain 6 6 0 2.000 -1.000 - -"]  # after the long wait for requests: not counted
    assert clock.snapshot()["plain"]["busy_ms"] == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_engine_times_its_steps_on_cuda(tiny_qwen, monkeypatch, tmp_path):
    """DSPARK_STEP_CLOCK=1: the model runner records the events around every step's device
    work; a no-speculation engine's decode steps are `plain`, its prefill ones `mixed`."""
    from dspark import LLM, SamplingParams

    monkeypatch.setenv("DSPARK_STEP_CLOCK", "1")
    log = tmp_path / "steps.log"
    monkeypatch.setenv("DSPARK_STEP_CLOCK_LOG", str(log))
    llm = LLM(tiny_qwen, device="cuda")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(5, 30))}] * 3, params)
    clock = llm.engine.runner.step_clock
    assert clock.enabled
    clock.collect()
    snap = clock.snapshot()
    assert snap["plain"]["steps"] >= 10 and snap["plain"]["busy_ms"] > 0
    assert snap["mixed"]["steps"] >= 1
    # DSPARK_STEP_CLOCK_LOG: one line per step read, with its shape (3 requests decoding)
    lines = [ln.split() for ln in log.read_text().splitlines()]
    assert len(lines) == sum(v["steps"] for v in snap.values())
    plain = [ln for ln in lines if ln[0] == "plain"]
    assert len(plain) == snap["plain"]["steps"]
    assert all(ln[1] == ln[2] == "3" and ln[3] == "0" for ln in plain)
    assert sum(float(ln[4]) for ln in plain) == pytest.approx(snap["plain"]["busy_ms"], rel=1e-3)
