"""append_tokens: a row's emitted tokens are committed up to the one that finishes the request
(fast path: all at once when none can)."""

from __future__ import annotations

import pytest

from dspark.engine.detokenizer import Detokenizer
from dspark.engine.request import Request, RequestStatus
from dspark.engine.stopping import append_tokens
from dspark.sampling_params import SamplingParams

EOS = 2


def _req(max_total: int = 100, **params) -> Request:
    req = Request("r", [5, 6, 7], SamplingParams(**params), [EOS], seed=0)
    req.max_total_tokens = max_total
    return req


@pytest.mark.parametrize(
    "params, max_total, emitted, kept, status, reason",
    [
        ({}, 100, [9, 10, 11], [9, 10, 11], RequestStatus.WAITING, None),  # nothing stops
        ({}, 100, [9, EOS, 11], [9, EOS], RequestStatus.FINISHED_STOPPED, None),
        ({"ignore_eos": True}, 100, [9, EOS, 11], [9, EOS, 11], RequestStatus.WAITING, None),
        ({"stop_token_ids": [10]}, 100, [9, 10, 11], [9, 10], RequestStatus.FINISHED_STOPPED, 10),
        ({}, 5, [9, 10, 11], [9, 10], RequestStatus.FINISHED_LENGTH, None),  # 3 + 2 = limit
        ({}, 6, [9, 10, 11], [9, 10, 11], RequestStatus.FINISHED_LENGTH, None),
        ({}, 7, [9, 10, 11], [9, 10, 11], RequestStatus.WAITING, None),
    ],
)
def test_tokens_are_committed_up_to_the_one_that_finishes(params, max_total, emitted, kept,
                                                           status, reason):  # fmt: skip
    req = _req(max_total, **params)
    got = append_tokens(req, list(emitted), now=1.0, detokenizer=Detokenizer(None))
    assert got == kept and req.output_token_ids == kept
    assert req.status is status and req.stop_reason == reason
    assert req.first_token_time == 1.0
    assert (req.finished_time is not None) == status.finished
