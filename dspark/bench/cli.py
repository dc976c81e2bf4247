r"""`dspark bench serve` (and `dspark bench plot`): arguments, reports and the result file.

    dspark bench serve --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 1024 --random-output-len 256 --ignore-eos --num-prompts 256 \
        --sweep 1,4,16,32,64,128,256 --save-result results/adaptive.json --label adaptive
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCHEMA_VERSION = 1


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 50,99, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must lie in (0, 100], got {text!r}")
    return values


def _json_object(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--extra-body is not valid JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return obj


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is ok)")
    a("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    a("--model", default=None, help="model name (default: first id from GET /v1/models)")
    a("--api-key", default=None, help="bearer token (else $DSPARK_API_KEY or $OPENAI_API_KEY)")
    a("--dataset", default="random", choices=["random", "prompts", "humaneval"])
    a("--dataset-path", default=None, help="JSONL for 'prompts'; HumanEval.jsonl[.gz] (optional)")
    a("--random-input-len", type=int, default=1024, help="prompt length (default 1024)")
    a("--random-output-len", type=int, default=128, help="max_tokens (default 128)")
    a("--random-range-ratio", type=float, default=0.0, metavar="R",
      help="draw each random prompt's input and output lengths uniformly from "
           "[L (1 - R), L (1 + R)] (default 0: fixed lengths)")
    a("--random-prompt-type", default="words", choices=["words", "token-ids"],
      help="random words (text) or random token ids (exact length, /v1/completions only)")
    a("--random-token-id-range", type=_int_list, default=[100, 5000], metavar="LO,HI")
    a("--tokenizer", default=None, help="HF tokenizer path: cut word prompts to exact lengths")
    a("--output-len", type=int, default=None,
      help="max_tokens for prompts/humaneval entries that do not set it (default 256)")
    a("--num-prompts", type=int, default=200, help="measured requests per level (default 200)")
    a("--prompts-per-concurrency", type=float, default=0.0, metavar="F",
      help="a level of concurrency C measures max(--num-prompts, ceil(F*C)) requests, so low "
           "levels stay short and high levels still fill their slots (default 0: off)")
    conc = p.add_mutually_exclusive_group()
    conc.add_argument("--max-concurrency", type=int, default=None)
    conc.add_argument("--sweep", type=_int_list, default=None, metavar="1,4,16,...",
                      help="run each max concurrency in turn")
    a("--request-rate", type=float, default=math.inf, help="Poisson arrivals per s (default inf)")
    a("--ignore-eos", action="store_true", help="send ignore_eos: true (fixed output lengths)")
    a("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    a("--seed", type=int, default=0, help="dataset seed; request i is sent seed + i")
    a("--warmup", type=int, default=0, help="unmeasured warm-up requests before the first level")
    a("--warmup-tokens-per-level", type=int, default=0, metavar="N",
      help="before each level, run its first `concurrency` requests cut to N output tokens, "
           "unmeasured (default 0: off)")
    a("--percentiles", type=_percentiles, default=(50.0, 95.0, 99.0), help="default 50,95,99")
    a("--save-result", default=None, metavar="FILE.json")
    a("--plot", default=None, metavar="FILE.png", help="default for sweeps: next to the JSON")
    a("--no-plot", action="store_true", help="write no plot, not even a sweep's")
    a("--label", default=None, help="arm name stored in the result (plot legend)")
    a("--extra-body", type=_json_object, default={}, help="JSON merged into every request body")
    a("--timeout", type=float, default=6 * 3600.0, help="per-request timeout in seconds")
    a("--disable-tqdm", action="store_true")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench serve` and `bench plot` on a top-level `subparsers` object."""
    from dspark.bench.plot import add_plot_arguments

    bench = subparsers.add_parser("bench", help="benchmarks")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = sub.add_parser("serve", help="benchmark an OpenAI-compatible server",
                           description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(serve)
    plot = sub.add_parser("plot", help="plot one or several bench serve result files")
    add_plot_arguments(plot)
    for parser in (bench, serve, plot):
        parser.set_defaults(func=run_bench)
    return bench


# ----------------------------------------------------------------------------- reports


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def format_level_report(m: dict, percentiles: tuple[float, ...]) -> str:
    conc = m["max_concurrency"] or "inf"
    lines = [f"==== max concurrency {conc} " + "=" * 30,
             f"completed / failed:       {m['completed']} / {m['failed']}",
             f"duration (s):             {_fmt(m['duration_s'])}",
             f"request throughput (/s):  {_fmt(m['request_throughput'])}",
             f"output tokens/s:          {_fmt(m['output_throughput'])}",
             f"total tokens/s:           {_fmt(m['total_token_throughput'])}"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2el_ms", "E2E")):
        s = m[key]
        pcts = "  ".join(f"p{q:g} {_fmt(s[f'p{q:g}'])}" for q in percentiles)
        lines.append(f"{name + ' (ms):':<26}mean {_fmt(s['mean'])}  {pcts}")
    spec = m.get("spec_decode")
    if spec:
        lines.append(f"acceptance length:        {_fmt(spec['mean_acceptance_length'])}"
                     f"  (from {spec['source']})")
        lines.append(f"verified tokens/request:  {_fmt(spec['verified_tokens_per_request'])}")
    cpu = m.get("host_cpu")
    if cpu:  # a process near 1.0 core is a single-threaded bound on the level
        lines.append("host CPU (cores busy):    " + "  ".join(
            f"{who} {_fmt(v)}" for who, v in cpu.items()))  # fmt: skip
    over = m.get("scheduler_overhead")
    if over:  # an adaptive server's planning + allocation, against its steps' wall time
        parts = ", ".join(f"{part} {v['plans']:.0f} x {v['ms_per_plan'] * 1e3:.0f}"
                          for part, v in over["plan_by_part"].items())  # fmt: skip
        lines.append(f"scheduler overhead:       {over['fraction'] * 100:.2f}% of step time "
                     f"(plan {over['plan_ms_per_step'] * 1e3:.1f} + alloc "
                     f"{over['alloc_ms_per_step'] * 1e3:.1f} us per {over['step_ms']:.2f} ms "
                     f"step; plans x us: {parts})")
    for err in m["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def format_table(results: list[dict], percentiles: tuple[float, ...] = (50.0, 95.0, 99.0)) -> str:
    """One row per concurrency level; latencies in ms (p50 = median, pHI = top percentile)."""
    hi = f"p{max(percentiles):g}"
    cols = [("conc", lambda m: m["max_concurrency"] or "inf"),
            ("ok", lambda m: m["completed"]), ("fail", lambda m: m["failed"]),
            ("dur s", lambda m: m["duration_s"]), ("req/s", lambda m: m["request_throughput"]),
            ("out tok/s", lambda m: m["output_throughput"]),
            ("tot tok/s", lambda m: m["total_token_throughput"])]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2el_ms", "E2E")):
        cols.append((f"{name} p50", lambda m, k=key: m[k]["median"]))
        cols.append((f"{name} {hi}", lambda m, k=key: m[k][hi]))
    cols.append(("acc len", lambda m: (m.get("spec_decode") or {}).get("mean_acceptance_length")))
    cols.append(("verif/req",
                 lambda m: (m.get("spec_decode") or {}).get("verified_tokens_per_request")))
    rows = [[name for name, _ in cols]] + [[_fmt(get(m)) for _, get in cols] for m in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _git_commit() -> str | None:
    """HEAD, with "-dirty" when tracked files differ from it: a copy of a working tree (as
    the GPU machine runs) can carry a HEAD older than its files."""
    here = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=here,
                               capture_output=True, timeout=10).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty else "")


def environment_info() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(),
            "hostname": socket.gethostname(), "cpu_count": os.cpu_count(),
            "dspark_version": version("dspark"), "git_commit": _git_commit(),
            "packages": {p: version(p) for p in ("aiohttp", "numpy")}}


def _redacted_argv(argv: list[str]) -> list[str]:
    out, hide = [], False
    for a in argv:
        out.append("***" if hide else ("--api-key=***" if a.startswith("--api-key=") else a))
        hide = a == "--api-key"
    return out


def _finite(obj):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def build_result_doc(args: argparse.Namespace, model: str | None, levels: list,
                     results: list[dict]) -> dict:
    keys = ("base_url", "endpoint", "dataset", "dataset_path", "num_prompts",
            "prompts_per_concurrency", "random_input_len", "random_output_len",
            "random_range_ratio", "random_prompt_type", "tokenizer", "output_len",
            "request_rate", "ignore_eos", "temperature", "seed", "warmup",
            "warmup_tokens_per_level", "percentiles", "label", "extra_body")
    config = {k: getattr(args, k, None) for k in keys}
    config.update(model=model, max_concurrency=levels)
    return _finite({"schema_version": SCHEMA_VERSION, "tool": "dspark bench serve",
                    "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    "command": _redacted_argv(getattr(args, "argv", None) or sys.argv),
                    "config": config,
                    "environment": environment_info(), "results": results})


# ----------------------------------------------------------------------------- running


def _load_samples(args: argparse.Namespace, levels: list) -> tuple[list, list]:
    """(per-level sample lists, warm-up samples). Random prompts are distinct across levels
    and warm-up, so no level gets prefix-cache hits from an earlier one."""
    from dspark.bench.datasets import load_dataset, random_dataset, take

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    counts = [level_num_prompts(args, c) for c in levels]
    if args.dataset == "random":
        rnd = dict(input_len=args.random_input_len, output_len=args.random_output_len,
                   prompt_type=args.random_prompt_type, range_ratio=args.random_range_ratio,
                   token_id_range=tuple(args.random_token_id_range), tokenizer=tokenizer)
        pool = random_dataset(sum(counts), seed=args.seed, **rnd)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        per_level = [pool[s:s + n] for s, n in zip(starts, counts)]
        warmup = random_dataset(args.warmup, seed=args.seed + 1_000_003, **rnd)
        return per_level, warmup
    samples = load_dataset(args.dataset, max(counts), path=args.dataset_path,
                           default_max_tokens=args.output_len, seed=args.seed)
    if len(levels) > 1:
        print("note: every level reuses the same prompts; prefix caching may favour later "
              "levels", file=sys.stderr)
    return [samples[:n] for n in counts], take(samples, args.warmup)


def level_num_prompts(args: argparse.Namespace, concurrency: int | None) -> int:
    """Measured requests at one level: --num-prompts, raised to F x concurrency if asked."""
    scaled = math.ceil(args.prompts_per_concurrency * concurrency) if concurrency else 0
    return max(args.num_prompts, scaled)


def _run_serve(args: argparse.Namespace) -> int:
    from dspark.bench.serve import BenchConfig, run_sweep

    problem = None
    if (args.num_prompts < 1 or args.warmup < 0 or args.warmup_tokens_per_level < 0
            or not args.prompts_per_concurrency >= 0):  # fmt: skip
        problem = ("--num-prompts must be >= 1, --warmup, --warmup-tokens-per-level and "
                   "--prompts-per-concurrency >= 0")
    elif len(args.random_token_id_range) != 2:
        problem = "--random-token-id-range takes two integers LO,HI"
    elif args.random_prompt_type == "token-ids" and args.endpoint != "/v1/completions":
        problem = "--random-prompt-type token-ids needs --endpoint /v1/completions"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    levels = args.sweep or [args.max_concurrency]
    try:
        per_level, warmup = _load_samples(args, levels)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.sweep and level_num_prompts(args, max(args.sweep)) < max(args.sweep):
        print(f"warning: --num-prompts {args.num_prompts} < max concurrency {max(args.sweep)}: "
              "the top levels cannot fill their slots", file=sys.stderr)
    api_key = args.api_key or os.environ.get("DSPARK_API_KEY") or os.environ.get("OPENAI_API_KEY")
    cfg = BenchConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model,
                      api_key=api_key, request_rate=args.request_rate,
                      ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
                      extra_body=args.extra_body, percentiles=args.percentiles,
                      timeout_s=args.timeout, disable_tqdm=args.disable_tqdm,
                      warmup_tokens_per_level=args.warmup_tokens_per_level)
    results: list[dict] = []

    def report(m: dict) -> None:
        results.append(m)
        print(format_level_report(m, cfg.percentiles), flush=True)

    interrupted = False
    try:
        asyncio.run(run_sweep(cfg, levels, per_level.__getitem__, warmup, report))
    except RuntimeError as e:  # no model could be resolved: nothing was measured
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # keep the levels that finished
        interrupted = True
        print(f"\ninterrupted after {len(results)} of {len(levels)} levels", file=sys.stderr)
    if len(results) > 1:
        print("\n" + format_table(results, cfg.percentiles))
    doc = build_result_doc(args, cfg.model, levels, results)
    doc["interrupted"] = interrupted
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
        print(f"wrote {path}")
    plot_path = args.plot
    if plot_path is None and args.sweep and args.save_result:
        plot_path = str(Path(args.save_result).with_suffix(".png"))
    if plot_path and not args.no_plot:
        from dspark.bench.plot import plot_arms

        label = args.label or (Path(args.save_result).stem if args.save_result else "run")
        title = f"{cfg.model} | {_workload(args)}"
        print(f"wrote {plot_arms([(label, doc['results'])], plot_path, title)}")
    if interrupted:
        return 130
    return 0 if results and all(m["completed"] > 0 for m in results) else 1


def _workload(args: argparse.Namespace) -> str:
    if args.dataset == "random":
        text = f"random in={args.random_input_len} out={args.random_output_len}"
    else:
        text = args.dataset
    return text + (" ignore_eos" if args.ignore_eos else "") + f" T={args.temperature:g}"


def run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "plot":
        from dspark.bench.plot import run_plot

        return run_plot(args)
    return _run_serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    if argv is not None:  # (called in-process: the result records this command, not ours)
        args.argv = ["dspark", "bench", *argv]
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
