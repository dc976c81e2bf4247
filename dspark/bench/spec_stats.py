"""Speculation statistics of a benchmark level: totalled from the responses' `spec_decode`
objects, or as the growth of a dspark server's Prometheus counters over the level (with its
steps by kind)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp

    from dspark.bench.serve import BenchConfig, RequestOutput

# `spec_decode` response fields -> the Prometheus counters that total them server-wide
SPEC_COUNTERS = {
    "num_drafted_tokens": "dspark_spec_drafted_tokens_total",
    "num_verified_tokens": "dspark_spec_verified_tokens_total",
    "num_accepted_tokens": "dspark_spec_accepted_tokens_total",
    "num_steps": "dspark_spec_num_steps_total",
}
SPEC_FIELDS = tuple(SPEC_COUNTERS)
# a speculative server's steps by kind (a kind's series appears once it has counted a step)
STEP_KIND_METRIC = "dspark_spec_steps_total"
# the adaptive policy's drafting decision: learned fixed terms and acceptance ratio (gauges)
LEARNED_METRIC = "dspark_spec_learned_fixed_ms"
RATIO_METRIC = "dspark_spec_acceptance_ratio"
# servers started with DSPARK_STEP_CLOCK=1: device busy / idle time by kind of step
CLOCK_METRICS = {"steps": "dspark_step_clock_steps_total",
                 "busy_ms": "dspark_step_device_busy_ms_total",
                 "idle_ms": "dspark_step_device_idle_ms_total"}  # fmt: skip
# CPU seconds of the server's process and of the process running the engine loop (counters)
CPU_METRICS = {"server": "process_cpu_seconds_total", "engine": "dspark_engine_cpu_seconds_total"}
# the adaptive policy's scheduler overhead (planning by part, allocation) and the engine's
# steps, whose wall time is its denominator (counters)
SCHED_METRICS = {"plan": "dspark_spec_plan_ms_total", "alloc": "dspark_spec_alloc_ms_total",
                 "step_ms": "dspark_engine_step_ms_total", "steps": "dspark_engine_steps_total"}
PLANS_METRIC = "dspark_spec_plans_total"
# servers started with DSPARK_HOST_TIMERS=1: host time of the engine's loop by part (counter)
HOST_METRIC = "dspark_engine_host_ms_total"
# an adaptive server's steps its fixed terms were learned from, by kind (counters; the
# residuals' sum is a gauge: it falls where the table overprices steps)
OBSERVED_METRICS = {"steps": "dspark_spec_observed_steps_total",
                    "ms": "dspark_spec_observed_step_ms_total",
                    "residual": "dspark_spec_observed_residual_ms_sum"}  # fmt: skip


def spec_summary(totals: dict[str, float], num_requests: int, source: str) -> dict:
    """Acceptance statistics from drafted / verified / accepted / step totals.
    mean acceptance length = (accepted + steps) / steps (tokens committed per decoding round)."""
    drafted, verified, accepted, steps = (totals[k] for k in SPEC_FIELDS)
    return {
        "source": source,
        **{k: totals[k] for k in SPEC_FIELDS},
        "mean_acceptance_length": (accepted + steps) / steps if steps > 0 else None,
        "acceptance_rate": accepted / verified if verified > 0 else None,
        "verified_tokens_per_request": verified / num_requests if num_requests else None,
        "drafted_tokens_per_request": drafted / num_requests if num_requests else None,
    }


def spec_from_responses(outputs: list[RequestOutput]) -> dict | None:
    stats = [o.spec_decode for o in outputs if o.success and isinstance(o.spec_decode, dict)]
    stats = [s for s in stats if all(isinstance(s.get(k), (int, float)) for k in SPEC_FIELDS)]
    if not stats:
        return None
    totals = {k: sum(s[k] for s in stats) for k in SPEC_FIELDS}
    return spec_summary(totals, len(stats), "responses") | {"num_requests_with_stats": len(stats)}


def parse_prometheus(text: str, names: set[str]) -> dict[str, float]:
    """Sum of each wanted metric over all its label sets (Prometheus text format)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rfind("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        if name in names:
            try:
                found[name] = found.get(name, 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    return found


async def fetch_spec_counters(session: aiohttp.ClientSession, cfg: BenchConfig) -> dict | None:
    """The four `dspark_spec_*` counters from GET /metrics, or None when unavailable."""
    try:
        async with session.get(cfg.root_url + "/metrics", headers=cfg.headers()) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
            one_of_several = "x-dspark-api-server" in resp.headers
    except Exception:  # noqa: BLE001 - metrics are optional
        return None
    counters = counters_from_text(text)
    if counters is not None and one_of_several:  # (dspark serve --api-server-count N: this
        # page's process CPU is one API server's, and the next scrape may reach another)
        counters.pop("cpu:server", None)
    return counters


def counters_from_text(text: str) -> dict | None:
    """The counters `fetch_spec_counters` reads, from a /metrics page (None without the four
    `dspark_spec_*` ones: not a speculative dspark server)."""
    found = parse_prometheus(text, set(SPEC_COUNTERS.values()))
    if len(found) != len(SPEC_COUNTERS):
        return None
    kinds = series_by_label(text, STEP_KIND_METRIC, "kind")
    state = {"learned_fixed_ms": learned_terms(text),
             "acceptance_ratio": series_by_label(text, RATIO_METRIC, "mode")}
    clock = {f"clock:{field}:{kind}": v for field, name in CLOCK_METRICS.items()
             for kind, v in series_by_label(text, name, "kind").items()}  # fmt: skip
    # (one scan for the CPU and scheduler counters; the plan's is summed over its parts)
    more = parse_prometheus(text, set(CPU_METRICS.values()) | set(SCHED_METRICS.values()))
    cpu = {f"cpu:{who}": more[name] for who, name in CPU_METRICS.items() if name in more}
    sched = {f"sched:{k}": more[name] for k, name in SCHED_METRICS.items() if name in more}
    for field, name in (("plan", SCHED_METRICS["plan"]), ("plans", PLANS_METRIC)):
        sched |= {f"sched:{field}:{part}": v
                  for part, v in series_by_label(text, name, "part").items()}  # fmt: skip
    sched |= {f"host:{part}": v for part, v in series_by_label(text, HOST_METRIC, "part").items()}
    sched |= {f"observed:{field}:{labels['kind']}:{labels['batch']}": v
              for field, name in OBSERVED_METRICS.items()
              for labels, v in labelled_series(text, name)
              if {"kind", "batch"} <= labels.keys()}  # fmt: skip
    return {k: found[name] for k, name in SPEC_COUNTERS.items()} | {
        f"steps:{kind}": v for kind, v in kinds.items()} | {
        k: v for k, v in state.items() if v} | clock | cpu | sched


def learned_terms(text: str) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {kind: {batch range: ms}}} from the learned-fixed-term gauges."""
    found: dict[str, dict[str, dict[str, float]]] = {}
    for labels, ms in labelled_series(text, LEARNED_METRIC):
        if {"mode", "kind", "batch"} <= labels.keys():
            found.setdefault(labels["mode"], {}).setdefault(labels["kind"], {})[
                labels["batch"]] = ms
    return found


def series_by_label(text: str, name: str, label: str) -> dict[str, float]:
    """The values of a metric's series keyed by one label's value."""
    return {labels[label]: v for labels, v in labelled_series(text, name) if label in labels}


def labelled_series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each series of a metric rendered as `name{a="x",b="y"} number`
    (Prometheus text format); unparsable lines are skipped."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels_text, _, value = line[len(name) + 1 :].rpartition("}")
        try:
            found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels_text)),
                          float(value.split()[0])))  # fmt: skip
        except (ValueError, IndexError):
            continue
    return found


def spec_from_counters(before: dict | None, after: dict | None, num_requests: int) -> dict | None:
    if before is None or after is None:
        return None
    delta = {k: after[k] - before[k] for k in SPEC_FIELDS}
    if delta["num_steps"] <= 0 and delta["num_drafted_tokens"] <= 0:
        return None
    summary = spec_summary(delta, num_requests, "metrics")
    kinds = {k.removeprefix("steps:"): after[k] - before.get(k, 0.0)
             for k in after if k.startswith("steps:")}  # fmt: skip
    if kinds:  # the server's steps during the level, by kind
        summary["steps_by_kind"] = kinds
    for key in ("learned_fixed_ms", "acceptance_ratio"):  # the decision's state at the end
        if key in after:
            summary[key] = after[key]
    return summary


def _means_per_step(before: dict, after: dict, prefix: str,
                    fields: dict[str, str]) -> dict[str, dict[str, float]]:
    """{series: {"steps": n, name: growth / n, ...}} over a level, for the series of counters
    f"{prefix}:steps:{series}" that counted steps and their f"{prefix}:{field}:{series}"
    (`fields`: field -> name in the result)."""
    head, out = f"{prefix}:steps:", {}
    for key in after:
        if key.startswith(head):
            series = key.removeprefix(head)
            n = after[key] - before.get(key, 0.0)
            if n > 0:
                out[series] = {"steps": n} | {
                    name: (after.get(f"{prefix}:{f}:{series}", 0.0)
                           - before.get(f"{prefix}:{f}:{series}", 0.0)) / n
                    for f, name in fields.items()}  # fmt: skip
    return out


def clock_from_counters(before: dict | None, after: dict | None) -> dict | None:
    """{kind: {steps, busy_ms_per_step, idle_ms_per_step}} over a level, from the step-clock
    counters of a server started with DSPARK_STEP_CLOCK=1 (None without them)."""
    if before is None or after is None:
        return None
    return _means_per_step(before, after, "clock", {"busy_ms": "busy_ms_per_step",
                                                     "idle_ms": "idle_ms_per_step"}) or None


def host_cpu(before: dict | None, after: dict | None, duration_s: float,
             client_cpu_s: float) -> dict | None:
    """Busy fraction of one core over a level, per process: the benchmark client (its own
    process time), the server's process and the process running the engine loop (from the
    server's counters, when it exports them). A process near 1.0 is a single-threaded Python
    bound: the level measures it, not the engine's device work."""
    if duration_s <= 0:
        return None
    out = {"client": client_cpu_s / duration_s}
    for key in ("cpu:server", "cpu:engine"):
        if before and after and key in before and key in after:
            out[key.removeprefix("cpu:")] = max(0.0, after[key] - before[key]) / duration_s
    return out


def scheduler_overhead(before: dict | None, after: dict | None) -> dict | None:
    """The adaptive policy's overhead over a level, from an adaptive server's counters:
    planning (host) and allocation (device) ms per engine step, their fraction of the steps'
    wall time (the goal: under 2%), and planning by part (ms per plan and plans). None
    without the counters or without planned steps."""
    keys = ("sched:plan", "sched:alloc", "sched:step_ms", "sched:steps")
    if not before or not after or any(k not in after for k in keys):
        return None
    grew = {k.removeprefix("sched:"): after[k] - before.get(k, 0.0) for k in after
            if k.startswith("sched:")}  # fmt: skip
    steps, step_ms = grew["steps"], grew["step_ms"]
    if steps <= 0 or step_ms <= 0 or grew["plan"] <= 0:
        return None
    parts = {}
    for key, n in grew.items():
        if key.startswith("plans:") and n > 0:
            part = key.removeprefix("plans:")
            parts[part] = {"plans": n, "ms_per_plan": grew.get(f"plan:{part}", 0.0) / n}
    return {"plan_ms_per_step": grew["plan"] / steps, "alloc_ms_per_step": grew["alloc"] / steps,
            "step_ms": step_ms / steps, "fraction": (grew["plan"] + grew["alloc"]) / step_ms,
            "plan_by_part": parts}  # fmt: skip


def host_parts(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """{part: host ms per engine step} over a level, from the counters of a server started
    with DSPARK_HOST_TIMERS=1 (None without them or without steps)."""
    if not before or not after or "sched:steps" not in after:
        return None
    steps = after["sched:steps"] - before.get("sched:steps", 0.0)
    parts = {k.removeprefix("host:"): (v - before.get(k, 0.0)) / steps
             for k, v in after.items() if k.startswith("host:")} if steps > 0 else {}
    return parts or None


def observed_steps(before: dict | None, after: dict | None) -> dict | None:
    """{kind: {batch range: {steps, step_ms, residual_ms}}} over a level: the steps an
    adaptive server learned its fixed terms from, with their mean measured period and its
    part beyond the cost table (the mean of what each term is a window median of). None
    without the counters or without such steps."""
    if not before or not after:
        return None
    out: dict[str, dict[str, dict[str, float]]] = {}
    means = _means_per_step(before, after, "observed", {"ms": "step_ms",
                                                         "residual": "residual_ms"})
    for series, mean in means.items():  # (series: "kind:batch")
        kind, batch = series.split(":", 1)
        out.setdefault(kind, {})[batch] = mean
    return out or None
