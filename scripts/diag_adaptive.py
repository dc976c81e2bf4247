"""Why the adaptive policy wins or loses at a concurrency: its steps by kind (prefill, plain
without drafting, plain while drafting, verifying b drafts) with the measured ms per step next
to what its cost table predicts, and the table's own view of the drafting decision, beside a
no-speculation engine on the same requests. Offline engines, pure decode after a warm-up pass.

    python3 scripts/make_shape_dirs.py --out /tmp/shapes
    python3 scripts/diag_adaptive.py --concurrency 64,128 --synthetic-rates 0.65,0.56,... --out $OUT
    python3 scripts/diag_adaptive.py --smoke                   # CPU, tiny pair: the script only
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_step import ASSETS, pair_spec, prompts  # noqa: E402  (demo pair; prompt ids; spec)


class LaunchRecords:
    """Wraps engine.step and runner.launch: one record per launched step (sync engines: the
    step call's wall time; engines that schedule ahead: the call's period, i.e. the same)."""

    def __init__(self, engine):
        self.engine, self.records, self._pending = engine, [], []
        runner = engine.runner
        launch, step = runner.launch, engine.step

        def spy_launch(sched, tables, follows=False):
            spec = runner.spec
            plan0 = None if spec is None else spec.overhead.plan_total_ms()
            wait = launch(sched, tables, follows)
            rec = {"rows": len(sched.rows), "tokens": sched.num_tokens,
                   "prefill": any(r.num_non_draft_tokens > 1 for r in sched.rows),
                   "slots": sum(r.num_draft_slots for r in sched.rows),
                   "drafting": None if spec is None else bool(spec.draft_enabled),
                   "budget": None if spec is None else spec.last_budget}  # fmt: skip
            if spec is not None:  # what the drafting decision saw at this batch size
                # (the scheduler overhead's planning)
                rec["plan_ms"] = spec.overhead.plan_total_ms() - plan0
                n = len(sched.rows)
                rec["fixed_spec"] = spec.fixed_costs.get("spec", n)
                rec["fixed_plain"] = spec.fixed_costs.get("plain", n)
            self._pending.append(rec)

            def spy_wait():
                result = wait()
                rec["emitted"] = sum(len(e) for e in result.emitted)
                rec["verified"] = sum(result.verified)
                rec["forward_tokens"] = result.num_tokens
                return result

            return spy_wait

        def spy_step():
            t0 = time.perf_counter()
            out = step()
            ms = (time.perf_counter() - t0) * 1e3
            for rec in self._pending:
                rec["ms"] = ms / len(self._pending)
            self.records += self._pending
            self._pending = []
            return out

        runner.launch, engine.step = spy_launch, spy_step
        self._originals = (launch, step)

    def restore(self) -> None:
        self.engine.runner.launch, self.engine.step = self._originals


def kind(rec: dict) -> str:
    mixed = "prefill+" if rec["prefill"] else ""
    if rec["drafting"] is None:
        return "prefill" if mixed else "nospec"
    if rec.get("verified", 0) == 0:
        return mixed + ("plain+draft" if rec["drafting"] else "plain")
    return mixed + f"verify {rec['verified'] // max(rec['rows'], 1)}/req" + (
        "" if rec["drafting"] else " (no draft)")


def predicted_ms(spec, rec: dict) -> float | None:
    cost = spec.cost if spec is not None else None
    if cost is None or rec["prefill"]:
        return None
    n = rec.get("forward_tokens") or rec["tokens"]
    if rec.get("verified", 0) == 0 and not rec["drafting"]:
        fixed = spec.fixed_costs.get("plain", rec["rows"])
        return (cost.fixed_overhead_ms if fixed is None else fixed) + cost.verify_lookup(n)
    draft = cost.draft_lookup(rec["rows"]) if rec["drafting"] else 0.0
    fixed = spec.fixed_costs.get("spec", rec["rows"])
    return (cost.fixed_overhead_ms if fixed is None else fixed) + draft + cost.verify_lookup(n)


def summarize(records: list[dict], spec) -> list[str]:
    groups = collections.defaultdict(list)
    for rec in records:
        groups[kind(rec)].append(rec)
    lines = [f"  {'step kind':<22}{'steps':>6}{'ms/step':>9}{'predicted':>10}{'tok/step':>9}"
             f"{'tok/ms':>8}"]
    for name, recs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        ms = float(np.mean([r["ms"] for r in recs]))
        pred = [p for p in (predicted_ms(spec, r) for r in recs) if p is not None]
        emitted = float(np.mean([r.get("emitted", 0) for r in recs]))
        p = f"{np.mean(pred):10.2f}" if pred else f"{'-':>10}"
        lines.append(f"  {name:<22}{len(recs):6d}{ms:9.2f}{p}{emitted:9.1f}{emitted / ms:8.2f}")
    fixed = [r for r in records if r.get("fixed_spec") is not None]
    if fixed:
        def mean_of(key):
            vals = [r[key] for r in fixed if r.get(key) is not None]
            return f"{np.mean(vals):.2f}" if vals else "-"
        lines.append(f"  fixed terms the plans used (mean over steps): spec {mean_of('fixed_spec')}"
                     f" ms, plain {mean_of('fixed_plain')} ms; planning {mean_of('plan_ms')} ms"
                     " per step")
    decode = [r for r in records if not r["prefill"]]
    if decode:
        ms, toks = sum(r["ms"] for r in decode), sum(r.get("emitted", 0) for r in decode)
        lines.append(f"  decode steps overall: {len(decode)} steps, {ms / len(decode):.2f} ms/step,"
                     f" {toks / ms:.2f} tokens/ms")
    return lines


def table_view(spec, conc: int) -> list[str]:
    """The cost table's prediction of plain decoding and of verifying l drafts per request."""
    cost = spec.cost
    if cost is None:
        return ["  (no cost table)"]
    surv = spec.drafting.survival
    plain_fixed = spec.fixed_costs.get("plain", conc)
    spec.fixed_costs.apply(cost, conc)  # the speculative term at this batch size
    fixed = cost.fixed_overhead_ms
    plain = (fixed if plain_fixed is None else plain_fixed) + cost.verify_lookup(conc)
    lines = [f"  fixed (spec) {fixed:.2f} ms, fixed (plain) "
             f"{'-' if plain_fixed is None else f'{plain_fixed:.2f}'} ms, "
             f"drafter({conc} reqs) {cost.draft_lookup(conc):.2f} ms, "
             f"survival {None if surv is None else [round(float(x), 3) for x in surv]}",
             f"  plain: {plain:.2f} ms -> {conc / plain:.2f} tok/ms"]
    for length in range(1, spec.k + 1):
        t = float(cost.step_time_lookup(np.array([conc * (1 + length)]), conc)[0])
        gain = conc * (1 + (0 if surv is None else float(np.sum(surv[:length]))))
        lines.append(f"  verify {length}/req: forward {cost.verify_lookup(conc * (1 + length)):.2f}"
                     f" ms, step {t:.2f} ms -> {gain / t:.2f} tok/ms (table)")
    return lines


def measure(llm, args, conc: int) -> tuple[list[str], dict]:
    """One measured pass after a warm-up: all `conc` requests at once, or (--serving) as
    `bench serve` drives a server (see serve_pass)."""
    from dspark import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts(conc, args.prompt_len, 1), params, use_tqdm=False)  # warm-up
    log = LaunchRecords(llm.engine)
    t0 = time.perf_counter()
    if args.serving:
        toks, what = serve_pass(llm.engine, args, conc, params)
    else:
        outs = llm.generate(prompts(conc, args.prompt_len, 2), params, use_tqdm=False)
        toks, what = sum(len(o.outputs[0].token_ids) for o in outs), "with prefill"
    wall = time.perf_counter() - t0
    log.restore()
    spec = llm.engine.runner.spec
    lines = [f"  {toks / wall:.1f} output tok/s over the run ({wall:.2f} s, {what})"]
    lines += summarize(log.records, spec)
    if args.serving and spec is not None:
        learned = spec.metrics()["learned_fixed_ms"]  # (as /metrics shows them)
        lines.append(f"  learned fixed terms by sampling mode and batch-size bucket: {learned}")
    elif spec is not None and spec.cost is not None:
        lines += table_view(spec, conc)
    return lines, {"tok_s": toks / wall, "records": log.records}


def serve_pass(engine, args, conc: int, params) -> tuple[int, str]:
    """`conc` requests in flight, a new one added as soon as one finishes, 2 x conc in all
    (prefill chunks then land in many decode steps, as they do in serving). Returns (output
    tokens, a description)."""
    todo, toks, added = prompts(2 * conc, args.prompt_len, 2), 0, conc
    for i in range(conc):
        engine.add_request(f"serve-{i}", todo[i], params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                toks += len(out.outputs[0].token_ids)
                if added < len(todo):
                    engine.add_request(f"serve-{added}", todo[added], params)
                    added += 1
    return toks, f"{2 * conc} requests, {conc} in flight"


def drafter_table(runner, conc: int) -> str:
    """The drafter alone (context write + one block proposal for `conc` rows, as served: its
    graph where whole-step graphs exist): ms per call and its top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dspark.spec.profiler import _draft_step, median_of_repeats

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ms = {}  # timed as the start-up cost profile times it
    for greedy in (False, True):
        step = _draft_step(runner, conc, 512, greedy=greedy)
        ms[greedy] = median_of_repeats(step, repeats=10, warmup=3)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        sync()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return (f"  drafter for {conc} rows: median {ms[False]:.2f} ms per call sampled, "
            f"{ms[True]:.2f} ms greedy (5 greedy calls profiled)\n"
            + prof.key_averages().table(sort_by=key, row_limit=25))


def prefill_table(llm, conc: int, prompt_len: int) -> str:
    """The prefill steps of `conc` requests (ms per step, top kernels by CUDA time): what the
    drafter's context pass adds to a prompt chunk."""
    import torch
    from host_step_cost import prefill_all
    from profile_step import label_phases
    from torch.profiler import ProfilerActivity, profile

    from dspark import SamplingParams

    engine = llm.engine
    label_phases(llm)  # phase:: ranges (target forward, write_context, propose, ...)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts(conc, prompt_len, 5)):
        engine.add_request(f"prefill-{i}", p, params)
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps0 = engine.stats["steps"]
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        prefill_all(engine)
    ms = (time.perf_counter() - t0) * 1e3
    steps = engine.stats["steps"] - steps0
    while engine.has_unfinished_requests():
        engine.step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    ka = prof.key_averages()
    phases = [f"    {e.key[7:]:<16} device {getattr(e, 'device_time_total', 0) / 1e3:8.2f} ms"
              f"  host {e.cpu_time_total / 1e3:8.2f} ms  ({e.count} calls)"
              for e in ka if e.key.startswith("phase::")]  # fmt: skip
    return "\n".join([f"  prefill of {conc} x {prompt_len} tokens: {steps} steps, {ms:.1f} ms "
                      "(profiled)"] + phases + [ka.table(sort_by=key, row_limit=25)])


def mixed_table(llm, conc: int, prompt_len: int, steps: int = 8) -> str:
    """Steps that carry one new prompt's chunk beside ~`conc` decoding rows, the common step
    with prefill at high load (8B shape, c = 256: ~110 a level), device ms per step and top
    kernels: what an adaptive engine's such step runs beyond no-spec's (its drafter's
    context write, ...), at the same shape in both arms. `steps` prompts arrive one a step."""
    import torch
    from host_step_cost import prefill_all
    from profile_step import label_phases
    from torch.profiler import ProfilerActivity, profile

    from dspark import SamplingParams

    engine = llm.engine
    label_phases(llm)
    # the decoding rows outlive the profiled steps (2 + `steps` decode steps, then the drain)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts(max(conc - steps, 1), prompt_len, 7)):
        engine.add_request(f"mixed-base-{i}", p, params)
    prefill_all(engine)
    for _ in range(2):
        engine.step()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps0 = engine.stats["steps"]
    with profile(activities=acts) as prof:
        for i, p in enumerate(prompts(steps, prompt_len, 8)):
            engine.add_request(f"mixed-new-{i}", p, params)
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    n = max(engine.stats["steps"] - steps0, 1)
    while engine.has_unfinished_requests():
        engine.step()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    ka = prof.key_averages()
    device_ms = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 1e3
    device = f"device {device_ms / n:.2f} ms per step (kernels)" if cuda else "no CUDA device"
    return "\n".join([f"  {steps} prompts of {prompt_len} tokens beside ~{conc} decoding rows, "
                      f"one a step: {n} steps, {device}", ka.table(sort_by=key, row_limit=25)])


def run_arm(args, arm: str, spec_cfg: dict | None, levels: list[int]) -> list:
    """One engine per arm; a `-sync` suffix turns async scheduling off. Returns (report lines,
    data) per level, in order (a level may repeat)."""
    from dspark import LLM

    extra = {"device": "cpu", "enforce_eager": True} if args.smoke else {}
    extra["async_scheduling"] = not arm.endswith("-sync")
    out = []
    with LLM(args.target, speculative_config=spec_cfg, load_format=args.load_format,
             max_num_seqs=max(levels), max_model_len=args.prompt_len + args.tokens + 64,
             max_num_batched_tokens=args.max_num_batched_tokens, **extra) as llm:  # fmt: skip
        if arm.removesuffix("-sync") == "plain":
            from host_step_cost import hold_plain

            hold_plain(llm.engine.runner.spec)
        for conc in levels:
            lines, data = measure(llm, args, conc)
            title = f"### {arm} at concurrency {conc}"
            if spec_cfg is not None and args.synthetic_rates:
                title += " (SYNTHETIC acceptance)"
            if f"{arm}@{conc}" in args.kernel_tables.split(","):
                from diag_step_paths import kernel_table

                lines.append(kernel_table(llm.engine, arm, conc, args.prompt_len, 30,
                                          args.temperature))
            if f"prefill@{conc}" in args.kernel_tables.split(","):
                lines.append(prefill_table(llm, conc, args.prompt_len))
            if f"mixed@{conc}" in args.kernel_tables.split(","):
                lines.append(mixed_table(llm, conc, args.prompt_len))
            if f"draft@{conc}" in args.kernel_tables.split(",") and spec_cfg is not None:
                lines.append(drafter_table(llm.engine.runner, conc))
            print("\n".join([title] + lines), flush=True)
            out.append(([title] + lines, data))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="/tmp/shapes/qwen3-8b")
    ap.add_argument("--drafter", default="/tmp/shapes/qwen3-8b-dspark")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--concurrency", default="64,128")
    ap.add_argument("--arms", default="nospec,adaptive",
                    help="from nospec,fixed,adaptive; a -sync suffix: no async scheduling")
    ap.add_argument("--kernel-tables", default=None,
                    help="ARM@CONC,...: also the top kernels by CUDA time of 8 decode steps; "
                    "draft@CONC: of the drafter alone (speculative arms); prefill@CONC: of the "
                    "prefill steps of CONC prompts; mixed@CONC: of steps with one prompt's "
                    "chunk beside ~CONC decoding rows (default: none; with --smoke all four "
                    "at c = 3)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--temperature", type=float, default=0.0, help="of every request")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--synthetic-rates", default="0.65,0.56,0.55,0.55,0.57,0.76,0.8")
    ap.add_argument("--serving", action="store_true",
                    help="keep CONC requests in flight, 2 x CONC in all (as bench serve does)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random pair")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:  # the bundled demo pair on the CPU
        args.target, args.drafter = os.path.join(ASSETS, "target"), os.path.join(ASSETS, "drafter")
        args.load_format, args.prompt_len, args.tokens, args.concurrency = "auto", 24, 12, "3"
        if args.kernel_tables is None:
            args.kernel_tables = "adaptive@3,draft@3,prefill@3,mixed@3"
    args.kernel_tables = args.kernel_tables or ""
    spec = pair_spec(args)
    arm_cfgs = {"nospec": None, "fixed": dict(spec, adaptive_policy="fixed"),
                "adaptive": dict(spec, enable_adaptive_verification=True)}
    arm_cfgs["plain"] = arm_cfgs["adaptive"]  # its drafting held off: adaptive's plain steps
    levels = [int(c) for c in args.concurrency.split(",")]
    results = {arm: run_arm(args, arm, arm_cfgs[arm.removesuffix("-sync")], levels)
               for arm in args.arms.split(",")}  # fmt: skip
    report, dump = [], {}
    for i, conc in enumerate(levels):  # grouped by level (a repeated level: "@c#2", ...)
        tag = f"@{conc}" + (f"#{levels[:i].count(conc) + 1}" if levels.count(conc) > 1 else "")
        for arm, by_level in results.items():
            report += by_level[i][0]
            dump[arm + tag] = by_level[i][1]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "diag_adaptive.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    with open(os.path.join(args.out, "diag_adaptive.json"), "w") as f:
        json.dump(dump, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
