"""One 8B-shaped engine (random bf16 weights), no speculation: decode step time and tokens/s
with the whole-step CUDA graphs and with the per-phase graphs behind them (the same engine,
`runner.step_graphs` set aside), then the top kernels by CUDA time of a few pure decode steps
of each. Tells whether a slow decode step is the whole-step graph's doing.

    python3 scripts/diag_step_paths.py --out $OUT    # GPU (after scripts/make_shape_dirs.py)
    python3 scripts/diag_step_paths.py --smoke       # CPU, tiny shape: checks the script only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_bench import TINY, make_engine, run_generate  # noqa: E402
from host_step_cost import prefill_all  # noqa: E402


def kernel_table(engine, tag: str, conc: int, prompt_len: int, rows: int,
                 temperature: float = 0.0) -> str:
    from torch.profiler import ProfilerActivity, profile

    from dspark.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True)
    for i in range(conc):
        ids = [5 + (i + j) % 100 for j in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
    prefill_all(engine)  # outside the profile
    for _ in range(2):  # and the first decode steps
        engine.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(8):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="/tmp/shapes/qwen3-8b")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--table-concurrency", type=int, default=None,
                    help="concurrency of the kernel tables (default: the first of --concurrency)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (no graphs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.smoke:
        args.model, args.device = tempfile.mkdtemp(prefix="diag-shape-"), "cpu"
        args.concurrency, args.output_len = "1,2", 6
        with open(os.path.join(args.model, "config.json"), "w") as f:
            json.dump(TINY, f)
    conc = [int(c) for c in args.concurrency.split(",")]
    engine = make_engine(args.model, max(conc), 0.80, args.device)
    runner = engine.runner
    whole = runner.step_graphs
    lines, tables = [], []
    for label, graphs in (("whole-step", whole), ("per-phase", None)):
        runner.step_graphs = graphs
        for c in conc:
            tok_s, step_ms = run_generate(engine, c, 512, args.output_len)
            lines.append(f"{label:<11} c={c:<4} {tok_s:9.1f} tok/s  decode step {step_ms:6.2f} ms")
            print(lines[-1], flush=True)
        tc = args.table_concurrency or conc[0]
        table = kernel_table(engine, label, tc, 512, args.rows)
        tables.append(f"### {label}, c={tc}\n{table}")
    runner.step_graphs = whole
    text = "\n".join(tables + lines)
    with open(os.path.join(args.out, "diag_step_paths.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
