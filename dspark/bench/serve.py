"""Serving benchmark client: streamed OpenAI-compatible requests, per-request timings,
aggregate metrics and a concurrency sweep.

Timings are taken per SSE event carrying generated text: TTFT is the first such event,
ITL the gaps between successive ones (a speculative server may commit several tokens per
event, so ITL is per chunk, not per token), E2E ends when the stream closes.
TPOT = (E2E - TTFT) / (output_tokens - 1) over requests with more than one output token.
Output token counts come from `usage.completion_tokens` of the final chunk when the server
sends it, else from the number of text chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from dspark.bench.datasets import SampleRequest
from dspark.bench.spec_stats import (
    clock_from_counters,
    fetch_spec_counters,
    host_cpu,
    host_parts,
    observed_steps,
    scheduler_overhead,
    spec_from_counters,
    spec_from_responses,
)

MAX_KEPT_ERRORS = 5


@dataclass
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    request_rate: float = math.inf
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    extra_body: dict = field(default_factory=dict)
    percentiles: tuple[float, ...] = (50.0, 95.0, 99.0)
    timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False
    # before each level, its own first `concurrency` requests cut to this many output tokens,
    # unmeasured and prefix-cache salted (0: off): batch shapes first seen at a level compile
    # or capture outside it
    warmup_tokens_per_level: int = 0

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("/chat/completions")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_tokens: int | None = None
    output_tokens: int = 0
    ttft: float = 0.0  # s, request sent -> first text chunk
    latency: float = 0.0  # s, request sent -> end of stream
    itl: list[float] = field(default_factory=list)  # s, gaps between text chunks
    spec_decode: dict | None = None
    streamed: bool = True  # False: all output arrived at the end (no per-token timing)


def build_body(cfg: BenchConfig, sample: SampleRequest, seed: int) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": sample.max_tokens,
                  "temperature": cfg.temperature, "seed": seed, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.is_chat:
        if not isinstance(sample.prompt, str):
            raise ValueError("token-id prompts need the /v1/completions endpoint")
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _chunk_has_text(obj: dict, chat: bool) -> bool:
    for choice in obj.get("choices") or ():
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                return True
        elif choice.get("text") or choice.get("token_ids"):  # token ids: tokenizer-less server
            return True
    return False


def _short(text: str, n: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n] + "..."


async def _sse_events(resp: aiohttp.ClientResponse):
    """(arrival time, decoded JSON) for each `data:` line of an SSE stream, `[DONE]` skipped."""
    buf = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        *lines, buf = (buf + data).split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                yield now, json.loads(line[5:])
    tail = buf.strip()  # a last event without its newline
    if tail.startswith(b"data:") and tail[5:].strip() != b"[DONE]":
        yield time.perf_counter(), json.loads(tail[5:])


async def send_request(
    session: aiohttp.ClientSession, cfg: BenchConfig, sample: SampleRequest, seed: int
) -> RequestOutput:
    """One streamed request. Never raises (except on cancellation): failures are recorded."""
    out = RequestOutput(prompt_tokens=sample.prompt_len)
    num_chunks, usage = 0, None
    start = last = time.perf_counter()
    try:
        body = build_body(cfg, sample, seed)
        url = cfg.root_url + cfg.endpoint
        async with session.post(url, json=body, headers=cfg.headers()) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {_short(await resp.text())}"
                return out
            async for now, obj in _sse_events(resp):
                if obj.get("error"):
                    out.error = f"stream error: {_short(json.dumps(obj['error']))}"
                    return out
                usage = obj.get("usage") or usage
                spec = obj.get("spec_decode") or (usage or {}).get("spec_decode")
                out.spec_decode = spec or out.spec_decode
                if _chunk_has_text(obj, cfg.is_chat):
                    if num_chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    num_chunks += 1
        out.latency = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - a benchmark must survive any per-request failure
        out.error = f"{type(e).__name__}: {_short(str(e))}" if str(e) else type(e).__name__
        return out
    if usage and isinstance(usage.get("completion_tokens"), int):
        out.output_tokens = usage["completion_tokens"]
    else:
        out.output_tokens = num_chunks
    if usage and isinstance(usage.get("prompt_tokens"), int):
        out.prompt_tokens = usage["prompt_tokens"]
    if num_chunks == 0:
        if out.output_tokens == 0:
            out.error = "stream ended without generated text"
            return out
        out.ttft = out.latency  # tokens reported but no text seen: first output at the end
        out.streamed = False
    out.success = True
    return out


# ----------------------------------------------------------------------------- metrics


def summarize(values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """mean / median / std / p<q> of values given in seconds, reported in milliseconds."""
    keys = ["mean", "median", "std"] + [f"p{q:g}" for q in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for q in percentiles:
        stats[f"p{q:g}"] = float(np.percentile(ms, q))
    return stats


def request_tpot(o: RequestOutput) -> float | None:
    if o.output_tokens <= 1 or not o.streamed:  # unknown, not 0
        return None
    return (o.latency - o.ttft) / (o.output_tokens - 1)


def compute_metrics(outputs: list[RequestOutput], duration_s: float,
                    percentiles: tuple[float, ...] = (50.0, 95.0, 99.0)) -> dict:
    ok = [o for o in outputs if o.success]
    failed = [o for o in outputs if not o.success]
    input_tokens = sum(o.prompt_tokens or 0 for o in ok)
    output_tokens = sum(o.output_tokens for o in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    tpots = [t for t in map(request_tpot, ok) if t is not None]
    errors = list(dict.fromkeys(o.error for o in failed))[:MAX_KEPT_ERRORS]
    return {
        "completed": len(ok),
        "failed": len(failed),
        "errors": errors,
        "error_counts": dict(Counter(o.error.split(":")[0] for o in failed)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "input_tokens_known": all(o.prompt_tokens is not None for o in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": summarize([o.ttft for o in ok], percentiles),
        "tpot_ms": summarize(tpots, percentiles),
        "itl_ms": summarize([x for o in ok for x in o.itl], percentiles),
        "e2el_ms": summarize([o.latency for o in ok], percentiles),
    }


# ----------------------------------------------------------------------------- running


async def resolve_model(session: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    """The first model id from GET /v1/models."""
    url = cfg.root_url + "/v1/models"
    try:
        async with session.get(url, headers=cfg.headers()) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {_short(await resp.text())}")
            models = (await resp.json()).get("data") or []
    except Exception as e:
        raise RuntimeError(f"cannot list models at {url} ({e}); pass --model") from None
    if not models:
        raise RuntimeError(f"{url} lists no models; pass --model")
    return models[0]["id"]


async def run_level(session: aiohttp.ClientSession, cfg: BenchConfig,
                    samples: list[SampleRequest], concurrency: int | None,
                    desc: str = "") -> tuple[list[RequestOutput], float]:
    """Send every sample (arrivals Poisson at `cfg.request_rate`, at most `concurrency` in
    flight); returns per-request outputs in sample order and the wall time in seconds."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(cfg.seed)
    pbar = tqdm(total=len(samples), desc=desc, disable=cfg.disable_tqdm, leave=False)

    async def one(i: int, sample: SampleRequest) -> RequestOutput:
        if sem is None:
            out = await send_request(session, cfg, sample, cfg.seed + i)
        else:
            async with sem:
                out = await send_request(session, cfg, sample, cfg.seed + i)
        pbar.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for i, sample in enumerate(samples):
        tasks.append(asyncio.create_task(one(i, sample)))
        if math.isfinite(cfg.request_rate) and i + 1 < len(samples):
            await asyncio.sleep(rng.expovariate(cfg.request_rate))
    outputs = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    pbar.close()
    return list(outputs), duration


async def run_sweep(cfg: BenchConfig, levels: list[int | None],
                    samples_for_level: Callable[[int], list[SampleRequest]],
                    warmup: list[SampleRequest] | None = None,
                    on_level: Callable[[dict], None] | None = None) -> list[dict]:
    """Run each concurrency level in turn (after the optional warm-up requests, which are
    not measured); one metrics dict per level, with `spec_decode` from the responses or,
    failing that, from the `/metrics` counter deltas (None when neither is available)."""
    results = []
    # limit=0: no connection-pool cap (aiohttp's default of 100 would cap concurrency).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0),
                                     trust_env=False) as session:
        if cfg.model is None:
            cfg.model = await resolve_model(session, cfg)
        if warmup:
            warm_conc = max((c for c in levels if c), default=len(warmup))
            await run_level(session, cfg, warmup, min(len(warmup), warm_conc), "warmup")
        for idx, level in enumerate(levels):
            samples = samples_for_level(idx)
            if cfg.warmup_tokens_per_level > 0:
                n = cfg.warmup_tokens_per_level
                warm = [dataclasses.replace(s, max_tokens=min(s.max_tokens, n))
                        for s in samples[: level or len(samples)]]  # fmt: skip
                # salted: the measured requests must not find these prompts in the prefix cache
                body = {**cfg.extra_body, "cache_salt": f"dspark-bench-warmup-{idx}"}
                await run_level(session, dataclasses.replace(cfg, extra_body=body), warm, level,
                                f"warm-up {level or 'inf'}")  # fmt: skip
            before = await fetch_spec_counters(session, cfg)
            cpu0 = time.process_time()
            outputs, duration = await run_level(session, cfg, samples, level,
                                                f"concurrency {level or 'inf'}")
            client_cpu_s = time.process_time() - cpu0
            after = await fetch_spec_counters(session, cfg)
            rate = cfg.request_rate if math.isfinite(cfg.request_rate) else None
            m = {"max_concurrency": level, "request_rate": rate, "num_prompts": len(samples)}
            m.update(compute_metrics(outputs, duration, cfg.percentiles))
            from_counters = spec_from_counters(before, after, m["completed"])
            m["spec_decode"] = spec_from_responses(outputs) or from_counters
            if from_counters is not None and m["spec_decode"] is not from_counters:
                m["spec_decode"]["metrics_delta"] = from_counters
            clock = clock_from_counters(before, after)
            if clock is not None:  # (a server started with DSPARK_STEP_CLOCK=1)
                m["step_clock"] = clock
            m["host_cpu"] = host_cpu(before, after, duration, client_cpu_s)
            overhead = scheduler_overhead(before, after)
            if overhead is not None:  # (an adaptive server)
                m["scheduler_overhead"] = overhead
            observed = observed_steps(before, after)
            if observed is not None:  # (an adaptive server: what its fixed terms saw)
                m["observed_steps"] = observed
            host = host_parts(before, after)
            if host is not None:  # (a server started with DSPARK_HOST_TIMERS=1)
                m["host_ms_per_step"] = host
            results.append(m)
            if on_level is not None:
                on_level(m)
    return results
