"""The server with its engine in a process of its own (`dspark serve`'s default): the same
tokens as the offline engine, streams, disconnects and bad input through the process pipe,
a load failure reported plainly, and an engine process that dies or is orphaned."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import pytest

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.engine.async_engine import AsyncLLMEngine
from dspark.engine.engine_process import ProcessCore
from tests.e2e.test_server import (
    MAX_MODEL_LEN,
    MODEL,
    _greedy,
    run_server,
    sse_data,
    stream_or_drop,
)


def _gauges(server) -> tuple[float, float, float]:
    m = server.metrics()
    return (m[("dspark_num_requests_running", ())], m[("dspark_num_requests_waiting", ())],
            m[("dspark_kv_cache_usage_ratio", ())])  # fmt: skip


def _wait_drained(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _gauges(server) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gauges(server) == (0, 0, 0)


@pytest.fixture(scope="module")
def server(tiny_qwen):
    with run_server(tiny_qwen, engine_process=True) as handle:
        assert handle.engine.engine is None  # (the LLMEngine lives in the child)
        yield handle


def test_greedy_tokens_match_the_offline_engine(server, tiny_qwen):
    prompts = ["def add(a, b):", "for i in range(10):"]
    llm = LLM(tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=160, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    got = [_greedy(server, p, max_tokens=16) for p in prompts]
    assert [g[0] for g in got] == want
    assert all(g[1] == 16 and g[2] == "length" for g in got)


def test_streams_disconnects_and_bad_input(server):
    """32 concurrent streams, 8 of which disconnect; a bad request in the middle is a 400
    naming its field. The others get every token; afterwards nothing is held."""

    async def main():
        async with server.async_client() as client:
            tasks = [asyncio.create_task(stream_or_drop(client, i, 8, 120)) for i in range(32)]
            await asyncio.sleep(0.05)
            bad = await asyncio.to_thread(
                server.post, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                 "max_tokens": 10 * MAX_MODEL_LEN})  # fmt: skip
            return bad, await asyncio.gather(*tasks)

    bad, results = asyncio.run(main())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    assert sum(r is None for r in results) == 8
    for chunks in results:
        if chunks is not None:
            assert chunks[-1].usage.completion_tokens == 8
    _wait_drained(server)
    m = server.metrics()
    assert m[("dspark_engine_alive", ())] == 1
    assert _greedy(server, "def add(a, b):", max_tokens=4)[1] == 4


def test_a_model_that_cannot_load_is_a_plain_error(tiny_qwen, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(os.path.join(tiny_qwen, "config.json"), broken / "config.json")  # no weights
    with pytest.raises(RuntimeError, match="no .safetensors weights found"):
        AsyncLLMEngine.from_config(EngineConfig(model=str(broken), device="cpu"),
                                   engine_process=True)  # fmt: skip


def test_an_engine_process_that_dies_fails_its_streams_and_health(tiny_qwen):
    with run_server(tiny_qwen, engine_process=True) as srv:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True,
                "stream": True}  # fmt: skip
        events = sse_data(srv.url, body, srv.headers,
                          lambda: os.kill(srv.engine.core.proc.pid, signal.SIGKILL))
        assert "exited unexpectedly" in events[-1] or "exited unexpectedly" in events[-2]
        health = httpx.get(srv.url + "/health", timeout=10)
        assert health.status_code == 500 and "exited unexpectedly" in health.text
        r = srv.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "dead" in r.json()["error"]["message"]
        assert srv.metrics()[("dspark_engine_alive", ())] == 0


def test_an_orphaned_engine_process_exits(tiny_qwen):
    """The server's process gone (its command pipe closed): the child aborts its requests
    and exits instead of serving nobody forever."""
    core = ProcessCore(EngineConfig(model=tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN))
    events = []
    core.start(events.extend)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    core.submit(("add", "r0", "hello", params, None, None))
    deadline = time.monotonic() + 20
    while not any(e[0] == "outputs" for e in events) and time.monotonic() < deadline:
        time.sleep(0.02)
    core._cmd.close()
    core.proc.join(20)
    assert core.proc.exitcode == 0
    # (an engine process's outputs are its requests' DeltaStreams, built when read)
    finals = {o.request_id: o.build() for e in events if e[0] == "outputs" for o in e[1]
              if o.finished}  # fmt: skip
    assert [o.outputs[0].finish_reason for o in finals.values()] == ["abort"]


def test_engine_cpus_pin_the_engine_process(tiny_qwen, monkeypatch):
    """DSPARK_ENGINE_CPUS pins the engine process (not the server's) to the CPUs named."""
    cpu = max(os.sched_getaffinity(0))
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", str(cpu))
    core = ProcessCore(EngineConfig(model=tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN))
    try:
        assert os.sched_getaffinity(core.proc.pid) == {cpu}
        assert os.sched_getaffinity(0) != {cpu} or os.cpu_count() == 1  # the server's: as was
    finally:
        core._cmd.close()
        core.proc.join(20)


def test_engine_cpus_pin_an_engine_thread_alone(tiny_qwen, monkeypatch):
    """With the engine in a thread of the server (--no-engine-process) only that thread is
    pinned; the server's own threads keep their CPUs, and it still serves."""
    cpu = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", str(cpu))
    with run_server(tiny_qwen, engine_process=False) as srv:
        assert os.sched_getaffinity(srv.engine.core._thread.native_id) == {cpu}
        assert os.sched_getaffinity(0) == before
        assert _greedy(srv, "def add(a, b):", max_tokens=4)[1] == 4


def test_bad_engine_cpus_stop_an_engine_thread_before_it_serves(tiny_qwen, monkeypatch):
    from dspark.engine.async_engine import ThreadCore

    core = ThreadCore(LLM(tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN).engine)
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", "1-")
    with pytest.raises(ValueError, match="DSPARK_ENGINE_CPUS: '1-'"):
        core.start([].extend)
    assert not core.is_alive()  # (never started)
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", "100000")
    with pytest.raises(ValueError, match=r"DSPARK_ENGINE_CPUS: CPUs \[100000\] are not av"):
        core.start([].extend)
    assert not core.is_alive()  # started, then stopped


def test_bad_engine_cpus_are_a_plain_error(tiny_qwen, monkeypatch):
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", "2-x")
    with pytest.raises(RuntimeError, match="DSPARK_ENGINE_CPUS: '2-x'"):
        ProcessCore(EngineConfig(model=tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN))
    monkeypatch.setenv("DSPARK_ENGINE_CPUS", "100000")
    with pytest.raises(RuntimeError, match=r"DSPARK_ENGINE_CPUS: CPUs \[100000\] are not av"):
        ProcessCore(EngineConfig(model=tiny_qwen, device="cpu", max_model_len=MAX_MODEL_LEN))
