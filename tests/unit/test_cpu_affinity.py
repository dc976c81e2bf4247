"""DSPARK_ENGINE_CPUS: the CPU list's forms and its errors (the engine process applies it:
tests/e2e/test_server_process.py)."""

from __future__ import annotations

import pytest

from dspark.engine.cpu_affinity import parse_cpu_list


def test_lists_ranges_and_spaces():
    assert parse_cpu_list("2") == {2}
    assert parse_cpu_list("2,3") == {2, 3}
    assert parse_cpu_list(" 4-7, 12 ") == {4, 5, 6, 7, 12}
    assert parse_cpu_list("0-0,0") == {0}


@pytest.mark.parametrize("text", ["", "a", "2-", "-3", "5-3", "1,,2", "1.5"])
def test_bad_lists_name_the_variable(text):
    with pytest.raises(ValueError, match="DSPARK_ENGINE_CPUS"):
        parse_cpu_list(text)
