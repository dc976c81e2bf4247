"""Host cost of replaying a CUDA graph against the number of kernels in it: is a launch's
cost per launch or per node? (A small pair's speculative step replays two graphs, ~180 us of
host time each on the H200 machine, profiled.) Each graph chains N tiny elementwise kernels
on a 1 KiB tensor, so the device time is negligible and the host time is the launch.

    python3 scripts/bench_graph_launch.py --nodes 1,10,100,300,1000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def host_us_per_replay(num_kernels: int, replays: int) -> tuple[float, float]:
    """(median host us of one replay onto an idle device; wall us per replay, back to back
    and synchronized at the end)."""
    x = torch.zeros(256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up outside the capture (allocator, kernels)
        for _ in range(3):
            y = x
            for _ in range(num_kernels):
                y = y.add_(1.0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for _ in range(num_kernels):
            y = y.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    host = []
    for _ in range(replays):  # each launch onto an idle device, as a host-bound step's is
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    device = (time.perf_counter() - t0) / replays
    return statistics.median(host) * 1e6, device * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,10,100,300,1000")
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_graph_launch: no CUDA device; nothing measured")
        return 0
    print(f"{'kernels':>8} {'host us/replay':>15} {'wall us/replay (synced)':>24}")
    for n in (int(v) for v in args.nodes.split(",")):
        host, wall = host_us_per_replay(n, args.replays)
        print(f"{n:>8} {host:>15.1f} {wall:>24.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
