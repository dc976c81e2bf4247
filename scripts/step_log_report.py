"""Compare servers' step logs (DSPARK_STEP_CLOCK=1 with DSPARK_STEP_CLOCK_LOG, which
bench_e2e.py sets per server: serve_<arm>.log.steps) at the same batch shape.

Per-kind means mix batch sizes (an adaptive engine drafts only below some batch size, no-spec
decodes plainly at every size), so this lines steps up by shape:
  * every kind: steps, device ms (busy + idle before it), mean forward tokens, prefill tokens;
  * decode steps (no prefill) by batch size, in buckets of 32 requests: mean busy ms;
  * steps with prefill chunks whose rows verify nothing, by batch size and forward tokens
    (bins of 256), where every arm has them: mean busy ms, and each arm's mean difference;
  * steps at the full token budget (compute-bound prefill): mean busy ms;
  * the lagged plans' parts (decision / search / other) by kind of step, where the log has
    them (a seventh field since the thirty-fourth session; since the thirty-fifth a search
    says why it ran: search:new / search:spent / search:rate, plan_reuse.StandingPlans.miss),
    and their mean host µs (an eighth field since the thirty-sixth);
  * prefill capacity the budget-bound steps left unused: tokens below the budget in steps
    whose prefill took at least half of it (a prompt was cut there, so the tokens missing are
    draft slots charged but not verified), priced at those steps' own ms per token;
  * with --fit-prefill, the busy time of the steps with prefill chunks (of at least
    --min-rows rows) fitted to an intercept, a price per prefill token and one per other
    token (decode rows and verified drafts): what such a step pays beyond its tokens.

    python3 scripts/step_log_report.py serve_nospec.log.steps serve_adaptive7.log.steps \
        --budget 8192 --last-level
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import numpy as np


def read_steps(path: str) -> list[tuple[str, int, int, int, float, float]]:
    """(kind, requests, forward tokens, prefill tokens, busy ms, idle ms) per line."""
    steps = []
    with open(path) as f:
        for line in f:
            k, r, t, p, b, i = line.split()[:6]
            steps.append((k, int(r), int(t), int(p), float(b), float(i)))
    return steps


def _plan_fields(path: str):
    """(kind, plan part, plan µs or None) of each line with a seventh field."""
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) > 6:
                us = fields[7] if len(fields) > 7 and fields[7] != "-" else None
                yield fields[0], fields[6], None if us is None else float(us)


def plan_parts(path: str) -> dict[str, dict[str, int]]:
    """{kind of step: {plan part: steps}} from a log's seventh field (empty: an older log)."""
    parts: dict[str, dict[str, int]] = defaultdict(dict)
    for kind, part, _ in _plan_fields(path):
        parts[kind][part] = parts[kind].get(part, 0) + 1
    return dict(parts)


def plan_us(path: str) -> dict[str, dict[str, float]]:
    """{kind of step: {plan part: mean host µs}} from a log's eighth field (since the
    thirty-sixth session; empty: an older log)."""
    sums: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for kind, part, us in _plan_fields(path):
        if us is not None:
            acc = sums[kind, part]
            acc[0] += us
            acc[1] += 1
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (kind, part), (total, n) in sums.items():
        out[kind][part] = total / n
    return dict(out)


def last_level(steps: list) -> list:
    """The steps of a sweep's last level: from the start of the ramp that first reaches the
    largest batch (walking back while the batch shrinks: the lowest batch before the ramp,
    which may be the last step of the level before) to the end."""
    if not steps:
        return steps
    top = max(s[1] for s in steps)
    i = next(j for j, s in enumerate(steps) if s[1] == top)
    while i > 0 and steps[i - 1][1] < steps[i][1]:
        i -= 1
    return steps[i:]


def level(steps: list, k: int) -> list:
    """The sweep's k-th level from the end (1: the last): last_level of what the later levels
    leave. Where a level's largest batch first comes mid-level (a closed loop's batch wanders
    above its concurrency: 140 rows at c = 128), the window starts there: check its steps."""
    for _ in range(k - 1):
        steps = steps[: len(steps) - len(last_level(steps))]
    return last_level(steps)


def prefill_fit(named: dict[str, list], min_rows: int = 1) -> list[str]:
    """Least squares of the busy ms of steps with prefill chunks (at least `min_rows` rows)
    against an intercept, their prefill tokens and their other tokens."""
    out = []
    for name, steps in named.items():
        fit = [s for s in steps if s[3] > 0 and s[1] >= min_rows]
        if len(fit) < 4:
            continue
        a = np.array([[1.0, s[3], s[2] - s[3]] for s in fit])
        (c0, cp, cd), *_ = np.linalg.lstsq(a, np.array([s[4] for s in fit]), rcond=None)
        out.append(f"  {name}: {len(fit)} steps, intercept {c0:.2f} ms, {cp * 1e3:.2f} us a "
                   f"prefill token, {cd * 1e3:.2f} us a decode or verify token")  # fmt: skip
    head = f"steps with prefill chunks of {min_rows}+ rows, busy ms fitted:"
    return [head] + out if out else []


def report(name: str, steps: list, budget: int) -> list[str]:
    ms = sum(s[4] + max(s[5], 0.0) for s in steps)
    out = [f"{name}: {len(steps)} steps, {ms:,.0f} ms (busy + idle)"]
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, 0])
    for k, _, t, p, b, _ in steps:
        e = kinds[k]
        e[0], e[1], e[2], e[3] = e[0] + 1, e[1] + b, e[2] + t, e[3] + p
    for k, (n, b, t, p) in sorted(kinds.items()):
        out.append(f"  {k:<13} {n:5d} steps {b:9,.0f} ms busy  {t / n:7.0f} tokens/step  "
                   f"{p:8,d} prefill tokens")  # fmt: skip
    full = [s[4] for s in steps if s[2] >= budget]
    if full:
        out.append(f"  at the full budget ({budget} tokens): {len(full)} steps, "
                   f"{sum(full) / len(full):.1f} ms each")  # fmt: skip
    bound = [s for s in steps if s[3] >= budget // 2]
    if bound:
        unused = sum(max(budget - s[2], 0) for s in bound)
        per_token = sum(s[4] for s in bound) / sum(s[2] for s in bound)
        out.append(f"  budget-bound steps with prefill: {len(bound)}, {unused:,d} tokens of "
                   f"the budget unused (~{unused * per_token:,.0f} ms at their "
                   f"{per_token * 1e3:.1f} us a token)")  # fmt: skip
    return out


def decode_by_batch(named: dict[str, list], width: int = 32) -> list[str]:
    """Mean busy ms of decode steps (no prefill) per kind and batch bucket, arms side by side."""
    cells: dict[tuple[str, int], dict[str, list]] = defaultdict(dict)
    for name, steps in named.items():
        for k, r, _, p, b, _ in steps:
            if p == 0:
                cells[(k, r // width * width)].setdefault(name, []).append(b)
    out = [f"decode steps by batch size (mean busy ms, steps): {' | '.join(named)}"]
    for (k, lo), by_arm in sorted(cells.items()):
        row = " | ".join(f"{sum(v) / len(v):6.2f} ({len(v):3d})" if (v := by_arm.get(n))
                         else f"{'-':>12}" for n in named)  # fmt: skip
        out.append(f"  {k:<7} {lo:4d}-{lo + width - 1:<4d} {row}")
    return out


def prefill_by_shape(named: dict[str, list], req_width: int = 32,
                     tok_width: int = 256) -> list[str]:  # fmt: skip
    """Mean busy ms of steps with prefill chunks whose rows verify nothing (kind `mixed`) per
    batch bucket and forward-token bin where the first arm and another have such steps, arms
    side by side; last, each other arm's mean difference from the first over the cells both
    have (weighted by the fewer steps of the two). A cost that every such step pays whatever
    its tokens shows as the same difference in every bin (twenty-ninth session: the LM head
    over 1 + K rows a request)."""
    cells: dict[tuple[int, int], dict[str, list]] = defaultdict(dict)
    for name, steps in named.items():
        for k, r, t, p, b, _ in steps:
            if k == "mixed" and p > 0:
                cells[(r // req_width, t // tok_width)].setdefault(name, []).append(b)
    first, others = list(named)[0], list(named)[1:]
    shared = {key: arms for key, arms in cells.items()
              if first in arms and any(n in arms for n in others)}  # fmt: skip
    if not shared:
        return []
    out = ["steps with prefill, no row verifying, by batch size and forward tokens "
           f"(mean busy ms, steps): {' | '.join(named)}"]
    diff = {n: [0.0, 0, 0] for n in others}  # weighted sum, weight, cells
    for (rq, tk), arms in sorted(shared.items()):
        means = {n: sum(v) / len(v) for n, v in arms.items()}
        row = " | ".join(f"{means[n]:7.2f} ({len(arms[n]):3d})" if n in arms else f"{'-':>13}"
                         for n in named)  # fmt: skip
        out.append(f"  {rq * req_width:4d}-{(rq + 1) * req_width - 1:<4d} req "
                   f"{tk * tok_width:5d}-{(tk + 1) * tok_width - 1:<5d} tokens  {row}")
        for n in others:
            if n in arms:
                w = min(len(arms[n]), len(arms[first]))
                d = diff[n]
                d[0], d[1], d[2] = d[0] + w * (means[n] - means[first]), d[1] + w, d[2] + 1
    out += [f"  {n} against {first}: {d / w:+.2f} ms a step (weighted mean over {c} cells)"
            for n, (d, w, c) in diff.items() if c]  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="step logs (serve_<arm>.log.steps)")
    ap.add_argument("--budget", type=int, default=8192, help="the servers' max batched tokens")
    ap.add_argument("--last-level", action="store_true",
                    help="only the sweep's last level (the ramp to the largest batch onwards)")
    ap.add_argument("--level", type=int, default=0, metavar="K",
                    help="only the sweep's K-th level from the end (1: --last-level)")
    ap.add_argument("--fit-prefill", action="store_true",
                    help="fit the busy time of the steps with prefill chunks (see above)")
    ap.add_argument("--min-rows", type=int, default=1, help="of the steps --fit-prefill fits")
    args = ap.parse_args(argv)
    k = args.level or int(args.last_level)
    named, parts = {}, []
    for path in args.logs:
        steps = read_steps(path)
        name = os.path.basename(path).removeprefix("serve_").split(".")[0]
        named[name] = level(steps, k) if k else steps
        by_kind = plan_parts(path) if not k else {}  # (whole logs only)
        if any(p != "-" for kinds in by_kind.values() for p in kinds):
            parts.append(f"{name} plans by kind of step: " + "; ".join(
                f"{k} " + ", ".join(f"{p} {n}" for p, n in sorted(v.items()))
                for k, v in sorted(by_kind.items())))  # fmt: skip
        us = plan_us(path) if not k else {}
        if us:
            parts.append(f"{name} plan µs by kind of step (mean): " + "; ".join(
                f"{k} " + ", ".join(f"{p} {m:.0f}" for p, m in sorted(v.items()))
                for k, v in sorted(us.items())))  # fmt: skip
    lines = [ln for name, steps in named.items() for ln in report(name, steps, args.budget)]
    fit = prefill_fit(named, args.min_rows) if args.fit_prefill else []
    print("\n".join(lines + parts + decode_by_batch(named) + prefill_by_shape(named) + fit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
