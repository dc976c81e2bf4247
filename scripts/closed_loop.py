"""The offline API's closed loop (an in-process engine, no HTTP server), for offline_sweep.py.

`closed_loop` keeps exactly C requests in one engine (a new prompt is added as soon as a
request's final output arrives) until the prompts run out; `closed_loops_in_turns` runs one
such loop per engine at once, in turns of N engine steps, each engine timed by its own turns.
A result row (`_summary`) holds the throughput, the batch held, the policy's counts and its
scheduler overhead over the run, and, until `compare_tokens` pops them, every prompt's tokens.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable

from dspark.bench.spec_stats import SPEC_FIELDS, spec_summary
from dspark.engine.prompt_input import prompt_token_ids

_runs = itertools.count()  # request ids of a run: unique within an engine


def pretokenized(engine, prompts: list, max_tokens: list[int]) -> list[dict]:
    """The prompts as token ids (tokenized now, so that the timed loop does not tokenize)."""
    vocab, max_len = engine.model_config.vocab_size, engine.max_model_len
    out = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        text, ids = prompt_token_ids(prompt, engine.tokenizer, vocab, max_len, n)
        out.append({"prompt_token_ids": ids, "prompt": text})
    return out


def _steps(engine, prompts: list, params_for: Callable[[int], object], concurrency: int,
           salt: str | None):  # fmt: skip
    """Run `prompts` with `concurrency` of them in the engine at a time, yielding after every
    engine step; returns (StopIteration's value) what it produced, wall_s the time spent in
    it (between yields: its own time when other engines' steps run in between). Invariant:
    after the first `concurrency`, the next prompt is added only when a final output
    arrives, so the scheduler (running + waiting) never holds more than `concurrency`
    requests; it holds fewer only at the tail, and between a request's commit (which takes
    it out of the scheduler) and the step() call that returns its output (llm_engine.py).
    The level's end: the steps that began with fewer than min(concurrency, prompts) requests
    held, once the prompts ran out (their count, and their share of the run's own time).
    There a speculative engine's requests, whose progress per step varies, finish one by
    one, where no-spec's, started together at equal lengths, finish together (fixed K at
    T = 1, c = 16: 18% of a level's time on 106 of 536 steps; H100, fifty-eighth session)."""
    run, sched = next(_runs), engine.scheduler
    added, finished, batch, held = 0, [], [], []
    full, end_steps, end_s = min(concurrency, len(prompts)), 0, 0.0

    def add() -> None:
        nonlocal added
        engine.add_request(f"closed{run}-{added}", prompts[added], params_for(added),
                           cache_salt=salt)  # fmt: skip
        added += 1

    policy0 = _policy_counts(engine)  # (before the clock: it waits for device timers)
    kinds0 = {kind: list(v) for kind, v in engine.step_kinds.items()}
    start, own = time.perf_counter(), 0.0
    steps0, step_ms0 = engine.stats["steps"], engine.stats["step_time_ms"]
    followed0 = engine.stats["followed_steps"]
    graph0 = _graph_steps(engine)
    timers = getattr(engine, "host_timers", None)  # (offline_sweep --host-timers)
    host0 = None if timers is None else timers.snapshot()
    while added < min(concurrency, len(prompts)):
        add()
    while engine.has_unfinished_requests():
        held.append(len(sched.running) + len(sched.waiting))
        for out in engine.step():  # (the offline API's engine returns final outputs only)
            if out.finished:
                finished.append(out)
                if added < len(prompts):
                    add()
        # the requests of the step this call launched, less those its commit finished
        batch.append(len(sched.running))
        spent = time.perf_counter() - start
        own += spent
        if held[-1] < full:
            end_steps, end_s = end_steps + 1, end_s + spent
        yield
        start = time.perf_counter()
    own += time.perf_counter() - start
    policy = _policy_counts(engine)
    return {"outputs": finished, "wall_s": own, "batch": batch, "held": held,
            "end_steps": end_steps, "end_share": end_s / own if own > 0 else 0.0,
            "steps": engine.stats["steps"] - steps0,
            "followed": engine.stats["followed_steps"] - followed0,  # (dspark/engine/follow.py)
            "graph_steps": None if graph0 is None else _graph_steps(engine) - graph0,
            "host_ms": None if host0 is None else {
                part: ms - host0[part] for part, ms in timers.snapshot().items()},
            "step_ms": engine.stats["step_time_ms"] - step_ms0,
            # steps launched and their periods (ms) by kind, every engine
            "kinds": {kind: [n - kinds0[kind][0], ms - kinds0[kind][1]]
                      for kind, (n, ms) in engine.step_kinds.items()},
            "policy": None if policy is None else {
                part: {k: n - policy0[part].get(k, 0) for k, n in counts.items()}
                for part, counts in policy.items()}}  # fmt: skip


def _graph_steps(engine) -> int | None:
    """Steps run on whole-step graphs so far (None: the engine has none); the others took the
    per-phase path (prefill-only steps, and steps with prefill chunks past the graphs' token
    bucket: ~3x a graph step's host work)."""
    graphs = getattr(getattr(engine, "runner", None), "step_graphs", None)
    return None if graphs is None else sum(graphs.steps.values())


def _policy_counts(engine) -> dict | None:
    """A speculative engine's cumulative steps by kind (plain / draft / verify / mixed), plans
    by part (decision / search / other) and scheduler overhead (planning host ms, allocation
    device ms); None without speculation. A run's deltas say what the policy did in it:
    plain steps are drafting held off, decisions re-ran it."""
    spec = getattr(getattr(engine, "runner", None), "spec", None)
    if spec is None:
        return None
    plan_ms, alloc_ms = spec.scheduler_overhead_ms()  # (waits for the allocation timers)
    return {"steps_by_kind": dict(spec.step_counts), "plans": dict(spec.overhead.plans),
            "overhead_ms": {"plan": plan_ms, "alloc": alloc_ms},
            # (skip_idle_context_write: target tokens run again to rebuild context gaps)
            "context": {"rebuilt_tokens": spec.rebuilt_tokens},
            # (the drafting decision's verdicts: how many, and how far they put drafting
            # ahead of plain decoding, as a sum of log ratios)
            "verdicts": dict(spec.drafting.record.verdicts),
            # (the checked predictions: drafts accepted against the confidences' and the
            # decision's estimate of them)
            "survival": dict(spec.drafting.record.tally),
            # (plans and their host ms by path: cruise, standing, idle, decision, ...)
            "plan_paths": {p: n for p, (n, _) in spec.overhead.paths.items()},
            "plan_path_ms": {p: ms for p, (_, ms) in spec.overhead.paths.items()}}


def _drive(engine, prompts: list, params_for: Callable[[int], object], concurrency: int,
           salt: str | None) -> dict:  # fmt: skip
    """_steps run alone (its wall_s: the run's wall time)."""
    gen = _steps(engine, prompts, params_for, concurrency, salt)
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value


def _lockstep(runs: list, turn_steps: int, sync: Callable[[], None],
              pauses: list[Callable[[], None]] | None = None) -> list[dict]:  # fmt: skip
    """Step the `_steps` generators `runs` in turns of `turn_steps` engine steps each, round
    robin, until all are done; each one's wall_s is its own turns' time. A turn ends with
    `sync()` (the device's queue drained) inside the turn's time, so a step left in flight by
    async scheduling is paid by its own engine, not by the next turn's; then `pauses[i]()`
    (the engine's mark_idle): the other engines' turns until its next one are no step's
    cost. Without it an adaptive engine's first step of every turn had those turns in its
    period (under _MAX_GAP_S, 0.1 s, at low concurrency), and learned fixed terms of 1.3-3.9
    ms for steps of ~0.5 ms: its drafting decision flipped on those, and it ran 13-22% below
    no-spec at T = 1, c = 4-128 (H100, forty-sixth session). The host's speed drifts
    0.9-2.2x from one second to the next on the H200 machines (twenty-fifth session), more
    than the arms differ; engines measured in turns of tens of ms meet the same drift."""
    results: list = [None] * len(runs)
    extra = [0.0] * len(runs)  # the syncs' time, added to the engine whose turn it ended
    live = list(range(len(runs)))
    while live:
        for i in list(live):
            for _ in range(turn_steps):
                try:
                    next(runs[i])
                except StopIteration as done:
                    results[i] = done.value
                    live.remove(i)
                    break
            t0 = time.perf_counter()
            sync()
            extra[i] += time.perf_counter() - t0
            if pauses is not None:
                pauses[i]()
    for res, e in zip(results, extra, strict=True):
        res["wall_s"] += e
    return results


def closed_loop(engine, prompts: list, params_for: Callable[[int], object], concurrency: int,
                warmup: int = 0, warmup_tokens: int = 16, salt: str | None = None,
                outputs: list | None = None) -> dict:  # fmt: skip
    """Throughput of `engine` (an LLMEngine with stream_outputs off, as LLM makes it) at a
    closed loop of `concurrency` requests over `prompts` (request i sampled with
    `params_for(i)`). First, unmeasured, the first `warmup` prompts cut to `warmup_tokens`
    tokens at the same concurrency (salted apart, so that the measured requests do not find
    them in the prefix cache). The clock runs from the first measured request's arrival to
    the last one's final output. `outputs`, if given, receives the measured final outputs."""
    _warm(engine, prompts, params_for, concurrency, warmup, warmup_tokens, salt)
    run = _drive(engine, prompts, params_for, concurrency, salt)
    return _summary(run, prompts, concurrency, outputs)


def closed_loops_in_turns(engines: list, prompts: list, params_for: Callable[[int], object],
                          concurrency: int, turn_steps: int, warmup: int = 0,
                          warmup_tokens: int = 16, salt: str | None = None,
                          sync: Callable[[], None] = lambda: None) -> list[dict]:  # fmt: skip
    """closed_loop for each of `engines` (each its own closed loop of `concurrency` requests
    over `prompts`, its own prefix-cache salt), run in turns of `turn_steps` steps
    (_lockstep), warmed up one after another first. Each result's wall_s and throughputs
    are its own turns' time; TPOT and TTFT, which wall-clock times of its requests would
    give, include the other engines' turns and are left out (None)."""
    for i, engine in enumerate(engines):
        _warm(engine, prompts, params_for, concurrency, warmup, warmup_tokens, f"{salt}e{i}-")
    runs = [_steps(engine, prompts, params_for, concurrency, f"{salt}e{i}-")
            for i, engine in enumerate(engines)]  # fmt: skip
    pauses = [engine.mark_idle for engine in engines]
    return [_summary(run, prompts, concurrency, None, latencies=False) | {"turn_steps": turn_steps}
            for run in _lockstep(runs, turn_steps, sync, pauses)]  # fmt: skip


def _warm(engine, prompts: list, params_for, concurrency: int, warmup: int,
          warmup_tokens: int, salt: str | None) -> None:  # fmt: skip
    """The first `warmup` prompts cut to `warmup_tokens` tokens, unmeasured."""
    if warmup > 0:
        def cut(i: int):
            p = params_for(i)
            return dataclasses.replace(p, max_tokens=min(p.max_tokens or warmup_tokens,
                                                         warmup_tokens))  # fmt: skip

        _drive(engine, prompts[:warmup], cut, concurrency, f"{salt or ''}warmup")


def _summary(run: dict, prompts: list, concurrency: int, outputs: list | None,
             latencies: bool = True) -> dict:  # fmt: skip
    done = run["outputs"]
    if outputs is not None:
        outputs.extend(done)
    tokens = [len(o.outputs[0].token_ids) for o in done]
    wall, batch = run["wall_s"], run["batch"]
    # TPOT: each request's first token to its last, per later token (as bench serve's)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) * 1e3 / (n - 1)
             for o, n in zip(done, tokens) if n > 1 and o.metrics.finished_time is not None]
    ttfts = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in done
             if o.metrics.first_token_time is not None]  # fmt: skip
    stats = [o.spec_decode for o in done if isinstance(o.spec_decode, dict)]
    spec = (spec_summary({k: sum(s[k] for s in stats) for k in SPEC_FIELDS}, len(stats),
                         "offline outputs") if stats else None)  # fmt: skip
    return {
        "max_concurrency": concurrency, "num_prompts": len(prompts), "completed": len(done),
        "output_tokens": sum(tokens), "wall_s": wall,
        "output_throughput": sum(tokens) / wall if wall > 0 else 0.0,
        "request_throughput": len(done) / wall if wall > 0 else 0.0,
        "mean_tpot_ms": statistics.fmean(tpots) if tpots and latencies else None,
        "mean_ttft_ms": statistics.fmean(ttfts) if ttfts and latencies else None,
        "steps": run["steps"],
        "followed_steps": run["followed"],  # (launched following the step in flight)
        "graph_steps": run["graph_steps"],  # (run on whole-step graphs; None: no graphs)
        # host ms per step by part (offline_sweep --host-timers; parts nest: host_timers.py)
        "host_ms_per_step": {part: ms / run["steps"] for part, ms in run["host_ms"].items()}
        if run["host_ms"] is not None and run["steps"] else None,
        # engine.step()'s own time per step; the rest of the wall time is the loop's
        "step_ms_per_step": run["step_ms"] / run["steps"] if run["steps"] else None,
        # requests running after each step() call (its launched step's, less finished ones)
        "batch_mean": statistics.fmean(batch) if batch else 0.0,
        "batch_p50": statistics.median_low(batch) if batch else 0,
        "batch_max": max(batch, default=0),
        "max_in_flight": max(run["held"], default=0),  # scheduler's running + waiting
        # the level's end (_steps): its steps, and their share of the run's own time
        "end_steps": run["end_steps"], "end_share": run["end_share"],
        "spec_decode": spec,
        "policy": run["policy"],  # (_policy_counts' deltas over the run; None without)
        "kinds": run["kinds"],  # ([steps, period ms] by kind of step over the run)
        "scheduler_overhead": _overhead_fraction(run),
        # prompt index -> its tokens, for the arms' T = 0 comparison (compare_tokens pops it)
        "_tokens": {int(o.request_id.rsplit("-", 1)[1]): list(o.outputs[0].token_ids)
                    for o in done},
    }


DIVERGED_KEPT = 16  # prompts a row lists under "t0_diverged" (the first ones by index)


def first_difference(a: list[int] | None, b: list[int]) -> int:
    """The index of the first token where `a` and `b` differ (-1: `a` is missing)."""
    if a is None:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_tokens(rows: list[dict]) -> None:
    """One level's round, an arm a row, the first arm's row first: each row gets
    "t0_identical" = [prompts whose tokens equal the first arm's, prompts], at T = 0 (the
    lossless check at every level's batch sizes, beside the identity pass's 32 prompts), and
    "t0_diverged" = [[prompt, first differing token], ...] for up to DIVERGED_KEPT of the
    others (where an output left the first arm's tells a near-tie flip, late and rare, from a
    broken step); every row's tokens are dropped (the summary would carry every token of the
    sweep)."""
    first = rows[0].pop("_tokens")
    for row in rows[1:]:
        tokens = row.pop("_tokens")
        diverged = [[i, first_difference(tokens.get(i), t)] for i, t in sorted(first.items())
                    if tokens.get(i) != t]  # fmt: skip
        row["t0_identical"] = [len(first) - len(diverged), len(first)]
        row["t0_diverged"] = diverged[:DIVERGED_KEPT]


def _overhead_fraction(run: dict) -> float | None:
    """Planning + allocation over the engine's step time in the run (the identity pass's
    measure, per level); None without speculation or steps."""
    policy = run["policy"]
    if policy is None or not run["step_ms"]:
        return None
    return (policy["overhead_ms"]["plan"] + policy["overhead_ms"]["alloc"]) / run["step_ms"]
