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
