"""KV-cache sizing: a block holds every target layer's K/V and every drafter layer's, and the
start-up log says what the drafter's share costs."""

from __future__ import annotations

import json
import logging
import os

import pytest

from dspark import LLM
from dspark.engine.kv_sizing import bytes_per_block, drafter_share
from dspark.testing.drafters import make_tiny_drafter


@pytest.fixture(scope="module")
def drafter(tiny_qwen, tmp_path_factory):
    return make_tiny_drafter(str(tmp_path_factory.mktemp("kv_d")), tiny_qwen, num_layers=2,
                             seed=3)  # fmt: skip


def _layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def test_the_drafter_layers_share_each_block(tiny_qwen, drafter, caplog):
    with caplog.at_level(logging.INFO, logger="dspark.engine.model_runner"):
        llm = LLM(tiny_qwen, device="cpu", max_num_seqs=4,
                  speculative_config={"model": drafter, "num_speculative_tokens": 3})  # fmt: skip
    runner = llm.engine.runner
    target, draft = _layers(tiny_qwen), _layers(drafter)
    # (the tiny drafter's layers have the target's K/V heads and head size)
    per_layer = bytes_per_block(runner) // (target + draft)
    assert bytes_per_block(runner) == per_layer * (target + draft)
    assert runner.spec.drafter.kv_cache_bytes_per_block(runner.block_size) == per_layer * draft
    share = draft / (target + draft)
    line = next(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
    assert f"the drafter's context K/V takes {share:.1%} of each block" in line
    # sized from memory (cpu_kv_cache_gb): the same bytes in target-only blocks
    without = int(runner.num_blocks / (1 - share))
    assert f"{without} blocks without it" in line
    assert abs(without * per_layer * target - runner.num_blocks * per_layer * (target + draft)) \
        <= per_layer * (target + draft)  # (one block of rounding)


def test_no_drafter_no_share(tiny_qwen):
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=4, num_kv_blocks=64)
    assert drafter_share(llm.engine.runner) == ""


def test_a_configured_cache_size_names_no_alternative(tiny_qwen, drafter):
    llm = LLM(tiny_qwen, device="cpu", max_num_seqs=4, num_kv_blocks=64,
              speculative_config={"model": drafter, "num_speculative_tokens": 3})  # fmt: skip
    line = drafter_share(llm.engine.runner)
    assert "of each block" in line and "without it" not in line
    assert llm.engine.runner.num_blocks == 64
