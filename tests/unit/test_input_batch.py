"""pack_step: the host half of a step (one int64 array, its scalars, the draft fills)."""

import numpy as np

from dspark import SamplingParams
from dspark.engine.input_batch import pack_step


def test_packed_scalars_give_the_sizes_the_planner_reads():
    """SpecDecoder.plan takes a step's sizes from the packed scalars, not from its rows: the
    drafts laid out (num_draft_fills) are the rows' capacities summed, the stream less them
    and one token per row is the prefill beyond one token per row, and num_samples counts
    the sampling rows; with a prefill chunk (a row that does not sample) among drafting rows."""

    class Row:
        def __init__(self, req, n, caps, samples=True):
            self.req, self.num_new_tokens, self.num_draft_slots = req, n, caps
            self.samples = samples

    class Req:
        def __init__(self, slot, ctx, length):
            self.num_computed_tokens, self.token_ids, self.slot = ctx, list(range(length)), slot
            self.seed, self.round, self.num_pending = slot, 0, 0
            self.params = SamplingParams(temperature=0.0)

    rows = [Row(Req(0, 6, 7), 4, 3), Row(Req(1, 0, 30), 11, 0, samples=False),
            Row(Req(2, 9, 10), 1, 0), Row(Req(3, 2, 3), 6, 5), Row(Req(4, 0, 5), 5, 0)]
    host = pack_step(rows, np.arange(5 * 8, dtype=np.int64).reshape(5, 8), 4)
    per_row = host.per_row()
    samples, caps, non_draft = per_row[0], per_row[1], per_row[2]
    n = len(rows)
    assert host.get("num_draft_fills") == int(caps.sum()) == 8
    assert host.get("num_tokens") - host.get("num_draft_fills") - n == int(non_draft.sum()) - n
    assert host.prefill_tokens() == int(non_draft.sum()) - n
    assert int(non_draft.sum()) - n == (1 + 11 + 1 + 1 + 5) - n  # 14 prefill tokens beyond
    assert host.get("num_samples") == int(np.count_nonzero(samples)) == 4
    # the rows' contexts before the step, summed: what the cost table prices the KV read by
    assert host.get("context_tokens") == 6 + 0 + 9 + 2 + 0
