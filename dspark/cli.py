"""`dspark` command line: serve | generate | bench | profile | calibrate | train-drafter."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    p.add_argument("--model", required=model_required, help="target checkpoint folder")
    p.add_argument("--speculative-config", default=None, help="JSON, same keys as the API")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 2048, plus max-num-seqs x K with speculation)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)


def parse_spec_config(text: str | None) -> dict | None:
    from dspark.config import parse_speculative_json

    return parse_speculative_json(text) if text else None


def engine_kwargs(args) -> dict:
    return dict(
        device=args.device, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=parse_spec_config(args.speculative_config),
    )  # fmt: skip


def cmd_generate(args) -> int:
    from dspark import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sample_seed, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    for out in llm.generate(args.prompt, params):
        comp = out.outputs[0]
        print(json.dumps({
            "prompt": out.prompt, "text": comp.text, "token_ids": comp.token_ids,
            "finish_reason": comp.finish_reason, "spec_decode": out.spec_decode,
        }))  # fmt: skip
    return 0


def cmd_profile(args) -> int:
    from dspark.config import EngineConfig
    from dspark.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    spec = kwargs["speculative_config"]
    if spec is not None:  # profile with a fixed policy: no start-up table needed
        spec = dict(spec, adaptive_policy="fixed", enable_adaptive_verification=False)
        kwargs["speculative_config"] = spec
    engine = LLMEngine(EngineConfig(model=args.model, **kwargs))
    cost = engine.runner.profile_cost(  # every tensor-parallel rank runs the forwards
        max_tokens=args.max_tokens, context_len=args.context_len, repeats=args.repeats,
        warmup=args.warmup,
    )  # fmt: skip
    engine.runner.shutdown()
    cost.to_json(args.output)
    problem = cost.describe_problem()
    print(f"wrote {args.output}: {len(cost.verify_tokens)} token counts, "
          f"{len(cost.draft_reqs)} drafter request counts")  # fmt: skip
    for n, t in zip(cost.verify_tokens, cost.verify_ms):
        print(f"  verify {int(n):6d} tokens  {t:9.3f} ms")
    for r, t in zip(cost.draft_reqs, cost.draft_ms):
        print(f"  draft  {int(r):6d} reqs    {t:9.3f} ms")
    if problem:
        print(f"WARNING: {problem}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from dspark.server.cli import add_serve_parser

    add_serve_parser(sub)

    g = sub.add_parser("generate", help="generate completions offline")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="may be repeated")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--sample-seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    from dspark.bench.cli import add_bench_parser

    add_bench_parser(sub)

    p = sub.add_parser("profile", help="measure the step-cost table for adaptive verification")
    add_engine_args(p)
    p.add_argument("--output", required=True, help="cost table JSON to write")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.set_defaults(func=cmd_profile)

    from dspark.train.cli import add_train_parsers

    add_train_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad configuration or input (a checkpoint
        # folder without config.json, a missing file): a clear message, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
