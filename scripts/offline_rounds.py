"""Each offline round's diagnostics in the interleaved sweep's summary (e2e_report.py prints
them after the throughput table): what a speculative arm's policy did, each arm's step
periods by kind, and, with --host-timers, each arm's host work per step by part."""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dspark.spec.tracing import STEP_KINDS  # noqa: E402  (the kinds a server counts)

# the host parts printed, outermost first (they nest: dspark/engine/host_timers.py)
HOST_PARTS = ("schedule", "launch", "plan", "graph_start", "conf_copy", "wait_commit",
              "commit", "observe", "outputs")  # fmt: skip


def arm_levels(sweep: dict, arm: str, t: float) -> list[dict]:
    """One arm's offline rows at temperature t, a level each ([] for an arm cut short)."""
    return (sweep["arms"].get(arm) or {}).get("by_temperature", {}).get(f"{t:g}") or []


def _margin(verdicts: dict | None) -> str:
    """" m+8%": a round's drafting verdicts put drafting 8% ahead of plain decoding (the
    geometric mean of their rate ratios); "" where the round had none."""
    if not verdicts or not verdicts.get("decisions"):
        return ""
    return f" m{math.exp(verdicts['log_spec_over_plain'] / verdicts['decisions']) - 1:+.0%}"


def _kind_ms(kinds: dict) -> str:
    """"-/0.51/0.87/1.20": a round's mean period of its steps by kind (STEP_KINDS order; "-"
    where it ran none)."""
    return "/".join(f"{kinds[k][1] / kinds[k][0]:.3f}" if kinds[k][0] else "-"
                    for k in STEP_KINDS)  # fmt: skip


def _survival(policy: dict | None) -> str:
    """" s2.10/1.53/1.40": over a round's checked predictions, the drafts a row got accepted,
    the decision's estimate of them and its confidences' (unscaled); "" where none."""
    tally = (policy or {}).get("survival") or {}
    rows = tally.get("rows")
    if not rows:
        return ""
    return " s" + "/".join(f"{tally[k] / rows:.2f}" for k in ("accepted", "estimated", "raw"))


def _priced(policy: dict | None) -> str:
    """" p0.639/1.470": the plain and verify-all step times (ms) a round's drafting verdicts
    priced, on average (beside the measured periods: which side a verdict erred on); ""
    where it priced none, or ran before the verdicts kept them."""
    v = (policy or {}).get("verdicts") or {}
    n = v.get("decisions")
    if not n or "verify_ms" not in v:
        return ""
    return f" p{v['plain_ms'] / n:.3f}/{v['verify_ms'] / n:.3f}"


def _followed(followed: int | None, steps: int | None) -> str:
    """" f412/530": steps launched following the step in flight, of all (when any)."""
    return f" f{followed}/{steps}" if followed else ""


def _on_graphs(graph: int | None, steps: int | None) -> str:
    """" g380/420": steps run on whole-step graphs, of all (engines with graphs)."""
    return "" if graph is None else f" g{graph}/{steps}"


def _level_end(steps: int | None, share: float | None) -> str:
    """" e18%/106": the share of a round's own time in the level's end (steps begun with
    fewer than C requests held: closed_loop._steps), and those steps (when any)."""
    return f" e{share:.0%}/{steps}" if steps else ""


def print_offline_steps(names: list[str], sweep: dict) -> None:
    """Each arm's mean step period by kind in every offline round (where an arm's time went
    beside another's: fifty-third session), and what a speculative arm's decisions priced
    (plain and verify-all steps; the survival against what was accepted)."""
    def per_round(lv: dict) -> list[str]:
        kinds = lv.get("rounds_kinds") or []
        policies = lv.get("rounds_policy") or [None] * len(kinds)
        followed = lv.get("rounds_followed") or [(None, None)] * len(kinds)
        graph = lv.get("rounds_graph") or [(None, None)] * len(kinds)
        end = lv.get("rounds_end") or [(None, None)] * len(kinds)
        return [_kind_ms(k) + _priced(p) + _survival(p) + _followed(*f) + _on_graphs(*g)
                + _level_end(*e)
                for k, p, f, g, e in zip(kinds, policies, followed, graph, end, strict=True)
                if k]  # fmt: skip

    for t in sweep["temperatures"]:
        for n in names:
            _print_levels(f"{n} offline at T={t:g}, each round's ms a step by kind "
                          f"({' / '.join(STEP_KINDS)}; the engine's periods), p: the plain / "
                          "verify-all step ms its drafting verdicts priced, s: drafts a "
                          "checked row got accepted / the decision's estimate / its "
                          "confidences', f: steps that followed the one in flight / all "
                          "(when any), g: steps on whole-step graphs / all (the others: the "
                          "per-phase path), e: the share of its time in the level's end "
                          "(steps begun with fewer than C requests held) / those steps: ",
                          arm_levels(sweep, n, t), per_round)


def _print_levels(head: str, levels: list[dict], per_round) -> None:
    """`head`, then "c=C " and each level's rounds (per_round(level): strings), for the
    levels with any; nothing where none has."""
    cells = [f"c={lv['max_concurrency']} " + ", ".join(rounds)
             for lv in levels if (rounds := per_round(lv))]  # fmt: skip
    if cells:
        print(head + "; ".join(cells))


def print_offline_policy(names: list[str], sweep: dict) -> None:
    """What each speculative arm's policy did in every offline round, in run order: its
    steps by kind, drafting decisions, and drafts verified a request (the thing adaptive
    verification changes; forty-third session: a round lost at C = 256 had verified 698 a
    request against fixed K's 799)."""
    def per_round(lv: dict) -> list[str]:
        policies = lv.get("rounds_policy") or [lv.get("policy")]
        verified = lv.get("rounds_verified") or [
            (lv.get("spec_decode") or {}).get("verified_tokens_per_request")]
        return [
            "/".join(str(p["steps_by_kind"].get(k, 0)) for k in STEP_KINDS)
            + f" d{p['plans'].get('decision', 0)}" + _margin(p.get("verdicts"))
            + f" v{v:.0f}"
            + (f" r{p['context']['rebuilt_tokens']}"
               if p.get("context", {}).get("rebuilt_tokens") else "")
            for p, v in zip(policies, verified, strict=True)
            if p is not None and v is not None]  # fmt: skip

    for t in sweep["temperatures"]:
        for n in names:
            rows = arm_levels(sweep, n, t)
            _print_levels(f"{n} offline at T={t:g}, each round's steps by kind "
                          f"({' / '.join(STEP_KINDS)}), decisions d (m: by how much their "
                          "verdicts priced drafting ahead of plain decoding, geometric mean), "
                          "drafts verified a request v, context tokens rebuilt r (when any): ",
                          rows, per_round)
            shares = [(lv["max_concurrency"], lv.get("scheduler_overhead")) for lv in rows]
            if any(x is not None for _, x in shares):  # (the median round's, per level)
                print(f"{n} offline scheduler overhead at T={t:g} (plan + alloc, % of step "
                      "time): " + ", ".join(f"c={c} {x:.2%}" for c, x in shares
                                            if x is not None))  # fmt: skip


def print_offline_host(names: list[str], sweep: dict) -> None:
    """With --host-timers: each arm's host ms per step by part in every round (HOST_PARTS
    order, "-" for a part the arm does not have); then every adaptive arm's plans by path.
    Arms run in turns on one host, so a part that differs between them at the same level is
    work one arm does and the other does not (the fifty-seventh session's question:
    adaptive's verify-all steps took 3-7% longer than fixed K's identical ones at
    C = 16-64)."""
    def per_round(lv: dict) -> list[str]:
        return ["/".join(f"{h[p]:.3f}" if p in h else "-" for p in HOST_PARTS)
                for h in lv.get("rounds_host") or () if h]  # fmt: skip

    for t in sweep["temperatures"]:
        for n in names:
            _print_levels(f"{n} offline at T={t:g}, host ms per step by part "
                          f"({' / '.join(HOST_PARTS)}; nested: launch holds plan and "
                          "graph_start, which holds conf_copy; wait_commit holds commit): ",
                          arm_levels(sweep, n, t), per_round)
    for t in sweep["temperatures"]:
        for n in names:
            _print_levels(f"{n} offline at T={t:g}, plans by path (count x µs each): ",
                          arm_levels(sweep, n, t), _plan_paths)


def _plan_paths(lv: dict) -> list[str]:
    """Each round's "cruise 410x9 standing 120x21 decision 13x480" (most plans first)."""
    out = []
    for p in lv.get("rounds_policy") or ():
        counts, ms = (p or {}).get("plan_paths"), (p or {}).get("plan_path_ms") or {}
        if counts:
            out.append(" ".join(f"{k} {n}x{ms.get(k, 0.0) * 1e3 / n:.0f}"
                                for k, n in sorted(counts.items(), key=lambda x: -x[1]) if n))
    return out
