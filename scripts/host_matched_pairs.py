"""Adaptive against fixed K round by round, set against how fast the host ran for each arm.

On the H200 machine the host's speed drifts between and within seconds, and a small pair's
serving is host-bound, so one round pair's throughput ratio moves with it: in the thirty-second
session every pair decided by more than 10% had the winner's shared host parts faster. This
reads the per-round results of interleaved runs (`bench_e2e.py --interleave --rounds N` with
DSPARK_HOST_TIMERS=1 servers: `<arm>_t<T>_c<C>_r<R>.json`, or `<arm>_t<T>_c<C>.json` for one
round) from one or more run folders and prints, for every round pair:

  * adaptive's output tok/s over fixed K's;
  * adaptive's host ms per step over fixed K's in the parts whose code both run alike
    (bench_e2e.SHARED_HOST_PARTS: commit, outputs, schedule).

Then the geometric mean of the throughput ratios, and a least-squares fit of log(throughput
ratio) on log(host ratio) whose intercept estimates the ratio at equal host speed, with its
standard error. The intercept is an estimate, not a measurement; if adaptive's own work slowed
its shared parts (cache pressure), part of its cost would hide in the host ratio, so the mean
host ratio is printed too (near 1: no such shift).

    tar xzf benchmarks/h200-2026-12-04-s32/e2e_t0_more/e2e_files.tgz -C /tmp/s32
    python3 scripts/host_matched_pairs.py /tmp/s32/e2e --temperature 0 --levels 1,4,16,64
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import shared_host_ms  # noqa: E402

_NAME = re.compile(r"_t(?P<t>[0-9.]+)_c(?P<c>\d+)(?:_r(?P<r>\d+))?\.json$")


def round_pairs(folders: list[str], temperature: str, levels: set[int] | None,
                adaptive: str = "adaptive7", fixed: str = "fixed7") -> list[tuple]:
    """(concurrency, round label, throughput ratio, shared host ratio) of every round whose
    two arms both have results with host timers. A pair found twice (a warm machine's /tmp
    kept an earlier run's files) counts once."""
    pairs, seen = [], set()
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, f"{adaptive}_t{temperature}_c*.json"))):
            m = _NAME.search(path)
            if m is None or (levels and int(m["c"]) not in levels):
                continue
            other = os.path.join(folder, fixed + os.path.basename(path)[len(adaptive):])
            if not os.path.exists(other):
                continue
            a, f = (json.load(open(p))["results"][0] for p in (path, other))
            ha, hf = shared_host_ms(a), shared_host_ms(f)
            key = (a["output_throughput"], f["output_throughput"])
            if ha is None or hf is None or hf <= 0 or key in seen:
                continue
            seen.add(key)
            label = f"{folder.rstrip('/')}:r{m['r'] or '-'}"
            pairs.append((int(m["c"]), label, key[0] / key[1], ha / hf))
    return pairs


def host_matched_fit(pairs: list[tuple]) -> dict:
    """Geometric means of the throughput and host ratios, and the fit of log(throughput
    ratio) = a + b log(host ratio): exp(a) is the ratio at equal host speed (se: a's
    standard error, in log units; None with fewer than three pairs)."""
    y = np.log([p[2] for p in pairs])
    x = np.log([p[3] for p in pairs])
    out = {"pairs": len(pairs), "mean_ratio": float(np.exp(y.mean())),
           "mean_host_ratio": float(np.exp(x.mean())), "at_equal_host": None, "se": None,
           "slope": None, "corr": None}  # fmt: skip
    if len(pairs) >= 3 and np.ptp(x) > 0:
        design = np.vstack([np.ones_like(x), x]).T
        coef = np.linalg.lstsq(design, y, rcond=None)[0]
        resid = y - design @ coef
        var = float(resid @ resid) / (len(y) - 2) * np.linalg.inv(design.T @ design)[0, 0]
        out.update(at_equal_host=float(np.exp(coef[0])), se=math.sqrt(var),
                   slope=float(coef[1]), corr=float(np.corrcoef(x, y)[0, 1]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folders", nargs="+", help="folders of per-round bench_e2e.py results")
    ap.add_argument("--temperature", default="0", help="as in the file names (0, 1, ...)")
    ap.add_argument("--levels", default=None, help="concurrency levels to keep, e.g. 1,4,16")
    args = ap.parse_args()
    levels = {int(c) for c in args.levels.split(",")} if args.levels else None
    pairs = round_pairs(args.folders, args.temperature, levels)
    if not pairs:
        print("no round pairs with host timers found", file=sys.stderr)
        return 1
    for c, label, ratio, host in sorted(pairs):
        print(f"c={c:<4} {label:<40} adaptive / fixed: tok/s {ratio - 1:+7.1%}  "
              f"shared host ms {host:.2f}x")
    fit = host_matched_fit(pairs)
    line = (f"{fit['pairs']} pairs: geometric mean {fit['mean_ratio'] - 1:+.1%}, mean host "
            f"ratio {fit['mean_host_ratio']:.2f}x")
    if fit["at_equal_host"] is not None:
        line += (f"; fit at equal host speed {fit['at_equal_host'] - 1:+.1%} (se "
                 f"{fit['se']:.1%}), slope {fit['slope']:.2f}, corr {fit['corr']:.2f}")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
