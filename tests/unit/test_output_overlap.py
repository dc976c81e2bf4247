"""CPU/GPU overlap without async scheduling (speculative engines schedule each step after
the previous one finished): a step's outputs (text, output objects, the driver's delivery)
are built while the next step's device work runs, i.e. between that step's launch and its
wait, and nothing is lost or reordered by it. (tests/unit/test_async_scheduling.py: the
engines that also schedule ahead.)"""

import pytest

from dspark import LLM, SamplingParams
from tests.unit.launch_trace import trace_steps


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(tiny_qwen, device="cpu", async_scheduling=False)


def test_outputs_are_built_between_the_next_launch_and_its_wait(llm):
    eng = llm.engine
    log = []
    launch = trace_steps(eng, log)
    eng.stream_outputs = True
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        for i in range(3):
            eng.add_request(f"o{i}", {"prompt_token_ids": [3 + i, 7, 11, 2, 9]}, params)
        calls = 0
        while eng.has_unfinished_requests():
            assert eng.step() == []  # everything went to on_outputs
            calls += 1
    finally:
        eng.runner.launch, eng.on_outputs = launch, None
        eng.stream_outputs = False
    steps = [e for e in log if e[0] == "launch"]
    assert calls == len(steps) == 5  # one prefill step + 4 decode steps; no extra call
    deliveries = [i for i, e in enumerate(log) if e[0] == "outputs"]
    assert len(deliveries) == 5
    for n, at in enumerate(deliveries[:-1]):
        # the outputs of step n come after step n+1's launch and before its wait
        assert log[at - 1] == ("launch", n + 1) and log[at + 1] == ("wait", n + 1), log
    # the last step's outputs come right after its own wait: nothing left to overlap with
    assert log[-2:] == [("wait", 4), ("outputs", [(f"o{i}", True) for i in range(3)])]
    assert all(len(e[1]) == 3 for e in log if e[0] == "outputs")


def test_streamed_outputs_add_up_to_the_final_output(llm):
    eng = llm.engine
    eng.stream_outputs = True
    try:
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)
        for i in range(4):
            eng.add_request(f"s{i}", {"prompt_token_ids": [5, 9 + i, 2]}, params)
        seen: dict[str, list[int]] = {}
        final = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                assert out.request_id not in final  # nothing after the last output
                seen.setdefault(out.request_id, []).extend(out.new_token_ids)
                assert out.outputs[0].token_ids == seen[out.request_id]
                if out.finished:
                    final[out.request_id] = out
    finally:
        eng.stream_outputs = False
    assert sorted(final) == [f"s{i}" for i in range(4)]
    assert all(len(seen[r]) == 9 for r in final)


def test_abort_drops_an_output_not_built_yet(llm):
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    eng.add_request("a0", {"prompt_token_ids": [4, 8, 15]}, params)
    eng.add_request("a1", {"prompt_token_ids": [16, 23, 42]},
                    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))  # fmt: skip
    out = eng.step()  # a0 finished in this step; a1 still runs, so a0's output waits
    assert out == [] and eng.requests["a0"].is_finished
    eng.abort_request("a0")
    assert "a0" not in eng.requests
    ids = []
    while eng.has_unfinished_requests():
        ids += [o.request_id for o in eng.step()]
    assert ids == ["a1"]
