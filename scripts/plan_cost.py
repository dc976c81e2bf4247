"""Host cost of the lagged policy's planning (`SpecDecoder.plan`) per step, without a GPU:
the demo pair with its device work stubbed (scripts/host_step_cost.py) runs a few decode
steps with drafting on, then one packed step is planned repeatedly and timed (the fastest of
a few runs), as the engine plans (a clear verify-all plan is reused for the next plans of its
shape) and without reuse, the engine's plan of a step with a prompt chunk beside the
decoding rows ("mixed plan"), the planner's plan of a step with a prefill chunk of varying
size (plans reused), a plan on which the drafting decision is due, with the parts: the
stale-confidence read, the exact no-trim bound, the budget search (uncached,
plan_budget_lagged, numpy) and the planner's own (on Python floats up to SMALL_SLOTS draft
slots), the drafting decision's survey.

`--cold`: each call after a sweep of the caches (a read of 64 MiB, not timed), the median of
the calls. In the engine's loop a plan runs after the step's other host work has pushed its
objects out of the caches, and a hot loop understates it 5-15x (development machine, thirtieth
session: plan 1.7 -> 22-30 us, search 21 -> 100-210 us, the decision's survey 13 -> 80-140
us at 1-32 requests); the H200 host's serving loop measured 8-19 us per plan, 160-270 us
per search and 90-230 us per decision for the demo pair (eighteenth to thirtieth sessions).

    python3 scripts/plan_cost.py --concurrency 1,64,256 [--cold]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_step_cost import DEMO, demo_spec, prefill_all, stub_device_work, sweep_caches  # noqa: E402

import dspark.engine.model_runner as mr  # noqa: E402
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.spec.budget_search import plan_budget_lagged  # noqa: E402


def per_call_us(fn, n: int, blocks: int = 5) -> float:
    """The fastest of `blocks` runs of n // blocks calls (a shared machine's noise only ever
    adds time)."""
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(max(n // blocks, 1)):
            fn()
        best = min(best, (time.perf_counter() - t0) / max(n // blocks, 1))
    return best * 1e6


def cold_call_us(fn, n: int) -> float:
    """The median of n calls, each after reading 64 MiB (evicts the last-level cache)."""
    times = []
    for _ in range(max(n, 1)):
        sweep_caches()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def _decoding(num_reqs: int, chunk: bool = False):
    """The demo pair with its device work stubbed, `num_reqs` requests a few steps into
    decoding; returns (the LLM, its decoder, the last packed decode step) or, with `chunk`,
    the packed step that a 300-token prompt arriving then adds its chunk to."""
    llm = LLM(f"{DEMO}/target", device="cpu", max_num_seqs=max(num_reqs, 2) + chunk,
              speculative_config=demo_spec("lagged"))  # fmt: skip
    sg, sd = stub_device_work(llm.engine.runner), llm.engine.runner.spec
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for i in range(num_reqs):
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": list(range(100 + i, 132 + i))},
                               params)  # fmt: skip
    prefill_all(llm.engine, sg)
    packed = []
    pack = mr.pack_step
    mr.pack_step = lambda *a, **k: packed.append(pack(*a, **k)) or packed[-1]
    try:
        for _ in range(3):
            llm.engine.step()
        if chunk:
            llm.engine.add_request("chunk", {"prompt_token_ids": list(range(50, 350))}, params)
            llm.engine.step()
    finally:
        mr.pack_step = pack
    return llm, sd, packed[-1]


def measure(num_reqs: int, repeats: int, cold: bool = False) -> str:
    llm, sd, host = _decoding(num_reqs)  # (the engines stay alive while timed)
    rows = host.per_row()
    caps, slots = rows[1], rows[4]
    stale, cost = sd._stale(slots), sd.planner.cost
    total = int(caps.sum())
    settled = sd.planner._trimming_cannot_pay(caps.size, 0, total, 0.0)
    timed = (lambda fn, n: cold_call_us(fn, n // 10)) if cold else per_call_us
    plan = timed(lambda: sd.plan(host), repeats)  # the engine's (plans reused)
    # the planner's plan of a step with a prefill chunk (an opportunity rate: the decode bound
    # does not apply; at 4 requests the chunk bound settles these, and the plan then stands)
    # whose size varies from step to step, as it does in serving, plans reused: each call a size not
    # seen before, within one size group (2,049-4,096 tokens) so that plans stand for each other
    sizes = itertools.cycle(np.random.default_rng(0).permutation(np.arange(2049, 4097)).tolist())
    chunk = timed(lambda: sd.planner.plan_cpu(stale, caps, next(sizes), caps.size, 0.0, 2.0),
                  repeats)  # fmt: skip
    # a decode plan on which the drafting decision is due (every few steps, and whenever the
    # batch size moves by a quarter: its stale confidences read and surveyed, drafting priced
    # against plain decoding as in serving, where draft skipping is on; the decision's state
    # is put back after, so that the later parts plan with drafting on)
    kept = copy.deepcopy(sd.drafting)
    sd.drafting.due, sd.drafting.routine = (lambda num_reqs: True), (lambda *a: False)
    sd.drafting.enabled = True
    try:
        decision = timed(lambda: sd.plan(host), repeats)
    finally:
        sd.drafting = kept
    # (the planner's standing plans: StandingPlans holds the counts)
    sd.planner.standing.clear_plans = sd.planner.standing.trimmed_plans = sd.settled_plans = 1
    sd.planner.invalidate_tables()  # (drops the standing plans too)
    # the engine's plan of a step with a prompt chunk beside the decoding rows (its decode
    # rate priced, plans reused), on an engine of its own
    llm_mixed, sd_mixed, mixed = _decoding(num_reqs, chunk=True)
    parts = {
        "plan": plan,
        "mixed plan": timed(lambda: sd_mixed.plan(mixed), repeats),
        "plan without reuse": timed(lambda: sd.plan(host), repeats),
        "chunk plan": chunk,
        "decision plan": decision,
        "stale read": timed(lambda: sd._stale(slots), repeats),
        "bound": timed(lambda: sd.planner._trimming_cannot_pay(caps.size, 0, total, 0.0),
                       repeats),  # fmt: skip
        "search": timed(lambda: plan_budget_lagged(stale, caps, 0, caps.size, cost),
                        repeats),  # fmt: skip
        # the planner's own search (Python floats up to SMALL_SLOTS draft slots: small_search.py;
        # an opportunity rate, as in a step with prefill chunks: the decode bound does not
        # apply, and at 2 tokens/ms the chunk bound settled none of these calls, 4 requests)
        "planner search": timed(lambda: sd.planner.plan_cpu(stale, caps, 0, caps.size, 0.0, 2.0),
                                repeats),  # fmt: skip
        "decision survey": timed(lambda: sd.drafting.survey(np.arange(caps.size), stale, True),
                                 repeats),  # fmt: skip
    }
    return (f"{num_reqs} requests (bound settles: {settled}{', cold' if cold else ''}): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in parts.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--cold", action="store_true",
                    help="each call after a cache sweep (median of repeats / 10 calls)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for c in (int(x) for x in args.concurrency.split(",")):
        print(measure(c, args.repeats, args.cold), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
