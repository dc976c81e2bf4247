"""Profile the step-cost table on the running model (engine start-up and `dspark profile`), and
install a loaded or profiled table into the engine's spec decoder (`install_cost_model`).

Times the target forward (+ LM head over every token, as a verify step computes logits for
every verified position) against the number of tokens in a ragged batch, and the drafter
(context write + one block proposal; with whole-step CUDA graphs, the drafter's graph, as
served) against the number of requests. Dummy requests get a
synthetic context of `context_len` tokens. Medians of repeats, warm-up excluded; the table is
made monotone by CostModel.

On the GPU it also measures what a context token costs (CostModel's context pricing): one
plain step of CONTEXT_ROWS one-token rows at `context_len` and at `context_len` +
CONTEXT_EXTRA; the difference over the extra tokens read is the slope (~0.036 us a token for
the 8B shape's 147,456 bytes of K and V at ~4 TB/s). Not on the CPU: its torch attention's
timing is noise at test sizes, and the tables it profiles serve tests.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from dspark.attention.base import AttentionMetadata, compute_token_to_req
from dspark.spec.cost_model import CostModel

logger = logging.getLogger(__name__)

# a table profiled at start-up is also written to this path (bench_e2e.py: one per server),
# so that the planning of a served run can be replayed on the CPU against its own table
COST_TABLE_OUT_ENV = "DSPARK_COST_TABLE_OUT"
# rows of the context-slope probe (fewer where the KV cache or max_num_seqs is smaller): the
# load where the context's price decides; 64 rows streamed KV slower (H200, 8B shape: 54.5 ns
# a token against the ~36 that steps of 128-256 rows over 640 tokens paid, BENCHMARKS.md,
# twenty-fourth session)
CONTEXT_ROWS = 256
CONTEXT_EXTRA = 1024  # ... and the extra context of its second step (less past max length)


def default_token_counts(max_tokens: int) -> list[int]:
    counts = {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024}
    counts |= {1536, 2048, 3072, 4096, 6144, 8192}
    return sorted(c for c in counts if c <= max_tokens)


def _dummy_batch(runner, num_tokens: int, num_reqs: int, context_len: int):
    """A ragged batch of num_reqs rows (sizes differing by at most one) over fresh blocks."""
    device, bs = runner.device, runner.block_size
    q = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    q[: num_tokens % num_reqs] += 1
    seq = context_len + q
    blocks_per_req = -(-int(seq.max()) // bs)
    usable = runner.num_blocks - 1
    bt = 1 + (np.arange(num_reqs * blocks_per_req) % usable).reshape(num_reqs, blocks_per_req)
    qsl = np.concatenate([[0], np.cumsum(q)])
    row = np.repeat(np.arange(num_reqs), q)
    pos = context_len + np.arange(num_tokens) - qsl[row]
    slots = bt[row, pos // bs] * bs + pos % bs
    t = lambda a, dt=torch.int64: torch.as_tensor(a, dtype=dt, device=device)  # noqa: E731
    qsl_t = t(qsl, torch.int32)
    md = AttentionMetadata(
        query_start_loc=qsl_t, seq_lens=t(seq, torch.int32), block_tables=t(bt, torch.int32),
        slot_mapping=t(slots), positions=t(pos),
        token_to_req=compute_token_to_req(qsl_t, num_tokens),
        max_query_len=int(q.max()), max_seq_len=int(seq.max()), num_reqs=num_reqs,
    )  # fmt: skip
    ids = torch.randint(0, runner.model_cfg.vocab_size, (num_tokens,), device=device)
    return ids, md


@torch.inference_mode()
def profile_cost_model(
    runner,
    max_tokens: int | None = None,
    context_len: int = 256,
    repeats: int = 5,
    warmup: int = 2,
) -> CostModel:
    cfg = runner.config
    spec = runner.spec
    k = spec.k if spec is not None else 0
    max_tokens = max_tokens or min(cfg.max_num_batched_tokens, cfg.max_num_seqs * (1 + k))
    counts, times, rows = [], [], []
    for n in default_token_counts(max_tokens):
        num_reqs = max(1, min(cfg.max_num_seqs, n))
        counts.append(n)
        rows.append(num_reqs)
        times.append(median_of_repeats(_target_step(runner, n, num_reqs, context_len),
                                       repeats, warmup))  # fmt: skip
    slope, probe = 0.0, None
    if runner.device.type == "cuda":
        slope, probe = _context_slope(runner, context_len, repeats, warmup)
    draft_reqs, draft_times, greedy_times = [], [], []
    if spec is not None:
        for r in sorted({1, 4, 16, 64, 256, cfg.max_num_seqs}):
            if r > cfg.max_num_seqs:
                continue
            draft_reqs.append(r)
            step = _draft_step(runner, r, context_len)
            draft_times.append(median_of_repeats(step, repeats, warmup))
            step = _draft_step(runner, r, context_len, greedy=True)
            greedy_times.append(median_of_repeats(step, repeats, warmup))
    graph_sizes = runner.graphs.buckets if runner.graphs is not None else None
    prov = make_provenance(
        model=cfg.model, dtype=str(runner.dtype).replace("torch.", ""),
        device_name=_device_name(runner.device), num_speculative_tokens=k,
        context_len=context_len, source="profiled", graph_sizes=graph_sizes,
        context_probe=probe,
    )  # fmt: skip
    return CostModel.from_measurements(
        counts, times, draft_reqs, draft_times, 0.0, prov, graph_sizes=graph_sizes,
        draft_greedy_times_ms=greedy_times, verify_reqs=rows, context_ms_per_token=slope,
        profile_context_len=context_len,
    )  # fmt: skip


def _target_step(runner, num_tokens: int, num_reqs: int, context_len: int):
    """The target's forward + LM head over a dummy batch (CUDA-graph replay where a bucket
    fits), as a callable."""
    ids, md = _dummy_batch(runner, num_tokens, num_reqs, context_len)

    def step():
        hidden, _ = runner.forward(ids, md, num_tokens)
        runner.model.compute_logits(hidden)

    return step


def _context_slope(runner, context_len: int, repeats: int, warmup: int):
    """(ms per context token read, the probe's record) from two plain steps that differ in
    their rows' context only. Rows and extra context shrink to fit the KV cache without two
    rows sharing a block (a shared block would be read from cache, not memory) and the
    model's length; (0, None) where no probe fits."""
    bs, cfg = runner.block_size, runner.config
    extra = min(CONTEXT_EXTRA, runner.max_blocks_per_seq * bs - context_len - 1)
    rows = min(CONTEXT_ROWS, cfg.max_num_seqs,
               (runner.num_blocks - 1) // -(-(context_len + extra + 1) // bs))  # fmt: skip
    if extra < 128 or rows < 1:
        return 0.0, None
    ms = [median_of_repeats(_target_step(runner, rows, rows, c), repeats, warmup)
          for c in (context_len, context_len + extra)]  # fmt: skip
    slope = max(ms[1] - ms[0], 0.0) / (rows * extra)
    return slope, {"rows": rows, "context_lens": [context_len, context_len + extra], "ms": ms}


def _draft_step(runner, num_reqs: int, context_len: int, greedy: bool = False):
    """The drafter's work of one step for `num_reqs` rows (sampled drafts, or argmax only)."""
    spec = runner.spec
    if runner.step_graphs is not None:  # serving drafts inside whole-step graphs: time those
        return runner.step_graphs.draft_step(num_reqs, greedy)
    n = num_reqs * (1 + spec.k)
    ids, md = _dummy_batch(runner, n, num_reqs, context_len)
    d = spec.drafter
    m = len(spec.aux_layer_ids)
    aux = torch.randn(n, m * runner.model_cfg.hidden_size, device=runner.device, dtype=runner.dtype)
    anchors = ids[:num_reqs]
    anchor_pos = torch.full((num_reqs,), context_len, dtype=torch.int64, device=runner.device)
    temp = torch.ones(num_reqs, device=runner.device)
    seeds = torch.arange(num_reqs, device=runner.device)

    def step():
        d.write_context(aux, md.positions, md.slot_mapping, spec.kv_caches, runner.backend)
        d.propose(
            anchors, anchor_pos, md.block_tables, context_len + spec.k + 1, spec.kv_caches,
            runner.backend, spec.k, temp, seeds, seeds, spec.draft_method(greedy),
            spec.needs_max_probs,
        )  # fmt: skip

    return step


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def make_provenance(
    model: str | None = None,
    dtype: str | None = None,
    device_name: str | None = None,
    num_speculative_tokens: int | None = None,
    graph_sizes: Sequence[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Provenance record for a profiled table: what it was measured on, with which software."""
    from importlib import metadata

    def _version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "model": model, "dtype": dtype, "device_name": device_name,
        "num_speculative_tokens": num_speculative_tokens,
        "graph_sizes": list(graph_sizes) if graph_sizes is not None else None,
        "torch": _version("torch"), "triton": _version("triton"),
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def median_of_repeats(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1,
                      sync: bool | None = None) -> float:
    """Median wall time (ms) of `fn()` on the host clock. With `sync` (default: CUDA is
    initialised) `torch.cuda.synchronize()` brackets every call so queued kernels count."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if sync is None:
        import torch

        sync = torch.cuda.is_available() and torch.cuda.is_initialized()
    if sync:
        import torch

        barrier = torch.cuda.synchronize
    else:
        barrier = lambda: None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def install_cost_model(runner) -> None:
    """Give the runner's spec decoder its cost table: loaded from `cost_table_path` (with a
    warning when it was measured on another GPU) or profiled on this model now; under tensor
    parallelism rank 0's table, so that every rank plans alike. An unusable table (no verify
    points, one, or flat) is installed with a status saying every draft will be verified."""
    path = runner.config.speculative_config.cost_table_path
    if path:
        cost = CostModel.from_json(path) if runner.tp.rank == 0 else None
        status = f"loaded from {path}"
        prov = cost.provenance if cost is not None else {}
        if prov.get("device_name") and runner.device.type == "cuda":
            name = torch.cuda.get_device_name(runner.device)
            if prov["device_name"] != name:
                logger.warning("cost table %s was measured on %s, not %s", path,
                               prov["device_name"], name)  # fmt: skip
    else:
        on_gpu = runner.device.type == "cuda"
        # every rank runs the profile's forwards (collectives); rank 0's timings count
        cost = profile_cost_model(
            runner, context_len=256 if on_gpu else 32, repeats=5 if on_gpu else 3,
            warmup=2 if on_gpu else 1,
        )  # fmt: skip
        status = "profiled at start-up"
        out = os.environ.get(COST_TABLE_OUT_ENV)
        if out and runner.tp.rank == 0:  # (planning replayed on the CPU from a served table)
            cost.to_json(out)
            status += f", written to {out}"
    if runner.world is not None:  # rank 0's table, so that every rank plans alike
        cost = CostModel.from_dict(runner.world.broadcast_object(
            cost.to_dict() if runner.tp.rank == 0 else None))  # fmt: skip
    if cost.prices_context:
        status += (f"; context read priced at {cost.context_ms_per_token * 1e6:.1f} ns a token "
                   f"(the table's rows: {cost.profile_context_len:g}-token contexts)")
    problem = cost.describe_problem()
    if problem:
        # (where the table came from stays in the status: which table to re-profile)
        status = f"UNUSABLE ({problem}): every draft is verified; the table was {status}"
        if runner.tp.rank == 0:
            logger.warning("adaptive verification: %s", status)
    else:
        logger.info("adaptive verification cost table %s", status)
    runner.spec.set_cost_model(cost, status)
