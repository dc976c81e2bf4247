"""How fast each of this machine's CPUs runs Python, alone and beside a busy neighbour.

A host-bound engine (a small model, where a step is ~0.5 ms of Python) is as fast as the core
its loop lands on. This times one fixed pure-Python workload pinned to each CPU in turn (so
the spread between CPUs and between rounds shows), then on pairs of CPUs at once (a pair that
slows both is two threads of one core, or one host core under a VM's two vCPUs).

    python3 scripts/cpu_speed_map.py --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def workload(n: int) -> float:
    """ms for n rounds of dict/list/attribute work shaped like an engine's bookkeeping."""
    t0 = time.perf_counter()
    d: dict[int, list[int]] = {}
    for i in range(n):
        row = d.setdefault(i & 1023, [])
        row.append(i)
        if len(row) > 8:
            row.pop(0)
        _ = sum(row) + len(d)
    return (time.perf_counter() - t0) * 1e3


def pinned(cpu: int, n: int, start: mp.Event | None, out: mp.Queue) -> None:
    os.sched_setaffinity(0, {cpu})
    workload(n // 10)  # warm
    if start is not None:
        start.wait()
    out.put((cpu, workload(n)))


def run(cpus: list[int], n: int) -> dict[int, float]:
    """Time the workload on each CPU of `cpus` at the same moment (one process each)."""
    out, start = mp.Queue(), mp.Event()
    procs = [mp.Process(target=pinned, args=(c, n, start, out)) for c in cpus]
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    res = dict(out.get() for _ in cpus)
    for p in procs:
        p.join()
    return res


def siblings(cpu: int) -> str:
    path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=400_000)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    alone: dict[int, list[float]] = {c: [] for c in cpus}
    for _ in range(args.rounds):
        for c in cpus:
            alone[c] += run([c], args.iters).values()
    print(f"{len(cpus)} CPUs; one process at a time, ms per workload (rounds: {args.rounds})")
    print("cpu  siblings   median      min      max")
    for c in cpus:
        t = alone[c]
        mid = statistics.median(t)
        print(f"{c:3d}  {siblings(c):>8s}  {mid:7.1f}  {min(t):7.1f}  {max(t):7.1f}")
    med = [statistics.median(alone[c]) for c in cpus]
    print(f"spread of CPU medians: {min(med):.1f}-{max(med):.1f} ms ({max(med) / min(med):.2f}x)")
    base = cpus[0]
    print(f"\npairs: cpu {base} beside each other CPU at once (ms, both; alone ~{med[0]:.1f})")
    for c in cpus[1:]:
        r = run([base, c], args.iters)
        print(f"{base:3d}+{c:<3d} {r[base]:7.1f} {r[c]:7.1f}")
    everyone = run(cpus, args.iters)
    vals = list(everyone.values())
    print(f"\nall {len(cpus)} at once: median {statistics.median(vals):.1f} ms, "
          f"range {min(vals):.1f}-{max(vals):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
