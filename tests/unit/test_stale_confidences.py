"""The first-draft marks of StaleConfidences on a packed step's rows (no engine): a slot
given to a new request reads as unknown until the copy holding its first drafts; the step
that drafts for it first marks it with that copy's generation, and no other step does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dspark.spec.drafting import PROBE_ROWS
from dspark.spec.stale_confidences import NOT_DRAFTED, StaleConfidences


class _Planning(StaleConfidences):
    def __init__(self, num_slots: int, generation: int):
        self._policy, self.probing = "lagged", False
        self._conf_from = np.zeros(num_slots, dtype=np.int64)
        self._unmarked_slots: set[int] = set()
        self.host_confs = SimpleNamespace(next_generation=generation)


def _host(slots: list[int], samples: list[int]):
    rows = np.zeros((8, len(slots)), dtype=np.int64)
    rows[0], rows[4] = samples, slots
    return SimpleNamespace(per_row=lambda: rows)


def test_the_step_that_drafts_first_for_a_slot_marks_it_and_no_other_does():
    p = _Planning(num_slots=32, generation=7)
    for slot in (3, 9, 20, 25):
        p.slot_assigned(slot)
    p.slot_assigned(3)  # (again, before it drafted: counted once)
    assert p._unmarked_slots == {3, 9, 20, 25}
    assert (p._conf_from[[3, 9, 20, 25]] == NOT_DRAFTED).all()
    # slot 3 samples (its prompt completed), 9 is mid-prompt (no sample), 20 and 25 are not in
    # the step; 5 was never assigned
    p._mark_first_drafts(_host([5, 9, 3], [1, 0, 1]))
    assert p._conf_from[3] == 7 and p._conf_marked == 7
    assert p._unmarked_slots == {9, 20, 25} and p._conf_from[9] == NOT_DRAFTED
    assert p._conf_from[5] == 0  # (a slot that was never new keeps its mark)
    # a draft probe drafts for its first PROBE_ROWS rows only: slot 25 past them stays unknown
    p.probing, p.host_confs.next_generation = True, 8
    rows = list(range(100, 100 + PROBE_ROWS - 1)) + [20, 25]
    p._conf_from = np.zeros(200, dtype=np.int64)
    p._conf_from[[9, 20, 25]] = NOT_DRAFTED
    p._mark_first_drafts(_host(rows, [1] * len(rows)))
    assert p._conf_from[20] == 8 and p._conf_from[25] == NOT_DRAFTED
    assert p._unmarked_slots == {9, 25}
    # a policy other than the lagged one marks nothing new
    q = _Planning(num_slots=4, generation=1)
    q._policy = "fixed"
    q.slot_assigned(2)
    assert not q._unmarked_slots and q._conf_from[2] == 0
