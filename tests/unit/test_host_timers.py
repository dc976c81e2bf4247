"""DSPARK_HOST_TIMERS=1: the serving loop's host time by part, from the engine's snapshot to
/metrics and a benchmark level's ms per engine step; absent when the variable is unset."""

from __future__ import annotations

import time

import pytest

from dspark import SamplingParams
from dspark.bench.spec_stats import counters_from_text, host_parts
from dspark.config import EngineConfig
from dspark.engine.engine_core import EngineCore
from dspark.engine.llm_engine import LLMEngine
from dspark.server.metrics import ServerMetrics
from dspark.spec.cost_model import CostModel
from dspark.testing.drafters import make_tiny_drafter

PARTS = {"inbox", "snapshot", "emit", "schedule", "launch", "wait_commit", "commit", "outputs",
         "plan", "observe", "conf_copy"}  # (graph_start only where whole-step graphs run: CUDA)


@pytest.fixture(scope="module")
def adaptive_config(tiny_qwen, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ht")
    drafter = make_tiny_drafter(str(tmp / "drafter"), tiny_qwen, seed=3)
    table = str(tmp / "table.json")
    CostModel.analytic(weight_read_ms=0.01, ms_per_token=0.05, fixed_overhead_ms=0.5,
                       draft_base_ms=0.1, draft_ms_per_req=0.01).to_json(table)  # fmt: skip
    spec = {"model": drafter, "num_speculative_tokens": 4, "adaptive_policy": "lagged",
            "cost_table_path": table}  # fmt: skip
    return EngineConfig(model=tiny_qwen, device="cpu", max_num_seqs=8,
                        speculative_config=spec)  # fmt: skip


def _serve(config: EngineConfig, num_requests: int = 6) -> list[dict]:
    """Run an EngineCore's loop until its requests are done; the snapshots it emitted."""
    events: list[tuple] = []
    core = EngineCore(LLMEngine(config), lambda batch: events.extend(batch))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(num_requests):
        core.submit(("add", f"r{i}", {"prompt_token_ids": list(range(5, 12 + i))}, params,
                     None, time.time()))  # fmt: skip
    core.submit(("stop",))
    core.run()
    assert not [e for e in events if e[0] in ("dead", "rejected")]
    return [e[1] for e in events if e[0] == "snapshot"]


def test_host_timers_export_the_loop_by_part(adaptive_config, monkeypatch):
    monkeypatch.setenv("DSPARK_HOST_TIMERS", "1")
    first, *_, last = _serve(adaptive_config)
    assert set(last["host_ms"]) == PARTS
    ms = last["host_ms"]
    assert all(v > 0 for v in ms.values()), ms
    # the parts nest: launch holds planning, the wait holds the commit; all of a step's parts
    # fit in the engine's step time
    assert ms["launch"] >= ms["plan"] and ms["wait_commit"] >= ms["commit"]
    top = ms["schedule"] + ms["launch"] + ms["wait_commit"] + ms["outputs"]
    assert top <= last["step_time_ms"] * 1.05 + 1.0
    # through /metrics to a level's ms per engine step (the counters grow by the snapshots')
    metrics = ServerMetrics("x")
    metrics.update_from_snapshot(first, alive=True)
    before = counters_from_text(metrics.render()[0].decode())
    metrics.update_from_snapshot(last, alive=True)
    after = counters_from_text(metrics.render()[0].decode())
    steps = last["steps"] - first["steps"]
    assert steps > 0
    view = host_parts(before, after)
    assert set(view) == PARTS
    for part in PARTS:
        grew = last["host_ms"][part] - first.get("host_ms", {}).get(part, 0.0)
        assert view[part] == pytest.approx(grew / steps)
    assert host_parts(after, after) is None  # no step in between


def test_without_the_variable_nothing_is_timed(adaptive_config, monkeypatch):
    monkeypatch.delenv("DSPARK_HOST_TIMERS", raising=False)
    snaps = _serve(adaptive_config, num_requests=2)
    assert all("host_ms" not in s for s in snaps)
    metrics = ServerMetrics("x")
    metrics.update_from_snapshot(snaps[0], alive=True)
    before = counters_from_text(metrics.render()[0].decode())
    metrics.update_from_snapshot(snaps[-1], alive=True)
    text = metrics.render()[0].decode()
    assert "dspark_engine_host_ms_total{" not in text
    after = counters_from_text(text)
    assert after["sched:steps"] > before.get("sched:steps", 0.0)  # steps ran, none timed
    assert host_parts(before, after) is None
