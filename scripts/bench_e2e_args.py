"""The command line of scripts/bench_e2e.py (its module doc is the help's description)."""

from __future__ import annotations

import argparse
import json
import os
import time

from offline_sweep import parse_levels

ARM_KINDS = ("nospec", "fixed", "adaptive")


def parse_args(description: str) -> argparse.Namespace:
    """bench_e2e.py's arguments, parsed and checked: a setting the run cannot use is refused
    at once, naming the flag (argparse's exit status 2), before any server starts."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--target", required=True)
    a("--drafter", required=True)
    a("--sts", default=None, help="STS calibration JSON for the drafter")
    a("--k", type=int, default=7)
    a("--dataset", default="humaneval", choices=["humaneval", "random", "prompts"])
    a("--dataset-path", default=None)
    a("--input-len", type=int, default=512)
    a("--output-len", type=int, default=256)
    a("--range-ratio", type=float, default=0.0,
      help="random dataset: each prompt's input and output lengths drawn from [L(1-R), L(1+R)] "
           "(closed loops of one output length keep no-spec's requests in lockstep)")
    a("--sweep", default="1,4,16,32,64,128,256")
    a("--num-prompts", type=int, default=16, help="measured requests per level, at least")
    a("--prompts-per-concurrency", type=float, default=2.0,
      help="a level of concurrency C measures max(--num-prompts, F*C) requests")
    a("--warmup", type=int, default=16)
    a("--warmup-tokens-per-level", type=int, default=16,
      help="per level, its first `concurrency` requests cut to this many tokens, unmeasured")
    a("--temperatures", default="0,1")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=8192)
    a("--max-model-len", type=int, default=2048)
    a("--device", default="auto")
    a("--load-format", default="auto", choices=["auto", "dummy"])
    a("--synthetic-rates", default=None, help="SYNTHETIC acceptance per position (benchmark)")
    a("--identity-prompts", type=int, default=32,
      help="prompts of the offline T=0 identity and overhead pass (0: skip it)")
    a("--identity-tokens", type=int, default=128)
    a("--start-timeout", type=float, default=600)
    a("--port", type=int, default=8123)
    a("--interleave", action="store_true",
      help="all servers at once, each level arm after arm (order rotating by level); "
           "--offline-sweep then opens every arm's engine at once too, each level arm "
           "after arm, the order reversed every other round")
    a("--arms", default=",".join(ARM_KINDS),
      help="the arms and the order they run in: adaptive and one or both of nospec, fixed "
           "(nospec,adaptive skips fixed K's server and sweep)")
    a("--reverse-arms", action="store_true",
      help="run the arms in the reverse order (arms run later meet a hotter GPU: at its "
           "700 W cap the H200's clock drops in compute-bound prefill steps)")
    a("--rounds", type=int, default=1,
      help="with --interleave: each level measured this many times per arm, the median "
           "kept (the offline sweep's too); the report also balances the rounds for run "
           "order (e2e_report.order_balanced): with two arms an even count runs each first "
           "as often")
    a("--stop-after", type=float, default=None, metavar="S",
      help="with --interleave: start no level once S seconds have passed since this script "
           "started, servers' start-up included (the first level always runs), and report the "
           "levels measured, each with its rounds; a caller's time limit then cuts no level "
           "halfway (default: no limit)")
    a("--num-kv-blocks", type=int, default=None,
      help="each server's KV cache in blocks (with --interleave on a GPU: required)")
    a("--api-server-count", type=int, default=1,
      help="each server's API-server processes (dspark serve --api-server-count): one caps "
           "a small pair's serving sweep at about a core of HTTP")
    a("--no-engine-process", dest="engine_process", action="store_false",
      help="servers run their engine in a thread (dspark serve --no-engine-process)")
    a("--engine-cpus", default=None, metavar="LIST",
      help="every server's engine process on these CPUs (DSPARK_ENGINE_CPUS, e.g. '2'), the "
           "servers and clients on the others: a CPU's speed is not read as an arm's")
    a("--offline-sweep", type=parse_levels, default=[], metavar="LEVELS",
      help="concurrency levels (e.g. 128,256) of a closed-loop sweep of each arm through the "
           "offline API (no HTTP server), at each temperature; default: none")
    a("--offline-turn-steps", type=int, default=0, metavar="N",
      help="with --interleave and --offline-sweep: each level's arms run at once, in turns of "
           "N engine steps each (an arm's throughput over its own turns, so the host's drift "
           "meets every arm alike); 0: arm after arm")
    a("--offline-only", action="store_true",
      help="no servers and no serving sweep: only --offline-sweep (and the identity pass); "
           "with --interleave --offline-turn-steps N the arms' ratios are the host-drift-free "
           "ones, without TPOT")
    a("--adaptive-config", default="{}", metavar="JSON",
      help="more speculative_config keys for the adaptive arm alone, e.g. "
           "'{\"skip_idle_context_write\": true}'")
    a("--step-log", action="store_true",
      help="with --interleave and --offline-sweep: the speculative engines' steps and the "
           "drafting verdicts, one JSON line each, in OUT/step_log.jsonl (step_log.py)")
    a("--host-timers", action="store_true",
      help="with --interleave and --offline-sweep: each engine's host ms per step by part "
           "(dspark/engine/host_timers.py; ~1 us a wrapped call, every arm alike)")
    a("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    args.adaptive_config = adaptive_config(ap, args)
    args.started = time.time()  # (--stop-after counts from here)
    if args.engine_cpus:
        from dspark.engine.cpu_affinity import parse_cpu_list

        try:
            parse_cpu_list(args.engine_cpus)
        except ValueError as e:
            ap.error(f"--engine-cpus: {e}")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if (len(set(args.arms)) != len(args.arms) or not set(args.arms) <= set(ARM_KINDS)
            or "adaptive" not in args.arms or len(args.arms) < 2):  # fmt: skip
        ap.error(f"--arms: adaptive and one or both of nospec, fixed, each once; got "
                 f"{','.join(args.arms)!r}")  # fmt: skip
    if args.rounds < 1 or (args.rounds > 1 and not args.interleave):
        ap.error("--rounds must be >= 1, and above 1 only with --interleave")
    if args.stop_after is not None and (args.stop_after < 0 or not args.interleave):
        ap.error("--stop-after must be >= 0, and only with --interleave")
    if args.offline_turn_steps < 0 or (args.offline_turn_steps and not (
            args.interleave and args.offline_sweep)):  # fmt: skip
        ap.error("--offline-turn-steps must be >= 0, and above 0 only with --interleave and "
                 "--offline-sweep")
    for flag in ("step_log", "host_timers"):
        if getattr(args, flag) and not (args.interleave and args.offline_sweep):
            ap.error(f"--{flag.replace('_', '-')} needs --interleave and --offline-sweep")
    if args.offline_only and not args.offline_sweep:
        ap.error("--offline-only needs --offline-sweep LEVELS")
    if args.identity_prompts < 0:  # (checked now: the offline pass runs after the sweep)
        ap.error("--identity-prompts must be >= 0 (0: skip the offline pass)")
    if args.identity_tokens < 1:
        ap.error("--identity-tokens must be >= 1")
    if args.api_server_count < 1 or (args.api_server_count > 1 and not args.engine_process):
        ap.error("--api-server-count must be >= 1, and above 1 only with the engine process")
    if args.interleave and args.num_kv_blocks is None and args.device != "cpu":
        ap.error("--interleave needs --num-kv-blocks (the first server would take the memory)")
    return args


def adaptive_config(ap: argparse.ArgumentParser, args) -> dict:
    """--adaptive-config's keys, checked as the engine will check them (a key or value it
    refuses is refused now, naming the flag, not by a server minutes into the run)."""
    from dspark.config import SpeculativeConfig

    try:
        extra = json.loads(args.adaptive_config)
    except json.JSONDecodeError as e:
        ap.error(f"--adaptive-config: not JSON ({e})")
    if not isinstance(extra, dict):
        ap.error("--adaptive-config: a JSON object of speculative_config keys")
    fixed = sorted({"model", "num_speculative_tokens"} & set(extra))
    if fixed:  # (every arm's drafter and K: --drafter, --k; the arms' names carry K)
        ap.error(f"--adaptive-config: {', '.join(fixed)} set for every arm by --drafter / --k")
    try:
        SpeculativeConfig.from_dict({"model": args.drafter, "enable_adaptive_verification": True,
                                     **extra})  # fmt: skip
    except (TypeError, ValueError) as e:
        ap.error(f"--adaptive-config: {e}")
    return extra
