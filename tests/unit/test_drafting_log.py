"""The drafting decision's flip log: every turn at INFO in bursts, then at most one a second.

The forty-fourth session's offline engines turned drafting off five times in 13 s, and each
turn back on came within a second of the turn off: a log limited to one INFO line a second
kept only the five "off" lines, so why drafting resumed each time was not seen."""

from __future__ import annotations

import logging

import numpy as np

from dspark.spec import drafting_log
from dspark.spec.drafting_log import FLIP_LOG_BURST, FLIP_LOG_EVERY_S, FlipLog


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _say(log: FlipLog, pays: bool) -> None:
    log.say(pays, 128, 118.1, 129.6, 1.18, 0.43, True, np.array([0.6, 0.3]), 1.0)


def _levels(caplog) -> list[str]:
    return [r.levelname for r in caplog.records if r.name == drafting_log.logger.name]


def test_a_burst_of_turns_is_logged_whole_then_one_a_second(caplog):
    clock = FakeClock()
    log = FlipLog(clock=clock)
    with caplog.at_level(logging.DEBUG, logger=drafting_log.logger.name):
        for i in range(FLIP_LOG_BURST + 3):  # back to back: the burst, then DEBUG
            _say(log, i % 2 == 0)
        assert _levels(caplog) == ["INFO"] * FLIP_LOG_BURST + ["DEBUG"] * 3
        caplog.clear()
        clock.now += FLIP_LOG_EVERY_S  # one second earns one INFO line, not more
        _say(log, True)
        _say(log, False)
        assert _levels(caplog) == ["INFO", "DEBUG"]
        caplog.clear()
        clock.now += 1000 * FLIP_LOG_EVERY_S  # a long quiet spell refills the burst, no more
        for i in range(FLIP_LOG_BURST + 1):
            _say(log, i % 2 == 0)
        assert _levels(caplog) == ["INFO"] * FLIP_LOG_BURST + ["DEBUG"]
    # each line names the turn and the rates it compared
    message = caplog.records[0].getMessage()
    assert message.startswith(drafting_log.FLIP_LOG_PREFIX + "on at 128 requests")
    assert "118.100 tok/ms vs plain decoding 129.600 tok/ms" in message


def test_the_rate_bounds_info_lines_over_a_long_run(caplog):
    """Flips every 0.1 s for 100 s: at most the burst plus one a second at INFO."""
    clock = FakeClock()
    log = FlipLog(clock=clock)
    with caplog.at_level(logging.DEBUG, logger=drafting_log.logger.name):
        for i in range(1000):
            _say(log, i % 2 == 0)
            clock.now += 0.1
    levels = _levels(caplog)
    assert len(levels) == 1000
    info = levels.count("INFO")
    assert FLIP_LOG_BURST + 95 <= info <= FLIP_LOG_BURST + 100 / FLIP_LOG_EVERY_S + 1
