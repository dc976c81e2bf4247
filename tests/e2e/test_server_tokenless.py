"""A checkpoint without a tokenizer (e.g. benchmark shapes with random weights) is served on
token ids: streamed completion chunks carry the new `token_ids` step by step, so TTFT and TPOT
can be measured, and they are exactly the tokens the offline engine generates."""

from __future__ import annotations

import json
import os
import shutil

import httpx

from dspark import LLM, SamplingParams
from tests.e2e.test_server import MAX_MODEL_LEN, MODEL, run_server


def _tokenless_copy(src: str, dst: str) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith((".json", ".safetensors")) and "token" not in name:
            shutil.copy(os.path.join(src, name), dst)
    return dst


def test_stream_carries_token_ids_without_a_tokenizer(tiny_qwen, tmp_path):
    path = _tokenless_copy(tiny_qwen, str(tmp_path / "tokenless"))
    prompt = [5, 17, 42, 7, 99, 3]
    want = LLM(path, device="cpu", max_model_len=MAX_MODEL_LEN, seed=0).generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    with run_server(path, api_key=None) as srv:
        assert srv.engine.tokenizer is None
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        chunks = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    with_ids = [c for c in chunks if c["choices"] and c["choices"][0].get("token_ids")]
    assert len(with_ids) >= 2  # streamed step by step, not all at the end
    got = [t for c in with_ids for t in c["choices"][0]["token_ids"]]
    assert got == list(want) and len(got) == 12
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
