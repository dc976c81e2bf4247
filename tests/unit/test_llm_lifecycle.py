"""LLM.shutdown() gives the engine's memory back (weights, KV cache, drafter, graphs), so
that a process can run several engines one after another, and a shut-down LLM says so."""

import gc
import weakref

import pytest

from dspark import LLM, SamplingParams
from dspark.testing.drafters import make_tiny_drafter


def test_shutdown_releases_memory_and_next_engine_runs(tiny_qwen, tmp_path):
    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    with LLM(tiny_qwen, device="cpu", max_model_len=128,
             speculative_config={"model": drafter, "num_speculative_tokens": 3}) as llm:
        first = llm.generate([prompt], params)[0].outputs[0].token_ids
        runner = llm.engine.runner
        alive = [weakref.ref(t) for t in (runner.k_cache, runner.v_cache)]
        alive += [weakref.ref(runner.model), weakref.ref(runner.spec.drafter)]
    gc.collect()
    assert all(ref() is None for ref in alive)  # nothing of the engine's memory is kept
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([prompt], params)
    llm.shutdown()  # idempotent
    with LLM(tiny_qwen, device="cpu", max_model_len=128) as again:
        assert again.generate([prompt], params)[0].outputs[0].token_ids == first


def test_start_up_objects_are_frozen_until_shutdown(tiny_qwen):
    """The engine freezes what exists after start-up, so the collector's full passes (a pause
    of ~150 ms per pass on a 2-core CPU with torch loaded) skip it while serving; shutdown
    unfreezes, so the engine's cycles can be collected and its memory returned."""
    gc.unfreeze()
    llm = LLM(tiny_qwen, device="cpu")
    assert gc.get_freeze_count() > 10_000
    ref = weakref.ref(llm.engine.runner.model)
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None  # the model is collectable once unfrozen
