"""CUDA graphs for decode and verify steps, keyed by token-count bucket.

A graph is captured per bucket of T tokens with R = min(T, max_num_seqs) request rows and a
promised maximum query length of 1 + K, so one graph serves any mix of 1..1+K tokens per
row. Replay copies the step's inputs into persistent buffers: tokens past the real ones are
padding (token 0, position 0, the sentinel slot) and rows past the real ones have zero length
(query_start_loc repeats the total). The token->request map is recomputed inside the graph
from the device query_start_loc, so changing ragged boundaries replay exactly like eager.
Steps with longer queries (prefill chunks) or more tokens than the largest bucket run eagerly.

Prefill graphs (`capture_prefill_graphs`): a second set over token buckets up to
PREFILL_GRAPH_MAX_TOKENS with the promised query length of a whole chunk (the attention's
prefill block shape), for steps that mix prefill chunks with decode rows. Eager, a small
such step pays the host's launches of every layer's kernels: on the H200 a mixed step of ~770
tokens took 39-54 ms against a 13 ms graph decode step of the same rows (diag_adaptive
--serving; the host launch cost is the inferred cause), and speculation makes these steps
common in serving (requests finish at different steps, so new prompts arrive one or two at a
time). Past the cap, a step's device time hides the launches. They share the decode graphs'
memory pool and write into one output buffer of the largest bucket (a replay overwrites the
previous one's hidden states, which the step consumed on the same stream before).
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager

import torch

from dspark.attention.base import SENTINEL_SLOT, AttentionMetadata, compute_token_to_req
from dspark.engine.input_batch import StepInputs

logger = logging.getLogger(__name__)


_guard_depth = 0  # capture_guard nesting: only the outermost one collects


@contextmanager
def capture_guard():
    """Collect garbage first and keep the collector off while capturing: a finalizer that runs
    mid-capture (e.g. another engine's CUDA graph being destroyed) makes a CUDA call that is
    illegal during stream capture and invalidates the graph. Reentrant: a batch of captures
    under one guard collects once (a full collection of a loaded server's heap takes ~0.1 s,
    which one per whole-step graph made most of their ~0.3 s capture each)."""
    global _guard_depth
    if _guard_depth == 0:
        gc.collect()
    torch.cuda.synchronize()
    was_enabled = gc.isenabled()
    gc.disable()
    _guard_depth += 1
    try:
        yield
    finally:
        _guard_depth -= 1
        if was_enabled:
            gc.enable()


PREFILL_GRAPH_MAX_TOKENS = 4096


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets of the prefill graphs: fine enough that padding costs at most a quarter
    of a step past 1,024 tokens."""
    sizes = [16, 32, 64, 128] + list(range(256, PREFILL_GRAPH_MAX_TOKENS + 1, 256))
    return [s for s in sizes if s <= max_tokens]


def capture_prefill_graphs(runner, decode_graphs: CudaGraphRunner) -> CudaGraphRunner | None:
    """The prefill graphs of a runner (None: none fit, or capture failed: those steps then run
    eagerly, as before; the decode graphs are unaffected)."""
    limit = runner.config.max_num_batched_tokens
    buckets = prefill_buckets(limit)
    if not buckets:
        return None
    graphs = CudaGraphRunner(runner, max_query_len=limit, buckets=buckets,
                             pool=decode_graphs.pool, shared_outputs=True,
                             min_query_len=decode_graphs.max_query_len + 1)  # fmt: skip
    try:
        graphs.capture()
    except Exception:
        logger.exception("prefill CUDA graph capture failed: steps with prefill chunks run eagerly")
        return None
    return graphs


DECODE_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448,
                      512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def default_buckets(max_tokens: int) -> list[int]:
    return [s for s in DECODE_GRAPH_SIZES if s <= max_tokens] or [1]


def decode_graph_max_tokens(max_num_batched_tokens: int, max_num_seqs: int, k: int) -> int:
    """Largest token bucket of the decode/verify graphs: every row's 1 + K tokens at
    max_num_seqs rows, as far as the step's token budget and the bucket list reach. Capped
    below that (at 1024 until the thirty-eighth session), a full verify past the cap was
    profiled eagerly (the H100's trained pair: 4.0 ms at 1536-2048 tokens against 0.81 ms for
    a 1024-token graph) while serving ran it in a whole-step graph, so the planner trimmed
    c = 256 steps to 1024 tokens for a saving that did not exist (offline closed loop: -12%
    against fixed K)."""
    return min(max_num_batched_tokens, max_num_seqs * (1 + k), DECODE_GRAPH_SIZES[-1])


class CudaGraphRunner:
    def __init__(self, runner, max_query_len: int, max_tokens: int | None = None,
                 buckets: list[int] | None = None, pool=None, shared_outputs: bool = False,
                 min_query_len: int = 0):
        self.runner = runner
        self.max_query_len = max_query_len
        # steps of shorter queries only are not this set's (prefill graphs: they keep the
        # decode block shape, eagerly past the decode buckets)
        self.min_query_len = min_query_len
        self.buckets = buckets if buckets is not None else default_buckets(max_tokens)
        # one output buffer for every bucket (else each graph keeps its own outputs alive)
        self.shared_outputs = shared_outputs
        self._out: tuple[torch.Tensor, torch.Tensor | None] | None = None
        cfg = runner.config
        self.max_reqs = cfg.max_num_seqs
        dev = runner.device
        t, r = self.buckets[-1], min(self.buckets[-1], self.max_reqs)
        max_blocks = runner.max_blocks_per_seq
        self.max_seq_len = runner.max_model_len
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), SENTINEL_SLOT, dtype=torch.int64, device=dev)
        self.qsl = torch.zeros(r + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(r, max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.pool = pool
        self.replays = 0  # (tests and diagnostics)

    def _forward(self, t: int):
        r = min(t, self.max_reqs)
        qsl = self.qsl[: r + 1]
        md = AttentionMetadata(
            query_start_loc=qsl, seq_lens=self.seq_lens[:r], block_tables=self.block_tables[:r],
            slot_mapping=self.slot_mapping[:t], positions=self.positions[:t],
            token_to_req=compute_token_to_req(qsl, t), max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, num_reqs=r,
        )  # fmt: skip
        return self.runner.eager_forward(self.input_ids[:t], md)

    @torch.inference_mode()
    def capture(self) -> None:
        with capture_guard():
            self._capture_all()

    def _capture_all(self) -> None:
        for t in reversed(self.buckets):  # largest first: later graphs reuse its pool
            r = min(t, self.max_reqs)
            # a valid dummy batch: r rows sharing the tokens, every token in the sentinel slot
            base = torch.arange(r + 1, dtype=torch.int32, device=self.qsl.device) * (t // r)
            base[-1] = t
            self.qsl[: r + 1] = base
            self.seq_lens[:r] = torch.diff(base).to(torch.int32)
            self.positions[:t] = 0
            for _ in range(2):  # warm up (Triton autotuning / compilation) outside the graph
                out = self._forward(t)
            if self.shared_outputs and self._out is None:  # sized by the largest bucket
                self._out = tuple(None if x is None else torch.empty_like(x) for x in out)
            del out
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._forward(t)
                if self.shared_outputs:  # the forward's own outputs die with the capture
                    out = tuple(None if buf is None else buf[:t].copy_(x)
                                for buf, x in zip(self._out, out, strict=True))
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[t], self.outputs[t] = g, out
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for token buckets %s (query length <= %d)",
                    len(self.graphs), self.buckets, self.max_query_len)

    def bucket_for(self, num_tokens: int, num_reqs: int, max_query_len: int) -> int | None:
        if not self.min_query_len <= max_query_len <= self.max_query_len:
            return None
        for t in self.buckets:
            if t >= num_tokens:
                return t if num_reqs <= min(t, self.max_reqs) else None
        return None

    def run(self, inp: StepInputs, t: int):
        md = inp.attn_metadata()
        return self.run_raw(inp.input_ids, md, inp.num_tokens, t)

    def run_raw(self, input_ids: torch.Tensor, md: AttentionMetadata, n: int, t: int):
        r = md.num_reqs
        r_cap = min(t, self.max_reqs)
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:t].zero_()
        self.positions[:n].copy_(md.positions)
        self.positions[n:t].zero_()
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.slot_mapping[n:t].fill_(SENTINEL_SLOT)
        self.qsl[: r + 1].copy_(md.query_start_loc)
        self.qsl[r + 1 : r_cap + 1] = self.qsl[r]  # zero-length padding rows (device copy)
        self.seq_lens[:r].copy_(md.seq_lens)
        self.seq_lens[r:r_cap].zero_()
        nb = md.block_tables.shape[1]
        self.block_tables[:r, :nb].copy_(md.block_tables)
        self.block_tables[:r, nb:].zero_()
        self.block_tables[r:r_cap].zero_()
        self.graphs[t].replay()
        self.replays += 1
        hidden, aux = self.outputs[t]
        return hidden[:n], None if aux is None else aux[:n]
