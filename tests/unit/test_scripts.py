"""The GPU benchmark script runs end to end in its CPU smoke mode (so it cannot rot between
GPU sessions); its numbers are meaningless on a CPU and are not checked beyond sanity."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _smoke(script: str, out) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, f"scripts/{script}", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_gpu_bench_smoke(tmp_path):
    proc = _smoke("gpu_bench.py", tmp_path)
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    tput = res["dspark_tok_s"]
    assert set(tput) == {"1", "4"} and all(v > 0 for v in tput.values())
    assert set(res["hf_tok_s"]) == {"1", "4"}
    assert res["dspark_decode_step_ms"]["4"] > 0
    assert "decode batch 1 forward" in proc.stdout


def test_profile_example_smoke(tmp_path):
    _smoke("profile_example.py", tmp_path)
    table = json.loads((tmp_path / "cost_table_smoke.json").read_text())
    assert table["provenance"]["dtype"] == "bfloat16" and table["verify"]["ms"]


def test_profile_step_smoke(tmp_path):
    proc = _smoke("profile_step.py", tmp_path)
    report = (tmp_path / "profile_step.txt").read_text()
    assert report.count("### ") == 4 and "fixed T=1" in report  # 2 arms x 2 temperatures
    rows = [line.split() for line in proc.stdout.splitlines()
            if line.startswith(("nospec ", "fixed "))]
    assert len(rows) == 8 and all(float(r[4]) > 0 and float(r[5]) > 0 for r in rows)
    assert all(r[6] != "-" for r in rows if r[0] == "fixed")  # acceptance reported
