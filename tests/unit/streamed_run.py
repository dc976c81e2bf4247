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
