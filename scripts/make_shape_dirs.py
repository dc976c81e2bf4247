"""Write config-only checkpoint folders for benchmark shapes (random weights are created by
`--load-format dummy`): a Qwen3-8B-shaped target and a DSpark drafter for it in the DeepSpec
layout (5 layers, block 7, Markov rank 256, target layers [1, 9, 17, 25, 33])."""

from __future__ import annotations

import argparse
import json
import os

QWEN3_8B = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, dtype="bfloat16", model_type="qwen3",
)  # fmt: skip


def drafter_config(target: dict, num_layers: int = 5) -> dict:
    return dict(
        target, architectures=["Qwen3DSparkModel"], num_hidden_layers=num_layers,
        num_target_layers=target["num_hidden_layers"], block_size=7, mask_token_id=151669,
        target_layer_ids=[1, 9, 17, 25, 33], markov_rank=256, markov_head_type="vanilla",
        enable_confidence_head=True, confidence_head_with_markov=True,
        layer_types=["full_attention"] * num_layers,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for name, cfg in (("qwen3-8b", QWEN3_8B), ("qwen3-8b-dspark", drafter_config(QWEN3_8B))):
        os.makedirs(os.path.join(args.out, name), exist_ok=True)
        with open(os.path.join(args.out, name, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        print(os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
