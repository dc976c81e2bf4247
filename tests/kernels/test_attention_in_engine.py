"""An engine on the Triton attention kernels (the interpreter, on CPU) where a prompt arrives
while another request decodes: that step attends the decode / verify row in the short launch
and the prompt's chunk in the long one, and both split their KV range (the chip's SM count
patched to an H200's, as on a GPU with few rows over a long context). Greedy tokens must equal
the torch reference backend's, with and without speculation. (When only the long launch split,
with the launches in the other order, its combine overwrote the short row.)"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.attention.triton import launch_config  # noqa: E402
from dspark.attention.triton import paged_attention as pa  # noqa: E402
from dspark.attention.triton_backend import triton_interpreting  # noqa: E402
from dspark.testing.drafters import make_tiny_drafter  # noqa: E402

if not triton_interpreting():
    pytest.skip("runs the kernels on CPU through TRITON_INTERPRET", allow_module_level=True)

LONG_PROMPT = [3 + (7 * i) % 90 for i in range(48)]  # 3 split chunks (of 16, set below)
LATE_PROMPT = list(range(50, 70))  # 20 tokens: longer than a verify row, a prefill tile's


def _serve(target, backend: str, spec) -> dict[str, list[int]]:
    llm = LLM(target, device="cpu", attention_backend=backend, block_size=16,
              max_num_batched_tokens=512, speculative_config=spec)  # fmt: skip
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    if backend == "triton":  # key segments of 16, not 256: a short context splits (and the
        engine.runner.backend.split_len = 16  # interpreter runs it in seconds)
    engine.add_request("early", {"prompt_token_ids": LONG_PROMPT}, params)
    tokens, steps = {}, 0
    while engine.has_unfinished_requests():
        if steps == 2:  # "early" is decoding by now
            engine.add_request("late", {"prompt_token_ids": LATE_PROMPT}, params)
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return tokens


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prompt_beside_a_decoding_row_matches_the_torch_backend(
    tiny_qwen, tmp_path, monkeypatch, speculative
):
    spec = None
    if speculative:
        drafter = make_tiny_drafter(str(tmp_path / "drafter"), tiny_qwen, seed=3)
        spec = {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "fixed"}
    want = _serve(tiny_qwen, "torch", spec)
    monkeypatch.setattr(launch_config, "num_sms", lambda device: 132)
    launches = []
    real = pa._launch

    def spy(q, k_cache, v_cache, md, scale, out, launch, num_splits, *rest):
        launches.append((launch.pass_, num_splits))
        return real(q, k_cache, v_cache, md, scale, out, launch, num_splits, *rest)

    monkeypatch.setattr(pa, "_launch", spy)
    got = _serve(tiny_qwen, "triton", spec)
    # steps with a prompt's chunk: both launches split (the step's splits are one count)
    assert {1, 2} <= {p for p, s in launches if s > 1}, set(launches)
    assert got == want and set(got) == {"early", "late"}
