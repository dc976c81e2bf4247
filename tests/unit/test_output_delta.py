"""The engine process's outputs travel as deltas made straight from the requests
(dspark/engine/output_delta.py), their text made by the server's process unless the request
has stop strings: decoded, every streamed output equals the RequestOutput the engine makes in
a thread, field by field (text included), through stop strings, length limits, stop tokens
and aborts; and what crosses the pipe stops growing with the output."""

import copy
import pickle

import pytest

from dspark import LLM, SamplingParams
from dspark.engine.output_builder import make_output
from dspark.engine.output_delta import DeltaDecoder, DeltaEncoder


@pytest.fixture(scope="module")
def llm(tiny_qwen):
    return LLM(tiny_qwen, device="cpu", max_model_len=256, seed=0)


def _stream(llm, enc: DeltaEncoder, requests, abort_after: dict | None = None):
    """Step the engine with streaming on, each output made both ways; yields
    (RequestOutput, its delta) pairs as the engine made them, and the id of each abort."""
    eng = llm.engine

    def both(req, new_tokens, detok, stream, with_spec, detokenized=False):
        out = copy.deepcopy(make_output(req, new_tokens, detok, stream, with_spec, detokenized))
        # (the text is settled by then: the delta sees what the RequestOutput saw)
        return out, enc.make(req, new_tokens, detok, stream, with_spec, detokenized=True)

    eng.stream_outputs, eng.output_maker = True, both
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
                    yield rid
    finally:
        eng.stream_outputs, eng.output_maker = False, make_output


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
    enc, dec = DeltaEncoder(), DeltaDecoder(llm.engine.tokenizer)
    seen, finished, text_here, kept = 0, set(), 0, []
    for item in _stream(llm, enc, requests, abort_after={"gone": 5}):
        if isinstance(item, str):  # aborted: both sides forget it
            enc.forget(item)
            dec.forget(item)
            continue
        want, delta = item
        # the engine makes the text only of requests with stop strings; the decoder the rest
        assert (delta[2] == -1 and delta[3] == "") == (want.request_id != "stop"), delta
        text_here += delta[2] == -1 and want.outputs[0].text != ""
        got = dec.decode(pickle.loads(pickle.dumps(delta)))  # as through a pipe
        assert got == want, want.request_id
        kept.append((copy.deepcopy(got), got))
        seen += 1
        if want.finished:
            finished.add((want.request_id, want.outputs[0].finish_reason))
    assert seen > 40 and text_here > 30
    assert {rid for rid, _ in finished} == {"len", "stop", "hot", "ids"}
    assert ("stop", "stop") in finished and ("len", "length") in finished
    assert enc._sent == {} and dec._state == {}  # nothing held for finished or aborted ones
    # an output handed out earlier is not changed by later ones (as the engine's own)
    assert all(then == now for then, now in kept)


def test_an_output_after_its_abort_is_dropped(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    enc, dec = DeltaEncoder(), DeltaDecoder(llm.engine.tokenizer)
    deltas = [d for _, d in _stream(llm, enc, [("r", "hi", params)])]
    assert dec.decode(deltas[0]).outputs[0].token_ids == deltas[0][5]
    dec.forget("r")  # the server aborted it while the next output was in the pipe
    assert dec.decode(deltas[1]) is None


def test_what_crosses_the_pipe_does_not_grow_with_the_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 103))}  # a 100-token prompt
    sizes = [(len(pickle.dumps(out)), len(pickle.dumps(delta)))
             for out, delta in _stream(llm, DeltaEncoder(), [("long", prompt, params)])]
    full_last, delta_last = sizes[-2]  # (the last is the final output)
    assert len(sizes) == 120
    assert full_last > 10 * delta_last, sizes[-2]
    assert max(d for _, d in sizes[1:-1]) < 2 * min(d for _, d in sizes[1:-1]) + 64


def test_a_stream_read_late_builds_one_output_for_many_steps(llm):
    """The server's reader thread only applies deltas; a stream is handed over once until
    its output is built (RequestStream.get), and again when it finishes. Built after several
    steps, the output equals the engine's output of the newest step in every field but the
    text made here, which is a prefix of the engine's (one detokenization for all those
    steps: a window ending in an incomplete character holds back all its text, where the
    engine's one-token windows held back only that character), and equal once finished."""
    text = llm.generate(["def f(x):"], SamplingParams(temperature=0.0, max_tokens=24,
                                                      ignore_eos=True))[0].outputs[0].text
    requests = [
        ("plain", "def f(x):", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)),
        ("stop", "def f(x):", SamplingParams(temperature=0.0, max_tokens=24, stop=[text[6:9]])),
        ("hot", "for i in", SamplingParams(temperature=1.0, seed=5, max_tokens=20)),
    ]  # fmt: skip
    enc, dec = DeltaEncoder(), DeltaDecoder(llm.engine.tokenizer)
    latest, handed, builds = {}, {}, 0
    for step, (want, delta) in enumerate(_stream(llm, enc, requests)):
        for s in dec.apply_many([pickle.loads(pickle.dumps(delta))]):
            handed[s.request_id] = handed.get(s.request_id, 0) + 1
            latest[s.request_id] = s
        rid = want.request_id
        if want.finished or step % 5 == 4:  # read now and then: one build for many deltas
            got = latest[rid].build()
            builds += 1
            made, wanted = got.outputs[0], want.outputs[0]
            assert wanted.text.startswith(made.text), rid
            if want.finished or rid == "stop":  # (the engine made the stop request's text)
                assert made.text == wanted.text, rid
            made.text = wanted.text
            assert got == want, rid
    # handed over once per build (and on finishing), not once per step
    assert sum(handed.values()) <= builds + len(requests) < step
    assert dec._state == {}
