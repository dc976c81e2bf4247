"""Incremental detokenization equals full decoding; stop strings cut at the right place."""

import random

from transformers import AutoTokenizer

from dspark import LLM, SamplingParams
from dspark.engine.detokenizer import Detokenizer
from dspark.engine.request import Request


def _feed(tok, ids, stops=None):
    detok = Detokenizer(tok)
    req = Request("r", [1], SamplingParams(stop=stops), [], seed=0)
    hit = False
    for t in ids:
        req.token_ids.append(t)
        delta = detok.update(req)
        if stops and detok.find_stop(req, delta):
            hit = True
            break
    return req, hit


def test_incremental_equals_full_decode_with_multibyte_text(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    text = "def f(x):\n    return 'héllo wörld – ✓ 你好' + str(x) * 3\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 20
    req, _ = _feed(tok, ids)
    assert req.output_text == tok.decode(ids) == text
    # every intermediate text is a prefix of the final one (nothing is ever taken back)
    detok = Detokenizer(tok)
    req = Request("r", [1], SamplingParams(), [], seed=0)
    for t in ids:
        req.token_ids.append(t)
        detok.update(req)
        assert text.startswith(req.output_text)


def test_stop_string_straddling_tokens(tiny_qwen):
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    text = "alpha beta STOP gamma"
    ids = tok.encode(text, add_special_tokens=False)
    req, hit = _feed(tok, ids, stops=["ST" + "OP", "zzz"])
    assert hit and req.output_text == "alpha beta " and req.stop_reason == "STOP"
    assert tok.decode(req.token_ids[1:]).startswith("alpha beta ST")


def test_engine_stop_strings_match_full_decode(tiny_qwen):
    llm = LLM(tiny_qwen, device="cpu")
    free = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=40))[0]
    text = free.outputs[0].text
    rnd = random.Random(0)
    cut = rnd.randrange(5, len(text) - 3)
    stop = text[cut : cut + 3]
    first = text.find(stop)
    out = llm.generate(["def add(a, b):"],
                       SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]  # fmt: skip
    assert out.outputs[0].text == text[:first]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_batched_update_equals_per_request_update(tiny_qwen):
    """update_many (one Rust decode_batch call per step) leaves every request with exactly the
    text, offsets and deltas of per-request update, chunk by chunk, multi-byte text included."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    detok = Detokenizer(tok)
    assert detok._decode_batch is not None  # the fast path is what is tested
    rng = random.Random(5)
    texts = ["héllo wörld – ✓ 你好 " * 3, "def f(x):\n    return x * 2\n", "ünïcødé ✓✓ 猫 " * 2]
    seqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    seqs += [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(3)]
    one = [Request(f"a{i}", [1, 2], SamplingParams(), [], seed=0) for i in range(len(seqs))]
    many = [Request(f"b{i}", [1, 2], SamplingParams(), [], seed=0) for i in range(len(seqs))]
    pos = [0] * len(seqs)
    while any(p < len(s) for p, s in zip(pos, seqs)):
        active = []
        for i, s in enumerate(seqs):
            n = rng.randint(0, 3)  # 0: this request gets no token this step
            for r in (one[i], many[i]):
                r.token_ids.extend(s[pos[i] : pos[i] + n])
            pos[i] += n
            active.append(i)
        for i in active:
            detok.update(one[i])
        detok.update_many([many[i] for i in active])
        for a, b in zip(one, many):
            assert (a.output_text, a.prefix_offset, a.read_offset) == (
                b.output_text, b.prefix_offset, b.read_offset)
    for a, s in zip(one, seqs[:3]):
        assert a.output_text == tok.decode(s, skip_special_tokens=True)


def test_flush_gives_the_held_back_tail_at_the_finish(tiny_qwen):
    """An output that ends inside a multi-byte character: incremental updates hold that
    tail back; flush (at the finish) makes the text the decode of every output token."""
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    ids = tok.encode("ab 你好", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    req, _ = _feed(tok, ids[:cut])
    assert req.output_text != tok.decode(ids[:cut])  # held back
    Detokenizer(tok).flush(req)
    assert req.output_text == tok.decode(ids[:cut])
