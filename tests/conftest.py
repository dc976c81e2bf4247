import os

import pytest
import torch

from dspark.testing.checkpoints import TinyShape, make_tiny_target

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# the processes the tests start (scripts, servers, engine processes) take one torch thread
# each: beside this one's two they only contended for CI's 2 cores (test_scripts.py, whose
# script runs go two at a time: 196 -> 124 s, 5.8 -> 3.3 min of CPU; fifty-first session)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CUDA runs: engines of many tiny shapes would each compile every attention variant at
# start-up; tests/kernels/test_attention_variants.py checks the warm-up itself
os.environ.setdefault("DSPARK_ATTENTION_WARMUP", "0")

# Shapes used by the parity tests: GQA ratios, tied/untied, odd head_dim, Llama-3 RoPE.
SHAPES = {
    "qwen3_gqa2": TinyShape(arch="qwen3"),
    "qwen3_mha_oddhead": TinyShape(
        arch="qwen3", hidden_size=48, num_attention_heads=3, num_key_value_heads=3, head_dim=24
    ),
    "qwen3_gqa4_tied": TinyShape(
        arch="qwen3", num_attention_heads=8, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=True,
    ),
    "llama3_rope_gqa2": TinyShape(
        arch="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied_mqa": TinyShape(
        arch="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, tie_word_embeddings=True, num_hidden_layers=3,
    ),
}  # fmt: skip


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str, **kwargs) -> str:
        key = name + repr(sorted(kwargs.items()))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(name))
            make_tiny_target(path, SHAPES[name], seed=len(cache), **kwargs)
            cache[key] = path
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_qwen(ckpt_dir):
    return ckpt_dir("qwen3_gqa2")
