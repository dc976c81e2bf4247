"""End-to-end adaptive-verification benchmark: three arms on one build, same server flags.

Arms: no speculation, fixed K, adaptive K' <= K (default policy, cost table profiled at
server start-up). For each arm a `dspark serve` process is started and `dspark bench serve`
sweeps the concurrency levels at each temperature; then the offline API checks that the three
arms emit identical tokens at temperature 0 and measures the scheduler's overhead (planning +
allocation) against the step time. Prints a table last; JSON, logs and plots go to --out.

With --interleave the three servers run side by side (each with --num-kv-blocks blocks on a
GPU, so that the first does not take the memory of all) and every level is measured arm after
arm, the arms' order rotating from level to level: a host whose speed drifts over minutes (the
H200 machine's small-model steps moved by up to 36% between identical runs) then shifts all
arms of a level alike instead of whichever arm ran its whole sweep in the slow minutes. For
small pairs: three 8B-shape servers with the KV cache of 256 requests x 768 tokens (~28 GB
each) and their weights do not fit one H200.

--offline-sweep LEVELS: each arm also through the offline API, a closed loop of exactly C
requests (offline_sweep.py): at c >= 128 a serving sweep can measure the API server instead.

    python3 scripts/bench_e2e.py --target T --drafter D --dataset humaneval \
        --dataset-path HumanEval.jsonl.gz --out $OUT
    # synthetic acceptance on a random-weight target (labelled SYNTHETIC everywhere):
    python3 scripts/bench_e2e.py --target DIR --drafter DIR --load-format dummy \
        --synthetic-rates 0.65,0.56,0.55,0.55,0.57,0.76,0.8 --dataset random --out $OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e_args import parse_args  # noqa: E402  (the command line)
from e2e_identity import offline_checks  # noqa: E402  (the T = 0 identity pass)
from e2e_report import (  # noqa: E402  (the summary, and what the servers logged)
    drafting_flips,
    graph_status,
    print_checks,
    print_flips,
    print_offline_table,
    print_table,
)
from offline_sweep import offline_sweep  # noqa: E402  (the closed loop)

from dspark.bench.cli import main as bench_main  # noqa: E402  (the client, in this process)
from dspark.engine.cpu_affinity import parse_cpu_list  # noqa: E402


def arm_kind(name: str) -> str:
    """nospec / fixed / adaptive of an arm's name (fixed7 -> fixed)."""
    return name.rstrip("0123456789")


def arms(args) -> dict[str, dict | None]:
    """The chosen arms (--arms) in the report's order: no-spec, fixed K, adaptive."""
    return {n: s for n, s in all_arms(args).items() if arm_kind(n) in args.arms}


def run_order(args) -> list[tuple[str, dict | None]]:
    """The arms in the order they run: --arms' order, reversed with --reverse-arms."""
    named = {arm_kind(n): (n, s) for n, s in all_arms(args).items()}
    order = [named[k] for k in args.arms]
    return order[::-1] if args.reverse_arms else order


def all_arms(args) -> dict[str, dict | None]:
    base = {"model": args.drafter, "num_speculative_tokens": args.k}
    if args.sts:
        base["confidence_calibration_path"] = args.sts
    if args.synthetic_rates:
        base["rejection_sample_method"] = "synthetic"
        base["synthetic_acceptance_rates"] = [float(x) for x in args.synthetic_rates.split(",")]
    return {
        "nospec": None,
        f"fixed{args.k}": dict(base, adaptive_policy="fixed"),
        f"adaptive{args.k}": dict(base, enable_adaptive_verification=True,
                                  **args.adaptive_config),
    }


def engine_flags(args) -> list[str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len),
             "--device", args.device]  # fmt: skip
    if args.num_kv_blocks:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.api_server_count > 1:
        flags += ["--api-server-count", str(args.api_server_count)]
    return flags


def off_engine_cpus(args) -> set[int] | None:
    """With --engine-cpus, this machine's other CPUs, where the servers and the client run,
    so that every arm's engine runs on the same CPUs and nothing else does (None: no pinning,
    or no CPU left over)."""
    if not args.engine_cpus:
        return None
    return os.sched_getaffinity(0) - parse_cpu_list(args.engine_cpus) or None


def server_pinning(args) -> dict:
    """Popen arguments for a server: off the engines' CPUs, its engine process on them (via
    DSPARK_ENGINE_CPUS)."""
    if not args.engine_cpus:
        return {}
    from dspark.engine.cpu_affinity import ENV

    others = off_engine_cpus(args)
    kw = {"preexec_fn": (lambda: os.sched_setaffinity(0, others))} if others else {}
    kw["env"] = dict(os.environ, **{ENV: args.engine_cpus})
    return kw


def serve(args, spec, port, log_path, no_wait: bool = False):
    """Start `dspark serve` for one arm; returns (process, URL) once it answers /health
    (with no_wait: at once, for wait_ready)."""
    cmd = [sys.executable, "-m", "dspark", "serve", "--model", args.target, "--port", str(port),
           *engine_flags(args)]  # fmt: skip
    if args.load_format != "auto":
        cmd += ["--load-format", args.load_format]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    if not args.engine_process:
        cmd += ["--no-engine-process"]
    log = open(log_path, "w")
    kw = server_pinning(args)
    if spec is not None and "cost_table_path" not in spec:  # (the table it profiles, kept)
        kw["env"] = dict(kw.get("env", os.environ), DSPARK_COST_TABLE_OUT=f"{log_path}.table.json")
    if os.environ.get("DSPARK_STEP_CLOCK", "0") not in ("0", ""):  # every step, beside the log
        steps = f"{log_path}.steps"  # (appended to by the engine: a new file per server)
        if os.path.exists(steps):
            os.remove(steps)
        kw["env"] = dict(kw.get("env", os.environ), DSPARK_STEP_CLOCK_LOG=steps)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, **kw)
    url = f"http://127.0.0.1:{port}"
    return (proc, url) if no_wait else wait_ready(args, proc, url, log_path)


def profiles_at_start(spec: dict | None) -> bool:
    """Whether an arm's server profiles its cost table at start-up (adaptive, no table
    given): it starts with no other server starting beside it, whose GPU work (graph
    captures) would be in its timings."""
    return (spec is not None and spec.get("adaptive_policy", "lagged") != "fixed"
            and "cost_table_path" not in spec)


def wait_ready(args, proc, url: str, log_path: str):
    deadline = time.time() + args.start_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"server did not start in {args.start_timeout}s; see {log_path}")


def sweep(args, url, arm, temp, levels: str | None = None, warmup: int | None = None,
          seed: int = 0, out: str | None = None) -> dict:
    """`dspark bench serve` against one server: the whole sweep (default) or `levels`."""
    out = out or os.path.join(args.out, f"{arm}_t{temp:g}.json")
    warmup = args.warmup if warmup is None else warmup
    cmd = ["serve", "--base-url", url,
           "--sweep", levels or args.sweep, "--num-prompts", str(args.num_prompts),
           "--ignore-eos", "--prompts-per-concurrency", str(args.prompts_per_concurrency),
           "--temperature", str(temp), "--seed", str(seed), "--warmup", str(warmup),
           "--warmup-tokens-per-level", str(args.warmup_tokens_per_level),
           "--percentiles", "50,99", "--save-result", out, "--label", arm, "--disable-tqdm",
           "--dataset", args.dataset, "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio)]
    if args.dataset_path:
        cmd += ["--dataset-path", args.dataset_path]
    if args.load_format == "dummy":  # no tokenizer: send token ids
        cmd += ["--random-prompt-type", "token-ids"]
    if levels is not None:  # one level of an interleaved run: its own plot shows one point,
        cmd += ["--no-plot"]  # and took ~1 s a run to draw on the CPU (24 of them a test)
    # in this process (a `dspark bench serve` process per level took ~1 s to start on the
    # development machine: 12 of the 37 s of the demo pair's test); with --engine-cpus off
    # the engines' CPUs while it runs, as a client process was (not for good: this process
    # also runs the offline engines, and torch's threads pinned to one CPU of two made
    # them ~5x slower there)
    mask, others = os.sched_getaffinity(0), off_engine_cpus(args)
    if others:
        os.sched_setaffinity(0, others)
    try:
        rc = bench_main(cmd)
    finally:
        if others:
            os.sched_setaffinity(0, mask)
    if rc != 0:
        raise RuntimeError(f"dspark bench serve {' '.join(cmd)} exited with {rc}")
    return json.load(open(out))


def run_sequential(args, temps) -> dict:
    """Each arm's server in turn, its whole sweep at each temperature."""
    results = {}
    for i, (arm, spec) in enumerate(run_order(args)):
        proc, url = serve(args, spec, args.port + i, os.path.join(args.out, f"serve_{arm}.log"))
        try:
            for t in temps:
                results[(arm, t)] = sweep(args, url, arm, t)
        finally:
            proc.terminate()
            proc.wait(60)
    return results


def run_interleaved(args, temps) -> dict:
    """Every arm's server at once; each level arm after arm, the order rotating by level (and
    by round). A level's prompts are the same for every arm and round (random prompts: seeded
    by the level's index, so distinct across levels); each arm warms up before its first level
    of a temperature. With --rounds N the sweep runs N times over the levels (a round is one
    pass over all levels, so a run cut short keeps a whole sweep first), and each arm keeps
    its median round of each level (`median_round`). With --stop-after S no level starts
    once S seconds have passed since the script started (args.started; the first level
    always runs): the levels measured so far are reported, each with the rounds it got.
    Each arm's levels are merged into one result file, as a sequential sweep writes it."""
    procs, urls = [], {}
    try:
        order = run_order(args)
        # the servers that profile nothing start side by side (three starts one after another
        # took ~2/3 of the demo pair's CPU test; a GPU's 8B-shape start spends tens of seconds
        # capturing graphs); then each that profiles a cost table at start-up, alone
        logs = [os.path.join(args.out, f"serve_{arm}.log") for arm, _ in order]
        alone = [profiles_at_start(spec) for _, spec in order]
        starting = []
        for i, (arm, spec) in enumerate(order):
            if not alone[i]:
                proc, url = serve(args, spec, args.port + i, logs[i], no_wait=True)
                procs.append(proc)
                starting.append((arm, proc, url, logs[i]))
        for arm, proc, url, log in starting:
            urls[arm] = wait_ready(args, proc, url, log)[1]
        for i, (arm, spec) in enumerate(order):
            if alone[i]:
                proc, url = serve(args, spec, args.port + i, logs[i], no_wait=True)
                procs.append(proc)
                urls[arm] = wait_ready(args, proc, url, logs[i])[1]
        names, levels = [arm for arm, _ in order], args.sweep.split(",")
        results, cut, measured = {}, [], False
        for t in temps:
            runs = {arm: [[] for _ in levels] for arm in names}  # [arm][level]: its rounds
            orders = [[] for _ in levels]  # (the arms' order in each round: order_balanced)
            for r in range(args.rounds):
                for j, level in enumerate(levels):
                    if (args.stop_after is not None and measured
                            and time.time() - args.started > args.stop_after):  # fmt: skip
                        cut.append(f"T={t:g} c={level} round {r}")
                        continue
                    first = (j + r) % len(names)
                    orders[j].append(names[first:] + names[:first])
                    for arm in orders[j][-1]:
                        tag = f"_r{r}" if args.rounds > 1 else ""
                        out = os.path.join(args.out, f"{arm}_t{t:g}_c{level}{tag}.json")
                        runs[arm][j].append(sweep(args, urls[arm], arm, t, levels=level,
                                                  out=out, seed=j,
                                                  warmup=None if j == r == 0 else 0))  # fmt: skip
                    measured = True
            done = [j for j in range(len(levels)) if orders[j]]
            for arm in names if done else ():
                parts = [median_round(runs[arm][j]) for j in done]
                for j, part in zip(done, parts):
                    if len(orders[j]) > 1:
                        part["results"][0]["rounds_order"] = orders[j]
                merged = dict(parts[0], results=[lv for p in parts for lv in p["results"]])
                with open(os.path.join(args.out, f"{arm}_t{t:g}.json"), "w") as f:
                    json.dump(merged, f, indent=1)
                results[(arm, t)] = merged
        if cut:
            print(f"--stop-after {args.stop_after:g}: not measured: {', '.join(cut)}", flush=True)
        return results
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def median_round(rounds: list[dict]) -> dict:
    """Of one arm's rounds of one level (`dspark bench serve` results of that level alone),
    the one with the median output tokens/s (the lower one of an even count), its level
    noting every round's figure (`rounds_output_throughput`, in round order). On a host whose
    speed drifts over seconds, one round of a short level can land in a slow stretch: the
    trained pair's same scheduling work took 0.6-1.9x as long in one arm as in another at
    the same level (H200, twenty-first session)."""
    tput = [r["results"][0]["output_throughput"] for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: tput[i])
    chosen = rounds[order[(len(rounds) - 1) // 2]]
    if len(rounds) > 1:
        chosen["results"][0]["rounds_output_throughput"] = tput
        shared = [shared_host_ms(r["results"][0]) for r in rounds]
        if None not in shared:  # (servers run with DSPARK_HOST_TIMERS=1)
            chosen["results"][0]["rounds_shared_host_ms"] = shared
    return chosen


SHARED_HOST_PARTS = ("commit", "outputs", "schedule")


def shared_host_ms(level: dict) -> float | None:
    """The engine's host ms per step in the parts whose code every speculative arm shares
    (SHARED_HOST_PARTS, from DSPARK_HOST_TIMERS), None without them. Their ratio between two
    arms' rounds says how fast the host ran for each: on the H200 machine it moved the
    trained pair's round pairs more than planning did (thirty-second session: every pair
    decided by more than 10% had the winner's shared parts faster)."""
    host = level.get("host_ms_per_step")
    if not host or any(p not in host for p in SHARED_HOST_PARTS):
        return None
    return float(sum(host[p] for p in SHARED_HOST_PARTS))


def main() -> int:
    args = parse_args(__doc__)
    os.makedirs(args.out, exist_ok=True)
    label = "SYNTHETIC acceptance " if args.synthetic_rates else ""
    temps = [float(t) for t in args.temperatures.split(",")]
    results = {} if args.offline_only else (run_interleaved if args.interleave
                                            else run_sequential)(args, temps)  # fmt: skip
    # the sweep's summary first: a run cut in the offline pass (a caller's timeout) keeps it
    write_summary(args, results, {"offline_pass": "not finished"})
    offline = {}  # before the identity pass (a caller's timeout often cuts that one); the
    if args.offline_sweep:  # summary gets each arm's levels as soon as the arm finishes
        offline["offline_sweep"] = offline_sweep(args, run_order(args), args.offline_sweep, temps,
                                                 on_arm=lambda r: write_summary(args, results, {
                                                     "offline_pass": "not finished",
                                                     "offline_sweep": r}))  # fmt: skip
    checks = offline | (offline_checks(args, arms(args)) if args.identity_prompts > 0 else {
        "identical_at_t0": None, "num_prompts": 0, "overhead": None, "mismatching_prompts": {}})
    # which execution path each server ran (a failed capture silently changes the arm)
    checks["graphs"] = {arm: graph_status(os.path.join(args.out, f"serve_{arm}.log"))
                        for arm in arms(args)}  # fmt: skip
    # why the adaptive server drafted or not, in its own words (dspark.spec.drafting)
    checks["drafting_flips"] = drafting_flips(
        os.path.join(args.out, f"serve_{list(arms(args))[-1]}.log"))
    if offline:  # (the offline engines log in one file: only the adaptive arm decides)
        checks["offline_drafting_flips"] = drafting_flips(
            os.path.join(args.out, "offline_engines.log"))
    write_summary(args, results, checks)
    swept = [t for t in temps if any(k[1] == t for k in results)]  # (--stop-after: maybe not all)
    for t in swept:
        files = [os.path.join(args.out, f"{a}_t{t:g}.json") for a in arms(args)]
        bench_main(["plot", *files, "-o", os.path.join(args.out, f"sweep_t{t:g}.png"),
                    "--title", f"{label}T={t:g}"])  # fmt: skip
    if not args.offline_only:
        print_table(list(arms(args)), swept, results, checks, label)
    else:  # (the identity pass's lines, which print_table ends with)
        print_checks(checks)
    if offline:
        print_offline_table(list(arms(args)), offline["offline_sweep"], label)
        print_flips("offline engines", checks["offline_drafting_flips"])
    return 0


def write_summary(args, results: dict, checks: dict) -> None:
    summary = {"args": vars(args), "checks": checks, "synthetic": bool(args.synthetic_rates),
               "results": {f"{a}@{t:g}": r["results"] for (a, t), r in results.items()}}
    with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
