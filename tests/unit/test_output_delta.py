"""The engine process's outputs travel as deltas (dspark/engine/output_delta.py): decoded,
every streamed output equals the engine's own, field by field, through stop strings, length
limits, stop tokens and aborts; and what crosses the pipe stops growing with the output."""

import copy
import pickle

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.output_delta import DeltaDecoder, DeltaEncoder


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(tiny_qwen, device="cpu", max_model_len=256, seed=0)


def _stream(llm, requests, abort_after: dict | None = None):
    """Step the engine with streaming on; yields each output as the engine built it."""
    eng = llm.engine
    eng.stream_outputs = True
    try:
        for rid, prompt, params in requests:
            eng.add_request(rid, prompt, params)
        steps = 0
        while eng.has_unfinished_requests():
            yield from eng.step()
            steps += 1
            for rid, at in (abort_after or {}).items():
                if steps == at and rid in eng.requests:
                    eng.abort_request(rid)
                    yield rid  # (the abort, in order)
    finally:
        eng.stream_outputs = False


def test_decoded_outputs_equal_the_engines(llm):
    text = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True))[0].outputs[0].text
    stop = text[6:9]  # a stop string the greedy continuation is known to contain
    assert stop
    requests = [
        ("len", "def f(x):", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        ("stop", "def f(x):", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])),
        ("hot", "for i in", SamplingParams(temperature=1.0, seed=3, max_tokens=30)),
        ("ids", {"prompt_token_ids": [5, 9, 2, 7]},
         SamplingParams(temperature=0.7, seed=1, max_tokens=40, ignore_eos=True)),
        ("gone", "class A:", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    ]  # fmt: skip
    enc, dec = DeltaEncoder(), DeltaDecoder()
    seen, finished = 0, set()
    for item in _stream(llm, requests, abort_after={"gone": 5}):
        if isinstance(item, str):  # aborted: both sides forget it
            enc.forget(item)
            dec.forget(item)
            continue
        want = copy.deepcopy(item)  # (the engine's token list keeps growing)
        delta = pickle.loads(pickle.dumps(enc.encode(item)))  # as through the pipe
        got = copy.deepcopy(dec.decode(delta))
        assert got == want, item.request_id
        seen += 1
        if item.finished:
            finished.add((item.request_id, item.outputs[0].finish_reason))
    assert seen > 40
    assert {rid for rid, _ in finished} == {"len", "stop", "hot", "ids"}
    assert ("stop", "stop") in finished and ("len", "length") in finished
    assert enc._sent == {} and dec._state == {}  # nothing held for finished or aborted ones


def test_an_output_after_its_abort_is_dropped():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    from dspark.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def out(ids, text):
        return RequestOutput("r", "p", [1, 2], [CompletionOutput(0, text, ids)], False,
                             RequestMetrics(0.0, None, None, 2, 0, 0), new_token_ids=ids[-1:])

    assert dec.decode(enc.encode(out([7], "a"))).outputs[0].text == "a"
    late = enc.encode(out([7, 8], "ab"))
    dec.forget("r")  # the server aborted it while that output was in the pipe
    assert dec.decode(late) is None


def test_what_crosses_the_pipe_does_not_grow_with_the_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 103))}  # a 100-token prompt
    enc = DeltaEncoder()
    sizes = []
    for out in _stream(llm, [("long", prompt, params)]):
        sizes.append((len(pickle.dumps(out)), len(pickle.dumps(enc.encode(out)))))
    full_last, delta_last = sizes[-2]  # (the last is the final output)
    assert len(sizes) == 120
    assert full_last > 10 * delta_last, sizes[-2]
    assert max(d for _, d in sizes[1:-1]) < 2 * min(d for _, d in sizes[1:-1]) + 64
