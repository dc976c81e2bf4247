from dspark.engine.request import SpecStats


def test_conditional_and_unconditional_acceptance_and_trimming():
    st = SpecStats()
    st.record(num_drafted=4, num_verified=4, num_accepted=2)  # slots 0,1 accepted, 2 rejected
    st.record(num_drafted=4, num_verified=1, num_accepted=1)  # slot 0 accepted, rest trimmed
    st.record(num_drafted=4, num_verified=3, num_accepted=0)  # slot 0 rejected
    d = st.as_dict()
    assert d["num_trimmed_tokens"] == 12 - 8 and d["num_rejected_tokens"] == 8 - 3
    assert d["mean_acceptance_length"] == (3 + 3) / 3
    assert d["acceptance_per_position"] == [2 / 3, 1 / 3, 0.0, 0.0]
    # slot 0 tested 3 times (accepted twice); slot 1 tested once (round 1: accepted);
    # slot 2 tested once (round 1: rejected); slot 3 never tested
    assert d["conditional_acceptance_per_position"] == [2 / 3, 1.0, 0.0, None]
    other = SpecStats()
    other.record(4, 4, 4)
    st.merge(other)
    assert st.as_dict()["conditional_acceptance_per_position"] == [3 / 4, 1.0, 1 / 2, 1.0]


def _reference(rounds):
    """Per-position counts by the definition, one loop per round."""
    width = max((d for d, _, _ in rounds), default=0)
    ver, acc, reach = [0] * width, [0] * width, [0] * width
    for _, v, a in rounds:
        for j in range(v):
            ver[j] += 1
        for j in range(a):
            acc[j] += 1
        for j in range(min(a + 1, v)):
            reach[j] += 1
    return ver, acc, reach


def test_histograms_give_the_per_position_counts_and_batches_equal_rounds():
    import numpy as np

    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(300):
        d = int(rng.integers(1, 8))
        v = int(rng.integers(0, d + 1))
        rounds.append((d, v, int(rng.integers(0, v + 1))))
    one, many, halves = SpecStats(), SpecStats(), SpecStats()
    for r in rounds:
        one.record(*r)
    many.record_many(*zip(*rounds))
    for part in (rounds[:120], rounds[120:]):
        other = SpecStats()
        other.record_many(*zip(*part))
        halves.merge(other)
    want = _reference(rounds)
    for st in (one, many, halves):
        assert (st.verified_per_pos, st.accepted_per_pos, st.reached_per_pos) == want
        assert st.as_dict() == one.as_dict()
    assert one.num_steps == 300 and one.width == max(d for d, _, _ in rounds)


def test_a_requests_rounds_counted_by_kind_read_as_the_counters_record_gives():
    """Request.spec: rounds counted by kind as the commit path counts them read as the
    counters SpecStats.record builds, at every length."""
    import numpy as np

    from dspark.engine.request import Request
    from dspark.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    req = Request("r", [1, 2, 3], SamplingParams(), [0], seed=0)
    want = SpecStats()
    assert req.spec.as_dict() == want.as_dict()
    for n in range(1, 300):
        d = int(rng.integers(1, 8))
        v = int(rng.integers(0, d + 1))
        r = (d, v, int(rng.integers(0, v + 1)))
        want.record(*r)
        req.spec_rounds[r] = req.spec_rounds.get(r, 0) + 1
        if n % 17 == 0 or n == 299:
            assert req.spec.as_dict() == want.as_dict(), n
    assert len(req.spec_rounds) <= 8**3


def test_a_finished_requests_counters_are_every_round_the_engine_counted(tiny_qwen, tmp_path):
    """One request decoding for many rounds: its final output's spec_decode is what the
    engine's aggregate counters say (the same rounds)."""
    from dspark import LLM, SamplingParams
    from dspark.testing.drafters import make_tiny_drafter

    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=3)
    llm = LLM(tiny_qwen, device="cpu", speculative_config={
        "model": drafter, "num_speculative_tokens": 3, "adaptive_policy": "fixed"})
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                       SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True))[0]
    mine = out.spec_decode
    assert mine["num_steps"] > 40
    assert mine == llm.engine.spec_stats.as_dict()
