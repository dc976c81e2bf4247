"""Whole-step CUDA graphs: a decode or verify step as one replay plus one for the drafter.

Small targets are bounded by the host: a speculative step used to issue ~200 eager kernels
(input casts, graph-input copies, logits-row maps, verification, the drafter's context pass,
scatters into the draft buffers), each costing the host far more than the GPU. Here the device
half of a step whose shapes are fixed by its request bucket runs as two graphs:

  A (request bucket R, family, sampling mode): inputs -> target forward -> logits -> verify or
     sample -> packed outputs; writes the drafter's context and each row's next anchor.
  B (request bucket R, draft method): the drafter's proposal into the per-request buffers.

Between them the host starts the one device->host copy of A's outputs, so drafting overlaps
the host's bookkeeping as in the eager step. The host writes a step into one pinned int64
buffer laid out for the bucket (step_layout.py), sent with one copy; padding rows have zero
length, sample nothing and write to the scratch draft row; padding tokens write to the
sentinel slot.

Families of A: "spec" (rows carry up to K draft slots, every slot verified: T = R(1+K)
tokens), "trim" (the lagged plan's budget B: the graph allocates the global top-B over the
current survivals and compacts the stream to a token bucket >= R + B, the bucket being part
of the key) and "plain" (one token per row, no drafts: no-speculation engines and steps whose
drafting was skipped). Steps with prefill chunks, top-k/top-p/min-p, probes, traces, the
threshold / early-stop policies or tensor parallelism run the per-phase path (target-forward
and drafter graphs, eager glue).

Every graph is captured before serving (`capture_all`, dummy steps), "trim" graphs too unless
DSPARK_CAPTURE_TRIMS=0; a key not captured is captured on first use: the step runs eagerly
once (warm-up, same result), is captured and replayed. Every op of a
step is deterministic given its inputs, so re-running it over the same inputs writes the same
KV, drafts and outputs. A failed capture marks its key: those steps take the per-phase path.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dspark.attention.base import SENTINEL_SLOT
from dspark.engine.input_batch import (
    HostStep,
    StepInputs,
    finalize,
    record_emitted,
    resolve_pending,
)
from dspark.engine.step_layout import ROW_FIELDS, Layout, fill_host, pack_outputs
from dspark.sampling.sampler import sample_step
from dspark.spec.planner import allocate_top_b
from dspark.spec.verify import next_anchors

logger = logging.getLogger(__name__)

class CaptureFailed(RuntimeError):
    """A whole-step graph could not be captured (the key is not tried again)."""


class StepGraphs:
    def __init__(self, runner, use_graphs: bool = True):
        self.runner = runner
        self.spec = runner.spec
        self.k = self.spec.k if self.spec is not None else 0
        self.use_graphs = use_graphs  # False: run the same code eagerly (CPU tests)
        from dspark.spec.draft_graph import request_buckets

        self.buckets = request_buckets(runner.config.max_num_seqs)
        self.blocks = runner.max_blocks_per_seq
        self.max_model_len = runner.max_model_len
        biggest = Layout(self.buckets[-1], self.buckets[-1] * (1 + self.k), self.blocks)
        dev = runner.device
        pin = dev.type == "cuda"
        # Two pinned input and output buffers, used by alternate steps: the engine may launch
        # a step while the previous one is in flight (async scheduling), whose host->device
        # copy may not have run yet and whose outputs are read after the launch.
        self.host_bufs = [torch.zeros(biggest.size, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]  # fmt: skip
        self.dev_buf = torch.zeros(biggest.size, dtype=torch.int64, device=dev)
        width = biggest.rows * (self.k + 3)  # [R, K+1] tokens, [R] emitted, [R] verified
        self.host_outs = [torch.zeros(width, dtype=torch.int64, pin_memory=pin)
                          for _ in range(2)]  # fmt: skip
        self._parity = 0  # which of the two buffers the next step uses
        r = biggest.rows
        self.anchors = torch.zeros(r, dtype=torch.int64, device=dev)
        self.anchor_pos = torch.zeros(r, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.pool = None
        self._outputs_copied = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self.steps: dict[tuple, int] = {}  # steps run per key (observability, tests)
        self.failed: set[tuple] = set()  # keys whose capture failed: per-phase path
        self.alloc_ms: dict[int, float] = {}  # request bucket -> allocation device time
        # trimmed steps are compacted to the per-phase forward's token buckets (the cost table
        # prices those), capped by the full stream of their request bucket
        graphs = runner.graphs
        self.token_buckets = list(graphs.buckets) if graphs is not None else []

    # -- which steps qualify -------------------------------------------------------------------
    def key_for(self, host: HostStep, budget: int | None) -> tuple | None:
        """(family, rows bucket, sampling mode) of a step that a graph can run, else None."""
        g = host.get
        if (g("any_top_k") or g("any_top_p") or g("any_min_p") or g("num_reqs") == 0
                or g("max_blocks") > self.blocks):  # fmt: skip
            return None
        rb = next((b for b in self.buckets if b >= g("num_reqs")), None)
        if rb is None:
            return None
        mode = "greedy" if g("all_greedy") else "sample"
        spec = self.spec
        # traces sync every step; the online estimator's coefficients change between steps; a
        # probe drafts for its first rows only (eager: the graphs draft for all or none)
        if spec is not None and (spec.trace is not None or spec.estimator is not None
                                 or (spec.draft_enabled and spec.probing)):  # fmt: skip
            return None
        if g("max_capacity") == 0:
            return ("plain", rb, mode) if g("max_query_len") == 1 else None
        if g("max_query_len") > 1 + self.k or spec.sc.adaptive_policy not in ("fixed", "lagged"):
            return None  # threshold / early-stop choose lengths on the device: eager
        tb = self._trim_bucket(rb, host.forward_tokens(budget))
        if budget is None or (budget >= host.num_draft_slots() and tb == rb * (1 + self.k)):
            return "spec", rb, mode  # every row's 1 + K tokens, padding rows included
        # trimmed, or a lagged verify-all whose stream fills a smaller bucket (fewer drafts, as
        # after a probe, or fewer rows): allocate the budget, compact to a token bucket
        key = ("trim", rb, mode, tb)
        return None if key in self.failed else key

    def _trim_bucket(self, rb: int, num_tokens: int) -> int:
        """Token bucket of a trimmed step of request bucket rb with num_tokens tokens."""
        full = rb * (1 + self.k)
        return min(next((b for b in self.token_buckets if b >= num_tokens), full), full)

    def trim_buckets(self, rb: int) -> list[int]:
        """Every token bucket a trimmed step of request bucket rb can take: its rows number
        more than the next smaller request bucket, one token each at least, and it verifies
        fewer drafts than every slot (largest first)."""
        i = self.buckets.index(rb)
        fewest = (self.buckets[i - 1] if i else 0) + 1
        full = rb * (1 + self.k)
        return sorted({self._trim_bucket(rb, n) for n in range(fewest, full)}, reverse=True)

    def proposes(self) -> bool:
        """Whether this step drafts for every row (a probe drafts for a few: eager)."""
        return self.spec is not None and self.spec.draft_enabled and not self.spec.probing

    # -- the step ------------------------------------------------------------------------------
    def start(self, host: HostStep, key: tuple, budget: int | None = None):
        """Queue one step's device work; returns `wait`, which blocks until the step's packed
        outputs are on the host and returns them in bucket layout (see `unpack_outputs`).
        At most two steps are in flight: a step's pinned buffers and copy event are reused
        two starts later, which must come after its `wait`. Raises CaptureFailed when a graph
        first used here cannot be captured (the caller runs the step on the per-phase path;
        nothing was committed)."""
        family, rb, mode = key[:3]
        self.steps[key] = self.steps.get(key, 0) + 1
        lay = self._layout(key)
        i = self._parity
        host_buf = self.host_bufs[i]
        fill_host(host, lay, host_buf.numpy(), self._scratch(), self.k, budget)
        self.dev_buf[: lay.size].copy_(host_buf[: lay.size], non_blocking=True)
        if self.spec is not None:
            self.spec._no_drafts = family == "plain"
            self.spec.ran_as_graph = True
        packed = self._replay(key, lambda: self._step(key))
        self._parity = 1 - i  # (only once the step is queued: a failed capture keeps it)
        host_out = self.host_outs[i][: rb * (self.width(key) + 2)]
        host_out.copy_(packed, non_blocking=True)
        done = self._outputs_copied[i]  # re-recorded every other step
        if done is not None:
            done.record()
        # Graphs share one memory pool: a graph replayed after A may reuse memory holding A's
        # outputs, so every later replay (allocation timing, drafter) comes after the copy
        # of A's outputs in stream order.
        if family == "trim":  # scheduler overhead: the allocation's share of the replay
            self.spec.count_allocation_ms(self.allocation_ms(key))
        if self.proposes():
            method = self.spec.draft_method(mode == "greedy")
            self._replay(("draft", rb, method), lambda: self._draft(rb, method))
            self.spec._copy_conf_to_host()

        def wait() -> np.ndarray:
            if done is not None:
                done.synchronize()
            return host_out.numpy()

        return wait

    def width(self, key: tuple) -> int:
        """Tokens per row in the packed outputs: 1 for plain steps, which sample plainly
        (with synthetic acceptance only greedy ones do: SpecDecoder._verify), else K+1."""
        synthetic = self.spec is not None and self.spec.synthetic_rates is not None
        plain = key[0] == "plain" and (not synthetic or key[2] == "greedy")
        return 1 if plain else self.k + 1

    def _scratch(self) -> int:
        return self.spec.scratch_slot if self.spec is not None else self.runner.scratch_slot

    def _layout(self, key: tuple) -> Layout:
        family, rb = key[:2]  # a trimmed step is laid out with every draft slot
        return Layout(rb, rb if family == "plain" else rb * (1 + self.k), self.blocks)

    @torch.no_grad()  # no autograd in a step: fused kernels take only untracked tensors
    def _replay(self, key: tuple, fn):
        if not self.use_graphs:
            return fn()
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(key, fn)
        graph.replay()
        return self.outputs[key]

    def _capture(self, key: tuple, fn) -> torch.cuda.CUDAGraph:
        from dspark.engine.cuda_graph import capture_guard

        try:
            with capture_guard():
                fn()  # warm-up (compilation); the replay below recomputes the same values
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = fn()
                self.pool = self.pool or graph.pool()
        except Exception as e:
            self.failed.add(key)
            logger.exception("whole-step CUDA graph %s: capture failed, per-phase path", key)
            raise CaptureFailed(key) from e
        self.graphs[key], self.outputs[key] = graph, out
        logger.info("captured whole-step CUDA graph %s (%d so far)", key, len(self.graphs))
        return graph

    def capture_all(self, trims: bool = True) -> None:
        """Capture every key a step can take, before serving (a first-use capture would be a
        stall of ~0.1-1 s in the middle of traffic); `trims=False` leaves the lagged policy's
        trimmed steps to first use. Dummy steps: every row verifies K drafts (or decodes one
        token) of an empty context in the reserved block 0, drafts go to the scratch row; a
        trimmed step's budget fills its token bucket."""
        families = ("plain",) if self.spec is None else ("plain", "spec")
        methods = set() if self.spec is None else {self.spec.draft_method(True),
                                                   self.spec.draft_method(False)}  # fmt: skip
        trims = trims and self.spec is not None and self.spec.sc.adaptive_policy == "lagged"
        for rb in reversed(self.buckets):  # largest first: the pool fits every later graph
            for family in families:
                for mode in ("greedy", "sample"):
                    key = (family, rb, mode)
                    self._dummy_inputs(key)
                    if self.spec is not None:
                        self.spec._no_drafts = family == "plain"
                    self._replay(key, lambda key=key: self._step(key))
            for tb in self.trim_buckets(rb) if trims else ():
                for mode in ("greedy", "sample"):
                    key = ("trim", rb, mode, tb)
                    rows, budget = self.trim_dummy(rb, tb)
                    self._dummy_inputs(key, rows)
                    self.spec._no_drafts = False
                    self.dev_buf[self._layout(key).budget] = budget
                    self._replay(key, lambda key=key: self._step(key))
                self.allocation_ms(key)  # its allocation-only graph, timed once per bucket
            for method in sorted(methods):
                self._replay(("draft", rb, method), lambda rb=rb, m=method: self._draft(rb, m))
        if self.use_graphs:
            torch.cuda.synchronize()

    def draft_step(self, num_reqs: int, greedy: bool = False):
        """The drafter's part of a whole-step graph for `num_reqs` rows, as a callable (for
        the cost profile: drafting costs what it costs in serving, not an eager pass)."""
        rb = next(b for b in self.buckets if b >= num_reqs)
        self._dummy_inputs(("spec", rb, "greedy" if greedy else "sample"))
        method = self.spec.draft_method(greedy)
        return lambda: self._replay(("draft", rb, method), lambda: self._draft(rb, method))

    def _dummy_inputs(self, key: tuple, real_rows: int | None = None) -> None:
        """A dummy step of `real_rows` rows (default: the whole bucket), the rest padding."""
        lay = self._layout(key)
        r, t = lay.rows, lay.tokens
        q = t // r  # tokens per row: 1 + K or 1
        n = r if real_rows is None else real_rows
        rows = self.dev_buf[: 8 * r].view(8, r)
        rows.zero_()
        rows[ROW_FIELDS.index("samples"), :n] = 1
        rows[ROW_FIELDS.index("caps"), :n] = q - 1
        rows[ROW_FIELDS.index("nd"), :n] = 1
        rows[ROW_FIELDS.index("slots")] = self._scratch()
        temperature = 0.0 if key[2] == "greedy" else 1.0
        floats = torch.tensor([temperature, 1.0, 0.0], dtype=torch.float32, device=rows.device)
        self.dev_buf[lay.floats : lay.qsl].view(3, r)[:] = floats.view(torch.int32).long()[:, None]
        self.dev_buf[lay.qsl : lay.seq_lens] = torch.arange(r + 1, device=rows.device).clamp(
            max=n) * q  # (padding rows: zero length)  # fmt: skip
        seq_lens = self.dev_buf[lay.seq_lens : lay.block_tables]
        seq_lens.zero_()
        seq_lens[:n] = q
        self.dev_buf[lay.block_tables : lay.stream] = 0  # block 0: reserved for padding
        ids, pos, slot_map, src = self.dev_buf[lay.stream : lay.budget].view(4, t)
        ids.zero_()
        pos.copy_(torch.arange(t, device=rows.device) % q)
        pos[n * q :] = 0
        slot_map.fill_(SENTINEL_SLOT)  # nothing is written to the KV cache
        src.fill_(-1)

    def trim_dummy(self, rb: int, tb: int) -> tuple[int, int]:
        """(real rows, budget) of a dummy trimmed step that fills token bucket tb exactly: a
        bucket below rb rows (e.g. 160 tokens for rows 129..160 of bucket 192) holds fewer
        rows than the bucket, each without drafts."""
        rows = min(rb, tb)
        return rows, tb - rows

    # -- device code (captured) --------------------------------------------------------------
    def _rows(self, lay: Layout) -> dict[str, torch.Tensor]:
        buf, r = self.dev_buf, lay.rows
        rows = dict(zip(ROW_FIELDS, buf[: 8 * r].view(8, r), strict=True))
        floats = buf[lay.floats : lay.qsl].to(torch.int32).view(torch.float32).view(3, r)
        rows["temperature"] = floats[0]
        rows["block_tables"] = buf[lay.block_tables : lay.stream].view(r, lay.blocks).to(
            torch.int32)  # fmt: skip
        return rows

    def _inputs(self, key: tuple) -> StepInputs:
        family, rb, mode = key[:3]
        spec_rows = family != "plain"  # rows carry draft slots
        lay = self._layout(key)
        buf, t = self.dev_buf, lay.tokens
        rows = self._rows(lay)
        ids, pos, slot_map, src = buf[lay.stream : lay.budget].view(4, t)
        if self.spec is not None and spec_rows:
            drafts = self.spec.draft_tokens.view(-1)[src.clamp(min=0)]
            ids = torch.where(src >= 0, drafts, ids)
        return StepInputs(
            input_ids=ids, positions=pos, slot_mapping=slot_map,
            query_start_loc=buf[lay.qsl : lay.seq_lens].to(torch.int32),
            seq_lens=buf[lay.seq_lens : lay.block_tables].to(torch.int32),
            block_tables=rows["block_tables"], samples=rows["samples"].bool(),
            capacities=rows["caps"], num_non_draft=rows["nd"], start_pos=rows["start"],
            slots=rows["slots"], seeds=rows["seeds"], rounds=rows["rounds"],
            temperature=rows["temperature"], top_k=None, top_p=None, min_p=None,
            num_reqs=rb, num_tokens=t, max_query_len=1 + self.k if spec_rows else 1,
            max_seq_len=self.max_model_len, num_samples=rb, all_greedy=mode == "greedy",
            max_capacity=self.k if spec_rows else 0, max_num_logits=t,
        )  # fmt: skip

    def _step(self, key: tuple) -> torch.Tensor:
        rn, spec = self.runner, self.spec
        inp = self._inputs(key)
        if key[0] == "trim":
            finalize(inp, self._allocate(key), key[3], key[3])  # compacted to the bucket
        else:
            finalize(inp, None, None, None)  # every draft slot verified; logits rows <= T
        if rn.feeds_pending:
            resolve_pending(inp, rn.last_tokens)  # tokens of the step still in flight
        hidden, aux = rn.eager_forward(inp.input_ids, inp.attn_metadata())
        logits = rn.model.compute_logits(hidden[inp.logits_indices])
        if spec is None:
            out, num_out = sample_step(logits, inp)
        else:
            out, num_out = spec.verify(logits, inp)
            spec.drafter.write_context(aux, inp.positions, inp.slot_mapping, spec.kv_caches,
                                       rn.backend)  # fmt: skip
            anchors, anchor_pos = next_anchors(inp.anchor_pos, out, num_out)
            self.anchors[: inp.num_reqs].copy_(anchors)
            # padding rows (no tokens) would sit at position -1: give them an empty context
            self.anchor_pos[: inp.num_reqs].copy_(anchor_pos.clamp(min=0))
        if rn.feeds_pending:
            record_emitted(rn.last_tokens, inp, out, num_out)
        return pack_outputs(out, num_out, inp.lengths)

    def _allocate(self, key: tuple) -> torch.Tensor:
        """The lagged policy's global top-B over the current survivals of a trimmed step."""
        rows = self._rows(self._layout(key))
        caps = rows["caps"] * rows["samples"].bool().long()
        budget = self.dev_buf[self._layout(key).budget]
        return allocate_top_b(self.spec.conf[rows["slots"]], caps, budget)

    def allocation_ms(self, key: tuple) -> float:
        """Device time of a trimmed step's allocation, which runs inside its graph where it
        cannot be timed apart: a graph of the allocation alone is timed once per request
        bucket (mean of 10 replays over the step's inputs) and charged to every such step."""
        rb = key[1]
        if rb not in self.alloc_ms and self.use_graphs:
            try:
                self._replay(("alloc", rb), lambda: self._allocate(key))
            except CaptureFailed:  # the step itself already ran: count nothing, once
                logger.warning("allocation time of request bucket %d not measured", rb)
                self.alloc_ms[rb] = 0.0
        if rb not in self.alloc_ms:
            if self.use_graphs:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)  # fmt: skip
                start.record()
                for _ in range(10):
                    self.graphs["alloc", rb].replay()
                end.record()
                end.synchronize()
                self.alloc_ms[rb] = start.elapsed_time(end) / 10
            else:
                t0 = time.perf_counter()
                self._allocate(key)
                self.alloc_ms[rb] = (time.perf_counter() - t0) * 1e3
        return self.alloc_ms[rb]

    def _draft(self, rb: int, method: str) -> None:
        rows = self._rows(Layout(rb, 0, self.blocks))
        self.spec.draft(self.anchors[:rb], self.anchor_pos[:rb], rows["block_tables"],
                        rows["temperature"], rows["seeds"], rows["rounds"] + 1, rows["slots"],
                        method, self.max_model_len, use_graphs=False)  # fmt: skip
