"""How well the drafting decision's survival estimate follows the drafts accepted: an
adaptive engine on the bundled demo pair (CPU), drafting held on and every draft verified
(no trimming, so every position is observed), prints the acceptance per position over the
run next to the mean of the estimates the decision steps at a full batch left (from the
first quarter of them on). Run it in two trees to compare their estimators.

    python3 scripts/survival_estimate.py --temperature 0
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from dspark import LLM, SamplingParams  # noqa: E402

DEMO = os.path.join(ROOT, "dspark", "assets", "demo")


def _row(values) -> str:
    return "[" + " ".join(f"{v:.3f}" for v in values) + "]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    texts = (open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "dspark", "*", "*.py"))))
    prompts = [t[:300] for t in texts if len(t) > 300][: args.prompts]
    spec = dict(method="dspark", model=f"{DEMO}/drafter", num_speculative_tokens=7,
                enable_adaptive_verification=True, min_predicted_gain=9.0)  # (never trims)
    greedy = args.temperature == 0
    with LLM(f"{DEMO}/target", device="cpu", speculative_config=spec,
             max_num_seqs=args.concurrency) as llm:  # fmt: skip
        drafting = llm.engine.runner.spec.drafting
        drafting._pays = lambda *a, **k: True  # drafting held on
        estimates, check = [], drafting.check_prediction

        def check_and_read(*a):
            check(*a)
            if len(llm.engine.scheduler.running) == args.concurrency:
                estimates.append(drafting.estimate(greedy))

        drafting.check_prediction = check_and_read
        params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens,
                                ignore_eos=True)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
    accepted, steps = np.zeros(7), 0
    for o in outs:
        accepted += np.array(o.spec_decode["acceptance_per_position"]) * o.spec_decode["num_steps"]
        steps += o.spec_decode["num_steps"]
    actual = accepted / steps
    print(f"T = {args.temperature:g}, {len(estimates)} full-batch decision steps")
    print("accepted per position ", _row(actual), f"sum {actual.sum():.3f}")
    if not estimates:
        print("no decision step at a full batch: more prompts or tokens")
        return 1
    est = np.array(estimates[len(estimates) // 4 :]).mean(axis=0)
    print("estimate per position ", _row(est), f"sum {est.sum():.3f}")
    print(f"absolute error, summed over positions: {np.abs(est - actual).sum():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
