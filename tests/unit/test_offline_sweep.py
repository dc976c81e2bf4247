"""scripts/offline_sweep.py: bench_e2e.py --offline-sweep runs the closed loop
(test_closed_loop.py) per arm after the serving sweep and before the identity pass, writing
each arm's levels as soon as the arm finishes; interleaved, in rounds and in turns; with
--offline-only no server starts (the demo pair on the CPU; its numbers are not checked
beyond sanity)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

import pytest

from dspark.spec.cost_model import CostModel
from dspark.spec.drafting_log import FLIP_LOG_PREFIX

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import bench_e2e  # noqa: E402
from offline_sweep import parse_levels  # noqa: E402

from tests.unit.test_scripts import _bench_e2e_refuses  # noqa: E402

DEMO = os.path.join(ROOT, "dspark", "assets", "demo")


def test_parse_levels():
    assert parse_levels("128,256") == [128, 256] and parse_levels(" 4 , 2") == [4, 2]
    assert parse_levels("") == []
    for bad in ("0", "4,x", "-1", "4,4"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_levels(bad)


@pytest.mark.parametrize("value", ["0", "128,abc", "4,4"])
def test_bench_e2e_rejects_bad_offline_sweep_levels(monkeypatch, capsys, value):
    err = _bench_e2e_refuses(monkeypatch, capsys, "--offline-sweep", value)
    assert "argument --offline-sweep" in err


@pytest.mark.parametrize("extra", [["--offline-turn-steps", "-1"],
                                   ["--offline-turn-steps", "4"],  # (no --interleave)
                                   ["--offline-turn-steps", "4", "--interleave"]])  # (no sweep)
def test_bench_e2e_rejects_turns_without_an_interleaved_offline_sweep(monkeypatch, capsys,
                                                                     extra):
    sweep = [] if "--interleave" in extra else ["--offline-sweep", "128"]
    err = _bench_e2e_refuses(monkeypatch, capsys, "--device", "cpu", *sweep, *extra)
    assert "--offline-turn-steps" in err


def test_bench_e2e_offline_sweep_runs_each_arm_before_the_identity_pass(
    tmp_path, monkeypatch, capsys
):
    """The serving sweep, plots and identity pass are stubbed: the offline sweep itself runs
    (demo pair, CPU), after the serving sweep and before the identity pass, each arm's
    levels in the summary as soon as the arm finishes; the adaptive engine loads the table
    its server profiled instead of profiling again."""
    table = tmp_path / "serve_adaptive3.log.table.json"
    CostModel.analytic().to_json(str(table))  # (as the adaptive server wrote it)
    handlers = list(logging.getLogger("dspark").handlers)
    events, summaries = [], []
    write = bench_e2e.write_summary

    def record_summary(args, results, checks):
        write(args, results, checks)
        summaries.append(json.loads((tmp_path / "bench_e2e.json").read_text())["checks"])

    def identity_pass(args, arms):
        events.append(("identity", sorted(summaries[-1]["offline_sweep"]["arms"])))
        return {"identical_at_t0": True, "num_prompts": 1, "overhead": None,
                "mismatching_prompts": {}}  # fmt: skip

    monkeypatch.setattr(bench_e2e, "run_sequential",
                        lambda args, temps: events.append(("serving",)) or {})  # fmt: skip
    monkeypatch.setattr(bench_e2e, "write_summary", record_summary)
    monkeypatch.setattr(bench_e2e, "offline_checks", identity_pass)
    monkeypatch.setattr(bench_e2e, "print_table", lambda *a: None)
    monkeypatch.setattr(bench_e2e.subprocess, "run", lambda *a, **k: None)  # (the plots)
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--target", f"{DEMO}/target", "--drafter", f"{DEMO}/drafter",
        "--k", "3", "--dataset", "random", "--input-len", "8", "--output-len", "6",
        "--num-prompts", "4", "--prompts-per-concurrency", "1.5", "--temperatures", "0,1",
        "--arms", "nospec,adaptive", "--device", "cpu", "--max-model-len", "128",
        "--max-num-batched-tokens", "256", "--offline-sweep", "2,3", "--out", str(tmp_path)])
    assert bench_e2e.main() == 0
    assert events == [("serving",), ("identity", ["adaptive3", "nospec"])]
    # written after the serving sweep, after each arm (run order), and once at the end
    arms_written = [sorted((s.get("offline_sweep") or {}).get("arms", {})) for s in summaries]
    assert arms_written == [[], ["nospec"], ["adaptive3", "nospec"], ["adaptive3", "nospec"]]
    sweep = summaries[-1]["offline_sweep"]
    assert sweep["levels"] == [2, 3] and sweep["temperatures"] == [0.0, 1.0]
    for arm, done in sweep["arms"].items():
        for t in ("0", "1"):
            levels = done["by_temperature"][t]
            assert [lv["max_concurrency"] for lv in levels] == [2, 3]
            # max(--num-prompts, 1.5 C) prompts of --output-len tokens each
            assert [lv["completed"] for lv in levels] == [4, 5]
            assert [lv["output_tokens"] for lv in levels] == [24, 30]
            assert [lv["max_in_flight"] for lv in levels] == [2, 3]
            assert (levels[0]["spec_decode"] is None) == (arm == "nospec")
    assert sweep["arms"]["nospec"]["cost_table"] is None
    assert sweep["arms"]["adaptive3"]["cost_table"].startswith(f"loaded from {table}")
    # the offline engines' own INFO log, each arm's start-up named, kept beside the results
    log = (tmp_path / "offline_engines.log").read_text().splitlines()
    opened = [ln.split()[-1] for ln in log if "offline engine of arm" in ln]
    assert opened == ["nospec", "adaptive3"]
    assert sum("KV cache:" in ln for ln in log) == 2
    assert logging.getLogger("dspark").handlers == handlers  # (its handler removed at the end)
    out = capsys.readouterr().out
    assert "offline API, closed loop, concurrency C (no HTTP server)" in out
    # the adaptive engine's logged drafting turns, from that log, in the summary and report
    flips = summaries[-1]["offline_drafting_flips"]
    assert len(flips) == sum(FLIP_LOG_PREFIX in ln for ln in log)
    assert f"offline engines: drafting turned on/off {len(flips)} times in its log" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["2"], ["3"])]
    assert len(rows) == 4 and all(r[-1].endswith("%") for r in rows)  # adaptive vs nospec


def test_bench_e2e_offline_only_starts_no_server(tmp_path, monkeypatch, capsys):
    """--offline-only: no server and no serving sweep, only the offline sweep (here the arms
    in turns of 2 steps, demo pair, CPU, the adaptive engine skipping idle context writes);
    its table, each speculative arm's overhead per level and the identity pass's lines are
    printed, not the serving table."""
    def no_serving(args, temps):
        raise AssertionError("--offline-only ran a serving sweep")

    monkeypatch.setattr(bench_e2e, "run_interleaved", no_serving)
    monkeypatch.setattr(bench_e2e, "run_sequential", no_serving)
    monkeypatch.setattr(sys, "argv", [
        "bench_e2e.py", "--target", f"{DEMO}/target", "--drafter", f"{DEMO}/drafter",
        "--k", "3", "--dataset", "random", "--input-len", "8", "--output-len", "6",
        "--num-prompts", "3", "--prompts-per-concurrency", "1", "--temperatures", "1",
        "--arms", "nospec,adaptive",
        "--device", "cpu", "--max-model-len", "128", "--max-num-batched-tokens", "256",
        "--identity-prompts", "0", "--interleave", "--offline-sweep", "2",
        "--offline-turn-steps", "2", "--offline-only", "--out", str(tmp_path),
        "--adaptive-config", '{"skip_idle_context_write": true}'])  # fmt: skip
    assert bench_e2e.main() == 0
    summary = json.loads((tmp_path / "bench_e2e.json").read_text())
    assert summary["args"]["adaptive_config"] == {"skip_idle_context_write": True}
    assert summary["results"] == {} and not list(tmp_path.glob("*.png"))  # (nor a plot)
    sweep = summary["checks"]["offline_sweep"]
    for arm in ("nospec", "adaptive3"):
        (row,) = sweep["arms"][arm]["by_temperature"]["1"]
        assert row["completed"] == 3 and row["turn_steps"] == 2
        assert (row["scheduler_overhead"] is None) == (arm == "nospec")
    out = capsys.readouterr().out
    assert "end-to-end: output tok/s" not in out
    assert "offline API, closed loop, concurrency C (no HTTP server)" in out
    share = sweep["arms"]["adaptive3"]["by_temperature"]["1"][0]["scheduler_overhead"]
    assert (f"adaptive3 offline scheduler overhead at T=1 (plan + alloc, % of step time): "
            f"c=2 {share:.2%}") in out
    assert "T=0 identity and offline overhead: not checked (--identity-prompts 0)" in out


def test_bench_e2e_offline_only_needs_an_offline_sweep(monkeypatch, capsys):
    err = _bench_e2e_refuses(monkeypatch, capsys, "--offline-only")
    assert "--offline-only needs --offline-sweep" in err


def _sweep_args(tmp_path, **kw) -> argparse.Namespace:
    """bench_e2e's arguments as offline_sweep reads them: the demo pair on the CPU,
    interleaved, random 8-token prompts (`kw`: rounds, output length, prompts, turns)."""
    return argparse.Namespace(
        target=f"{DEMO}/target", out=str(tmp_path), num_kv_blocks=None, load_format="auto",
        device="cpu", max_model_len=128, max_num_batched_tokens=256, engine_cpus=None,
        interleave=True, warmup_tokens_per_level=2, dataset="random", dataset_path=None,
        input_len=8, range_ratio=0.0, prompts_per_concurrency=1.0, **kw)  # fmt: skip


def test_interleaved_offline_sweep_runs_each_level_arm_after_arm_in_rounds(tmp_path, monkeypatch,
                                                                          capsys):
    """With --interleave the offline sweep opens every arm's engine at once and runs each level
    arm after arm, --rounds times, the order reversed every other round, each round salted
    apart; a level's row is its median round, with every round's throughput in run order,
    and the summary is handed out after each level (demo pair, CPU); the report prints each
    round's policy counts and each level's scheduler overhead."""
    import offline_sweep as osw

    opened, runs, handed = {}, [], []
    real_open, real_level = osw._open, osw._level

    def spy_open(args, arm, spec, levels):
        llm = real_open(args, arm, spec, levels)
        opened[id(llm.engine)] = arm
        return llm

    def spy_level(args, engine, t, c, salt):
        runs.append((len(opened), opened[id(engine)], t, c, salt))
        return real_level(args, engine, t, c, salt)

    monkeypatch.setattr(osw, "_open", spy_open)
    monkeypatch.setattr(osw, "_level", spy_level)
    args = _sweep_args(tmp_path, rounds=3, output_len=5, num_prompts=3, offline_turn_steps=0)
    order = [("nospec", None), ("adaptive3", {"model": f"{DEMO}/drafter",
                                              "num_speculative_tokens": 3,
                                              "enable_adaptive_verification": True})]
    res = osw.offline_sweep(args, order, [2, 3], [1.0],
                            on_arm=lambda r: handed.append(json.dumps(r)))  # fmt: skip
    # both engines open before the first run; per level: N A, A N, N A
    assert all(n_open == 2 for n_open, *_ in runs)
    assert [(arm, c) for _, arm, _, c, _ in runs] == [
        (a, c) for c in (2, 3) for a in ("nospec", "adaptive3", "adaptive3", "nospec",
                                         "nospec", "adaptive3")]  # fmt: skip
    # every run of a level salted apart per round (the prefix cache serves no round's prompts)
    salts = {(arm, c): {s for _, a, _, cc, s in runs if (a, cc) == (arm, c)} for _, arm, _, c, _
             in runs}  # fmt: skip
    assert all(len(v) == 3 for v in salts.values())
    assert res["rounds"] == 3 and len(handed) == 2  # after each level
    assert len(json.loads(handed[0])["arms"]["nospec"]["by_temperature"]["1"]) == 1
    for arm in ("nospec", "adaptive3"):
        rows = res["arms"][arm]["by_temperature"]["1"]
        assert [r["max_concurrency"] for r in rows] == [2, 3]
        for r in rows:
            assert len(r["rounds"]) == 3 and r["completed"] == r["num_prompts"] == 3
            assert r["output_throughput"] == sorted(r["rounds"])[1]  # the median round
            assert r["rounds_order"] == [["nospec", "adaptive3"], ["adaptive3", "nospec"],
                                         ["nospec", "adaptive3"]]  # (as they ran)
            # every round's policy counts and verified drafts, in run order
            assert len(r["rounds_policy"]) == len(r["rounds_verified"]) == 3
            if arm == "nospec":
                assert r["rounds_policy"] == [None] * 3 and r["rounds_verified"] == [None] * 3
            else:
                assert all(sum(p["steps_by_kind"].values()) > 0 for p in r["rounds_policy"])
                # the steps it launched by kind are those it planned, each taking time
                for p, kinds in zip(r["rounds_policy"], r["rounds_kinds"], strict=True):
                    assert {k: n for k, (n, _) in kinds.items()} == p["steps_by_kind"]
                    assert all(ms > 0 for n, ms in kinds.values() if n)
                # (drafts verified a request: none where this CPU's policy held drafting off)
                assert all(v >= 0 for v in r["rounds_verified"])
            assert sum(n for n, _ in r["kinds"].values()) == r["steps"]  # (the median round)
            # every round's level end: of its step() calls (its steps, and a last call that
            # only returned outputs at most), a share of its own time
            assert len(r["rounds_end"]) == 3
            assert all(0 <= n <= steps + 1 and 0.0 <= share < 1.0
                       for (n, share), (_, steps) in zip(r["rounds_end"], r["rounds_graph"],
                                                         strict=True))  # fmt: skip
            assert (r["end_steps"], r["end_share"]) in [tuple(e) for e in r["rounds_end"]]
            # every arm's periods by kind add up to no more than the round's own wall time
            # (its turns); no-spec's steps are plain, or mixed where they carry prompt chunks
            for kinds, tput in zip(r["rounds_kinds"], r["rounds"], strict=True):
                assert sum(ms for _, ms in kinds.values()) <= r["output_tokens"] / tput * 1e3
                if arm == "nospec":
                    assert kinds["plain"][0] > 0 and kinds["mixed"][0] > 0
                    assert kinds["draft"] == kinds["verify"] == [0, 0.0]
    assert res["arms"]["adaptive3"]["cost_table"] is not None
    # the report prints each speculative arm's rounds: 3 a level, the no-spec arm not at all
    from e2e_report import print_offline_policy

    print_offline_policy(["nospec", "adaptive3"], res)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("adaptive3 offline at T=1")
    # ... then its median rounds' scheduler overhead, a level each
    shares = [r["scheduler_overhead"] for r in res["arms"]["adaptive3"]["by_temperature"]["1"]]
    assert lines[1] == ("adaptive3 offline scheduler overhead at T=1 (plan + alloc, % of step "
                        f"time): c=2 {shares[0]:.2%}, c=3 {shares[1]:.2%}")
    cells = re.findall(r"(\d+)/(\d+)/(\d+)/(\d+) d\d+(?: m[+-]\d+%)? v\d+", lines[0])
    assert len(cells) == 6 and "c=2 " in lines[0] and "c=3 " in lines[0]
    # each cell's steps by kind are its round's (run order), as the sweep counted them
    counted = [r["rounds_policy"] for r in res["arms"]["adaptive3"]["by_temperature"]["1"]]
    assert [tuple(map(int, c)) for c in cells] == [
        tuple(p["steps_by_kind"][k] for k in ("plain", "draft", "verify", "mixed"))
        for ps in counted for p in ps]  # fmt: skip


def test_order_balanced_ratios_weigh_each_run_order_alike():
    """The served c = 64 rounds of the thirty-ninth session (fixed K / adaptive tok/s; adaptive
    ran second, first, second): the arm run second was faster in each pair, and the two rounds
    adaptive ran second count as one, against the one it ran first; an order never run gives
    nothing; balanced_cell marks the rounds adaptive ran first."""
    import math

    from e2e_report import balanced_cell, order_balanced

    fixed, adaptive = [53128.0, 64306.0, 54828.0], [65505.0, 59265.0, 55490.0]
    first = [False, True, False]
    second = (math.log(65505 / 53128) + math.log(55490 / 54828)) / 2
    want = math.exp((second + math.log(59265 / 64306)) / 2) - 1
    assert order_balanced(adaptive, fixed, first) == pytest.approx(want)
    assert 0.01 < want < 0.02  # (the median round said +8.1%)
    assert order_balanced(adaptive, fixed, [False] * 3) is None
    orders = [["fixed7", "adaptive7"], ["adaptive7", "fixed7"], ["fixed7", "adaptive7"]]
    a = {"max_concurrency": 64, "rounds": adaptive, "rounds_order": orders}
    cell = balanced_cell(a, {"rounds": fixed}, "rounds", ("adaptive7", "fixed7"))
    assert cell == f"c=64 {want:+.1%} (+23.3% / -7.8%A / +1.2%)"
    assert balanced_cell(a, {"rounds": fixed[:2]}, "rounds", ("adaptive7", "fixed7")) is None


def test_median_round_is_the_lower_middle_by_throughput():
    from offline_sweep import median_round

    rows = [{"output_throughput": x, "tag": i} for i, x in enumerate([5.0, 1.0, 9.0, 3.0])]
    mid = median_round(rows)
    assert mid["tag"] == 3 and mid["rounds"] == [5.0, 1.0, 9.0, 3.0]
    assert median_round(rows[:1])["rounds"] == [5.0]


def test_offline_sweep_in_turns_runs_the_arms_at_once_each_timed_by_its_own_turns(tmp_path,
                                                                                monkeypatch,
                                                                                capsys):
    """--offline-turn-steps 2: each level's arms run their closed loops at once, two engine
    steps a turn, each with every prompt completed and exactly C requests held; an arm's
    throughput is over its own time (its wall_s under the level's), TPOT/TTFT left out
    (demo pair, CPU)."""
    import offline_sweep as osw

    order = []
    real_open = osw._open

    def spy_open(args, arm, spec, levels):
        llm = real_open(args, arm, spec, levels)
        step = llm.engine.step
        llm.engine.step = lambda: order.append(arm) or step()
        return llm

    monkeypatch.setattr(osw, "_open", spy_open)
    args = _sweep_args(tmp_path, rounds=2, output_len=6, num_prompts=4, offline_turn_steps=2)
    arms = [("nospec", None), ("fixed3", {"model": f"{DEMO}/drafter",
                                          "num_speculative_tokens": 3,
                                          "adaptive_policy": "fixed"})]
    t0 = time.perf_counter()
    res = osw.offline_sweep(args, arms, [2, 3], [0.0])
    elapsed = time.perf_counter() - t0
    assert res["turn_steps"] == 2
    for arm in ("nospec", "fixed3"):
        for r in res["arms"][arm]["by_temperature"]["0"]:
            c = r["max_concurrency"]
            assert r["completed"] == r["num_prompts"] == max(4, c) and r["max_in_flight"] == c
            assert r["output_tokens"] == 6 * r["completed"]
            assert r["mean_tpot_ms"] is None and r["mean_ttft_ms"] is None
            assert 0 < r["wall_s"] < elapsed and r["output_throughput"] > 0
    # the arms' steps interleaved, at most two in a row while both were running
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 8
    # T = 0: every round's prompts compared with the arm run first (no-spec), tokens dropped
    for arm in ("nospec", "fixed3"):
        for r in res["arms"][arm]["by_temperature"]["0"]:
            assert "_tokens" not in r
            n = max(4, r["max_concurrency"])
            expect = [None, None] if arm == "nospec" else [[n, n], [n, n]]  # (lossless)
            assert r["rounds_t0_identical"] == expect
    from e2e_report import print_offline_identity

    print_offline_identity(["nospec", "fixed3"], res)
    assert capsys.readouterr().out.strip() == (
        "fixed3 offline at T=0, prompts whose tokens equal nospec's (16 of 16; per level, "
        "each round): c=2 4/4, 4/4; c=3 4/4, 4/4")


def test_the_identity_report_says_where_diverging_outputs_left_the_first_arms(capsys):
    from e2e_report import print_offline_identity

    def level(c, identical, diverged):
        return {"max_concurrency": c, "rounds_t0_identical": identical,
                "rounds_t0_diverged": diverged}  # fmt: skip

    base = [level(4, [None, None], [None, None]), level(16, [None, None], [None, None])]
    fixed = [level(4, [[30, 32], [30, 32]], [[[3, 117], [9, 201]], [[3, 117], [9, 201]]]),
             level(16, [[64, 64], [64, 64]], [[], []])]  # fmt: skip
    sweep = {"arms": {"nospec": {"by_temperature": {"0": base}},
                      "fixed7": {"by_temperature": {"0": fixed}}}}  # fmt: skip
    print_offline_identity(["nospec", "fixed7"], sweep)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        "fixed7 offline at T=0, prompts whose tokens equal nospec's (188 of 192; per level, "
        "each round): c=4 30/32, 30/32; c=16 64/64, 64/64",
        "fixed7 offline at T=0, where outputs left nospec's (prompt@first differing token; "
        "each level's first round, up to 16 prompts): c=4 3@117 9@201"]


def test_the_report_names_context_tokens_rebuilt_in_a_round_that_rebuilt_any(capsys):
    """skip_idle_context_write's cost per round (r: target tokens run again), printed beside
    the round's steps by kind only where the round rebuilt any."""
    from e2e_report import print_offline_policy

    def policy(rebuilt):
        return {"steps_by_kind": {"plain": 90, "draft": 2, "verify": 8, "mixed": 1},
                "plans": {"decision": 3}, "context": {"rebuilt_tokens": rebuilt}}

    level = {"max_concurrency": 4, "rounds_policy": [policy(120), policy(0)],
             "rounds_verified": [40.0, 0.0]}
    sweep = {"temperatures": [1.0], "arms": {"adaptive7": {"by_temperature": {"1": [level]}}}}
    print_offline_policy(["adaptive7"], sweep)
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("c=4 90/2/8/1 d3 v40 r120, 90/2/8/1 d3 v0"), line


def test_the_report_gives_by_how_much_the_verdicts_priced_drafting_ahead(capsys):
    """m: the geometric mean of a round's drafting verdicts' rate ratios (drafting over
    plain decoding), printed after its decisions; none where no verdict was priced."""
    import math

    from e2e_report import print_offline_policy

    def policy(verdicts):
        return {"steps_by_kind": {"plain": 0, "draft": 0, "verify": 100, "mixed": 2},
                "plans": {"decision": 2}, "verdicts": verdicts}

    ahead = {"decisions": 2, "log_spec_over_plain": math.log(1.10) + math.log(1.06)}
    behind = {"decisions": 1, "log_spec_over_plain": math.log(0.86)}
    level = {"max_concurrency": 16, "rounds_verified": [700.0, 690.0, 650.0],
             "rounds_policy": [policy(ahead), policy(behind), policy({"decisions": 0,
                                                                     "log_spec_over_plain": 0.0})]}
    sweep = {"temperatures": [1.0], "arms": {"adaptive7": {"by_temperature": {"1": [level]}}}}
    print_offline_policy(["adaptive7"], sweep)
    line = capsys.readouterr().out.splitlines()[0]
    assert line.endswith("c=16 0/0/100/2 d2 m+8% v700, 0/0/100/2 d2 m-14% v690, "
                         "0/0/100/2 d2 v650"), line


def test_the_report_gives_each_rounds_step_periods_by_kind_and_the_priced_survival(capsys):
    """Each round's mean period of its steps by kind ("-" for a kind it ran none of), every
    arm's; the plain and verify-all step times a round's verdicts priced, on average; and per
    checked row the drafts accepted / the decision's estimate / the confidences' raw
    prediction; the steps that followed the one in flight, of all; the steps run on whole-step
    graphs, of all (none: an engine without them); the share of its time in the level's end,
    and those steps (none: nothing). Rounds from runs without those fields print nothing."""
    from e2e_report import print_offline_steps

    kinds = {"plain": [0, 0.0], "draft": [2, 1.0], "verify": [100, 87.5], "mixed": [4, 6.0]}
    tally = {"rows": 40.0, "accepted": 84.0, "estimated": 61.2, "raw": 56.0}
    verdicts = {"decisions": 4, "log_spec_over_plain": 0.2, "plain_ms": 2.4, "verify_ms": 3.6}
    level = {"max_concurrency": 16, "rounds_kinds": [kinds, kinds, None],
             "rounds_policy": [{"survival": tally, "verdicts": verdicts}, {}, {}],
             "rounds_followed": [(81, 106), (0, 106), (None, None)],
             "rounds_graph": [(98, 106), (None, 106), (None, None)],
             "rounds_end": [(19, 0.184), (0, 0.0), (None, None)]}
    plain = {"plain": [200, 90.0], "draft": [0, 0.0], "verify": [0, 0.0], "mixed": [3, 2.4]}
    nospec = {"max_concurrency": 16, "rounds_kinds": [plain], "rounds_policy": [None],
              "rounds_graph": [(0, 203)]}
    sweep = {"temperatures": [0.0], "arms": {"adaptive7": {"by_temperature": {"0": [level]}},
                                             "nospec": {"by_temperature": {"0": [nospec]}}}}
    print_offline_steps(["nospec", "adaptive7"], sweep)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nospec offline at T=0, each round's ms a step by kind")
    assert lines[0].endswith("c=16 0.450/-/-/0.800 g0/203"), lines[0]
    assert lines[1].startswith("adaptive7 offline at T=0, each round's ms a step by kind")
    assert lines[1].endswith("c=16 -/0.500/0.875/1.500 p0.600/0.900 s2.10/1.53/1.40 f81/106 "
                             "g98/106 e18%/19, -/0.500/0.875/1.500")


def test_host_timers_give_each_rounds_host_work_per_step_by_part(tmp_path, capsys):
    """--host-timers: every engine of the interleaved sweep times its step's parts; each
    round's row holds host ms per step by part, the speculative arm's with its planning,
    observation and confidence copy, no-spec's without; the parts nest (launch holds
    planning; the wait holds the commit), and the report prints them per round in
    HOST_PARTS order, "-" where the arm has no such part; then the adaptive arm's plans by
    path, each plan on one (demo pair, CPU)."""
    import offline_sweep as osw
    from e2e_report import print_offline_host
    from offline_rounds import HOST_PARTS

    args = _sweep_args(tmp_path, rounds=1, output_len=6, num_prompts=3, offline_turn_steps=2,
                       host_timers=True)  # fmt: skip
    arms = [("nospec", None), ("adaptive3", {"model": f"{DEMO}/drafter",
                                             "num_speculative_tokens": 3,
                                             "adaptive_policy": "lagged"})]
    res = osw.offline_sweep(args, arms, [2], [0.0])
    rows = {arm: res["arms"][arm]["by_temperature"]["0"][0] for arm, _ in arms}
    (spec,), (plain,) = rows["adaptive3"]["rounds_host"], rows["nospec"]["rounds_host"]
    assert {"plan", "observe", "conf_copy"} <= set(spec) and not {"plan", "observe"} & set(plain)
    for host in (spec, plain):
        assert {"schedule", "launch", "wait_commit", "commit", "outputs"} <= set(host)
        assert host["launch"] > 0 and host["wait_commit"] >= host["commit"] > 0
    assert spec["launch"] >= spec["plan"] > 0
    # a level's wall time bounds its steps' host work (the timers run inside its steps)
    steps = rows["adaptive3"]["steps"]
    assert spec["launch"] * steps <= rows["adaptive3"]["wall_s"] * 1e3
    print_offline_host(["nospec", "adaptive3"], res)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("nospec offline at T=0, host ms per step by part")
    cell = out[1].split("c=2 ")[1].split("/")
    assert len(cell) == len(HOST_PARTS)
    assert cell[HOST_PARTS.index("plan")] == f"{spec['plan']:.3f}"
    assert out[0].split("c=2 ")[1].split("/")[HOST_PARTS.index("plan")] == "-"
    # every plan of the adaptive arm counted on one path, its host time with it
    policy = rows["adaptive3"]["rounds_policy"][0]
    paths, path_ms = policy["plan_paths"], policy["plan_path_ms"]
    assert sum(paths.values()) == sum(policy["plans"].values()) > 0
    assert sum(path_ms.values()) == pytest.approx(policy["overhead_ms"]["plan"])
    (line,) = [x for x in out if x.startswith("adaptive3 offline at T=0, plans by path")]
    top = max(paths, key=paths.get)
    assert f"c=2 {top} {paths[top]}x{path_ms[top] * 1e3 / paths[top]:.0f}" in line
    assert not any(x.startswith("nospec offline at T=0, plans by path") for x in out)
