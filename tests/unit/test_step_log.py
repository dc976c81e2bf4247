"""scripts/step_log.py: an adaptive engine's observed steps and drafting verdicts, logged
while the engine runs as it would (demo pair, CPU)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections import defaultdict

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "dspark", "assets", "demo")


@pytest.mark.slow
def test_step_log_records_what_the_cost_model_learned(tmp_path, monkeypatch):
    """Every observed step is logged with the period and request count the online cost model
    took (their sums per kind and batch-size bucket equal the model's own totals), each
    residual as the period less the table's price; every verdict with the decision's rates;
    the file gets the records, labelled by level, once flushed."""
    monkeypatch.syspath_prepend(SCRIPTS)
    from step_log import StepLog

    from dspark import LLM, SamplingParams
    from dspark.spec.online_cost import bucket_label, size_bucket

    llm = LLM(f"{DEMO}/target", device="cpu", max_num_seqs=4, speculative_config={
        "model": f"{DEMO}/drafter", "num_speculative_tokens": 3,
        "enable_adaptive_verification": True})  # fmt: skip
    spec = llm.engine.runner.spec
    path = tmp_path / "log.jsonl"
    log = StepLog(llm.engine, "adaptive3", str(path))
    log.level = "t0-c2"
    llm.generate(["def add(a, b):", "class Stack:"],
                 SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    steps = [r for r in log.records if r["what"] == "step"]
    verdicts = [r for r in log.records if r["what"] == "verdict"]
    unobserved = [r for r in log.records if r["what"] == "unobserved"]
    assert steps and verdicts and unobserved
    # the prompts' prefill step, with both prompts' tokens, is among the steps not learned from
    assert any(r["reqs"] == 2 and r["tokens"] >= 10 for r in unobserved)
    assert all(r["ms"] > 0 for r in unobserved)
    totals = defaultdict(lambda: [0, 0.0])
    for r in steps:
        totals[(r["kind"], bucket_label(size_bucket(r["reqs"])))][0] += 1
        totals[(r["kind"], bucket_label(size_bucket(r["reqs"])))][1] += r["ms"]
    learned = spec.fixed_costs.observed_totals()
    assert {(k, b) for k, by in learned.items() for b in by} == set(totals)
    for (kind, b), (n, ms) in totals.items():
        assert learned[kind][b][0] == n
        assert learned[kind][b][1] == pytest.approx(ms, abs=1e-3 * n)
    for r in steps:  # (the residual: the period less the verify table's and the tag's price)
        assert r["ms"] - r["residual"] >= spec.cost.verify_lookup(r["tokens"]) - 1e-3
    for r in verdicts:
        assert r["pays"] in (True, False) and 1 <= r["reqs"] <= 2
        assert r["spec_rate"] > 0 and r["plain_rate"] > 0
        assert r["may_win"] in (True, False)  # (whether a plain probe may follow the verdict)
    assert not path.exists()  # (written between levels only)
    log.flush()
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(written) == len(steps) + len(verdicts) + len(unobserved) and log.records == []
    assert {r["level"] for r in written} == {"t0-c2"} and {r["arm"] for r in written} == {
        "adaptive3"}
    assert all(math.isfinite(r["ms"]) for r in written if r["what"] == "step")
    sys.modules.pop("step_log", None)
