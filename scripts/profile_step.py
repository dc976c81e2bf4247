"""Where a decoding step's time goes: ms per step and output tokens/s for no speculation and
fixed-K speculation (or adaptive, or the adaptive engine with drafting held off) at
temperatures 0 and 1 (plus sampling with the torch RNG instead of the Triton kernel), then a
torch.profiler table of a few steps per arm (kernel launches per step, top ops by CPU and by
CUDA time). Default pair: the bundled demo target + drafter.

    python3 scripts/profile_step.py --out $OUT            # GPU
    python3 scripts/profile_step.py --smoke               # CPU, tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.sampling import rng  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dspark", "assets", "demo")


def prompts(n: int, length: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 5000, (n, length), generator=g)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def measure(llm: LLM, conc: int, args, temp: float) -> dict:
    params = SamplingParams(temperature=temp, max_tokens=args.tokens, ignore_eos=True, seed=7)
    llm.generate(prompts(conc, args.prompt_len, 1), params, use_tqdm=False)  # warm-up
    stats = llm.engine.stats
    s0, t0 = stats["steps"], stats["step_time_ms"]
    start = time.perf_counter()
    outs = llm.generate(prompts(conc, args.prompt_len, 2), params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps = stats["steps"] - s0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    acc = [o.spec_decode["mean_acceptance_length"] for o in outs if o.spec_decode]
    acc = [a for a in acc if a is not None]  # None: the request never verified a draft
    return {"steps": steps, "ms_per_step": (stats["step_time_ms"] - t0) / max(steps, 1),
            "tok_s": toks / wall, "acc": sum(acc) / len(acc) if acc else None}  # fmt: skip


def ranged(obj, name: str, label) -> None:
    """Wrap obj.name in a profiler range named `label`, or by `label(*args, **kwargs)` of each
    call (instance attribute; profiling only; scripts/profile_mixed.py uses it too)."""
    from torch.profiler import record_function

    fn = getattr(obj, name)

    def wrapped(*a, **k):
        with record_function(label if isinstance(label, str) else label(*a, **k)):
            return fn(*a, **k)

    setattr(obj, name, wrapped)


def _phase(obj, name: str, label: str) -> None:
    """Wrap obj.name in a profiler range `phase::label`."""
    ranged(obj, name, f"phase::{label}")


def label_phases(llm: LLM) -> None:
    """Name the engine's phases in profiler traces: schedule, plan, pack (host inputs),
    upload, allocate, target forward, verify/sample, propose, write_context, commit, and the
    whole-step graph replays with their host buffer fill."""
    import dspark.engine.model_runner as mr

    eng, runner = llm.engine, llm.engine.runner
    _phase(eng.scheduler, "schedule", "schedule")
    _phase(eng, "_commit", "commit")
    _phase(runner, "forward", "target_forward")
    for name in ("pack_step", "upload_step"):
        if not hasattr(mr, f"_orig_{name}"):
            setattr(mr, f"_orig_{name}", getattr(mr, name))
            _phase(mr, name, name.split("_")[0])
    if runner.step_graphs is not None:  # the whole device half of most decode steps
        import dspark.engine.step_graph as sgm

        _phase(runner.step_graphs, "start", "whole_step_graphs")
        if not hasattr(sgm, "_orig_fill_host"):
            sgm._orig_fill_host = sgm.fill_host
            _phase(sgm, "fill_host", "fill_host")
    if runner.spec is not None:
        spec = runner.spec
        for name, label in (("plan", "plan"), ("choose_lengths", "allocate"),
                            ("verify", "verify"), ("propose", "propose")):  # fmt: skip
            _phase(spec, name, label)
        _phase(spec.drafter, "write_context", "write_context")


def host_timers(llm: LLM, args, temp: float, label: str) -> str:
    """Host time per step of the engine's step and its parts (planning in detail), timed with
    perf_counter, not the profiler (whose per-op overhead swamps phases under 100 us)."""
    import dspark.engine.model_runner as mr

    eng, spec = llm.engine, llm.engine.runner.spec
    # the whole call, then its parts: a step = schedule + launch (plan, pack, upload, graph
    # start) + outputs built + commit_launched (the wait for the device + commit); the
    # speculative decoder's parts where there is one (no-spec: the engine's alone, to set
    # against an adaptive engine's plain steps)
    parts = [(eng, "_step"), (eng, "_schedule"), (eng.runner, "launch"), (mr, "pack_step"),
             (mr, "upload_step"), (eng, "_deliver_outputs"), (eng, "_commit_launched"),
             (eng, "_commit")]  # fmt: skip
    if spec is not None:
        parts += [(spec, "plan"), (spec, "_plan"), (spec.planner, "plan_cpu"),
                  (spec.drafting, "survey"), (spec.drafting, "after_plan"),
                  (spec, "choose_lengths"), (spec, "observe_step_time")]  # fmt: skip
    graphs = eng.runner.step_graphs
    if graphs is not None:
        import dspark.engine.step_graph as sg

        parts += [(graphs, "start"), (graphs, "_replay"), (sg, "fill_host"),
                  (torch.cuda.CUDAGraph, "replay")]  # fmt: skip
        if spec is not None:
            parts += [(graphs, "allocation_ms"), (spec, "_copy_conf_to_host")]

    def timer_name(o, n: str) -> str:  # Class.method, module.function
        return f"{o.__name__ if isinstance(o, type) else type(o).__name__}.{n}"

    spent = {timer_name(o, n): [0.0, 0] for o, n in parts}
    saved = []
    for obj, name in parts:
        fn = getattr(obj, name)
        saved.append((obj, name, obj.__dict__.get(name)))

        def timed(*a, _fn=fn, _acc=spent[timer_name(obj, name)], **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _acc[0] += time.perf_counter() - t0
                _acc[1] += 1

        setattr(obj, name, timed)
    marks = _mark_graph_steps(graphs) if graphs is not None and torch.cuda.is_available() else []
    s0 = llm.engine.stats["steps"]
    try:
        measure(llm, args.profile_concurrency, args, temp)
    finally:
        for obj, name, old in saved:  # (the events' wrapper replaced start's timer: one attr)
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    steps = max(llm.engine.stats["steps"] - s0, 1)  # (measure()'s warm-up run and its run)
    rows = [f"  {name:<32} {t * 1e6 / steps:9.1f} us per step ({n / steps:.2f} calls)"
            for name, (t, n) in spent.items()]  # fmt: skip
    rows += _device_idle(marks)
    return "\n".join([f"### host timers {label} at concurrency {args.profile_concurrency}"] + rows)


def _mark_graph_steps(graphs) -> list:
    """CUDA events enqueued before and after each whole-step graph start: the device reaches
    them in stream order, so (before of step n+1) - (after of step n) is how long the device
    sat idle between two graph steps, and after - before a step's device span."""
    marks, start = [], graphs.start

    def marked(*a, **k):
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = start(*a, **k)
        after.record()
        marks.append((before, after))
        return out

    graphs.start = marked
    return marks


def _device_idle(marks: list) -> list[str]:
    if len(marks) < 2:
        return []
    torch.cuda.synchronize()
    span = np.array([b.elapsed_time(a) for b, a in marks])
    idle = np.array([a0.elapsed_time(b1) for (_, a0), (b1, _) in zip(marks, marks[1:])])
    idle = idle[idle < 20 * np.median(span)]  # (not across a prefill step off the graphs)
    return [f"  device span of a graph step       {np.median(span) * 1e3:9.1f} us median "
            f"({len(span)} steps)",
            f"  device idle between graph steps   {np.median(idle) * 1e3:9.1f} us median, "
            f"{np.mean(idle) * 1e3:.1f} mean"]  # fmt: skip


def profile(llm: LLM, args, temp: float, label: str) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    params = SamplingParams(temperature=temp, max_tokens=args.profile_tokens, ignore_eos=True,
                            seed=7)  # fmt: skip
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    s0 = llm.engine.stats["steps"]
    with tprofile(activities=acts) as prof:
        llm.generate(prompts(args.profile_concurrency, args.prompt_len, 3), params,
                     use_tqdm=False)  # fmt: skip
    steps = max(llm.engine.stats["steps"] - s0, 1)
    if args.trace:
        prof.export_chrome_trace(os.path.join(args.out, f"trace_{label.replace(' ', '_')}.json"))
    ka = prof.key_averages()
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                     "cudaGraphLaunch", "cuLaunchKernelEx"))
    text = [f"### {label}: {steps} steps at concurrency {args.profile_concurrency}, "
            f"{launches / steps:.0f} kernel/graph launches per step"]
    phases = sorted((e for e in ka if e.key.startswith("phase::")),
                    key=lambda e: -e.cpu_time_total)  # fmt: skip
    text += [f"  {e.key[7:]:<16} {e.cpu_time_total / steps:9.1f} us host per step "
             f"({e.count / steps:.2f} calls)" for e in phases]  # fmt: skip
    text.append(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        text.append(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    return "\n".join(text)


def pair_parser(doc: str) -> argparse.ArgumentParser:
    """A profiling script's arguments for its pair (default: the bundled demo pair) and K."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=os.path.join(ASSETS, "target"))
    ap.add_argument("--drafter", default=os.path.join(ASSETS, "drafter"))
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--synthetic-rates", default=None,
                    help="SYNTHETIC acceptance per position (benchmark mode, not lossless)")
    return ap


def pair_spec(args) -> dict:
    """The speculative config common to every arm of `pair_parser`'s arguments: the drafter,
    K, and SYNTHETIC acceptance when --synthetic-rates is given."""
    spec = {"model": args.drafter, "num_speculative_tokens": args.k}
    if args.synthetic_rates:
        spec.update(rejection_sample_method="synthetic",
                    synthetic_acceptance_rates=[float(x) for x in args.synthetic_rates.split(",")])
    return spec


def main() -> int:
    ap = pair_parser(__doc__)
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--profile-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--profile-concurrency", type=int, default=1)
    ap.add_argument("--trace", action="store_true", help="also write Chrome traces to --out")
    ap.add_argument("--arms", default="nospec,fixed",
                    help="from nospec,fixed,adaptive,plain (adaptive, drafting held off),"
                         "plain_skip (plain, writing no drafter context: "
                         "skip_idle_context_write),drafting (adaptive, drafting held on); "
                         "any with _onepass: with the one-program sampling kernel; with "
                         "_nofollow: no speculative step follows the one in flight "
                         "(dspark/engine/follow.py)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    args = ap.parse_args()
    kw = dict(max_model_len=1024, max_num_seqs=max(int(c) for c in args.concurrency.split(",")),
              max_num_batched_tokens=4096, load_format=args.load_format)
    if args.smoke:
        args.concurrency, args.tokens, args.profile_tokens, args.rows = "1,2", 8, 4, 5
        kw.update(device="cpu", max_num_seqs=4)
    levels = [int(c) for c in args.concurrency.split(",")]
    base = pair_spec(args)
    # plain: the adaptive engine with drafting held off (its plain steps against nospec's);
    # drafting: with drafting held on (its speculative steps against fixed K's, equal work
    # wherever the plan verifies every draft)
    arms = {"nospec": None, "fixed": dict(base, adaptive_policy="fixed"),
            "adaptive": dict(base, enable_adaptive_verification=True),
            "plain": dict(base, enable_adaptive_verification=True),
            "plain_skip": dict(base, enable_adaptive_verification=True,
                               skip_idle_context_write=True),
            "drafting": dict(base, enable_adaptive_verification=True, draft_skipping=False)}
    temps = [float(t) for t in args.temperatures.split(",")]
    rows, reports, timers = [], [], []
    from dspark.sampling import softmax_sample_triton

    one_pass_default = softmax_sample_triton.ONE_PROGRAM  # (DSPARK_ONE_PASS_SAMPLING)
    for arm in args.arms.split(","):
        # "<arm>_onepass": that arm with the one-program sampling kernel (vocabularies up to
        # its ONE_PROGRAM_MAX_VOCAB); "<arm>_nofollow": every speculative step waited for
        # before the next is scheduled (A/Bs in one process)
        one_pass, follow = "_onepass" in arm, "_nofollow" not in arm
        spec = arms[arm.replace("_onepass", "").replace("_nofollow", "")]
        softmax_sample_triton.ONE_PROGRAM = one_pass or one_pass_default
        with LLM(args.target, speculative_config=spec, **kw) as llm:
            llm.engine.follows = llm.engine.follows and follow
            if arm.startswith("plain"):  # drafting held off: no probes, and no decision
                # (the survival never gets known, so one would be due every step). Its timed
                # plan reads high: the host timers nested inside it cost ~3 us each in situ
                # (28th session: 46 us timed, 16 us untimed on the development machine;
                # 14-16 us in H200 servers)
                drafting = llm.engine.runner.spec.drafting
                drafting.after_plan = lambda *a, **k: (False, False)
                drafting.due = lambda num_reqs: False
                drafting.routine = lambda num_reqs, online: False  # (asks after_plan)
            label_phases(llm)
            for temp in temps:
                for c in levels:
                    kind = "triton" if rng._TRITON and torch.cuda.is_available() else "torch"
                    rows.append((arm, temp, kind, c, measure(llm, c, args, temp)))
                reports.append(profile(llm, args, temp, f"{arm} T={temp:g}"))
                timers.append(host_timers(llm, args, temp, f"{arm} T={temp:g}"))
            if torch.cuda.is_available() and 1.0 in temps:  # A/B: RNG as ~300 torch kernels
                rng._TRITON = False
                rows.append((arm, 1.0, "torch", levels[0], measure(llm, levels[0], args, 1.0)))
                rng._TRITON = True
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_step.txt"), "w") as f:
        f.write("\n\n".join(reports))
    # each report's header and host time per phase (the profiler tables are in the file)
    print("\n".join(line for r in reports for line in r.split("\n")
                    if line.startswith("###") or "us host per step" in line))
    print("\n".join(t for t in timers if t))
    print(f"\n{'arm':<16} {'T':>3} {'rng':>6} {'conc':>5} {'ms/step':>8} {'tok/s':>9} "
          f"{'acc':>5}")
    for arm, temp, kind, c, m in rows:
        acc = "-" if m["acc"] is None else f"{m['acc']:.2f}"
        print(f"{arm:<16} {temp:>3g} {kind:>6} {c:>5} {m['ms_per_step']:>8.2f} "
              f"{m['tok_s']:>9.1f} {acc:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
