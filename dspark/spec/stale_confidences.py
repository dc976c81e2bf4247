"""The lagged policy's reads of stale confidences (StepPlanning's mixin): a plan reads the
newest device->host copy of the drafts' confidences that has landed, never waiting, and a
slot's row reads as unknown until its current request's first drafts have landed."""

from __future__ import annotations

import numpy as np

from dspark.spec.drafting import PROBE_ROWS

NOT_DRAFTED = np.iinfo(np.int64).max  # a slot's request has drafted nothing yet (_conf_from;
# 0 there: never assigned, its landed rows are the fill)


class StaleConfidences:
    """Mixin of StepPlanning (SpecDecoder): _stale, slot_assigned, _mark_first_drafts."""

    _conf_from: np.ndarray  # per slot (decoder): see slot_assigned
    # (decoder: a set) slots assigned whose request's first drafting step is not planned
    _unmarked_slots: set[int]
    _conf_marked = 0  # the newest copy generation a first drafting step was marked with
    _conf_skips: int  # (decoder) drafting steps in a row that skipped their copy

    def _stale(self, slots: np.ndarray) -> np.ndarray:
        """The rows' confidences from the newest device->host copy that has landed, never
        waiting for the device, and never the newest one queued: that one holds the
        confidences of the drafts this step verifies, and a budget that reads them is
        biased (non-anticipation: planner.py; tests/unit/test_lossless_policies.py). Where the
        last drafting step skipped its copy (a cruise's, decoder._copy_conf_to_host) the
        newest one queued holds older drafts and may be read. NaN (unknown) where the copy
        read predates the row's request's first drafts (slot_assigned)."""
        copies = self.host_confs
        before = None if self._conf_skips else copies.newest_generation
        stale = copies.read(before=before)[slots]
        landed = copies.landed_generation
        if self._unmarked_slots or self._conf_marked > landed:  # (else every row is known:
            unknown = self._conf_from[slots] > landed  # a cold read costs ~15 µs more)
            if unknown.any():
                stale[unknown] = np.nan
        return stale

    def slot_assigned(self, slot: int) -> None:
        """A request was given `slot`. The landed copies hold the slot's last request's
        confidences until the copy of this one's first drafts lands, a step later on a GPU
        (the planner reads without waiting), so until then its row reads as unknown, as a
        slot never drafted does. Before, a new request's first plan read another request's
        confidences, and at a level's start, where most rows are new, the decision's
        acceptance check compared one batch's predictions with another's drafts: a likely
        cause, not confirmed, of drafting turning off on an acceptance ratio of 0.52 at a
        level's start (H200, trained pair, T = 0, 1.06 at the level's end; thirty-second
        session)."""
        if self._policy == "lagged" and self._conf_from[slot] != NOT_DRAFTED:
            self._conf_from[slot] = NOT_DRAFTED  # (once: a request gone before it drafted
            self._unmarked_slots.add(slot)  # left it so)

    def _mark_first_drafts(self, host) -> None:
        """This step drafts: its sampling rows (a probe's first PROBE_ROWS) whose requests
        had not drafted in their slot get their confidences in the copy it queues. The few
        unmarked slots are looked up in the step's slot list, one C scan each, where the array
        version took a mask, two gathers and a compare: with the caches cold, medians of six
        paired runs 30 / 29 / 48 -> 22 / 17 / 22 µs at 16 / 64 / 256 rows (development
        machine, noisy). Nearly every step with a new prompt's chunk runs it: its request
        drafts as its prompt completes."""
        rows = host.per_row()  # samples row 0, request slots row 4
        slots = rows[4].tolist()
        if self.probing:
            slots = slots[:PROBE_ROWS]
        samples, generation = rows[0], self.host_confs.next_generation
        for slot in tuple(self._unmarked_slots):
            try:
                row = slots.index(slot)
            except ValueError:  # (not in this step, or past a probe's rows)
                continue
            if samples[row]:
                self._conf_from[slot] = self._conf_marked = generation
                self._unmarked_slots.discard(slot)
