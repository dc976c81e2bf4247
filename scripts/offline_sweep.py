"""Closed-loop throughput of the offline API (an in-process engine, no HTTP server).

`dspark bench serve` at high concurrency can measure the API server instead of the engine:
on the H200 the trained pair's three arms at c = 128 / 256 were capped by the one API-server
process (~1 core busy; the engine held ~45 requests at c = 256, TTFT ~1 s). Here the engine
is driven directly: `closed_loop` (closed_loop.py) keeps exactly C requests in the engine (a
new prompt is added as soon as a request's final output arrives) until the prompts run out,
and `offline_sweep` runs it for each arm at each level and temperature (bench_e2e.py
--offline-sweep, with the serving sweep's dataset, output length and engine settings; with
--interleave, every arm's engine at once and each level arm after arm, --rounds times).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Callable

from closed_loop import closed_loop, closed_loops_in_turns, compare_tokens, pretokenized


def parse_levels(text: str) -> list[int]:
    """Concurrency levels of --offline-sweep ("128,256"; "" is none), as argparse's `type`."""
    levels = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            level = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an integer (expected levels like '128,256')") from None
        if level < 1:
            raise argparse.ArgumentTypeError(f"levels must be >= 1, got {level}")
        levels.append(level)
    if len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"a level is repeated in {text!r}")
    return levels


def level_prompts(args, concurrency: int) -> tuple[list, list[int]]:
    """(prompts, max tokens of each) of one level: what bench serve measures there
    (max(--num-prompts, F x C) samples, the same loader, lengths and output length)."""
    from dspark.bench.cli import level_num_prompts
    from dspark.bench.datasets import load_dataset

    n = level_num_prompts(args, concurrency)
    kind = "token-ids" if args.load_format == "dummy" else "words"
    samples = load_dataset(args.dataset, n, path=args.dataset_path, input_len=args.input_len,
                           output_len=args.output_len, default_max_tokens=args.output_len,
                           seed=concurrency, prompt_type=kind,
                           range_ratio=args.range_ratio)  # fmt: skip
    return [s.prompt for s in samples], [s.max_tokens for s in samples]


def with_served_table(spec: dict | None, out_dir: str, arm: str) -> dict | None:
    """`spec` loading the cost table its server profiled (bench_e2e.serve wrote it beside the
    log), so that the offline engine plans with the same table and does not profile again."""
    path = os.path.join(out_dir, f"serve_{arm}.log.table.json")
    if spec is None or "cost_table_path" in spec or not os.path.exists(path):
        return spec
    return dict(spec, cost_table_path=path)


def median_round(rounds: list[dict], orders: list[list[str]] | None = None) -> dict:
    """The round of median output throughput (the lower middle one of an even count), with
    every round's throughput in run order under "rounds" and, given, the order the arms ran
    in each round under "rounds_order" (e2e_report.order_balanced reads both)."""
    ordered = sorted(rounds, key=lambda r: r["output_throughput"])
    row = dict(ordered[(len(ordered) - 1) // 2], rounds=[r["output_throughput"] for r in rounds],
               rounds_policy=[r.get("policy") for r in rounds],
               rounds_kinds=[r.get("kinds") for r in rounds],
               rounds_followed=[(r.get("followed_steps"), r.get("steps")) for r in rounds],
               rounds_graph=[(r.get("graph_steps"), r.get("steps")) for r in rounds],
               rounds_end=[(r.get("end_steps"), r.get("end_share")) for r in rounds],
               rounds_host=[r.get("host_ms_per_step") for r in rounds],
               rounds_verified=[(r.get("spec_decode") or {}).get("verified_tokens_per_request")
                                for r in rounds],
               rounds_t0_identical=[r.get("t0_identical") for r in rounds],
               rounds_t0_diverged=[r.get("t0_diverged") for r in rounds])  # fmt: skip
    if orders is not None:
        row["rounds_order"] = orders
    return row


def _open(args, arm: str, spec: dict | None, levels: list[int]):
    from dspark import LLM

    spec = with_served_table(spec, args.out, arm)
    kw = {"num_kv_blocks": args.num_kv_blocks} if args.num_kv_blocks else {}
    logging.getLogger("dspark.offline_sweep").info("offline engine of arm %s", arm)
    return LLM(args.target, speculative_config=spec, load_format=args.load_format,
               device=args.device, max_num_seqs=max(levels), max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, **kw)  # fmt: skip


def _level_inputs(args, engine, t: float, c: int) -> tuple[list, Callable, int]:
    """(the prompts tokenized, request i's sampling params, warm-up prompts) of level c at
    temperature t."""
    from dspark import SamplingParams

    raw, max_tokens = level_prompts(args, c)
    prompts = pretokenized(engine, raw, max_tokens)
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return prompts, params.__getitem__, c if args.warmup_tokens_per_level > 0 else 0


def _level(args, engine, t: float, c: int, salt: str) -> dict:
    """One closed loop of level c at temperature t (salt: this run's prefix-cache salt)."""
    prompts, params_for, warm = _level_inputs(args, engine, t, c)
    return closed_loop(engine, prompts, params_for, c, warm, args.warmup_tokens_per_level,
                       salt=salt)  # fmt: skip


def _level_in_turns(args, engines: list, t: float, c: int, salt: str) -> list[dict]:
    """One closed loop of level c at temperature t per engine, run in turns of
    --offline-turn-steps steps (closed_loops_in_turns; a turn ends with the device synced)."""
    # (one target, one tokenizer: the first engine's tokens serve every arm)
    prompts, params_for, warm = _level_inputs(args, engines[0], t, c)
    sync = lambda: None  # noqa: E731
    if engines[0].device.type == "cuda":
        import torch

        sync = torch.cuda.synchronize
    return closed_loops_in_turns(engines, prompts, params_for, c, args.offline_turn_steps,
                                 warm, args.warmup_tokens_per_level, salt, sync)  # fmt: skip


def offline_sweep(args, run_order: list[tuple[str, dict | None]], levels: list[int],
                  temps: list[float], on_arm: Callable[[dict], None] | None = None) -> dict:
    """Every arm at every level and temperature. Returns {"levels", "temperatures", "rounds",
    "arms": {arm: {"cost_table", "by_temperature": {"T": [one row per level]}}}}, a row
    being closed_loop's result (median_round's with rounds). Sequentially (default): one
    engine per arm, freed before the next, `on_arm` given the result after each arm. With
    --interleave: every arm's engine open at once, each level run arm after arm, --rounds
    times, the order reversed every other round (the host's speed drifts 0.9-2.2x within a
    call: single runs of one arm moved up to 47% between two calls on one H200 machine,
    thirty-eighth session), `on_arm` given the result after each level. A run cut short
    keeps what was handed out."""
    rounds = args.rounds if args.interleave else 1  # (bench_e2e checked --rounds >= 1)
    result = {"levels": levels, "temperatures": temps, "rounds": rounds, "arms": {},
              "turn_steps": args.offline_turn_steps if args.interleave else 0}
    pinned_from = None
    if args.engine_cpus:  # this process is the engine now: on the servers' engine CPUs
        from dspark.engine.cpu_affinity import parse_cpu_list, pin

        pinned_from = os.sched_getaffinity(0)
        pin(parse_cpu_list(args.engine_cpus))
    try:
        with _engine_log(args.out):
            _arms(args, run_order, levels, temps, rounds, result, on_arm)
    finally:
        if pinned_from is not None:
            os.sched_setaffinity(0, pinned_from)
    return result


def _arms(args, run_order, levels, temps, rounds, result, on_arm) -> None:
    """offline_sweep's runs: interleaved, or arm after arm (its docstring)."""
    if args.interleave:
        _interleaved(args, run_order, levels, temps, rounds, result, on_arm)
    else:
        for arm, spec in run_order:
            with _open(args, arm, spec, levels) as llm:
                done = _arm_entry(result, arm, llm)
                for t in temps:
                    rows = [_level(args, llm.engine, t, c, f"offline-t{t:g}-c{c}-")
                            for c in levels]  # fmt: skip
                    for row in rows:  # (arm after arm: no two arms' tokens side by side)
                        row.pop("_tokens")
                    done["by_temperature"][f"{t:g}"] = rows
            if on_arm is not None:
                on_arm(result)


@contextlib.contextmanager
def _engine_log(out: str):
    """The offline engines' own log (INFO and up of the `dspark` loggers: start-up, drafting
    turned on/off, cost table) in OUT/offline_engines.log while the sweep runs, as each server
    logs beside its results; before, the offline arms' decisions were not kept anywhere."""
    os.makedirs(out, exist_ok=True)
    logger = logging.getLogger("dspark")
    level = logger.level
    handler = logging.FileHandler(os.path.join(out, "offline_engines.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


def _arm_entry(result: dict, arm: str, llm) -> dict:
    done = result["arms"][arm] = {
        "cost_table": getattr(llm.engine.runner.spec, "cost_status", None), "by_temperature": {}}
    return done


def _step_logs(args, engines: list) -> list:
    """With --step-log, a StepLog on each speculative engine: fixed K's steps all come as
    "unobserved" (it learns no costs), its periods beside adaptive's at the same level."""
    if not getattr(args, "step_log", False):
        return []
    from step_log import StepLog

    path = os.path.join(args.out, "step_log.jsonl")
    return [StepLog(llm.engine, arm, path) for arm, llm in engines
            if llm.engine.runner.spec is not None]


def _interleaved(args, run_order, levels, temps, rounds, result, on_arm) -> None:
    with contextlib.ExitStack() as stack:
        engines = [(arm, stack.enter_context(_open(args, arm, spec, levels)))
                   for arm, spec in run_order]  # fmt: skip
        for arm, llm in engines:
            _arm_entry(result, arm, llm)
        logs = _step_logs(args, engines)
        if getattr(args, "host_timers", False):
            from dspark.engine.host_timers import install_engine_timers

            for _, llm in engines:  # (read by closed_loop: each run's parts)
                llm.engine.host_timers = install_engine_timers(llm.engine)
        for t in temps:
            for c in levels:
                for log in logs:
                    log.level = f"t{t:g}-c{c}"
                runs: dict[str, list[dict]] = {arm: [] for arm, _ in engines}
                orders = []
                for r in range(rounds):
                    order = engines if r % 2 == 0 else engines[::-1]
                    orders.append([arm for arm, _ in order])
                    salt = f"offline-t{t:g}-c{c}-r{r}-"
                    if args.offline_turn_steps:  # every arm at once, in turns of steps
                        rows = _level_in_turns(args, [llm.engine for _, llm in order], t, c,
                                               salt)  # fmt: skip
                        for (arm, _), row in zip(order, rows, strict=True):
                            runs[arm].append(row)
                    else:
                        for arm, llm in order:
                            runs[arm].append(_level(args, llm.engine, t, c, salt))
                    this_round = [runs[arm][-1] for arm, _ in engines]  # (run order's first)
                    if t == 0:
                        compare_tokens(this_round)  # (it drops the tokens)
                    else:
                        for row in this_round:
                            row.pop("_tokens")
                for arm, rows in runs.items():
                    by_t = result["arms"][arm]["by_temperature"].setdefault(f"{t:g}", [])
                    by_t.append(median_round(rows, orders))
                for log in logs:
                    log.flush()
                if on_arm is not None:
                    on_arm(result)
