"""Pin the engine to chosen CPUs: DSPARK_ENGINE_CPUS="2" (or "2,3", "4-7,12"). The engine
process is pinned whole; an engine in a thread of the server (--no-engine-process), that
thread alone.

The engine loop is single-threaded Python; where steps are short its speed is the speed of
the CPU it runs on. On the H200 machine the same Python work ran up to 2x slower on some
CPUs than on others (scripts/cpu_speed_map.py, twenty-fifth session), and an unpinned
process lands wherever the OS puts it. Pinning keeps one engine on one CPU for its life,
and lets a benchmark put every arm's engine on the same CPU (scripts/bench_e2e.py
--engine-cpus), so that a CPU's speed is not read as an arm's.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "DSPARK_ENGINE_CPUS"


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a list like "2", "2,3" or "4-7,12" (the form of taskset -c). Raises
    ValueError naming DSPARK_ENGINE_CPUS and the bad part."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"{ENV}: {part!r} is not a CPU number or range (expected a list "
                             f"like '2', '2,3' or '4-7')") from None  # fmt: skip
        if first < 0 or last < first:
            raise ValueError(f"{ENV}: {part!r} is not a CPU range (non-negative, low-high)")
        cpus.update(range(first, last + 1))
    return cpus


def cpus_from_env() -> set[int] | None:
    """The CPUs DSPARK_ENGINE_CPUS names (None when unset); ValueError on a bad list."""
    text = os.environ.get(ENV, "").strip()
    return parse_cpu_list(text) if text else None


def pin(cpus: set[int], tid: int = 0) -> None:
    """Pin a thread (`tid`: its native id; 0, the calling one; threads it starts later
    inherit it) to `cpus`. The CPUs need not be among its parent's: a benchmark keeps its
    servers off the engines' CPUs (scripts/bench_e2e.py). ValueError naming
    DSPARK_ENGINE_CPUS where they are not available."""
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as e:  # (EINVAL: none of them online, or outside this machine's cpuset)
        raise ValueError(f"{ENV}: CPUs {sorted(cpus)} are not available to this process "
                         f"({e.strerror})") from None  # fmt: skip
    logger.info("engine pinned to CPUs %s (%s)", sorted(cpus), ENV)


def pin_from_env() -> set[int] | None:
    """Pin the calling thread (the engine process's main one) to DSPARK_ENGINE_CPUS; None
    when unset."""
    cpus = cpus_from_env()
    if cpus is not None:
        pin(cpus)
    return cpus
