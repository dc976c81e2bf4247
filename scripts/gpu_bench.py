"""GPU benchmarks for the engine core on a Qwen3-8B-shaped model with random bf16 weights.

Measures, in one run: the machine's copy bandwidth and bf16 matmul rate; (a) the latency of a
batch-1 decode step against the weight-read floor; (b) forward latency for ragged batches of
1..4096 tokens (the verify cost curve the planner uses); (c) no-speculation output tokens/s at
concurrency 1/16/64/256 (512 prompt + 256 output tokens) next to Hugging Face `generate` on the
same shape and batch. Prints a table last and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from make_shape_dirs import QWEN3_8B  # noqa: E402

TINY = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def ceilings(device: str) -> dict:
    cuda = device == "cuda"
    n = 1 << (30 if cuda else 24)  # bytes per buffer
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    ms = _time(lambda: b.copy_(a), 20)
    m = 8192 if cuda else 256
    x = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    mm = _time(lambda: x @ y, 20)
    a = b = None  # free the buffers
    return {"copy_tb_s": 2 * n / ms / 1e9, "bf16_tflops": 2 * m**3 / mm / 1e9}


def _time(fn, iters: int, warmup: int = 3) -> float:
    if not torch.cuda.is_available():  # --smoke on a CPU: host clock
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def make_engine(model_dir: str, max_num_seqs: int, util: float, device: str = "cuda"):
    from dspark.config import EngineConfig
    from dspark.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        model=model_dir, load_format="dummy", dtype="bfloat16", device=device,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=4096,
        gpu_memory_utilization=util,
    )  # fmt: skip
    return LLMEngine(cfg)


def forward_latency(engine, counts, context_len=512) -> dict:
    from dspark.spec.profiler import _dummy_batch

    runner = engine.runner
    out = {}
    for n in counts:
        ids, md = _dummy_batch(runner, n, min(n, runner.config.max_num_seqs), context_len)
        out[n] = _time(lambda ids=ids, md=md, n=n: runner.forward(ids, md, n), 10)
    return out


def run_generate(engine, concurrency: int, prompt_len: int, out_len: int) -> float:
    from dspark.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(concurrency)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i in range(concurrency):
        ids = torch.randint(0, engine.model_config.vocab_size, (prompt_len,),
                            generator=gen).tolist()  # fmt: skip
        engine.add_request(f"c{concurrency}-{i}", {"prompt_token_ids": ids}, params)
    _sync()
    clock = engine.runner.step_clock
    clock.collect()
    start = clock.snapshot().get("plain", {})
    t0 = time.perf_counter()
    produced, decode_steps = 0, []
    sched = engine.scheduler
    while engine.has_unfinished_requests():
        # a full pure-decode step: every request admitted and past its prefill
        pure = not sched.waiting and len(sched.running) == concurrency and all(
            r.num_output_tokens > 0 for r in sched.running
        )
        ts = time.perf_counter()
        for o in engine.step():
            produced += len(o.new_token_ids)
        if pure:
            decode_steps.append(time.perf_counter() - ts)
    _sync()
    assert produced == concurrency * out_len, produced
    decode_steps.sort()
    step_ms = 1e3 * decode_steps[len(decode_steps) // 2] if decode_steps else float("nan")
    tok_s = produced / (time.perf_counter() - t0)
    if clock.enabled:  # the decode steps' device time: busy, and idle waiting for the host
        clock.collect()
        end = clock.snapshot().get("plain", {})
        n = end.get("steps", 0) - start.get("steps", 0)
        if n:
            busy, idle = ((end[k] - start.get(k, 0.0)) / n for k in ("busy_ms", "idle_ms"))
            print(f"  decode steps on the device at c={concurrency}: {busy:.2f} ms busy + "
                  f"{idle:.2f} ms idle per step ({n} steps)", flush=True)  # fmt: skip
    return tok_s, step_ms


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_generate(model_dir, concurrencies, prompt_len, out_len, device="cuda") -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    res = {}
    for c in concurrencies:
        ids = torch.randint(0, config.vocab_size, (c, prompt_len), device=device)
        with torch.no_grad():
            model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)
            _sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=out_len, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))  # fmt: skip
            _sync()
        res[c] = c * out_len / (time.perf_counter() - t0)
    return res


def main() -> int:
    # the step clock (two CUDA events per step) splits the decode step into device busy time
    # and idle time waiting for the host
    os.environ.setdefault("DSPARK_STEP_CLOCK", "1")
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape on the CPU: checks the script itself, numbers mean nothing")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.concurrency, args.prompt_len, args.output_len = "1,4", 16, 8
    conc = [int(c) for c in args.concurrency.split(",")]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    res: dict = {"device": name, "torch": torch.__version__}
    res["ceilings"] = ceil = ceilings(device)
    print("ceilings", ceil, flush=True)
    model_dir = tempfile.mkdtemp(prefix="bench-shape-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(TINY if args.smoke else QWEN3_8B, f)
    t0 = time.perf_counter()
    engine = make_engine(model_dir, max(conc), 0.80, device)
    res["engine_start_s"] = time.perf_counter() - t0
    n_params = sum(p.numel() for p in engine.runner.model.parameters())
    weight_bytes = 2 * n_params
    floor_ms = weight_bytes / (ceil["copy_tb_s"] * 1e12) * 1e3
    res["params"] = n_params
    res["weight_read_floor_ms"] = floor_ms
    lat = forward_latency(engine, [1, 8, 64] if args.smoke else [1, 8, 64, 256, 1024, 4096])
    res["forward_ms"] = lat
    print("forward latency ms", lat, flush=True)
    res["decode_b1_ratio_to_floor"] = lat[1] / floor_ms
    tput, step = {}, {}
    for c in conc:
        tput[c], step[c] = run_generate(engine, c, args.prompt_len, args.output_len)
        print(f"dspark concurrency {c}: {tput[c]:.1f} output tok/s, decode step {step[c]:.2f} ms",
              flush=True)  # fmt: skip
    res["dspark_tok_s"] = tput
    res["dspark_decode_step_ms"] = step
    # decode step at the largest concurrency vs its floors (weights + KV read; compute)
    c = max(conc)
    ctx = args.prompt_len + args.output_len // 2
    mc = engine.model_config
    kv_bytes = c * ctx * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2
    mem_floor = (weight_bytes + kv_bytes) / (ceil["copy_tb_s"] * 1e12) * 1e3
    compute_floor = 2 * n_params * c / (ceil["bf16_tflops"] * 1e12) * 1e3
    res["decode_step_at_max_conc"] = {
        "step_ms": step[c], "weight_floor_ms": floor_ms, "weights_plus_kv_floor_ms":
        mem_floor, "compute_floor_ms": compute_floor,
    }  # fmt: skip
    engine.runner.release_memory()  # unfreezes what the engine froze (gc), frees the KV cache
    del engine
    if not args.skip_hf:
        res["hf_tok_s"] = hf_generate(model_dir, conc, args.prompt_len, args.output_len, device)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    shape = "tiny smoke shape" if args.smoke else "Qwen3-8B shape"
    print(f"\n=== summary ({shape}, random bf16 weights, {res['device']}) ===")
    print(f"copy {ceil['copy_tb_s']:.2f} TB/s, bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s, "
          f"weights {weight_bytes / 1e9:.1f} GB, weight-read floor {floor_ms:.2f} ms")
    print(f"(a) decode batch 1 forward: {lat[1]:.2f} ms = {lat[1] / floor_ms:.2f}x floor")
    print("(b) forward ms by tokens: " + ", ".join(f"{n}:{t:.2f}" for n, t in lat.items()))
    print(f"(c) {'conc':>5} {'dspark tok/s':>13} {'HF tok/s':>10} {'ratio':>6}")
    for c in conc:
        hf = res.get("hf_tok_s", {}).get(c)
        ratio = f"{tput[c] / hf:6.1f}" if hf else "   n/a"
        hf_s = f"{hf:10.1f}" if hf else "       n/a"
        print(f"    {c:>5} {tput[c]:13.1f} {hf_s} {ratio}")
    d = res["decode_step_at_max_conc"]
    print(f"decode step at c={max(conc)}: {d['step_ms']:.1f} ms vs floors: weights "
          f"{d['weight_floor_ms']:.1f}, weights+KV {d['weights_plus_kv_floor_ms']:.1f}, "
          f"compute {d['compute_floor_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
