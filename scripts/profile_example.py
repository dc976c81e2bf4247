"""Profile an example cost table on the GPU for a small bf16 target (random weights).

Writes examples/cost_table_<device>.json with its provenance; the same as running
`dspark profile --model DIR --dtype bfloat16 --speculative-config ... --output FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark.cli import main as dspark_main  # noqa: E402
from dspark.testing.checkpoints import TinyShape, make_tiny_target  # noqa: E402
from dspark.testing.drafters import make_tiny_drafter  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (script check)")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    shape = TinyShape() if args.smoke else TinyShape(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=64,
    )  # fmt: skip
    device = "cpu" if args.smoke else "cuda"
    target = make_tiny_target(os.path.join(root, "t"), shape, dtype="bfloat16")
    drafter = make_tiny_drafter(os.path.join(root, "d"), target, dtype="bfloat16", num_layers=2)
    name = "cost_table_smoke.json" if args.smoke else "cost_table_h200_small_bf16.json"
    out = os.path.join(args.out, name)
    spec = json.dumps({"model": drafter, "num_speculative_tokens": 7})
    cmd = ["profile", "--model", target, "--dtype", "bfloat16", "--device", device,
           "--max-num-seqs", "8" if args.smoke else "256", "--max-num-batched-tokens",
           "64" if args.smoke else "2048", "--speculative-config", spec, "--output", out]
    if args.smoke:
        cmd += ["--repeats", "2", "--warmup", "1", "--context-len", "16"]
    print("dspark " + " ".join(cmd), flush=True)
    return dspark_main(cmd)


if __name__ == "__main__":
    sys.exit(main())
