"""Bad input gets a clear error naming the problem and never disturbs other requests."""

import json
import math
import os

import pytest

from dspark import LLM, SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1, 2]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(tiny_qwen, device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "prompt,match",
    [
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [1, 2, 10_000]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": list(range(100))}, "max_model_len"),
        (12, "prompt"),
    ],
)
def test_bad_prompts_raise_and_others_still_run(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, prompt], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    llm.engine.block_manager.check_integrity()


def test_max_tokens_beyond_context(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=60))


def test_bad_checkpoints(tmp_path, tiny_qwen):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path), device="cpu")
    bad = tmp_path / "arch"
    bad.mkdir()
    cfg = json.load(open(os.path.join(tiny_qwen, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        LLM(str(bad), device="cpu")
    nofile = tmp_path / "noweights"
    nofile.mkdir()
    (nofile / "config.json").write_text(json.dumps(dict(cfg, architectures=["Qwen3ForCausalLM"])))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(nofile), device="cpu")
    (nofile / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="cannot read weight file"):
        LLM(str(nofile), device="cpu")


def test_missing_tensor_is_named(tmp_path, tiny_qwen):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "missing"
    dst.mkdir()
    for f in os.listdir(tiny_qwen):
        if f != "model.safetensors":
            (dst / f).write_bytes(open(os.path.join(tiny_qwen, f), "rb").read())
    tensors = load_file(os.path.join(tiny_qwen, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj"):
        LLM(str(dst), device="cpu")
