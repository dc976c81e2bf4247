"""Server robustness: bad input, auth, body limits, backpressure, client disconnects, engine
failure and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from tests.e2e.test_server import API_KEY, MAX_MODEL_LEN, MODEL, run_server, sse_data

BIG = "x" * (70 * 1024)

# (case, method, path, body (dict, or bytes sent raw), headers override, status, param, text)
BAD_INPUTS = [
    ("malformed json", "POST", "/v1/completions", b'{"prompt": "hi", ', None, 400, None,
     "malformed JSON"),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", None, 400, None, "object"),
    ("wrong type max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "8"},
     None, 400, "max_tokens", "integer"),
    ("wrong type temperature", "POST", "/v1/completions",
     {"prompt": "hi", "temperature": "hot"}, None, 400, "temperature", "number"),
    ("wrong type stream", "POST", "/v1/completions", {"prompt": "hi", "stream": 1}, None,
     400, "stream", "boolean"),
    ("wrong type prompt", "POST", "/v1/completions", {"prompt": [1, "a"]}, None, 400,
     "prompt", "prompt"),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, None, 400, "prompt",
     "required"),
    ("negative max_tokens", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": -5},
     None, 400, "max_tokens", ">= 1"),
    ("max_tokens beyond context", "POST", "/v1/completions",
     {"prompt": "hi", "max_tokens": 100000}, None, 400, "max_tokens", "max_model_len"),
    ("prompt beyond context", "POST", "/v1/completions",
     {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1}, None, 400, "prompt",
     "max_model_len"),
    ("token id out of vocab", "POST", "/v1/completions", {"prompt": [10**7]}, None, 400,
     "prompt", "prompt_token_ids"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, None, 400, "prompt", "empty"),
    ("bad top_p", "POST", "/v1/completions", {"prompt": "hi", "top_p": 0.0}, None, 400,
     "top_p", "top_p"),
    ("bad stop", "POST", "/v1/completions", {"prompt": "hi", "stop": [1]}, None, 400, "stop",
     "stop"),
    ("n=2", "POST", "/v1/completions", {"prompt": "hi", "n": 2}, None, 400, "n", "n=1"),
    ("unknown field", "POST", "/v1/completions", {"prompt": "hi", "frobnicate": 1}, None,
     400, "frobnicate", "frobnicate"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, None,
     404, "model", "gpt-9"),
    ("chat: no messages", "POST", "/v1/chat/completions", {"messages": []}, None, 400,
     "messages", "messages"),
    ("chat: bad role", "POST", "/v1/chat/completions",
     {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "messages", "role"),
    ("chat: unknown field", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tools": []}, None, 400, "tools",
     "tools"),
    ("no auth", "POST", "/v1/completions", {"prompt": "hi"}, {}, 401, None, "API key"),
    ("wrong key", "POST", "/v1/completions", {"prompt": "hi"},
     {"Authorization": "Bearer nope"}, 401, None, "API key"),
    ("no auth on models", "GET", "/v1/models", None, {}, 401, None, "API key"),
    ("oversized body", "POST", "/v1/completions", {"prompt": BIG}, None, 413, None,
     "exceeds"),
    ("unknown route", "GET", "/v1/nothing", None, None, 404, None, "Not Found"),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_qwen):
    with run_server(tiny_qwen) as handle:
        yield handle


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, case):
    _, method, path, body, headers, status, param, text = case
    h = dict(server.headers) if headers is None else dict(headers)
    kw = {}
    if isinstance(body, bytes):
        kw["content"] = body
        h["Content-Type"] = "application/json"
    elif body is not None:
        kw["json"] = body
    r = httpx.request(method, server.url + path, headers=h, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert text.lower() in err["message"].lower(), err
    if status == 401:
        assert r.headers.get("www-authenticate") == "Bearer"


def test_oversized_chunked_body_without_content_length(server):
    def body():
        for _ in range(80):
            yield b" " * 1024
    r = httpx.post(server.url + "/v1/completions", content=body(), timeout=30,
                   headers={**server.headers, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 413


def test_server_still_answers_after_bad_input(server):
    for case in BAD_INPUTS[:6]:
        test_bad_input(server, case)
    resp = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                              extra_body={"ignore_eos": True})  # fmt: skip
    assert resp.usage.completion_tokens == 3
    server.wait_idle()
    m = server.metrics()
    assert m[("dspark_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))]


def test_non_streaming_disconnect_aborts(server):
    stats = server.engine.engine.stats
    before = stats["generation_tokens"]
    body = {"prompt": "hi", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", body, timeout=0.3)
    server.wait_idle()
    assert stats["generation_tokens"] - before < 240  # aborted, not run to the end


def _patch_step(engine, delay: float) -> dict:
    """Slow every step down by ctl["delay"] seconds; ctl["fail"] = True makes steps raise."""
    eng = engine.engine
    real = eng.step
    ctl = {"delay": delay, "fail": False}

    def step():
        time.sleep(ctl["delay"])
        if ctl["fail"]:
            raise RuntimeError("injected fault")
        return real()

    eng.step = step
    return ctl


def test_queue_full_then_engine_failure(tiny_qwen):
    """Two running requests (one streaming) and one waiting; a fourth gets 503. A long step
    does not block HTTP. Then a step raises: all three get a 500 (the started stream an
    error event) promptly, /health fails and new requests get 500s."""
    with run_server(tiny_qwen, max_waiting=1, max_num_seqs=2) as srv:
        ctl = _patch_step(srv.engine, 0.02)
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        results: dict = {}

        def call(name):
            results[name] = srv.post("/v1/completions", body, timeout=30)

        def stream():
            chunks = []
            try:
                for chunk in srv.client().completions.create(
                    model=MODEL, prompt="yo", max_tokens=200, stream=True,
                    extra_body={"ignore_eos": True},
                ):  # fmt: skip
                    chunks.append(chunk)
            except openai.APIError as e:
                results["stream"] = (chunks, e)

        sched = srv.engine.engine.scheduler

        def start(thread, until):
            thread.start()
            deadline = time.monotonic() + 10
            while not until() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert until()
            return thread

        threads = [
            start(threading.Thread(target=call, args=("running",)), lambda: len(sched.running)),
            start(threading.Thread(target=stream), lambda: len(sched.running) == 2),
            start(threading.Thread(target=call, args=("waiting",)), lambda: sched.waiting),
        ]
        r = srv.post("/v1/completions", body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "queue_full"
        # a long step does not block HTTP
        ctl["delay"] = 1.5
        time.sleep(0.1)
        for path in ("/health", "/metrics", "/v1/models"):
            t0 = time.monotonic()
            assert httpx.get(srv.url + path, headers=srv.headers).status_code == 200
            assert time.monotonic() - t0 < 0.5, path
        ctl["delay"], ctl["fail"] = 0.0, True
        t0 = time.monotonic()
        for t in threads:
            t.join(10)
        assert time.monotonic() - t0 < 4
        for name in ("running", "waiting"):
            assert results[name].status_code == 500, results[name].text
            assert "injected fault" in results[name].json()["error"]["message"]
        chunks, err = results["stream"]
        assert chunks and "injected fault" in str(err)
        assert httpx.get(srv.url + "/health").status_code == 500
        r = srv.post("/v1/completions", body)
        assert r.status_code == 500 and "dead" in r.json()["error"]["message"]
        assert srv.metrics()[("dspark_engine_alive", ())] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_aborts_cleanly(tiny_qwen):
    """SIGTERM to the server's whole process group (as systemd stops a unit: the engine
    process gets it too, and ignores it): the stream in flight ends cleanly and the server
    exits 0."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dspark.server.cli", "--model", tiny_qwen, "--device", "cpu",
           "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64",
           "--shutdown-timeout", "0.5", "--served-model-name", MODEL, "--log-level", "warning"]
    env = {**os.environ, "DSPARK_API_KEY": API_KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        body = {"prompt": "hi", "max_tokens": 240, "ignore_eos": True, "stream": True}
        events = sse_data(url, body, headers, lambda: os.killpg(proc.pid, signal.SIGTERM))
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] in ("abort", "length")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--speculative-config", "{bad"], "not valid JSON"),
        (["--speculative-config", "[1]"], "must be a JSON object"),
        (["--speculative-config", '{"model": "d", "frobs": 1}'], "unknown speculative_config"),
        (["--speculative-config", '{"num_speculative_tokens": 3}'], "speculative_config.model"),
        (["--max-model-len", "1"], "max_model_len"),
        (["--api-server-count", "2", "--no-engine-process"], "needs the engine process"),
    ],
)
def test_cli_rejects_bad_configuration(tiny_qwen, capsys, argv, message):
    from dspark.server.cli import main

    assert main(["--model", tiny_qwen, *argv]) == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err, err


def test_cli_without_model_or_bundled_default(capsys, monkeypatch):
    from dspark.server.cli import main

    monkeypatch.setitem(sys.modules, "dspark.demo", None)  # as if it did not exist
    assert main([]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert main(["--model", "/nonexistent/checkpoint"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_a_sigterm_landing_inside_an_engine_send_does_not_hang_the_server(tiny_qwen):
    """The SIGTERM handler runs in the main thread between any two bytecodes, perhaps while
    that thread holds the engine process's send lock (a request's submit, or the handler's
    own drain cut by a second SIGTERM: the process group's, then the one the multi-server
    parent passes on). A handler that sent the drain itself waited on that lock forever (a
    suite run hung 120 s so, with the server and its engine process left behind). Here the
    real ProcessCore is attached to pipes the test holds, and the handler runs twice with
    its send lock held by the same thread: both return, and the drain is sent once, after."""
    import multiprocessing as mp

    from dspark.config import EngineConfig
    from dspark.engine.async_engine import AsyncLLMEngine
    from dspark.engine.engine_process import ProcessCore
    from dspark.server.cli import GracefulServer

    cmd_r, cmd_w = mp.Pipe(duplex=False)
    evt_r, evt_w = mp.Pipe(duplex=False)
    evt_w.send([("ready", {"max_model_len": MAX_MODEL_LEN})])
    core = ProcessCore(EngineConfig(model=tiny_qwen, device="cpu"), pipes=(cmd_w, evt_r))
    server = GracefulServer(uvicorn.Config(app=None), AsyncLLMEngine(core=core), 5.0)

    def signals_inside_a_send():
        with core._send_lock:  # (as ProcessCore.submit holds it around its send)
            server.handle_exit(signal.SIGTERM, None)
            server.handle_exit(signal.SIGTERM, None)

    handler = threading.Thread(target=signals_inside_a_send, daemon=True)
    handler.start()
    handler.join(10)
    assert not handler.is_alive(), "the SIGTERM handler waited on the engine's send lock"
    assert server.should_exit
    assert cmd_r.poll(10) and cmd_r.recv() == ("drain", 5.0)
    assert not cmd_r.poll(0.5)  # (once, however many signals)
