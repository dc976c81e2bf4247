"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 (random free
port, in a background thread of this process) in front of a real engine on a tiny random
checkpoint, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from dspark.config import EngineConfig
from dspark.engine.async_engine import AsyncLLMEngine
from dspark.server.api import build_app

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256


class ServerHandle:
    def __init__(self, engine: AsyncLLMEngine, app, port: int, api_key: str | None):
        self.engine, self.app, self.port, self.api_key = engine, app, port, api_key
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=60, **kw)  # fmt: skip

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                  max_retries=0, timeout=60, **kw)  # fmt: skip

    def post(self, path: str, json=None, headers=None, **kw) -> httpx.Response:
        h = dict(self.headers) if headers is None else headers
        kw.setdefault("timeout", 60)
        return httpx.post(self.url + path, json=json, headers=h, **kw)

    def metrics(self) -> dict[tuple, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine holds no request and every KV block is free again."""
        eng = self.engine.engine
        bm = eng.block_manager
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not eng.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks - 1:
                break
            time.sleep(0.05)
        assert not eng.has_unfinished_requests(), eng.scheduler.running
        assert bm.num_free_blocks == bm.num_blocks - 1
        bm.check_integrity()


@contextlib.contextmanager
def run_server(model_path: str, api_key: str | None = API_KEY, max_waiting: int = 1024,
               max_body_bytes: int = 64 * 1024, engine_process: bool = False,
               **engine_kw):  # fmt: skip
    kw = dict(model=model_path, device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=160,
              max_num_seqs=64, seed=0)  # fmt: skip
    kw.update(engine_kw)
    engine = AsyncLLMEngine.from_config(EngineConfig(**kw), engine_process=engine_process)
    app = build_app(engine, MODEL, api_key, max_body_bytes, max_waiting)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield ServerHandle(engine, app, sock.getsockname()[1], api_key)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        assert not thread.is_alive(), "server did not shut down"
        engine.close()


async def stream_or_drop(client, i: int, max_tokens: int, drop_max_tokens: int):
    """Stream request i (sampled, seed i); every fourth goes away after two chunks (None),
    the others return every chunk."""
    drop = i % 4 == 0
    stream = await client.completions.create(
        model=MODEL, prompt=f"def f{i}(x):", max_tokens=drop_max_tokens if drop else max_tokens,
        temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if drop and len(chunks) >= 2:
            await stream.close()  # the client goes away mid-stream
            return None
    return chunks


def sse_data(url: str, body: dict, headers: dict, after_two=None) -> list[str]:
    """The data lines of a streamed completion; `after_two()` runs once two have come."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=30) as resp:  # fmt: skip
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2 and after_two is not None:
                    after_two()
    return events


@pytest.fixture(scope="module")
def server(tiny_qwen):
    with run_server(tiny_qwen) as handle:
        yield handle


def test_completion_and_usage(server):
    resp = server.client().completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8 and resp.usage.prompt_tokens > 0
    assert "spec_decode" in resp.model_extra  # null without speculation
    assert resp.model == MODEL and resp.id.startswith("cmpl-")
    # a token-id prompt gives the same greedy text as its string
    ids = server.engine.tokenizer.encode("def add(a, b):", add_special_tokens=False)
    again = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert again.choices[0].text == choice.text
    assert again.usage.prompt_tokens == len(ids)
    # explicit nulls are "not given"; a one-element prompt list is one prompt
    body = {"model": MODEL, "prompt": ["def add(a, b):"], "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "stream": None, "n": None, "stop": None, "seed": None,
            "stream_options": None, "top_k": None, "user": "u1"}  # fmt: skip
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == choice.text


def test_chat_completion(server):
    resp = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "be brief"},
                               {"role": "user", "content": "hello"}],
        max_completion_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 6
    tok = server.engine.tokenizer
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert resp.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert "spec_decode" in resp.model_extra


def test_chat_without_template_is_a_clear_400(server, monkeypatch):
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", None)
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert "chat template" in r.json()["error"]["message"]


def _greedy(server, prompt: str, **kw) -> tuple[str, int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
            "ignore_eos": True, **kw}  # fmt: skip
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"], data["choices"][0][
        "finish_reason"
    ]


def _stop_string(text: str) -> str:
    for i in range(4, len(text) - 2):
        s = text[i : i + 2]
        if s.isascii() and s.isprintable() and text.find(s) >= 2:
            return s
    pytest.skip("no usable stop string in the generated text")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streaming_with_usage_matches_non_streaming(server, endpoint):
    full, _, _ = _greedy(server, "for i in range(10):")
    stop = _stop_string(full)
    expected = full[: full.find(stop)]
    text, n_tokens, finish = _greedy(server, "for i in range(10):", stop=[stop])
    assert (text, finish) == (expected, "stop")
    client = server.client()
    chunks = []
    if endpoint == "completions":
        stream = client.completions.create(
            model=MODEL, prompt="for i in range(10):", max_tokens=24, temperature=0.0,
            stop=[stop], stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for c in stream:
            chunks.append(c)
        pieces = [c.choices[0].text for c in chunks if c.choices]
    else:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert "spec_decode" in usage_chunk.model_extra
    assert all(c.usage is None for c in chunks[:-1])
    if endpoint == "completions":
        assert "".join(pieces) == expected
        assert finals[0].choices[0].finish_reason == "stop"
        assert usage_chunk.usage.completion_tokens == n_tokens
    else:
        assert usage_chunk.usage.completion_tokens == 12
        assert finals[0].choices[0].finish_reason == "length"
        ref = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
            temperature=0.0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert "".join(pieces) == ref.choices[0].message.content


def test_seeds_are_reproducible(server):
    def sample(seed: int) -> str:
        r = server.client().completions.create(
            model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=1.0,
            seed=seed, extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.0},
        )  # fmt: skip
        return r.choices[0].text

    a, b, c = sample(1234), sample(1234), sample(4321)
    assert a == b
    assert a != c


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    before = server.metrics()
    _greedy(server, "import os", max_tokens=5)
    server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    server.wait_idle()
    after = server.metrics()

    def grew(name, labels=(), by=1.0):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0) >= by

    assert grew("dspark_generation_tokens_total", by=8)
    assert grew("dspark_prompt_tokens_total", by=2)
    assert grew("dspark_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert grew("dspark_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))
    assert grew("dspark_request_finished_total", (("finish_reason", "length"),), by=2)
    for hist in ("time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert grew(f"dspark_{hist}_seconds_count", by=2), hist
    for name in ("dspark_spec_drafted_tokens_total", "dspark_spec_verified_tokens_total",
                 "dspark_spec_accepted_tokens_total", "dspark_spec_num_steps_total",
                 "dspark_kv_cache_usage_ratio", "dspark_num_requests_running",
                 "dspark_num_requests_waiting", "dspark_prefix_cache_hit_rate",
                 "dspark_spec_verify_budget"):  # fmt: skip
        assert (name, ()) in after, name
    assert after[("dspark_num_requests_running", ())] == 0
    assert after[("dspark_engine_alive", ())] == 1


def test_concurrent_streams_and_disconnects_free_every_block(server):
    """64 concurrent streams; 16 of them disconnect mid-stream. The rest get exactly
    max_tokens tokens and, once they finish, every KV block is free."""
    n_total, n_drop, max_tokens = 64, 16, 8

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(stream_or_drop(client, i, max_tokens, 200)
                                          for i in range(n_total)))  # fmt: skip

    results = asyncio.run(main())
    assert sum(r is None for r in results) == n_drop
    for chunks in results:
        if chunks is None:
            continue
        assert chunks[-1].usage.completion_tokens == max_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    server.wait_idle()
    assert server.engine.engine.requests == {}
    # still serving
    assert _greedy(server, "def add(a, b):", max_tokens=4)[1] == 4


@pytest.mark.parametrize("chat", [False, True])
def test_fast_delta_chunks_match_the_models(chat):
    from dspark.server import protocol as P
    from dspark.server.api import delta_renderer

    render = delta_renderer(chat, "id-1", 123, 'm"odel')
    for text in ["", "plain", 'q"uote\\', "\n\t\x00\x1f", "h\u00e9llo \ufffd \U0001f600"]:
        if chat:
            choice = P.ChatChunkChoice(delta=P.DeltaMessage(content=text))
            ref = P.ChatCompletionChunk(id="id-1", created=123, model='m"odel', choices=[choice])
        else:
            choice = P.CompletionChoice(text=text)
            ref = P.CompletionChunk(id="id-1", created=123, model='m"odel', choices=[choice])
        line = render(text)
        assert line.startswith("data: ") and line.endswith("\n\n")
        assert json.loads(line[6:]) == json.loads(ref.model_dump_json())


def test_spec_metrics_from_snapshot_deltas():
    """The dspark_spec_* series as the speculative engine will feed them (synthetic)."""
    from dspark.server.metrics import ServerMetrics

    m = ServerMetrics("x")
    snap = {"spec_enabled": True, "spec_num_steps": 10, "spec_drafted": 70,
            "spec_verified": 50, "spec_accepted": 30, "spec_accepted_per_pos": [8, 6],
            "spec_verified_per_pos": [10, 8], "generation_tokens": 40, "prefix_queries": 100,
            "prefix_hits": 25, "spec_runtime": {"budget": 48, "predicted_gain": 0.3,
                                                "cost_table_status": "loaded",
                                                "step_counts": {"plain": 4, "verify": 6},
                                                "drafting": False,
                                                "acceptance_ratio": {"greedy": 1.25},
                                                "learned_fixed_ms": {"greedy": {
                                                    "spec": {"4-7": 1.5, "8-15": 2.0},
                                                    "plain": {"4-7": 0.25}}}}}
    m.update_from_snapshot(snap, alive=True)
    later = {**snap["spec_runtime"], "step_counts": {"plain": 9, "verify": 6, "mixed": 2}}
    m.update_from_snapshot({**snap, "spec_drafted": 77, "spec_num_steps": 11,
                            "spec_runtime": later}, alive=True)  # fmt: skip
    text = m.render()[0].decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert got[("dspark_spec_drafted_tokens_total", ())] == 77
    assert got[("dspark_spec_num_steps_total", ())] == 11
    assert got[("dspark_spec_accepted_tokens_total", ())] == 30
    assert got[("dspark_spec_verified_tokens_total", ())] == 50
    assert got[("dspark_spec_acceptance_per_position", (("position", "1"),))] == 6 / 11
    assert got[("dspark_spec_conditional_acceptance_per_position", (("position", "0"),))] == 0.8
    assert got[("dspark_spec_verify_budget", ())] == 48
    assert got[("dspark_spec_steps_total", (("kind", "plain"),))] == 9
    assert got[("dspark_spec_steps_total", (("kind", "verify"),))] == 6
    assert got[("dspark_spec_steps_total", (("kind", "mixed"),))] == 2
    assert got[("dspark_spec_cost_table_info", (("status", "loaded"),))] == 1
    assert got[("dspark_prefix_cache_hit_rate", ())] == 0.25
    # what the drafting decision stood on: learned fixed terms, acceptance ratio, its state
    learned = "dspark_spec_learned_fixed_ms"
    assert got[(learned, (("batch", "8-15"), ("kind", "spec"), ("mode", "greedy")))] == 2.0
    assert got[(learned, (("batch", "4-7"), ("kind", "plain"), ("mode", "greedy")))] == 0.25
    assert got[("dspark_spec_acceptance_ratio", (("mode", "greedy"),))] == 1.25
    assert got[("dspark_spec_drafting", ())] == 0.0
