"""LandedCopies: the planner reads the newest device->host copy that has landed, never waiting
(dspark/spec/host_copy.py). Events are simulated: the test decides when a copy completes."""

import numpy as np
import torch

from dspark.spec.host_copy import LandedCopies


class FakeEvent:
    """A CUDA event whose completion the test controls; record() starts a new pending copy."""

    log: list = []

    def __init__(self):
        self.done = True

    def record(self):
        self.done = False
        FakeEvent.log.append(self)

    def query(self):
        return self.done


def _copies(depth=2):
    FakeEvent.log = []
    return LandedCopies((2, 3), torch.device("cpu"), depth=depth, event_factory=FakeEvent)


def test_a_copy_in_flight_is_never_read_and_the_previous_one_is():
    c = _copies()
    c.push(torch.full((2, 3), 0.5))
    assert np.all(c.read() == 1.0) and c.lag == 1  # in flight: the fill
    FakeEvent.log[0].done = True
    c.push(torch.full((2, 3), 0.25))  # the next copy is queued before the host reads again
    # the H200 failure: with one re-recorded event, the landed 0.5 copy was hidden forever
    assert np.all(c.read() == 0.5) and c.lag == 1
    FakeEvent.log[1].done = True
    assert np.all(c.read() == 0.25) and c.lag == 0


def test_steady_pipeline_reads_one_copy_behind():
    """Each plan runs while the last draft's copy is in flight: it sees the one before."""
    c = _copies()
    seen = []
    for step in range(1, 8):
        c.push(torch.full((2, 3), float(step)))
        if step > 1:
            FakeEvent.log[step - 2].done = True  # the previous copy landed meanwhile
        seen.append(float(c.read()[0, 0]))
    assert seen == [1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_a_buffer_being_rewritten_is_not_read():
    c = _copies(depth=2)
    c.push(torch.full((2, 3), 0.1))
    c.push(torch.full((2, 3), 0.2))
    FakeEvent.log[0].done = True
    c.push(torch.full((2, 3), 0.3))  # reuses buffer 0: its event is pending again
    assert np.all(c.read() == 1.0)  # 0.1 is being overwritten; 0.2 and 0.3 are in flight
    FakeEvent.log[2].done = True
    assert np.all(c.read() == 0.3)
    FakeEvent.log[1].done = True  # an older copy landing later never replaces a newer read
    assert np.all(c.read() == 0.3)


def test_cpu_copies_land_at_once():
    c = LandedCopies((1, 2), torch.device("cpu"))
    c.push(torch.tensor([[0.3, 0.7]]))
    np.testing.assert_allclose(c.read(), [[0.3, 0.7]], rtol=1e-6)
    assert c.lag == 0


def test_only_the_lagged_policy_copies_confidences_to_the_host(tiny_qwen, tmp_path):
    """The host copies feed the lagged budget and the drafting decision only: the other
    policies queue none (a device->host copy and an event a drafting step, for nothing)."""
    from dspark import LLM, SamplingParams
    from dspark.testing.drafters import make_tiny_drafter
    from tests.unit.test_adaptive_engine import _table

    drafter = make_tiny_drafter(str(tmp_path / "d"), tiny_qwen, seed=9)
    path = _table(tmp_path, "cheap", weight_read_ms=1.0, ms_per_token=0.001,
                  fixed_overhead_ms=0.5, draft_base_ms=0.0, draft_ms_per_req=0.0)  # fmt: skip
    pushed = {}
    for policy in ("fixed", "threshold", "early_stop", "lagged"):
        spec = {"model": drafter, "num_speculative_tokens": 3, "adaptive_policy": policy,
                "cost_table_path": path}  # fmt: skip
        llm = LLM(tiny_qwen, device="cpu", speculative_config=spec)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # fmt: skip
        pushed[policy] = llm.engine.runner.spec.host_confs.newest_generation
    assert pushed["lagged"] > 0 and pushed["fixed"] == pushed["threshold"] == 0, pushed
    assert pushed["early_stop"] == 0, pushed
