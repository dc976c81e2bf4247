"""The summary bench_e2e.py prints: output tok/s by arm, level and temperature, then the
per-level diagnostics the servers' /metrics gave (see print_table); and what the servers'
logs say (graphs captured, drafting turned on or off)."""

from __future__ import annotations

import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from closed_loop import DIVERGED_KEPT  # noqa: E402  (scripts/ is on the path: run from it)
from offline_rounds import (  # noqa: E402  (each offline round's policy, steps and host work)
    arm_levels,
    print_offline_host,
    print_offline_policy,
    print_offline_steps,
)

from dspark.spec.confidence import SAMPLING_MODES  # noqa: E402
from dspark.spec.drafting_log import (  # noqa: E402  (its drafting decisions)
    FLIP_LOG_BURST,
    FLIP_LOG_PREFIX,
)
from dspark.spec.online_cost import bucket_label, size_bucket  # noqa: E402
from dspark.spec.tracing import STEP_KINDS  # noqa: E402  (the kinds a server counts)


def decision_state(delta: dict, conc: int, temp: float) -> str | None:
    """The adaptive server's learned fixed terms at `conc` requests and its acceptance ratio
    (sampling mode of `temp`), read from /metrics at the end of a level."""
    mode = SAMPLING_MODES[0 if temp == 0 else 1]  # (greedy, sampled)
    terms = (delta.get("learned_fixed_ms") or {}).get(mode) or {}
    ratio = (delta.get("acceptance_ratio") or {}).get(mode)
    if not terms and ratio is None:
        return None
    batch = bucket_label(size_bucket(conc))
    spec, plain = ((terms.get(kind) or {}).get(batch) for kind in ("spec", "plain"))
    ms = "/".join("-" if v is None else f"{v:.2f}" for v in (spec, plain))
    return ms + ("" if ratio is None else f"; {ratio:.2f}")


def paired_by_round(levels: list[dict], against: int | None = None) -> list[float] | None:
    """Adaptive over the better of no-spec and fixed K within each round of one level
    (`levels`: the three arms' results of that level, in `names` order; each holds
    `rounds_output_throughput` when the level ran in rounds), or over arm `against` (0:
    no-spec, 1: fixed K) alone. The arms of a round run back to back, so a host that drifts
    between rounds moves the three together more than it moves the median rounds, which can
    each come from a different round. The better of two noisy figures reads high by their
    noise, so adaptive reads low against it where two arms are close; against one arm the
    ratio has no such bias. None: no rounds."""
    rounds = [lv.get("rounds_output_throughput") for lv in levels]
    if any(r is None for r in rounds) or len({len(r) for r in rounds}) != 1:
        return None
    nospec, fixed, adaptive = rounds
    base = [max(n, f) for n, f in zip(nospec, fixed)] if against is None else rounds[against]
    return [a / b - 1.0 for a, b in zip(adaptive, base)]


def order_balanced(adaptive: list[float], base: list[float],
                   adaptive_first: list[bool]) -> float | None:  # fmt: skip
    """Adaptive over a base arm from the rounds of one level, balanced for run order: the
    mean log-ratio over the rounds adaptive ran first and that over the rounds it ran second,
    averaged. On the H200 the arm run second was the faster in every round pair of a served
    level (thirty-ninth session: +23.3, +8.5, +1.2%), so with 3 rounds alternating the order
    the arm that ran second twice is favoured by the median round and by the median pair.
    None: one of the two orders never ran."""
    groups: tuple[list, list] = ([], [])
    for a, b, first in zip(adaptive, base, adaptive_first, strict=True):
        if a > 0 and b > 0:
            groups[first].append(math.log(a / b))
    if not (groups[0] and groups[1]):
        return None
    return math.exp((statistics.fmean(groups[0]) + statistics.fmean(groups[1])) / 2) - 1


def balanced_cell(adaptive: dict, base: dict, key: str, names: tuple[str, str]) -> str | None:
    """One level's order-balanced ratio of arm names[0] (row `adaptive`) over names[1] (row
    `base`), each row holding its rounds' throughput under `key` and the arms' order in each
    round under "rounds_order"; then each round's ratio, marked A where adaptive ran first.
    None: no rounds, or one order never ran."""
    a, b, orders = adaptive.get(key), base.get(key), adaptive.get("rounds_order")
    if not (a and b and orders) or not (len(a) == len(b) == len(orders)):
        return None
    first = [o.index(names[0]) < o.index(names[1]) for o in orders]
    ratio = order_balanced(a, b, first)
    if ratio is None:
        return None
    pairs = " / ".join(f"{x / y - 1:+.1%}{'A' if f else ''}" for x, y, f in zip(a, b, first))
    return f"c={adaptive['max_concurrency']} {ratio:+.1%} ({pairs})"


def print_balanced(names: list[str], adaptive_rows: list[dict], base_rows: list[dict],
                   key: str, what: str) -> None:  # fmt: skip
    """The order-balanced line of arm names[-1] over names[-2] across a sweep's levels."""
    cells = [balanced_cell(a, b, key, (names[-1], names[-2]))
             for a, b in zip(adaptive_rows, base_rows)]  # fmt: skip
    if any(cells):
        print(f"{names[-1]} vs {names[-2]} {what}, order-balanced (the mean log-ratio of the "
              f"rounds {names[-1]} ran first, A, and of those it ran second, averaged; each "
              "round's ratio): " + ", ".join(c for c in cells if c))


def shared_host_by_round(levels: list[dict]) -> list[float] | None:
    """Per round of one level, adaptive's host ms per step in the parts every speculative
    arm shares (bench_e2e.shared_host_ms) over fixed K's (`levels`: no-spec, fixed K,
    adaptive). Above 1: adaptive's host ran slower that round in code both arms run alike,
    which moves the pair's throughput ratio with it. None: no per-round host timers."""
    rounds = [lv.get("rounds_shared_host_ms") for lv in levels[1:]]
    if any(r is None for r in rounds) or len({len(r) for r in rounds}) != 1:
        return None
    fixed, adaptive = rounds
    return [a / f if f > 0 else float("nan") for a, f in zip(adaptive, fixed)]


def versus_header(names: list[str]) -> str:
    """The comparison column's title for arms `names` (no-spec, fixed, adaptive, or one of
    the first two and adaptive)."""
    return "adaptive vs best / vs fixed" if len(names) == 3 else f"{names[-1]} vs {names[0]}"


def versus_ratio(tput: list[float]) -> str:
    """The comparison column of one level: adaptive (last) against the better of the other
    two and against fixed K, or against the one other arm."""
    if len(tput) == 3:
        return f"{tput[2] / max(tput[0], tput[1]) - 1:+.1%} / {tput[2] / tput[1] - 1:+.1%}"
    return f"{tput[-1] / tput[0] - 1:+.1%}"


def print_table(names: list[str], temps, results, checks, label) -> None:
    """The arms' throughput by level and temperature (`names`: no-spec, fixed, adaptive, or
    one of the first two and adaptive), then what each level's counters say: the adaptive
    server's steps by kind, scheduler overhead, learned fixed terms and the steps they came
    from, every arm's host CPU, host time by part and step clock; the offline checks last."""
    print(f"\n=== {label}end-to-end: output tok/s (TPOT p50 ms | acceptance length) ===")
    for t in temps:
        print(f"-- temperature {t:g}")
        print("conc " + "".join(f"{n:>30}" for n in names) + "   " + versus_header(names))
        levels = results[(names[0], t)]["results"]
        for i, lvl in enumerate(levels):
            cells, tput = [], []
            for n in names:
                r = results[(n, t)]["results"][i]
                sd = r.get("spec_decode") or {}
                acc = sd.get("mean_acceptance_length")
                tput.append(r["output_throughput"])
                tpot = r["tpot_ms"]["p50"]  # None: the server streamed no per-token output
                tpot = "-" if tpot is None else f"{tpot:.2f}"
                cells.append(f"{r['output_throughput']:9.1f} ({tpot:>6} | "
                             f"{acc if acc is None else round(acc, 2)!s:>4})")  # fmt: skip
            print(f"{lvl['max_concurrency']:>4} " + "".join(f"{c:>30}" for c in cells)
                  + f"   {versus_ratio(tput)}")
        by_level = [[results[(n, t)]["results"][i] for n in names] for i in range(len(levels))]
        paired = [paired_by_round(arms_of_level) if len(names) == 3 else None
                  for arms_of_level in by_level]  # (the pairing needs the three arms)
        if any(paired):  # the per-round spread a median-round verdict sits in
            print(f"{names[-1]} vs best, paired by round (median): " + ", ".join(
                f"c={lvl['max_concurrency']} " + " / ".join(f"{x:+.1%}" for x in p)
                + f" ({statistics.median_low(p):+.1%})"  # (median_round's lower middle)
                for lvl, p in zip(levels, paired) if p))  # fmt: skip
            arms = [[paired_by_round(arms_of_level, j) for arms_of_level in by_level]
                    for j in (1, 0)]  # fmt: skip
            print(f"{names[-1]} vs {names[1]} / vs {names[0]}, median of the round pairs: "
                  + ", ".join(f"c={lvl['max_concurrency']} "
                              f"{statistics.median_low(f):+.1%} / {statistics.median_low(n):+.1%}"
                              for lvl, f, n in zip(levels, *arms) if f))  # fmt: skip
            shared = [shared_host_by_round(arms_of_level) for arms_of_level in by_level]
            if any(shared):  # how fast the host ran for each arm of each pair
                print(f"{names[-1]} vs {names[1]} by round, with {names[-1]} / {names[1]} host "
                      "ms per step in the parts both run alike (commit, outputs, schedule): "
                      + ", ".join(f"c={lvl['max_concurrency']} " + " ".join(
                          f"{x:+.1%} ({h:.2f}x)" for x, h in zip(f, sh))
                          for lvl, f, sh in zip(levels, arms[0], shared) if f and sh))
        print_balanced(names, results[(names[-1], t)]["results"],
                       results[(names[-2], t)]["results"], "rounds_output_throughput", "served")
        deltas = [(r.get("spec_decode") or {}).get("metrics_delta") or r.get("spec_decode")
                  or {} for r in results[(names[-1], t)]["results"]]  # fmt: skip
        kinds = [d.get("steps_by_kind") for d in deltas]
        if any(kinds):  # what the adaptive server ran at each level
            print(f"{names[-1]} steps by kind ({' / '.join(STEP_KINDS)}): " + ", ".join(
                f"c={lvl['max_concurrency']} " + "/".join(f"{(k or {}).get(x, 0):.0f}"
                                                          for x in STEP_KINDS)
                for lvl, k in zip(levels, kinds)))  # fmt: skip
        overheads = [r.get("scheduler_overhead") for r in results[(names[-1], t)]["results"]]
        if any(overheads):  # planning + allocation over each level, from the server's counters
            print(f"{names[-1]} scheduler overhead in serving (% of step time: plan + alloc us "
                  "per step): " + ", ".join(
                      f"c={lvl['max_concurrency']} {o['fraction']:.2%} ("
                      f"{o['plan_ms_per_step'] * 1e3:.0f}+{o['alloc_ms_per_step'] * 1e3:.0f})"
                      for lvl, o in zip(levels, overheads) if o))  # fmt: skip
        states = [decision_state(d, lvl["max_concurrency"], t) for lvl, d in zip(levels, deltas)]
        if any(states):  # what its drafting decision stood on at the end of each level
            print(f"{names[-1]} learned fixed terms at the level's batch size (speculative / "
                  "plain ms; acceptance ratio): " + ", ".join(
                      f"c={lvl['max_concurrency']} {st}" for lvl, st in zip(levels, states)
                      if st))  # fmt: skip
        observed = [r.get("observed_steps") for r in results[(names[-1], t)]["results"]]
        if any(observed):  # what those terms were learned from, at the level's batch size
            print(f"{names[-1]} steps its fixed terms learned from at the level's batch size "
                  "(kind count: mean period / mean residual ms): " + ", ".join(
                      f"c={lvl['max_concurrency']} " + " ".join(
                          f"{k} {v['steps']:.0f}: {v['step_ms']:.2f}/{v['residual_ms']:.2f}"
                          for k, by_batch in sorted(o.items())
                          for v in [by_batch.get(bucket_label(size_bucket(
                              lvl["max_concurrency"])))] if v)
                      for lvl, o in zip(levels, observed) if o))  # fmt: skip
        for n in names:  # who was busy: a process near 1.0 core bounds the level, not the GPU
            cpus = [r.get("host_cpu") for r in results[(n, t)]["results"]]
            if any(cpus):
                print(f"{n} host CPU, cores busy (client/server/engine process): " + ", ".join(
                    f"c={lvl['max_concurrency']} " + "/".join(
                        f"{(c or {}).get(w, float('nan')):.2f}"
                        for w in ("client", "server", "engine"))
                    for lvl, c in zip(levels, cpus)))  # fmt: skip
        for n in names:  # servers started with DSPARK_HOST_TIMERS=1 (parts nest)
            hosts = [r.get("host_ms_per_step") for r in results[(n, t)]["results"]]
            if any(hosts):
                print(f"{n} engine host ms per step by part: " + ", ".join(
                    f"c={lvl['max_concurrency']} " + " ".join(
                        f"{k} {v:.3f}" for k, v in sorted((h or {}).items()))
                    for lvl, h in zip(levels, hosts)))  # fmt: skip
        for n in names:  # servers started with DSPARK_STEP_CLOCK=1
            clocks = [r.get("step_clock") for r in results[(n, t)]["results"]]
            if any(clocks):
                print(f"{n} device ms per step by kind, busy + idle before it: " + ", ".join(
                    f"c={lvl['max_concurrency']} " + " ".join(
                        f"{k} {v['busy_ms_per_step']:.2f}+{v['idle_ms_per_step']:.2f}"
                        for k, v in sorted((c or {}).items()))
                    for lvl, c in zip(levels, clocks)))  # fmt: skip
    print("whole-step CUDA graphs per arm (captured / capture failures): "
          + ", ".join(f"{a} {g['captured']}/{g['failures']}"
                      for a, g in checks.get("graphs", {}).items()))  # fmt: skip
    print_flips("adaptive server", checks.get("drafting_flips") or [])
    print_checks(checks)


def print_checks(checks: dict) -> None:
    """The offline identity pass: T = 0 tokens across arms, and its scheduler overhead."""
    o = checks["overhead"] or {}
    if checks["num_prompts"] == 0:
        print("T=0 identity and offline overhead: not checked (--identity-prompts 0)")
    elif checks["identical_at_t0"] is None:
        print("T=0 identity: not checked (synthetic acceptance is not lossless by design)")
    else:
        print(f"T=0 identical tokens across arms: {checks['identical_at_t0']} "
              f"({checks['num_prompts']} prompts; differing prompts vs the first arm: "
              f"{checks.get('mismatching_prompts')})")
    if o:
        by_part = ", ".join(f"{p} {n} x {ms / n * 1e3:.0f} us" for p, (n, ms)
                            in (o.get("plan_by_part") or {}).items() if n)  # fmt: skip
        print(f"scheduler overhead: plan {o['plan_ms']:.1f} ms + alloc {o['alloc_ms']:.1f} ms "
              f"= {o['fraction']:.2%} of step time ({o['steps']} steps; plans: {by_part})")


def print_offline_table(names: list[str], sweep: dict, label: str = "") -> None:
    """The closed-loop sweep of the offline API (offline_sweep.py, bench_e2e --offline-sweep):
    output tok/s by arm, temperature and level, with the engine's median batch (requests
    running after a step) and the acceptance length; an arm cut short shows as '-'."""
    done = sweep["arms"]
    turns = sweep.get("turn_steps") or 0
    how = (f"; the arms at once in turns of {turns} steps, each timed by its own turns"
           if turns else "")  # fmt: skip
    print(f"\n=== {label}offline API, closed loop, concurrency C (no HTTP server): output "
          f"tok/s (batch p50 | acceptance length){how} ===")
    for t in sweep["temperatures"]:
        print(f"-- temperature {t:g}")
        print("   C " + "".join(f"{n:>28}" for n in names) + "   " + versus_header(names))
        for i, c in enumerate(sweep["levels"]):
            rows = [arm_levels(sweep, n, t) for n in names]
            levels = [r[i] if i < len(r) else None for r in rows]
            cells = []
            for lv in levels:
                if lv is None:
                    cells.append("-")
                    continue
                acc = (lv.get("spec_decode") or {}).get("mean_acceptance_length")
                acc = "-" if acc is None else f"{acc:.2f}"
                cells.append(f"{lv['output_throughput']:9.1f} ({lv['batch_p50']:>4} | {acc:>4})")
            tput = [None if lv is None else lv["output_throughput"] for lv in levels]
            ratio = "" if None in tput else versus_ratio(tput)
            print(f"{c:>4} " + "".join(f"{x:>28}" for x in cells) + f"   {ratio}")
    if sweep.get("rounds", 1) > 1:  # (the rows above are each level's median round)
        for t in sweep["temperatures"]:
            for n in names:
                rows = arm_levels(sweep, n, t)
                cells = "; ".join(f"c={lv['max_concurrency']} " + "/".join(
                    f"{x:.0f}" for x in lv.get("rounds", ())) for lv in rows)  # fmt: skip
                print(f"{n} offline rounds at T={t:g}, tok/s in run order: {cells}")
            rows = [arm_levels(sweep, n, t) for n in names[-2:]]
            print_balanced(names, rows[1], rows[0], "rounds", f"offline at T={t:g}")
    for n in names:
        if n in done and done[n].get("cost_table"):
            print(f"{n} offline engine's cost table: {done[n]['cost_table']}")
    print_offline_identity(names, sweep)
    print_offline_policy(names, sweep)
    print_offline_steps(names, sweep)
    print_offline_host(names, sweep)


def print_offline_identity(names: list[str], sweep: dict) -> None:
    """The T = 0 check of the interleaved offline sweep (closed_loop.compare_tokens): per
    arm, level and round, its prompts whose tokens equal those of the arm run first."""
    rows = {n: arm_levels(sweep, n, 0.0) for n in names}
    base = "/".join(n for n, lv in rows.items()
                    if lv and not any(lv[0].get("rounds_t0_identical") or ())) or "?"  # fmt: skip
    for n, levels in rows.items():
        counts = [(lv["max_concurrency"], lv.get("rounds_t0_identical") or ()) for lv in levels]
        if not any(c for _, per in counts for c in per):
            continue
        same = sum(c[0] for _, per in counts for c in per if c)
        total = sum(c[1] for _, per in counts for c in per if c)
        print(f"{n} offline at T=0, prompts whose tokens equal {base}'s "
              f"({same} of {total}; per level, each round): " + "; ".join(
                  f"c={c} " + ", ".join(f"{x[0]}/{x[1]}" for x in per if x)
                  for c, per in counts))  # fmt: skip
        firsts = [(lv["max_concurrency"], d) for lv in levels
                  for d in (lv.get("rounds_t0_diverged") or ())[:1] if d]  # fmt: skip
        if firsts:
            print(f"{n} offline at T=0, where outputs left {base}'s (prompt"
                  f"@first differing token; each level's first round, up to {DIVERGED_KEPT} "
                  "prompts): " + "; ".join(f"c={c} " + " ".join(f"{p}@{i}" for p, i in d)
                                           for c, d in firsts))  # fmt: skip


def print_flips(who: str, flips: list[str]) -> None:
    """The drafting decision's logged turns on or off (drafting_flips below), the first 10."""
    print(f"{who}: drafting turned on/off {len(flips)} times in its log (INFO: bursts of "
          f"{FLIP_LOG_BURST}, then at most one a second){'; the first 10:' if flips else ''}")
    for line in flips[:10]:
        print(f"  drafting {line}")


def graph_status(log_path: str) -> dict:
    """Whole-step CUDA graphs captured, and capture failures, as the server logged them."""
    try:
        text = open(log_path).read()
    except OSError:
        return {"captured": None, "failures": None}
    return {"captured": text.count("captured whole-step CUDA graph"),
            "failures": text.count("capture failed, per-phase path")
            + text.count("CUDA graph capture failed: running eagerly")
            + text.count("prefill CUDA graph capture failed")}  # fmt: skip


def drafting_flips(log_path: str) -> list[str]:
    """The adaptive server's logged turns of drafting on or off, in order (INFO: every turn of
    a burst of FLIP_LOG_BURST, then at most one a second; each with the rates it compared)."""
    try:
        lines = open(log_path).read().splitlines()
    except OSError:
        return []
    return [line.split(FLIP_LOG_PREFIX, 1)[1] for line in lines if FLIP_LOG_PREFIX in line]
