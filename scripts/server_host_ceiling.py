"""The serving path's host ceiling, without a GPU: `dspark serve`'s app (FastAPI + the
AsyncLLMEngine thread) on the demo pair with the decode steps' device work replaced by a fixed
answer (scripts/host_step_cost.py), driven by `dspark bench serve` over HTTP with streaming.
Output tokens/s here is what the host alone allows; a GPU run cannot exceed it on this host.
With `--device-ms`, each decode step's results are ready that long after its launch (the
host's work meanwhile overlaps it, the rest is a sleep with the GIL released, as a device
sync) and the report adds how late the engine thread resumes: the event loop holding the
GIL, or no free core.
The stub emits 3 tokens per verifying row and drafts nothing, so `lagged` (which plans from
the drafts' confidences) is not representative; `none` and `fixed` are.

    python3 scripts/server_host_ceiling.py --policy none --concurrency 64,256
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_step_cost import DEMO, demo_spec, stub_device_work  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def stub_engine(engine, device_ms: float, tokenless: bool) -> None:
    """The serving engine's setup: streaming outputs, decode steps' device work stubbed (run
    where the engine runs: this process, or the engine process)."""
    # one intra-op thread, as main() sets for this process: the stubbed engine's CPU tensors
    # would otherwise spin a thread pool (4-11 cores busy in the engine process, H200 host)
    torch.set_num_threads(1)
    stub_device_work(engine.runner, prefill=True, device_ms=device_ms)
    engine.stream_outputs = True  # as `dspark serve` (LLM turns it off for generate())
    if tokenless:  # as with --load-format dummy: chunks carry token ids, no text
        engine.tokenizer = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_multi(config, setup, count: int):
    """`dspark serve --api-server-count count` on the stubbed engine: (stop, url)."""
    import httpx

    from dspark.server.multi_server import start_multi_server, stop_servers, wait_multi_server

    port = _free_port()
    ns = argparse.Namespace(host="127.0.0.1", port=port, log_level="warning",
                            shutdown_timeout=5.0, max_body_bytes=1 << 20, max_waiting=4096,
                            api_server_count=count)  # fmt: skip
    engine, servers = start_multi_server(ns, config, "demo", None, setup=setup)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)

    def stop() -> None:
        stop_servers(servers)
        wait_multi_server(engine, servers)

    return stop, url


def start_server(policy: str, max_num_seqs: int, tokenless: bool, device_ms: float,
                 async_scheduling: bool = True, loop: str = "asyncio", http: str = "h11",
                 engine_process: bool = False, api_servers: int = 1):  # fmt: skip
    """The stubbed server: (stop, the LLMEngine when it runs in this process, url)."""
    import uvicorn

    from dspark.config import EngineConfig
    from dspark.engine.async_engine import AsyncLLMEngine
    from dspark.engine.engine_process import ProcessCore
    from dspark.engine.llm_engine import LLMEngine
    from dspark.server.api import build_app

    config = EngineConfig(model=f"{DEMO}/target", device="cpu", max_num_seqs=max_num_seqs,
                          speculative_config=demo_spec(policy, always_draft=False),
                          max_num_batched_tokens=16384, async_scheduling=async_scheduling)
    setup = functools.partial(stub_engine, device_ms=device_ms, tokenless=tokenless)
    if api_servers > 1:
        stop, url = start_multi(config, setup, api_servers)
        return stop, None, url
    if engine_process:
        engine = AsyncLLMEngine(core=ProcessCore(config, setup=setup))
        if tokenless:
            engine.core.tokenizer = None
    else:
        llm_engine = LLMEngine(config)
        setup(llm_engine)
        engine = AsyncLLMEngine(llm_engine)
    port = _free_port()
    config = uvicorn.Config(build_app(engine, "demo"), host="127.0.0.1", port=port, loop=loop,
                            http=http, log_level="warning", access_log=False)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)

    return stop, engine.engine, f"http://127.0.0.1:{port}"


def bench(url: str, conc: int, tokens: int, out: str) -> dict:
    cmd = [sys.executable, "-m", "dspark", "bench", "serve", "--base-url", url,
           "--max-concurrency", str(conc), "--num-prompts", str(conc), "--ignore-eos",
           "--dataset", "random", "--random-prompt-type", "token-ids", "--random-input-len", "32",
           "--random-output-len", str(tokens), "--warmup", str(min(conc, 16)),
           "--save-result", out, "--disable-tqdm"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.load(open(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="none", choices=["none", "fixed", "lagged"])
    ap.add_argument("--concurrency", default="64,256")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="each decode step's results are ready this long after its launch "
                         "(a device; the wait releases the GIL)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the server process (default: Python's 5 ms)")
    ap.add_argument("--tokenless", action="store_true", help="no tokenizer (token-id chunks)")
    ap.add_argument("--loop", default="asyncio", help="uvicorn event loop: asyncio | uvloop")
    ap.add_argument("--http", default="h11", help="uvicorn HTTP implementation: h11 | httptools")
    ap.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                    help="no-spec engine schedules each step after the previous one")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine in a process of its own, as `dspark serve` runs it")
    ap.add_argument("--api-server-count", type=int, default=1,
                    help="API-server processes in front of the engine process (dspark serve "
                         "--api-server-count; uvicorn's default loop and HTTP parser)")
    args = ap.parse_args()
    if args.api_server_count > 1 and args.tokenless:
        ap.error("--tokenless works with one API server only")
    torch.set_num_threads(1)
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    conc = [int(c) for c in args.concurrency.split(",")]
    stop, engine, url = start_server(args.policy, max(conc), args.tokenless, args.device_ms,
                                     args.async_scheduling, args.loop, args.http,
                                     args.engine_process, args.api_server_count)  # fmt: skip
    try:  # (engine: None in an engine process)
        waits = [] if engine is None else engine.runner.step_graphs.wait_overshoot_ms
        for c in conc:
            waits.clear()
            res = bench(url, c, args.tokens, os.path.join(tempfile.mkdtemp(), "r.json"))
            r = res["results"][0]
            assert r["completed"] == c and r["itl_ms"]["p50"] is not None, r  # streamed
            late = (f", device-wait overshoot p50 {np.median(waits):.2f} / p90 "
                    f"{np.percentile(waits, 90):.2f} ms") if waits else ""
            print(f"policy {args.policy}{' tokenless' if args.tokenless else ''}"
                  f"{' engine-process' if args.engine_process else ''}"
                  f"{'' if args.loop == 'asyncio' else ' ' + args.loop}"
                  f"{'' if args.http == 'h11' else ' ' + args.http}"
                  f"{'' if args.api_server_count == 1 else f' x{args.api_server_count} servers'}, "
                  f"concurrency {c}: {r['output_throughput']:.0f} output tok/s, "
                  f"TPOT p50 {r['tpot_ms']['p50']:.2f} ms, ITL p50 {r['itl_ms']['p50']:.2f} ms"
                  f"{late}; cores busy " + " ".join(
                      f"{who} {v:.2f}" for who, v in (r.get("host_cpu") or {}).items()),
                  flush=True)  # fmt: skip
            host = r.get("host_ms_per_step")  # (DSPARK_HOST_TIMERS=1: the engine loop's parts)
            if host:
                print("  engine host ms per step: " + " ".join(
                    f"{k} {v:.3f}" for k, v in sorted(host.items())), flush=True)
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
