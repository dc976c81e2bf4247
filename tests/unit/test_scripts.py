"""The GPU benchmark script runs end to end in its CPU smoke mode (so it cannot rot between
GPU sessions); its numbers are meaningless on a CPU and are not checked beyond sanity."""

import json
import os
import random
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")

# The scripts' CPU runs below are independent processes of ~4-15 s each on 2 cores (a torch
# import alone is ~2.5 s): they start when the module does, two at a time, in the order the
# tests read them, while the module's other tests run; each test waits for its own and checks
# it as before (one after another they took ~100 of this module's 172 s on 2 cores).
# (name, the test that reads it, script, arguments; "OUT": the run's own output folder)
SYNTHETIC = ["--synthetic-rates", "0.9,0.9,0.9,0.9,0.9,0.9,0.9"]
HOST_STEP = ["--concurrency", "3", "--tokens", "12"]
PLAN = ["--concurrency", "2", "--repeats", "20"]
# (profile_step and probe_cost with prompts of 16 tokens, not their default 128: the tests
# read which rows, phases and counts are printed, none of which depends on the prompt, and
# the CPU attention over 128+ positions was about a third of both runs: 16 -> 12.6 and
# 13 -> 8.6 s alone)
RUNS = [
    ("gpu_bench", "test_gpu_bench_smoke", "gpu_bench.py", ["--smoke", "--out", "OUT"]),
    ("profile_example", "test_profile_example_smoke", "profile_example.py",
     ["--smoke", "--out", "OUT"]),
    ("host_step_cost none", "test_host_step_cost", "host_step_cost.py",
     ["--policy", "none", *HOST_STEP]),
    ("host_step_cost lagged cold", "test_host_step_cost", "host_step_cost.py",
     ["--policy", "lagged", *HOST_STEP, "--cold"]),
    ("host_step_cost plain", "test_host_step_cost_plain_steps_decide_nothing",
     "host_step_cost.py", ["--policy", "lagged", "--plain", *HOST_STEP]),
    ("profile_step", "test_profile_step_smoke", "profile_step.py",
     ["--smoke", "--out", "OUT", "--prompt-len", "16"]),
    ("survival_estimate", "test_survival_estimate_smoke", "survival_estimate.py",
     ["--prompts", "8", "--concurrency", "4", "--tokens", "40"]),
    ("probe_cost", "test_probe_cost_smoke", "probe_cost.py", ["--smoke", "--prompt-len", "16"]),
    ("profile_mixed", "test_profile_mixed_smoke", "profile_mixed.py",
     ["--smoke", "--out", "OUT", "--arms", "nospec,fixed"]),
    ("profile_mixed synthetic",
     "test_profile_mixed_smoke_on_random_weights_with_synthetic_acceptance", "profile_mixed.py",
     ["--smoke", "--out", "OUT", "--arms", "fixed", "--load-format", "dummy", *SYNTHETIC]),
    ("diag_step_paths", "test_diag_step_paths_smoke", "diag_step_paths.py",
     ["--smoke", "--out", "OUT"]),
    ("plan_cost", "test_plan_cost", "plan_cost.py", PLAN),
    ("plan_cost cold", "test_plan_cost", "plan_cost.py", [*PLAN, "--cold"]),
    ("diag_adaptive", "test_diag_adaptive_smoke", "diag_adaptive.py",
     ["--smoke", "--out", "OUT"]),
    # (no kernel tables: the smoke run above profiles them, ~10 s on 2 cores)
    ("diag_adaptive serving", "test_diag_adaptive_serving_mode_keeps_requests_in_flight",
     "diag_adaptive.py", ["--smoke", "--out", "OUT", "--serving", "--kernel-tables", ""]),
]  # fmt: skip


class ScriptRuns:
    """The runs of RUNS that the selected tests read, started two at a time."""

    def __init__(self, root, tests: set[str]):
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="script-run")
        self.runs = {}
        for name, test, script, argv in RUNS:
            if test not in tests:
                continue
            out = root / name.replace(" ", "_")
            out.mkdir()
            argv = [str(out) if a == "OUT" else a for a in argv]
            self.runs[name] = (out, self.pool.submit(
                subprocess.run, [sys.executable, f"scripts/{script}", *argv], cwd=ROOT,
                capture_output=True, text=True, timeout=300))  # fmt: skip

    def result(self, name: str):
        """(the finished process, its output folder); it must have exited 0."""
        out, future = self.runs[name]
        proc = future.result()
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc, out


@pytest.fixture(scope="module", autouse=True)
def scripts(request, tmp_path_factory):
    tests = {getattr(item, "originalname", item.name) for item in request.session.items
             if item.module is request.module}  # fmt: skip
    runs = ScriptRuns(tmp_path_factory.mktemp("script_runs"), tests)
    yield runs
    runs.pool.shutdown(wait=True, cancel_futures=True)


def test_gpu_bench_smoke(scripts):
    proc, out = scripts.result("gpu_bench")
    res = json.loads((out / "gpu_bench.json").read_text())
    tput = res["dspark_tok_s"]
    assert set(tput) == {"1", "4"} and all(v > 0 for v in tput.values())
    assert set(res["hf_tok_s"]) == {"1", "4"}
    assert res["dspark_decode_step_ms"]["4"] > 0
    assert "decode batch 1 forward" in proc.stdout


def test_profile_example_smoke(scripts):
    _, out = scripts.result("profile_example")
    table = json.loads((out / "cost_table_smoke.json").read_text())
    assert table["provenance"]["dtype"] == "bfloat16" and table["verify"]["ms"]


# (the lagged policy's warm loop: the --plain test below; ~4 s a run on 2 cores)
@pytest.mark.parametrize("policy,cold", [("none", False), ("lagged", True)])
def test_host_step_cost(scripts, policy, cold):
    proc, _ = scripts.result(f"host_step_cost {policy}{' cold' if cold else ''}")
    line = proc.stdout.strip().splitlines()[-1]
    label = f"policy {policy}{', cold' if cold else ''}, concurrency 3:"
    assert label in line and "pack_step" in line
    assert "fill_host" in line  # the padded whole-step path ran
    assert ("plan" in line) == (policy == "lagged")


def test_host_step_cost_plain_steps_decide_nothing(scripts):
    """--plain: the adaptive engine's plain steps as between decisions in serving (no decision
    due, no probe): every plan is an "other" plan, and no step drafts."""
    proc, _ = scripts.result("host_step_cost plain")
    lines = proc.stdout.strip().splitlines()
    parts = next(ln for ln in lines if ln.startswith("planning by part"))
    assert "other" in parts and "decision" not in parts and "search" not in parts
    assert "policy lagged plain, concurrency 3:" in lines[-1]


def test_probe_cost_smoke(scripts):
    """probe_cost.py: no-spec, then an adaptive engine that never drafts but for its draft
    probes (on the CPU no step runs as a graph)."""
    proc, _ = scripts.result("probe_cost")
    rows = {r[0]: r for r in (line.split() for line in proc.stdout.splitlines())
            if r[:1] in (["nospec"], ["probing"])}  # fmt: skip
    assert set(rows) == {"nospec", "probing"}
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows.values())
    assert rows["nospec"][4] == "0" and int(rows["probing"][4]) >= 1  # probes counted
    assert rows["probing"][5] == "0"  # (graph steps)


def test_survival_estimate_smoke(scripts):
    """survival_estimate.py: the acceptance per position and the decision's estimate of it,
    both probabilities that do not rise with the position."""
    proc, _ = scripts.result("survival_estimate")
    rows = {line.split(" per position")[0]: line for line in proc.stdout.splitlines()
            if " per position" in line}  # fmt: skip
    assert set(rows) == {"accepted", "estimate"}
    for line in rows.values():
        values = [float(v) for v in line[line.index("[") + 1 : line.index("]")].split()]
        assert len(values) == 7 and all(1 >= a >= b >= 0 for a, b in zip(values, values[1:]))
    assert re.search(r"absolute error, summed over positions: [0-9.]+$", proc.stdout, re.M)


def test_profile_step_smoke(scripts):
    proc, out = scripts.result("profile_step")
    report = (out / "profile_step.txt").read_text()
    assert report.count("### ") == 4 and "fixed T=1" in report  # 2 arms x 2 temperatures
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("nospec ", "fixed "))]
    assert len(rows) == 8 and all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    assert all(r[6] != "-" for r in rows if r[0] == "fixed")  # acceptance reported
    # the host time per phase of each arm is printed too (not only in the file)
    assert "### fixed T=0" in proc.stdout
    assert re.search(r"^  commit +[0-9.]+ us host per step", proc.stdout, re.M)
    # ... and the timed host parts of every arm, no-spec's without the decoder's
    timers = proc.stdout.split("### host timers ")[1:]
    assert [t.split(" at ")[0] for t in timers] == ["nospec T=0", "nospec T=1", "fixed T=0",
                                                    "fixed T=1"]  # fmt: skip
    assert all(re.search(r"LLMEngine\._step +[0-9.]+ us per step", t) for t in timers)
    assert ["SpecDecoder.plan" in t for t in timers] == [False, False, True, True]


def test_profile_mixed_smoke(scripts):
    """Steps with prefill chunks and decode/verify steps are told apart and profiled by phase
    (the demo pair on the CPU, two arms)."""
    proc, out = scripts.result("profile_mixed")
    report = (out / "profile_mixed.txt").read_text()
    assert "### nospec T=1 c=4" in report and "### fixed T=1 c=4" in report
    kinds = re.findall(r"^(\w+) +(\d+) steps:", report, re.M)
    assert [k for k, _ in kinds] == ["mixed", "plain", "mixed", "verify"]
    assert all(int(n) > 0 for _, n in kinds)
    assert re.search(r"^    verify +host +[0-9.]+ us", report, re.M)  # (fixed K's phases)
    assert "### fixed" in proc.stdout  # (each arm printed as it ends)


def test_profile_mixed_smoke_on_random_weights_with_synthetic_acceptance(scripts):
    """The 8B shape's options pass through: random weights (--load-format dummy) accept no
    draft on their own, so the drafts verified come from SYNTHETIC acceptance."""
    proc, out = scripts.result("profile_mixed synthetic")
    assert "SYNTHETIC acceptance" in proc.stdout + proc.stderr
    report = (out / "profile_mixed.txt").read_text()
    kinds = re.findall(r"^(\w+) +(\d+) steps:", report, re.M)
    assert [k for k, _ in kinds] == ["mixed", "verify"] and all(int(n) > 0 for _, n in kinds)


def _ephemeral_low() -> int:
    """The lowest port the OS hands out to outgoing connections (Linux; 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port_block(n: int) -> int:
    """A base port whose next n ports were free a moment ago (the script binds base + i),
    below the ephemeral range: a block taken from it (a bind to port 0) lost base + 1 to an
    outgoing connection between the check and the second server's start (a forty-third
    session's suite run: "address already in use")."""
    top = max(_ephemeral_low(), 12000) - n
    for _ in range(200):
        base = random.randrange(10000, top)
        socks = [socket.socket() for _ in range(n)]
        try:
            for i, sk in enumerate(socks):
                sk.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError("no free block of ports")


# (CI runs two bench_e2e sweeps, ~55 s together on 2 cores: this sequential one of two arms
# with synthetic acceptance at T = 1, and the interleaved one of three arms below, at T = 0
# with the identity pass, in rounds: the GPU sessions' configuration. Both run their servers'
# engines in a thread: an engine process costs ~3-5 s more per server start here, and
# tests/e2e/test_server_process.py serves through one; and the script's main() in this
# process, which has imported torch, transformers and dspark already: a process of its own
# spent ~2.3 s more CPU on that before starting its first server)
def _bench_e2e_run(monkeypatch, capsys, tmp_path, *argv: str) -> str:
    """scripts/bench_e2e.py's main() on the demo pair, tiny sizes on the CPU, and `argv`; it
    must return 0. Returns what it printed."""
    demo = f"{ROOT}/dspark/assets/demo"
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--target", f"{demo}/target", "--drafter", f"{demo}/drafter",
        "--dataset", "random", "--input-len", "16", "--output-len", "6", "--num-prompts", "2",
        "--prompts-per-concurrency", "1", "--warmup", "1", "--max-num-seqs", "4",
        "--max-model-len", "128", "--max-num-batched-tokens", "256", "--device", "cpu",
        "--out", str(tmp_path), "--port", str(_free_port_block(3)), "--no-engine-process",
        *argv])  # fmt: skip
    assert _bench_e2e_module().main() == 0
    return capsys.readouterr().out


def test_bench_e2e_two_arms_reversed_without_the_offline_pass(tmp_path, monkeypatch, capsys):
    """--arms nospec,adaptive runs those two only; --reverse-arms runs them adaptive first (a
    GPU that heats up under load then slows no-spec's steps, not adaptive's); --identity-
    prompts 0 skips the offline pass, and the report says so instead of claiming a check;
    --synthetic-rates reaches the servers and every table says SYNTHETIC; --temperatures 1
    (the three-arm test below runs T = 0, which its identity pass needs)."""
    out = _bench_e2e_run(monkeypatch, capsys, tmp_path, "--sweep", "1", "--identity-prompts",
                         "0", "--temperatures", "1", "--arms", "nospec,adaptive",
                         "--reverse-arms", "--synthetic-rates", "0.9,0.8,0.7,0.6,0.5,0.4,0.3")
    assert "SYNTHETIC acceptance" in out
    assert "SYNTHETIC acceptance" in (tmp_path / "serve_adaptive7.log").read_text()
    assert json.loads((tmp_path / "bench_e2e.json").read_text())["synthetic"] is True
    done = [(tmp_path / f"{a}_t1.json").stat().st_mtime_ns for a in ("adaptive7", "nospec")]
    assert done == sorted(done)
    assert not (tmp_path / "fixed7_t1.json").exists()
    assert not (tmp_path / "serve_fixed7.log").exists()
    # the adaptive server's start-up cost table is kept beside its log (no-spec has none)
    assert json.loads((tmp_path / "serve_adaptive7.log.table.json").read_text())["verify"]
    assert not (tmp_path / "serve_nospec.log.table.json").exists()
    checks = json.loads((tmp_path / "bench_e2e.json").read_text())["checks"]
    assert checks["num_prompts"] == 0 and checks["overhead"] is None
    assert "not checked (--identity-prompts 0)" in out
    assert "T=0 identical tokens" not in out
    # the table keeps the canonical column order whatever order the arms ran in, and
    # compares adaptive with the one other arm
    lines = out.splitlines()
    header = next(ln for ln in lines if ln.startswith("conc"))
    assert header.index("nospec") < header.index("adaptive7") and "fixed7" not in header
    assert header.endswith("adaptive7 vs nospec")
    row = lines[lines.index(header) + 1].split()
    tput = json.loads((tmp_path / "bench_e2e.json").read_text())["results"]
    ratio = (tput["adaptive7@1"][0]["output_throughput"]
             / tput["nospec@1"][0]["output_throughput"] - 1)  # fmt: skip
    assert row[0] == "1" and row[-1] == f"{ratio:+.1%}"


def _bench_e2e_refuses(monkeypatch, capsys, *argv: str) -> str:
    """bench_e2e.main() on `argv` (in this process: argument errors exit before any work)
    must exit with argparse's status 2; returns its stderr."""
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--target", "t", "--drafter", "d", *argv])
    with pytest.raises(SystemExit) as exc:
        _bench_e2e_module().main()
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bench_e2e_rejects_arms_without_adaptive(monkeypatch, capsys):
    err = _bench_e2e_refuses(monkeypatch, capsys, "--arms", "nospec,fixed")
    assert "--arms: adaptive and one or both" in err


@pytest.mark.parametrize("value,named", [
    ('{"skip_idle_context_writes": true}', "unknown speculative_config key(s): "
                                           "skip_idle_context_writes"),
    ('{"adaptive_policy": "sometimes"}', "adaptive_policy"),
    ('{"num_speculative_tokens": 3}', "num_speculative_tokens set for every arm"),
    ("[1]", "a JSON object"), ("{skip", "not JSON")])
def test_bench_e2e_refuses_an_adaptive_config_the_engine_would(monkeypatch, capsys, value,
                                                               named):
    err = _bench_e2e_refuses(monkeypatch, capsys, "--adaptive-config", value)
    assert "--adaptive-config: " in err and named in err, err[-500:]


def test_bench_e2e_adaptive_config_reaches_the_adaptive_arm_alone(monkeypatch):
    """--adaptive-config's keys join the adaptive arm's speculative_config, not fixed K's."""
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--target", "t", "--drafter", "d", "--out", "o",
        "--adaptive-config", '{"skip_idle_context_write": true}'])  # fmt: skip
    module = _bench_e2e_module()
    arms = module.all_arms(module.parse_args("x"))
    assert arms["adaptive7"]["skip_idle_context_write"] is True
    assert arms["adaptive7"]["enable_adaptive_verification"] is True
    assert "skip_idle_context_write" not in arms["fixed7"] and arms["nospec"] is None


@pytest.mark.parametrize("flag,value", [("--identity-tokens", "0"),
                                        ("--identity-prompts", "-1")])
def test_bench_e2e_rejects_bad_offline_pass_settings_before_the_sweep(monkeypatch, capsys, flag,
                                                                      value):
    """The offline identity pass runs after the sweep (up to 10 minutes of device time): a
    setting it cannot run with is refused at once, naming the flag."""
    err = _bench_e2e_refuses(monkeypatch, capsys, flag, value)
    assert f"{flag} must be" in err, err[-500:]


def test_bench_e2e_runs_on_the_demo_pair(tmp_path, monkeypatch, capsys):
    """scripts/bench_e2e.py end to end on the CPU (three servers, a sweep at T = 0, offline
    checks), so the script that spends GPU time cannot break unnoticed: --interleave
    runs the servers side by side and measures each level arm after arm, the order rotating
    by level (the sequential and synthetic paths: the two-arm test above)."""
    # (the engines time their loops: DSPARK_HOST_TIMERS)
    monkeypatch.setenv("DSPARK_HOST_TIMERS", "1")
    # (two rounds per level: the median of each arm's rounds is kept; every engine on one CPU)
    cpu = max(os.sched_getaffinity(0))
    out = _bench_e2e_run(monkeypatch, capsys, tmp_path, "--sweep", "1,2", "--identity-prompts",
                         "2", "--identity-tokens", "6", "--temperatures", "0", "--interleave",
                         "--rounds", "2", "--engine-cpus", str(cpu))  # fmt: skip
    temps = ["0"]
    # one result file per arm, level and round, in the rotating order
    arms = ["nospec", "fixed7", "adaptive7"]
    for a in arms:
        assert f"engine pinned to CPUs [{cpu}]" in (tmp_path / f"serve_{a}.log"
                                                            ).read_text(), a  # fmt: skip
    # (a round is a pass over every level: round 0 of c = 1 and 2, then round 1)
    runs = [(level, r, (level - 1 + r) % 3) for r in (0, 1) for level in (1, 2)]
    stamps = []
    for level, r, first in runs:
        order = arms[first:] + arms[:first]
        files = [tmp_path / f"{a}_t0_c{level}_r{r}.json" for a in order]
        times = [f.stat().st_mtime_ns for f in files]
        assert times == sorted(times), (level, r, order, times)
        assert not any(f.with_suffix(".png").exists() for f in files)  # (--no-plot)
        stamps.append((min(times), max(times)))
    # each level's round ran after every earlier one
    assert all(a[1] < b[0] for a, b in zip(stamps, stamps[1:]))
    # the verdict's spread: adaptive over the better arm within each of the 2 rounds
    # (one line per temperature)
    paired = [ln for ln in out.splitlines() if "paired by round" in ln]
    assert len(paired) == len(temps), paired
    assert all(ln.count("%") == 2 * 3 and "c=2 " in ln for ln in paired), paired
    # ... and against each arm alone: one median per arm and level
    alone = [ln for ln in out.splitlines() if "median of the round pairs" in ln]
    assert len(alone) == len(temps), alone
    assert all(ln.count("%") == 2 * 2 and "c=2 " in ln for ln in alone), alone
    # ... and balanced for run order, where adaptive ran both before fixed K and after it:
    # at c = 2 only (rotations f a n, then a n f; at c = 1 n f a, then f a n), one line
    # per temperature, the round adaptive ran first marked A
    balanced = [ln for ln in out.splitlines() if "order-balanced" in ln]
    assert len(balanced) == len(temps), balanced
    assert all("c=2 " in ln and "c=1 " not in ln and ln.endswith("%A)") for ln in balanced)
    summary = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert sorted(summary["results"]) == sorted(f"{a}@{t}" for a in ("nospec", "fixed7",
                                                                      "adaptive7") for t in temps)
    for levels in summary["results"].values():
        assert [lv["max_concurrency"] for lv in levels] == [1, 2]
        assert all(lv["completed"] == 2 and lv["output_throughput"] > 0 for lv in levels)
    checks = summary["checks"]
    assert checks["identical_at_t0"] is True
    assert checks["overhead"]["step_ms"] > 0
    # the CPU has no CUDA graphs: each server logged none captured and no failure
    assert checks["graphs"] == {a: {"captured": 0, "failures": 0}
                                for a in ("nospec", "fixed7", "adaptive7")}  # fmt: skip
    assert checks["mismatching_prompts"] == {"fixed7": 0, "adaptive7": 0}
    assert "SYNTHETIC" not in out
    assert (tmp_path / "sweep_t0.png").stat().st_size > 10_000
    # the adaptive server's drafting flips from its log (however many this CPU makes)
    assert f"drafting turned on/off {len(checks['drafting_flips'])} times" in out
    # the adaptive server's steps during a level, by kind, from its /metrics (present when the
    # engine's metrics snapshot, taken every 0.1 s or on going idle, landed inside the level)
    for lv in summary["results"]["adaptive7@0"]:
        delta = lv["spec_decode"].get("metrics_delta")
        if delta is not None:
            kinds = delta["steps_by_kind"]
            assert set(kinds) <= {"plain", "draft", "verify", "mixed"}
            assert sum(kinds.values()) > 0
    # ... and what its drafting decision stood on (learned terms, acceptance ratio)
    states = [lv["spec_decode"].get("metrics_delta") or {}
              for lv in summary["results"]["adaptive7@0"]]  # fmt: skip
    for st in states:
        for kinds in (st.get("learned_fixed_ms") or {}).values():
            assert set(kinds) <= {"spec", "plain", "eager", "trim"} and all(kinds.values())
    if any("acceptance_ratio" in st for st in states):
        assert "adaptive7 learned fixed terms at the level's batch size" in out
    # its planning + allocation per level, against its steps (when a snapshot landed inside)
    overheads = [lv.get("scheduler_overhead") for lv in summary["results"]["adaptive7@0"]]
    for o in filter(None, overheads):
        assert 0 < o["fraction"] < 1 and o["plan_ms_per_step"] > 0
        assert set(o["plan_by_part"]) <= {"decision", "search", "other"}
    if any(overheads):
        assert "adaptive7 scheduler overhead in serving" in out
    # host time by part per engine step (servers started with DSPARK_HOST_TIMERS=1 only)
    hosts = [lv.get("host_ms_per_step") for arm in ("fixed7@0", "adaptive7@0")
             for lv in summary["results"][arm]]  # fmt: skip
    for h in filter(None, hosts):
        assert {"schedule", "launch", "wait_commit", "commit", "outputs"} <= set(h)
        assert all(v >= 0 for v in h.values()) and h["launch"] > 0
    if any(hosts):
        assert "engine host ms per step by part: " in out
    # the steps the adaptive server's fixed terms were learned from, by kind and batch size
    observed = [lv.get("observed_steps") for lv in summary["results"]["adaptive7@0"]]
    for o in filter(None, observed):
        assert set(o) <= {"spec", "plain", "eager", "trim"}
        for by_batch in o.values():
            assert all(v["steps"] > 0 and v["step_ms"] > 0 for v in by_batch.values())
    if any(observed):
        assert "adaptive7 steps its fixed terms learned from at the level's batch size" in (
            out)
    # the offline pass's planning by part adds up to its planning time
    parts = checks["overhead"]["plan_by_part"]
    assert sum(ms for _, ms in parts.values()) == pytest.approx(checks["overhead"]["plan_ms"])


def test_bench_e2e_reads_drafting_flips_from_a_server_log(tmp_path):
    bench_e2e = _bench_e2e_module()
    log = tmp_path / "serve.log"
    log.write_text("INFO dspark.serve: serving\n"
                   "INFO dspark.spec.drafting: adaptive verification: drafting off at 4 "
                   "requests: best verify length 1.0 tok/ms vs plain decoding 2.0 tok/ms\n"
                   "INFO:     127.0.0.1 - POST /v1/completions\n"
                   "INFO dspark.spec.drafting: adaptive verification: drafting on at 16 "
                   "requests: best verify length 3.0 tok/ms vs plain decoding 2.0 tok/ms\n")
    assert bench_e2e.drafting_flips(str(log)) == [
        "off at 4 requests: best verify length 1.0 tok/ms vs plain decoding 2.0 tok/ms",
        "on at 16 requests: best verify length 3.0 tok/ms vs plain decoding 2.0 tok/ms"]
    assert bench_e2e.drafting_flips(str(tmp_path / "missing.log")) == []


def test_diag_step_paths_smoke(scripts):
    proc, out = scripts.result("diag_step_paths")
    report = (out / "diag_step_paths.txt").read_text()
    assert report.count("### ") == 2  # a kernel table per path
    rows = [line.split() for line in proc.stdout.splitlines() if " tok/s " in line]
    assert [r[0] for r in rows[:4]] == ["whole-step"] * 2 + ["per-phase"] * 2
    assert all(float(r[2]) > 0 and float(r[-2]) > 0 for r in rows[:4])


@pytest.mark.parametrize("servers", [1, 2])
def test_server_host_ceiling_streams_every_step(servers):
    """The host-ceiling harness serves over HTTP with the device work stubbed; its requests
    must stream (one chunk per step, not one at the end: the LLM wrapper turns streaming off);
    also with two API-server processes in front of the (stubbed) engine process."""
    proc = subprocess.run(
        [sys.executable, "scripts/server_host_ceiling.py", "--policy", "lagged", "--concurrency",
         "4", "--tokens", "16", "--api-server-count", str(servers)], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    name = "policy lagged" + ("" if servers == 1 else f" x{servers} servers")
    assert line.startswith(f"{name}, concurrency 4:") and "TPOT p50" in line
    assert float(line.split(": ", 1)[1].split()[0]) > 0  # output tok/s


@pytest.mark.parametrize("cold", [False, True])
def test_plan_cost(scripts, cold):
    proc, _ = scripts.result("plan_cost cold" if cold else "plan_cost")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("2 requests") and all(k in line for k in ("plan", "bound", "search"))
    assert (", cold)" in line) == cold and "decision survey" in line and "chunk plan" in line
    assert "decision plan" in line and "mixed plan" in line
    times = [float(part.split()[-2]) for part in line.split("): ", 1)[1].split(", ")]
    assert len(times) == 10 and all(t > 0 for t in times), line


def test_diag_adaptive_smoke(scripts):
    _, out = scripts.result("diag_adaptive")
    report = (out / "diag_adaptive.txt").read_text()
    assert "### nospec at concurrency 3" in report and "### adaptive at concurrency 3" in report
    records = json.loads((out / "diag_adaptive.json").read_text())
    spec_steps = [r for r in records["adaptive@3"]["records"] if not r["prefill"]]
    assert spec_steps and all(r["ms"] > 0 and r["emitted"] >= r["rows"] for r in spec_steps)
    assert "verify 1/req: forward" in report  # the cost table's view of the decision
    # the steps with one prompt's chunk beside the decoding rows, profiled in both arms
    assert report.count("8 prompts of 24 tokens beside ~3 decoding rows") == 2


def test_diag_adaptive_serving_mode_keeps_requests_in_flight(scripts):
    _, out = scripts.result("diag_adaptive serving")
    report = (out / "diag_adaptive.txt").read_text()
    assert "beside ~3 decoding rows" not in report and "prefill of 3 x" not in report
    assert report.count("6 requests, 3 in flight") == 2  # both arms
    records = json.loads((out / "diag_adaptive.json").read_text())
    # every request of both waves ran to its 12 tokens (the smoke's max_tokens)
    assert sum(r["emitted"] for r in records["nospec@3"]["records"]) == 6 * 12
    assert sum(r["emitted"] for r in records["adaptive@3"]["records"]) >= 6 * 12
    assert "learned fixed terms by sampling mode and batch-size bucket" in report


def test_interleaved_rounds_keep_each_arms_median_round():
    """--rounds N: of one arm's N measurements of a level, the median one (by output tok/s;
    the lower middle of an even count) stands for the level, with every round's figure."""
    median_round = _bench_e2e_module().median_round

    def level(tput: float) -> dict:
        return {"results": [{"max_concurrency": 4, "output_throughput": tput}]}

    kept = median_round([level(900.0), level(700.0), level(1200.0)])
    assert kept["results"][0]["output_throughput"] == 900.0
    assert kept["results"][0]["rounds_output_throughput"] == [900.0, 700.0, 1200.0]
    assert median_round([level(5.0), level(3.0)])["results"][0]["output_throughput"] == 3.0
    single = median_round([level(42.0)])
    assert single["results"][0] == {"max_concurrency": 4, "output_throughput": 42.0}
    # servers with host timers: every round's ms per step in the parts all arms share
    # (commit, outputs, schedule; not plan, which only adaptive runs)
    def timed() -> list[dict]:
        rounds = [level(t) for t in (900.0, 700.0)]
        for r, ms in zip(rounds, (0.1, 0.2)):
            r["results"][0]["host_ms_per_step"] = {"commit": ms, "outputs": 0.05,
                                                   "schedule": 0.01, "plan": 1.0}  # fmt: skip
        return rounds

    assert median_round(timed())["results"][0]["rounds_shared_host_ms"] == pytest.approx(
        [0.16, 0.26])
    partial = timed()  # a round without one of the parts: no per-round figure
    del partial[1]["results"][0]["host_ms_per_step"]["schedule"]
    assert "rounds_shared_host_ms" not in median_round(partial)["results"][0]


def test_shared_host_by_round_sets_adaptive_against_fixed_round_by_round():
    """Each round's adaptive host ms in the shared parts over fixed K's: the pairing printed
    beside adaptive vs fixed, to show when a pair moved with the host's speed."""
    sys.path.insert(0, f"{ROOT}/scripts")
    from e2e_report import shared_host_by_round

    nospec = {"rounds_output_throughput": [1.0, 2.0]}  # (no-spec's parts differ: unused)
    fixed = {"rounds_shared_host_ms": [0.2, 0.4]}
    adaptive = {"rounds_shared_host_ms": [0.3, 0.2]}
    assert shared_host_by_round([nospec, fixed, adaptive]) == pytest.approx([1.5, 0.5])
    assert shared_host_by_round([nospec, fixed, {"output_throughput": 1.0}]) is None
    assert shared_host_by_round([nospec, fixed, {"rounds_shared_host_ms": [0.3]}]) is None


def test_paired_by_round_sets_adaptive_against_the_better_arm_of_each_round():
    """Each round's adaptive figure over the better of no-spec and fixed K in that round: the
    median-round verdict below is -5%, the rounds say -5 / -25 / -5%; without rounds there is
    nothing to pair."""
    sys.path.insert(0, f"{ROOT}/scripts")
    from e2e_report import paired_by_round

    def arm(*tput: float) -> dict:
        return {"output_throughput": sorted(tput)[1], "rounds_output_throughput": list(tput)}

    nospec, fixed, adaptive = arm(100.0, 200.0, 150.0), arm(90.0, 180.0, 120.0), arm(
        95.0, 150.0, 142.5)  # fmt: skip
    assert adaptive["output_throughput"] / nospec["output_throughput"] == pytest.approx(0.95)
    assert paired_by_round([nospec, fixed, adaptive]) == pytest.approx([-0.05, -0.25, -0.05])
    assert paired_by_round([fixed, nospec, adaptive]) == pytest.approx([-0.05, -0.25, -0.05])
    assert paired_by_round([nospec, fixed, {"output_throughput": 1.0}]) is None  # no rounds
    # against one arm alone (0: no-spec, 1: fixed K), round by round
    assert paired_by_round([nospec, fixed, adaptive], 1) == pytest.approx(
        [95 / 90 - 1, 150 / 180 - 1, 142.5 / 120 - 1])
    assert paired_by_round([nospec, fixed, adaptive], 0) == pytest.approx([-0.05, -0.25, -0.05])


def _bench_e2e_module():
    """scripts/bench_e2e.py as a module (its functions, without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", f"{ROOT}/scripts/bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2e_report_prints_each_round_pair_beside_the_host_speeds(capsys):
    """The summary's round pairs of adaptive against fixed K, each with adaptive's shared
    host ms over fixed K's in that round (servers with host timers, --rounds N)."""
    sys.path.insert(0, f"{ROOT}/scripts")
    from e2e_report import print_table

    def level(tput: list[float], shared: list[float] | None = None) -> dict:
        out = {"max_concurrency": 16, "output_throughput": sorted(tput)[0],
               "tpot_ms": {"p50": 0.5}, "rounds_output_throughput": tput}  # fmt: skip
        if shared is not None:
            out["rounds_shared_host_ms"] = shared
        return out

    names = ["nospec", "fixed7", "adaptive7"]
    results = {("nospec", 0.0): {"results": [level([500.0, 600.0])]},
               ("fixed7", 0.0): {"results": [level([1000.0, 1000.0], [0.2, 0.2])]},
               ("adaptive7", 0.0): {"results": [level([900.0, 1100.0], [0.24, 0.18])]}}
    checks = {"overhead": None, "num_prompts": 0}  # (no offline pass)
    print_table(names, [0.0], results, checks, "")
    line = next(x for x in capsys.readouterr().out.splitlines() if "parts both run alike" in x)
    assert line.endswith("c=16 -10.0% (1.20x) +10.0% (0.90x)"), line
    del results[("adaptive7", 0.0)]["results"][0]["rounds_shared_host_ms"]  # no host timers
    print_table(names, [0.0], results, checks, "")
    assert "parts both run alike" not in capsys.readouterr().out


def test_host_matched_pairs_fits_the_ratio_at_equal_host_speed(tmp_path):
    """Round pairs whose throughput ratio follows the shared host ratio exactly (log-linear,
    slope -0.5, -3% at equal speed): the fit recovers -3%; a pair found again in a second
    folder counts once; rounds without host timers or without the other arm are skipped."""
    sys.path.insert(0, f"{ROOT}/scripts")
    from host_matched_pairs import host_matched_fit, round_pairs

    def write(folder, arm, name, tput, commit):
        folder.mkdir(exist_ok=True)
        level = {"output_throughput": tput}
        if commit is not None:
            level["host_ms_per_step"] = {"commit": commit, "outputs": 0.0, "schedule": 0.0}
        (folder / f"{arm}_{name}.json").write_text(json.dumps({"results": [level]}))

    run, again = tmp_path / "run", tmp_path / "again"
    for i, (c, r, host) in enumerate([(1, 0, 1.3), (1, 1, 0.8), (16, 0, 1.0), (64, 0, 1.1)]):
        ratio = 0.97 * host ** -0.5
        write(run, "fixed7", f"t0_c{c}_r{r}", 1000.0 + i, 0.1)
        write(run, "adaptive7", f"t0_c{c}_r{r}", (1000.0 + i) * ratio, 0.1 * host)
    write(again, "fixed7", "t0_c1_r0", 1000.0, 0.1)  # the same pair, kept by a warm machine
    write(again, "adaptive7", "t0_c1_r0", 1000.0 * 0.97 * 1.3 ** -0.5, 0.13)
    write(again, "fixed7", "t0_c4", 500.0, None)  # no host timers
    write(again, "adaptive7", "t0_c4", 400.0, None)
    write(again, "adaptive7", "t0_c256", 400.0, 0.1)  # no fixed-K result
    pairs = round_pairs([str(run), str(again)], "0", None)
    assert sorted(p[0] for p in pairs) == [1, 1, 16, 64]
    fit = host_matched_fit(pairs)
    assert fit["at_equal_host"] == pytest.approx(0.97) and fit["slope"] == pytest.approx(-0.5)
    assert fit["se"] == pytest.approx(0.0, abs=1e-9) and fit["corr"] == pytest.approx(-1.0)
    assert [p[0] for p in round_pairs([str(run)], "0", {16, 64})] == [16, 64]
    proc = subprocess.run([sys.executable, "scripts/host_matched_pairs.py", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fit at equal host speed -3.0%" in proc.stdout.splitlines()[-1]
