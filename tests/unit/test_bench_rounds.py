"""scripts/bench_e2e.py's interleaved loop: rounds are whole passes over the levels, and
--stop-after cuts the sweep between levels, never inside one. The servers and the client are
replaced by stand-ins that record each call; the real ones run in test_scripts.py's
`test_bench_e2e_runs_on_the_demo_pair`."""

import json
import os
from types import SimpleNamespace

import pytest

from tests.unit.test_scripts import _bench_e2e_module, _bench_e2e_refuses


class _Server:
    def terminate(self):
        self.stopped = True

    def wait(self, timeout):
        return 0


def _run(tmp_path, monkeypatch, stop_after, sweep="1,2,4", rounds=2, seconds_per_run=10.0):
    """run_interleaved with two arms on a clock that moves `seconds_per_run` per level run;
    returns (its results, the (arm, level, round tag, warm-up) of every run in order)."""
    bench = _bench_e2e_module()
    now, calls = [1000.0], []
    monkeypatch.setattr(bench, "time", SimpleNamespace(time=lambda: now[0]))
    starts = []  # ("start" / "ready", port) in order

    def serve(args, spec, port, log, no_wait=False):
        starts.append(("start", port))
        return (_Server(), f"u{port}") if no_wait else wait_ready(args, _Server(), f"u{port}",
                                                                  log)  # fmt: skip

    def wait_ready(args, proc, url, log):
        starts.append(("ready", int(url[1:])))
        return proc, url

    monkeypatch.setattr(bench, "serve", serve)
    monkeypatch.setattr(bench, "wait_ready", wait_ready)

    def fake_sweep(args, url, arm, temp, levels=None, warmup=None, seed=0, out=None):
        now[0] += seconds_per_run
        calls.append((arm, levels, os.path.basename(out), warmup))
        tput = 100.0 * len(calls)  # (every run its own figure: the median is visible)
        return {"results": [{"max_concurrency": int(levels), "output_throughput": tput}]}

    monkeypatch.setattr(bench, "sweep", fake_sweep)
    args = SimpleNamespace(arms=["fixed", "adaptive"], reverse_arms=False, drafter="d", k=7,
                           sts=None, synthetic_rates=None, port=9000, out=str(tmp_path),
                           sweep=sweep, rounds=rounds, stop_after=stop_after,
                           started=now[0], adaptive_config={})  # fmt: skip
    results = bench.run_interleaved(args, [0.0])
    # fixed K's server (9000) starts with no other starting server waited for; the adaptive
    # one (9001), which profiles its cost table at start-up, only once it is ready
    assert starts == [("start", 9000), ("ready", 9000), ("start", 9001), ("ready", 9001)]
    return results, calls


def test_rounds_are_passes_over_every_level(tmp_path, monkeypatch):
    results, calls = _run(tmp_path, monkeypatch, stop_after=None)
    # round 0 over c = 1, 2, 4, then round 1; the arms' order rotating by level and round
    assert [(c, tag) for _, c, tag, _ in calls[::2]] == [
        ("1", "fixed7_t0_c1_r0.json"), ("2", "adaptive7_t0_c2_r0.json"),
        ("4", "fixed7_t0_c4_r0.json"), ("1", "adaptive7_t0_c1_r1.json"),
        ("2", "fixed7_t0_c2_r1.json"), ("4", "adaptive7_t0_c4_r1.json")]  # fmt: skip
    # each arm warms up in its first run of the temperature only
    assert [w for *_, w in calls] == [None, None] + [0] * 10
    levels = results[("adaptive7", 0.0)]["results"]
    assert [lv["max_concurrency"] for lv in levels] == [1, 2, 4]
    assert all(len(lv["rounds_order"]) == 2 for lv in levels)
    # adaptive's two rounds of c = 1 were runs 2 and 7: 200 and 700 tok/s, the lower kept
    assert levels[0]["rounds_output_throughput"] == [200.0, 700.0]
    assert levels[0]["output_throughput"] == 200.0
    merged = json.loads((tmp_path / "adaptive7_t0.json").read_text())
    assert [lv["max_concurrency"] for lv in merged["results"]] == [1, 2, 4]


def test_stop_after_keeps_the_levels_measured_each_with_its_rounds(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    # 20 s a level (two arms): c = 1, 2, 4 of round 0 end at 60 s, round 1's c = 1 starts at
    # 60 s <= 65 and ends at 80; nothing starts after
    results, calls = _run(tmp_path, monkeypatch, stop_after=65)
    assert [(c, tag[-7:-5]) for _, c, tag, _ in calls[::2]] == [
        ("1", "r0"), ("2", "r0"), ("4", "r0"), ("1", "r1")]
    for arm in ("fixed7", "adaptive7"):
        levels = results[(arm, 0.0)]["results"]
        assert [lv["max_concurrency"] for lv in levels] == [1, 2, 4]
        assert len(levels[0]["rounds_output_throughput"]) == 2
        assert all("rounds_order" not in lv for lv in levels[1:])
    out = capsys.readouterr().out
    assert "not measured: T=0 c=2 round 1, T=0 c=4 round 1" in out


def test_stop_after_zero_still_measures_the_first_level(tmp_path, monkeypatch):
    results, calls = _run(tmp_path, monkeypatch, stop_after=0)
    assert len(calls) == 2 and {c for _, c, _, _ in calls} == {"1"}
    assert [lv["max_concurrency"] for lv in results[("fixed7", 0.0)]["results"]] == [1]


@pytest.mark.parametrize("extra", [["--stop-after", "-1", "--interleave"],
                                   ["--stop-after", "60"]])  # fmt: skip
def test_stop_after_is_refused_without_interleave_or_below_zero(monkeypatch, capsys, extra):
    err = _bench_e2e_refuses(monkeypatch, capsys, *extra, "--num-kv-blocks", "8")
    assert "--stop-after must be" in err, err[-500:]
