"""Where a step with prefill chunks ("mixed") spends its time, against a decode / verify step
of the same engine: kernel and graph launches, the device time of the kernels it launched
(by phase and by kernel) and the host time of its phases, under torch.profiler.

In serving, requests finish at different steps under speculation, so new prompts arrive one or
two at a time and 30-45% of all steps at c >= 128 carry a prefill chunk (the
nineteenth session's e2e run: 902 of 2,258 steps at c = 256, T = 1). Those steps took the
per-phase path (eager glue around the target-forward graphs) until whole-step graphs covered
them (DSPARK_MIXED_GRAPHS=0 restores it, for comparison). Workload: `--prompts` prompts
(default 4 x concurrency) of staggered output lengths through an engine of `concurrency` rows.

    python3 scripts/profile_mixed.py --out $OUT          # GPU, bundled demo pair, c = 128
    python3 scripts/profile_mixed.py --smoke             # CPU, tiny sizes (CI)
"""

from __future__ import annotations

import os
import random
import sys
from collections import Counter, defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_step import pair_parser, pair_spec, ranged  # noqa: E402  (pair arguments; ranges)

from dspark import LLM, SamplingParams  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx")
PHASES = (("forward", "target_forward"), ("verify", "verify"), ("propose", "propose"),
          ("choose_lengths", "allocate"))  # fmt: skip


def _step_kind(sched, block_tables, follows=False) -> str:
    rows = sched.rows
    if any(r.num_non_draft_tokens > 1 for r in rows):
        return "step::mixed"
    return "step::verify" if any(r.num_draft_slots for r in rows) else "step::plain"


def workload(args, seed: int):
    rnd = random.Random(seed)
    n = args.prompts or 4 * args.concurrency
    prompts = [{"prompt_token_ids": [rnd.randrange(100, 5000) for _ in range(args.prompt_len)]}
               for _ in range(n)]  # fmt: skip
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, seed=i,
                             max_tokens=rnd.randrange(args.tokens // 2, args.tokens + 1))
              for i in range(n)]  # fmt: skip
    return prompts, params


def _walk(ev, phase=None):
    """(event, innermost phase:: range holding it) over ev and its descendants."""
    if ev.name.startswith("phase::"):
        phase = ev.name[7:]
    yield ev, phase
    for child in ev.cpu_children:
        yield from _walk(child, phase)


def summarize(events, label: str, top: int) -> list[str]:
    steps = [e for e in events if e.name.startswith("step::")]
    by_kind = defaultdict(list)
    for e in steps:
        by_kind[e.name[6:]].append(e)
    lines = [f"### {label}"]
    for kind, evs in sorted(by_kind.items()):
        n = len(evs)
        launches, dev_us, host_us = 0, 0.0, 0.0
        phase_host, phase_dev, kernels = Counter(), Counter(), Counter()
        for step in evs:
            host_us += step.cpu_time_total
            for e, phase in _walk(step):
                if e.name.startswith("phase::"):
                    phase_host[phase] += e.cpu_time_total
                if e.name in LAUNCHES:
                    launches += 1
                for k in getattr(e, "kernels", []):
                    dev_us += k.duration
                    kernels[k.name[:60]] += k.duration
                    phase_dev[phase or "other"] += k.duration
        lines.append(f"{kind:<7} {n:5d} steps: {launches / n:6.1f} launches, "
                     f"host {host_us / n:8.1f} us, device (kernels launched) "
                     f"{dev_us / n:8.1f} us per step")  # fmt: skip
        lines += [f"    {p:<16} host {phase_host[p] / n:8.1f} us  device {phase_dev[p] / n:8.1f} us"
                  for p in sorted(set(phase_host) | set(phase_dev))]  # fmt: skip
        lines += [f"    kernel {name:<60} {us / n:8.1f} us"
                  for name, us in kernels.most_common(top)]  # fmt: skip
    return lines


def main() -> int:
    ap = pair_parser(__doc__)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=0, help="default: 4 x concurrency")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="output lengths in [tokens/2, tokens]")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--arms", default="nospec,fixed,adaptive")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per step kind")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    args = ap.parse_args()
    kw = dict(max_model_len=1024, max_num_seqs=args.concurrency, max_num_batched_tokens=8192,
              load_format=args.load_format)  # (dummy: random weights, e.g. the 8B shape)
    if args.smoke:
        args.concurrency, args.prompts, args.tokens, args.prompt_len = 4, 5, 4, 24
        kw.update(device="cpu", max_num_seqs=4)
    base = pair_spec(args)  # (random weights accept nothing: --synthetic-rates)
    arms = {"nospec": None, "fixed": dict(base, adaptive_policy="fixed"),
            "adaptive": dict(base, enable_adaptive_verification=True)}
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    report = []
    for arm in args.arms.split(","):
        with LLM(args.target, speculative_config=arms[arm], **kw) as llm:
            runner = llm.engine.runner
            llm.generate(*workload(args, 0), use_tqdm=False)  # warm-up (first-use captures)
            ranged(runner, "launch", _step_kind)
            for name, label in PHASES:
                owner = runner if name == "forward" else runner.spec
                if owner is not None:
                    ranged(owner, name, f"phase::{label}")
            if runner.step_graphs is not None:
                ranged(runner.step_graphs, "start", "phase::whole_step_graphs")
            with profile(activities=acts) as prof:
                llm.generate(*workload(args, 1), use_tqdm=False)
            lines = summarize(prof.events(), f"{arm} T={args.temperature:g} "
                              f"c={args.concurrency}", args.top)  # fmt: skip
            print("\n".join(lines), flush=True)  # (each arm as it ends: a cut run keeps it)
            report += lines
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_mixed.txt"), "w") as f:
        f.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
