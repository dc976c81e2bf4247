"""Greedy tokens with whole-step CUDA graphs vs without (`enforce_eager`), no speculation and
fixed K, on one pair and dtype: tells a graph-path bug (eager != graph for the same arm) from
numerical ties between arms (bf16 kernels differ with batch shapes).

    python3 scripts/diag_graph_identity.py --dataset-path HumanEval.jsonl.gz
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.bench.datasets import load_dataset  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dspark", "assets", "demo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=os.path.join(DEMO, "target"))
    ap.add_argument("--drafter", default=os.path.join(DEMO, "drafter"))
    ap.add_argument("--dataset-path", required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    reqs = load_dataset("humaneval", args.prompts, path=args.dataset_path, input_len=512,
                        output_len=args.tokens, seed=0, prompt_type="words")  # fmt: skip
    prompts = [r.prompt for r in reqs]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    spec = {"model": args.drafter, "num_speculative_tokens": 7, "adaptive_policy": "fixed"}
    out = {}
    for arm, cfg in (("nospec", None), ("fixed7", spec)):
        for eager in (False, True):
            with LLM(args.target, speculative_config=cfg, dtype=args.dtype, max_num_seqs=32,
                     enforce_eager=eager) as llm:  # fmt: skip
                got = llm.generate(prompts, params, use_tqdm=False)
                out[arm, eager] = [o.outputs[0].token_ids for o in got]
    ref = out["nospec", True]
    for key, toks in out.items():
        diff = sum(a != b for a, b in zip(toks, ref, strict=True))
        print(f"{key[0]:>7} {'eager' if key[1] else 'graphs':>7}: {diff}/{len(ref)} prompts "
              "differ from no-spec eager")
    return 0


if __name__ == "__main__":
    sys.exit(main())
