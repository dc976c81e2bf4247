"""Request.is_finished tests identity against the two live statuses (it is hot); every other
status must be a finished one."""

from dspark import SamplingParams
from dspark.engine.request import Request, RequestStatus


def test_every_status_but_waiting_and_running_is_finished():
    req = Request("r", [1, 2], SamplingParams(), [], seed=0)
    live = {RequestStatus.WAITING, RequestStatus.RUNNING}
    for status in RequestStatus:
        req.status = status
        assert req.is_finished == status.finished == (status not in live)
        assert status.finished == (status.value in ("stop", "length", "abort"))
