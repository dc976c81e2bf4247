"""scripts/step_log_report.py on hand-made step logs: the last level is found, decode steps
line up by batch size, and the budget the budget-bound steps left unused is counted."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import step_log_report as slr  # noqa: E402


def _write(path, steps):
    path.write_text("".join(f"{k} {r} {t} {p} {b:.3f} {i:.3f}\n" for k, r, t, p, b, i in steps))
    return str(path)


def test_report_lines_up_steps_by_shape(tmp_path, capsys):
    warm = [("mixed", 2, 40, 38, 2.0, -1.0), ("plain", 12, 12, 0, 1.0, 0.0)]  # (12 > 10)
    # the level: a ramp to 64 requests through budget-bound prefill steps, then decoding
    level_a = [("mixed", 10, 100, 90, 9.0, 0.0), ("mixed_verify", 64, 80, 60, 8.0, 0.0),
               ("plain", 64, 64, 0, 3.0, 0.0), ("verify", 20, 60, 0, 2.5, 0.0)]  # fmt: skip
    level_b = [("mixed", 10, 100, 90, 9.0, 0.0), ("mixed", 64, 100, 36, 10.0, 0.0),
               ("plain", 64, 64, 0, 2.5, 0.0), ("plain", 20, 20, 0, 1.5, 0.0)]  # fmt: skip
    a = _write(tmp_path / "serve_adaptive7.log.steps", warm + level_a)
    b = _write(tmp_path / "serve_nospec.log.steps", warm + level_b)
    assert slr.last_level(slr.read_steps(a)) == [tuple(s) for s in level_a]
    assert slr.main([b, a, "--budget", "100", "--last-level"]) == 0
    out = capsys.readouterr().out
    assert "nospec: 4 steps, 23 ms" in out and "adaptive7: 4 steps, 22 ms" in out
    # prefill >= half the budget: nospec's first step (no tokens unused), adaptive's two
    # (20 unused in the second, priced at 17 ms / 180 tokens)
    assert "budget-bound steps with prefill: 1, 0 tokens" in out
    assert "budget-bound steps with prefill: 2, 20 tokens of the budget unused (~2 ms" in out
    assert "at the full budget (100 tokens): 2 steps, 9.5 ms each" in out  # nospec's two
    assert "plain     64-95     2.50 (  1) |   3.00 (  1)" in out
    assert "verify     0-31              - |   2.50 (  1)" in out


def test_steps_with_prefill_line_up_by_batch_and_tokens(tmp_path, capsys):
    """Steps with prefill chunks whose rows verify nothing are compared where both arms have
    them, by batch bucket and forward-token bin: a cost every such step pays whatever its
    tokens reads as one difference; verifying steps and cells one arm lacks are left out."""
    nospec = [("mixed", 250, 600, 350, 26.0, 0.0), ("mixed", 250, 610, 360, 28.0, 0.0),
              ("mixed", 250, 1100, 850, 40.0, 0.0), ("mixed", 100, 300, 200, 9.0, 0.0)]
    adaptive = [("mixed", 251, 620, 370, 29.0, 0.0), ("mixed", 252, 1050, 800, 43.0, 0.0),
                ("mixed", 252, 1060, 810, 41.0, 0.0),
                ("mixed_verify", 250, 700, 300, 80.0, 0.0)]  # (verifies: not lined up)
    a = _write(tmp_path / "serve_nospec.log.steps", nospec)
    b = _write(tmp_path / "serve_adaptive7.log.steps", adaptive)
    assert slr.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "224-255  req   512-767   tokens    27.00 (  2) |   29.00 (  1)" in out
    assert "224-255  req  1024-1279  tokens    40.00 (  1) |   42.00 (  2)" in out
    assert "96-127" not in out  # (only nospec has steps at 100 requests)
    # (29 - 27) x 1 + (42 - 40) x 1 over weights 1 + 1
    assert "adaptive7 against nospec: +2.00 ms a step (weighted mean over 2 cells)" in out


def test_the_plans_parts_are_counted_by_kind_of_step(tmp_path, capsys):
    """A log with the plan's part (seventh field) reports decision / search / other by kind
    of step; an older log without it reads as before and reports none."""
    lines = ["verify 16 128 0 1.000 0.100 other", "verify 16 128 0 1.000 0.100 decision",
             "mixed_verify 16 300 172 1.500 0.100 search", "mixed_verify 16 300 172 1.5 0.1 search",
             "plain 16 16 0 0.500 0.100 -"]  # fmt: skip
    new = tmp_path / "serve_adaptive7.log.steps"
    new.write_text("\n".join(lines) + "\n")
    old = _write(tmp_path / "serve_nospec.log.steps", [("plain", 16, 16, 0, 0.5, 0.1)])
    assert slr.plan_parts(str(new)) == {"verify": {"other": 1, "decision": 1},
                                        "mixed_verify": {"search": 2}, "plain": {"-": 1}}
    assert slr.plan_parts(old) == {} and len(slr.read_steps(str(new))) == 5
    assert slr.main([old, str(new), "--budget", "8192"]) == 0
    out = capsys.readouterr().out
    assert ("adaptive7 plans by kind of step: mixed_verify search 2; plain - 1; verify "
            "decision 1, other 1") in out
    assert "nospec plans by kind" not in out
    assert slr.plan_us(str(new)) == {}  # (no eighth field: no µs)


def test_the_plans_host_us_are_averaged_by_kind_and_part(tmp_path, capsys):
    """A log with the plan's host µs (eighth field; "-": no plan) reports their mean by kind
    of step and part."""
    lines = ["verify 16 128 0 1.000 0.100 other 10", "verify 16 128 0 1.000 0.100 other 20",
             "mixed_verify 16 300 172 1.5 0.1 search:rate 250", "plain 16 16 0 0.5 0.1 - -"]
    log = tmp_path / "serve_adaptive7.log.steps"
    log.write_text("\n".join(lines) + "\n")
    assert slr.plan_us(str(log)) == {"verify": {"other": 15.0},
                                     "mixed_verify": {"search:rate": 250.0}}
    assert slr.main([str(log)]) == 0
    assert ("adaptive7 plan µs by kind of step (mean): mixed_verify search:rate 250; verify "
            "other 15") in capsys.readouterr().out


def test_an_earlier_level_and_the_fit_of_steps_with_prefill(tmp_path, capsys):
    """--level 2 takes the level before the last (the last level's ramp cut off first);
    --fit-prefill fits the busy time of its steps with prefill chunks (at least --min-rows
    rows) to an intercept, a price per prefill token and one per other token."""

    def busy(p: int, d: int) -> float:  # 5 ms + 20 us a prefill token + 30 us another
        return 5.0 + 0.02 * p + 0.03 * d

    shapes = [(300, 40), (200, 60), (100, 50), (350, 80), (50, 45)]
    level1 = [("mixed", 3, 40, 37, 99.0, 0.0)]  # (too few rows for the fit)
    level1 += [("mixed", 40 + i, p + d, p, busy(p, d), 0.0) for i, (p, d) in enumerate(shapes)]
    level1 += [("plain", 48, 48, 0, 2.0, 0.0)]
    level2 = [("mixed", 10, 100, 90, 9.0, 0.0), ("plain", 80, 80, 0, 3.0, 0.0)]
    path = _write(tmp_path / "serve_adaptive7.log.steps", level1 + level2)
    steps = slr.read_steps(path)
    assert slr.level(steps, 1) == slr.last_level(steps) == [tuple(s) for s in level2]
    assert slr.level(steps, 2) == [tuple(s) for s in level1]
    assert slr.main([path, "--level", "2", "--fit-prefill", "--min-rows", "8"]) == 0
    out = capsys.readouterr().out
    assert "adaptive7: 7 steps" in out
    assert ("adaptive7: 5 steps, intercept 5.00 ms, 20.00 us a prefill token, 30.00 us a "
            "decode or verify token") in out
