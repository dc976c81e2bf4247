"""What draft probes cost while drafting is off: an adaptive engine whose drafting decision
always says plain decoding (so every 64th skipped step is a draft probe, then a step
verifying it) against no speculation: ms per step, output tok/s, and how many steps were
probes and how many ran as whole-step graphs. Run it in two trees to compare their code on
the same machine. Default pair: the bundled demo pair.

    python3 scripts/probe_cost.py --concurrency 16,32,64      # GPU
    python3 scripts/probe_cost.py --smoke                     # CPU, tiny sizes (CI)
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from profile_step import measure, pair_parser, pair_spec  # noqa: E402

from dspark import LLM  # noqa: E402
from dspark.spec.cost_model import CostModel  # noqa: E402


def costly_drafter_table() -> str:
    """A cost table whose drafter pass costs 100 ms (no start-up profile; the decision is
    held off below, since the fixed terms learned online would undo the price)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    CostModel.analytic(weight_read_ms=1.0, ms_per_token=0.01, fixed_overhead_ms=0.0,
                       draft_base_ms=100.0, draft_ms_per_req=0.0).to_json(path)  # fmt: skip
    return path


def main() -> int:
    ap = pair_parser(__doc__)
    ap.add_argument("--concurrency", default="16,32,64")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    kw = dict(max_model_len=1024, max_num_seqs=max(levels), max_num_batched_tokens=4096,
              load_format=args.load_format)  # fmt: skip
    if args.smoke:
        args.tokens, levels = 70, [4]
        kw.update(device="cpu", max_num_seqs=4)
    probing = dict(pair_spec(args), enable_adaptive_verification=True,
                   cost_table_path=costly_drafter_table())  # fmt: skip
    rows = []
    for arm, spec in (("nospec", None), ("probing", probing)):
        with LLM(args.target, speculative_config=spec, **kw) as llm:
            runner = llm.engine.runner
            if runner.spec is not None:  # every decision says plain decoding; probes as usual
                runner.spec.drafting._pays = lambda *a, **k: False
                runner.spec.drafting.pays = False
            for c in levels:
                counts = dict(runner.spec.step_counts) if runner.spec is not None else {}
                graphed = sum(runner.step_graphs.steps.values()) if runner.step_graphs else 0
                m = measure(llm, c, args, args.temperature)
                after = dict(runner.spec.step_counts) if runner.spec is not None else {}
                # (the warm-up run's steps are in these deltas too: measure runs two)
                probes = after.get("draft", 0) - counts.get("draft", 0)
                graphed = (sum(runner.step_graphs.steps.values()) if runner.step_graphs
                           else 0) - graphed  # fmt: skip
                rows.append((arm, c, m, probes, graphed))
    print(f"{'arm':<8} {'conc':>5} {'ms/step':>8} {'tok/s':>9} {'probes':>7} {'graph steps':>12}")
    for arm, c, m, probes, graphed in rows:
        print(f"{arm:<8} {c:>5} {m['ms_per_step']:>8.3f} {m['tok_s']:>9.1f} {probes:>7} "
              f"{graphed:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
