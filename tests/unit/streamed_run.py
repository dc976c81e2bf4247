"""A test helper: run requests through an engine's step() as a server does (streamed) and
check what came out against the final outputs and the block manager."""

from dspark import SamplingParams


def run_streamed(eng, prompts, max_tokens, temperature: float, stops=None) -> dict:
    """request id -> (final token ids, finish reason) of requests r0, r1, ... (seed 7 + i,
    `ignore_eos`, stop tokens `stops[i]`); every request's streamed pieces add up to its
    final tokens, and every block is given back."""
    eng.stream_outputs = True
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        params = SamplingParams(temperature=temperature, seed=7 + i, max_tokens=m,
                                ignore_eos=True, stop_token_ids=stops[i] if stops else None)
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    streamed: dict[str, list[int]] = {}
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id not in final
            streamed.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
    assert sorted(final) == sorted(f"r{i}" for i in range(len(prompts)))
    for rid, (tokens, _) in final.items():
        assert streamed[rid] == tokens
    eng.block_manager.check_integrity()
    assert not eng.block_manager.block_tables  # every block given back
    return final


def abort_in_flight(eng, max_tokens: int, steps: int, in_flight) -> dict:
    """Requests a0-a2 (greedy, `max_tokens` each); after `steps` step() calls, when
    `in_flight(eng)` holds, a1 (whose row is in the step in flight) is aborted and a3 added
    (it takes a1's slot). Returns request id -> final tokens of what finished."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"a{i}", {"prompt_token_ids": [5 + i, 8, 13, 21]}, params)
    seen = []
    for _ in range(steps):
        seen += eng.step()
    assert in_flight(eng)
    eng.abort_request("a1")
    eng.add_request("a3", {"prompt_token_ids": ABORT_NEXT_PROMPT}, params)
    while eng.has_unfinished_requests():
        seen += eng.step()
    done = {o.request_id: o.outputs[0].token_ids for o in seen if o.finished}
    assert sorted(done) == ["a0", "a2", "a3"]
    return done


ABORT_NEXT_PROMPT = [2, 3, 5, 7, 11]  # (a3's, in abort_in_flight)
