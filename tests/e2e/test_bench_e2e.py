"""`dspark bench serve --sweep 1,4,16` against a real dspark server with speculation on: the
table, the JSON and the PNG are produced and their contents agree with the server's own
counters."""

from __future__ import annotations

import json
import struct

import pytest

from dspark.bench.cli import main as bench_main
from dspark.testing.drafters import make_tiny_drafter
from tests.e2e.test_server import run_server


@pytest.fixture(scope="module")
def spec_server(tiny_qwen, tmp_path_factory):
    drafter = make_tiny_drafter(str(tmp_path_factory.mktemp("bench_drafter")), tiny_qwen, seed=4)
    spec = {"model": drafter, "num_speculative_tokens": 3}
    with run_server(tiny_qwen, api_key=None, speculative_config=spec) as handle:
        yield handle


def test_sweep_against_the_real_server(spec_server, tmp_path, capsys):
    result = tmp_path / "sweep.json"
    before = spec_server.metrics()
    rc = bench_main([
        "serve", "--base-url", spec_server.url, "--sweep", "1,4,16", "--num-prompts", "16",
        "--random-input-len", "12", "--random-output-len", "10", "--ignore-eos",
        "--temperature", "0", "--seed", "3", "--save-result", str(result), "--disable-tqdm",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    doc = json.loads(result.read_text())
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 4, 16]
    drafted = 0
    for r in doc["results"]:
        assert (r["completed"], r["failed"]) == (16, 0)
        assert r["total_output_tokens"] == 16 * 10  # ignore_eos: exactly max_tokens each
        assert r["output_throughput"] > 0 and r["tpot_ms"]["p50"] > 0
        spec = r["spec_decode"]
        assert spec is not None and spec["source"] == "responses"
        # every token after the first comes from a verify round: accepted + steps >= 9 each
        assert spec["num_accepted_tokens"] + spec["num_steps"] >= 16 * 9
        assert spec["mean_acceptance_length"] >= 1.0
        assert spec["num_verified_tokens"] <= spec["num_drafted_tokens"]
        drafted += spec["num_drafted_tokens"]
        # who was busy over the level: the client's own process time and the server's CPU
        # counters (its process, and the one running the engine loop); all did some work
        cpu = r["host_cpu"]
        assert set(cpu) == {"client", "server", "engine"}
        assert all(0.0 < v < 64.0 for v in cpu.values()), cpu
    after = spec_server.metrics()
    key = ("dspark_spec_drafted_tokens_total", ())
    assert after[key] - before.get(key, 0.0) == drafted  # the server's counter agrees
    # the table lists one row per concurrency with the same throughput as the JSON
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"],
                                                                               ["16"])]
    assert [row[0] for row in rows[-3:]] == ["1", "4", "16"]
    assert out.count("host CPU (cores busy):") == 3
    png = result.with_suffix(".png")
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 400 and height > 200 and png.stat().st_size > 10_000
