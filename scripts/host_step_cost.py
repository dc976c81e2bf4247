"""Host work of a whole-step-graph decode step, without a GPU: the padded step runs with its
device work replaced by a fixed answer (every row emits one token, or three when verifying),
so what is timed is scheduling, packing, the bucket layout, bookkeeping and commit.

`--cold`: each step after a read of 64 MiB (not timed), as the serving loop's other work
leaves the step's objects out of the caches.

    python3 scripts/host_step_cost.py --policy fixed --concurrency 1 [--cold]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dspark.engine.model_runner as mr  # noqa: E402
import dspark.engine.step_graph as sgm  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine.host_timers import HostTimers  # noqa: E402
from dspark.engine.step_graph import StepGraphs  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dspark", "assets", "demo")
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                     "cost_table_h200_small_bf16.json")  # fmt: skip


# conditional acceptance per position of the trained pair at T=0 (BENCHMARKS.md, fourth session)
PAIR_ACCEPTANCE = [0.76, 0.53, 0.51, 0.49, 0.73, 0.65, 0.78]


_SWEEP = None  # the buffer a cache sweep reads (allocated on first use)


def sweep_caches() -> None:
    """Read 64 MiB, evicting the last-level cache (as the serving loop's other work does
    between two plans or two steps' host parts)."""
    global _SWEEP
    if _SWEEP is None:
        _SWEEP = np.ones(8 << 20)  # float64: 64 MiB
    _SWEEP.sum()


def demo_spec(policy: str, always_draft: bool = True) -> dict | None:
    """The demo drafter's speculative config (K=7, the H200 small-model cost table, its STS
    file); None for policy "none". `always_draft`: the H200 table misprices this CPU's stubbed
    steps, so drafting-skipping is off, as the policy behaves on the GPU at low load (fixed K
    is 2.2x no-spec there)."""
    if policy == "none":
        return None
    spec = {"model": f"{DEMO}/drafter", "num_speculative_tokens": 7, "adaptive_policy": policy,
            "cost_table_path": TABLE, "confidence_calibration_path": f"{DEMO}/drafter/sts.json"}
    if always_draft:
        spec["draft_skipping"] = False
    return spec


def settling_table(path: str) -> str:
    """A copy of the cost table at `path` in which verification is nearly free (0.3 ms +
    0.4 us a token) and the drafter costs 0.15 ms: with a stub device of ~1.6 ms a step the
    learned fixed term makes the planner's bound settle every decode plan, as the demo pair's
    profiled table does on the H200 at low load. Returns the copy's path."""
    import json
    import tempfile

    with open(path) as f:
        d = json.load(f)
    d["verify"]["ms"] = [0.3 + 0.0004 * n for n in d["verify"]["num_tokens"]]
    d["draft"]["ms"] = [0.15] * len(d["draft"]["ms"])
    fd, out = tempfile.mkstemp(suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)
    return out


def hold_plain(spec) -> None:
    """An adaptive engine whose drafting decision always says plain decoding, with no probes
    and no decision due (in serving they come every few steps; its survival, never surveyed
    here, is set as if it had been): every decode step is the adaptive engine's plain step,
    planned as in serving between decisions (DraftingDecision.routine)."""
    import dspark.spec.drafting as drafting

    spec.drafting._pays = lambda *a, **k: False
    spec.drafting.pays = spec.drafting.plain_probes = False
    spec.drafting.due = lambda num_reqs: False
    spec.drafting.survival = np.ones(spec.k)
    spec.drafting._decide_spacing = 1 << 20  # (routine: no decision due)
    drafting._PROBE_EVERY = drafting._MOVED_MIN = 1 << 30


def prefill_all(engine, stub: StepGraphs | None = None) -> None:
    """Step until every request is past its prefill (prefill chunks run the model). With
    `stub` (from stub_device_work), the drafts' confidences are the stub's from then on."""
    sched = engine.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        engine.step()
    if stub is not None and engine.runner.spec is not None:
        stub._draft(None, None)
        engine.runner.spec._copy_conf_to_host()


def stub_device_work(runner, prefill: bool = False, device_ms: float = 0.0) -> StepGraphs:
    """Route decode steps through the padded whole-step path with the device work replaced by a
    fixed answer (every row emits one token, or three when verifying); what remains is host
    work. Prefill steps still run the model's tail (logits, sampling, drafting); with
    `prefill` its layers are skipped too (the hidden states are zeros). `device_ms`: each
    decode step occupies a device for that long, from its launch or the end of the previous
    step's; the host's work meanwhile overlaps it, the rest is a wait with the GIL released,
    as a device sync is."""
    if prefill:
        d, n_aux = runner.model.embed_tokens.weight.shape[1], len(runner.aux_layer_ids)

        def zeros(input_ids, md):
            t = input_ids.shape[0]
            hidden = torch.zeros(t, d, dtype=runner.dtype)
            return hidden, torch.zeros(t, n_aux * d, dtype=runner.dtype) if n_aux else None

        runner.eager_forward = zeros
    sg = runner.step_graphs = StepGraphs(runner, use_graphs=False)
    sg.wait_overshoot_ms = []
    if runner.spec is not None:
        runner.spec.graph_steps = runner.spec.graph_trims = True

    def fixed_answer(key):  # packed outputs: tokens, emitted, verified
        rows, width = key[1], sg.width(key)
        emitted = 1 if width == 1 else 3
        return torch.cat([torch.full((rows * width,), 7), torch.full((rows,), emitted),
                          torch.full((rows,), sg.k if width > 1 else 0)])  # fmt: skip

    if device_ms:  # a "device" that runs each step for device_ms, one after the other
        start = sg.start
        device_free = [0.0]  # when the device finishes the last step launched

        def start_with_device_time(host, key, budget=None):
            ready = max(time.perf_counter(), device_free[0]) + device_ms / 1e3
            device_free[0] = ready
            wait = start(host, key, budget)

            def wait_for_device():
                left = ready - time.perf_counter()
                if left > 0:  # the host's work since launch overlapped the device's
                    time.sleep(left)  # how late the thread resumes: GIL (or core) contention
                    sg.wait_overshoot_ms.append((time.perf_counter() - ready) * 1e3)
                return wait()

            return wait_for_device

        sg.start = start_with_device_time

    spec = runner.spec

    def drafter(rows, method):  # the drafts' confidences: the trained pair's acceptance
        if spec is not None:
            spec.conf.copy_(torch.tensor(PAIR_ACCEPTANCE[: spec.k]).expand_as(spec.conf))

    sg._step = fixed_answer
    sg._draft = drafter
    return sg


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="fixed", choices=["none", "fixed", "lagged"])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--stream", action="store_true",
                    help="outputs with text for every request every step, as a server streams")
    ap.add_argument("--deltas", action="store_true",
                    help="with --stream: outputs made as an engine process makes them (deltas; "
                         "text left to the server's process)")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="a device that takes this long per decode step: reports how much of "
                         "the host work does not overlap it")
    ap.add_argument("--plain", action="store_true",
                    help="lagged: its drafting decision always says plain decoding and no "
                         "probe runs (the adaptive engine's plain steps)")
    ap.add_argument("--settling-table", action="store_true",
                    help="lagged: a table whose bound settles every decode plan (settling_table;"
                         " use with --device-ms 1.6): planning as at low load on the H200")
    ap.add_argument("--settled-plans", type=int, default=None,
                    help="lagged: plans a bound-settled plan stands for (1: none stands)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cold", action="store_true",
                    help="read 64 MiB before each step (not timed): the serving loop's other "
                         "work leaves the step's objects out of the caches")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="cProfile the timed steps into FILE (pstats; the timers then read high)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec_config = demo_spec(args.policy, always_draft=not args.plain)
    if args.settling_table and spec_config is not None:
        spec_config["cost_table_path"] = settling_table(TABLE)
    llm = LLM(f"{DEMO}/target", device="cpu", max_num_seqs=256, speculative_config=spec_config)
    runner = llm.engine.runner
    if args.settled_plans is not None and runner.spec is not None:
        runner.spec.settled_plans = args.settled_plans
    if args.plain:
        hold_plain(runner.spec)
    sg = stub_device_work(runner, device_ms=args.device_ms)
    llm.engine.stream_outputs = args.stream
    if args.deltas:
        from dspark.engine.output_delta import DeltaEncoder

        DeltaEncoder().attach(llm.engine)  # (text made by the server's process: not timed)
    timers = HostTimers()  # (the serving loop's DSPARK_HOST_TIMERS wrapper, on these parts)
    for obj, name in ((mr, "pack_step"), (sgm, "fill_host"), (llm.engine, "_commit"),
                      (llm.engine, "_deliver_outputs"), (llm.engine.scheduler, "schedule"),
                      (llm.engine.block_tables, "rows"), (sg, "start")):  # fmt: skip
        timers.wrap(obj, name, name)
    if runner.spec is not None:
        timers.wrap(runner.spec, "plan", "plan")
        timers.wrap(runner.spec, "observe_step_time", "observe")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))}
               for i in range(args.concurrency)]  # fmt: skip
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    prefill_all(llm.engine, sg)  # not timed
    timers.reset()
    overhead = runner.spec.overhead if runner.spec is not None else None
    if overhead is not None:  # (planning by part over the timed steps only)
        overhead.plan_ms, overhead.plans = dict.fromkeys(overhead.plans, 0.0), dict.fromkeys(
            overhead.plans, 0)  # fmt: skip
        overhead.paths = {}
    preempted0 = llm.engine.stats["preemptions"]
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    swept = 0.0  # seconds spent sweeping the caches (--cold), not the step's
    steps, t0 = 0, time.perf_counter()
    while llm.engine.has_unfinished_requests():
        if args.cold:
            s0 = time.perf_counter()
            sweep_caches()
            swept += time.perf_counter() - s0
        llm.engine.step()
        steps += 1
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    per_step = (time.perf_counter() - t0 - swept) / steps * 1e6
    parts = ", ".join(f"{k} {v / steps * 1e3:.1f}"
                      for k, v in sorted(timers.ms.items(), key=lambda kv: -kv[1]) if v > 0)
    head = (f"policy {args.policy}{' plain' if args.plain else ''}"
            f"{f' T={args.temperature:g}' if args.temperature else ''}"
            f"{', cold' if args.cold else ''}"
            f"{', streaming' if args.stream else ''}"
            f"{' deltas' if args.deltas else ''}, "
            f"concurrency {args.concurrency}: {steps} decode steps, ")
    if overhead is not None and sum(overhead.plans.values()):  # (the summary stays last)
        print("planning by part (plans x us): " + ", ".join(
            f"{k} {n} x {overhead.plan_ms[k] / n * 1e3:.1f}"
            for k, n in overhead.plans.items() if n))  # fmt: skip
        print("plans by path (plans x us): " + ", ".join(
            f"{k} {n} x {ms / n * 1e3:.1f}" for k, (n, ms) in sorted(overhead.paths.items())))
    preempted = llm.engine.stats["preemptions"] - preempted0
    if preempted:  # (their prompts ran again through the model on the CPU: not host work)
        print(f"warning: {preempted} preemptions (KV blocks ran out): the figures below include "
              "recomputed prompts; use fewer --tokens or a lower --concurrency")
    if args.device_ms:  # (the breakdown's parts include the device wait where they span it)
        print(head + f"step period {per_step:.0f} us with a {args.device_ms:g} ms device: "
              f"{per_step - args.device_ms * 1e3:.0f} us of host work not overlapped")
    else:
        print(head + f"{per_step:.0f} us of host work per step ({parts})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
