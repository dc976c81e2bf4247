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
of the key), "plain" (one token per row, no drafts: no-speculation engines and steps whose
drafting was skipped) and, for steps with prefill chunks, "mixed" (rows verify drafts) and
"mixed_plain" (none do). A mixed step's stream is laid out as packed, up to `mixed_tokens`,
and compacted inside the graph to a token bucket of the prefill graphs (after the lagged
plan's allocation, if it trims), under the prefill graphs' promised query length. Eager, such
a step issued ~40-90 kernels (89 for fixed K on the demo pair at c = 128) and took ~3x a
verify step's host time; under speculation requests finish at different steps, so 30-45%
of all steps at c >= 128 carry a prompt or two. Steps with top-k/top-p/min-p, probes,
traces, the threshold / early-stop policies, tensor parallelism or a prefill key beyond
`mixed_keys` run the per-phase path (target-forward and drafter graphs, eager glue).

Every graph is captured before serving (`capture_all`, dummy steps), "trim" graphs too unless
DSPARK_CAPTURE_TRIMS=0, and steps with prefill chunks up to `mixed_keys` (past those: the
per-phase path). Any other key not captured is captured on first use: the step runs eagerly
once (warm-up, same result), is captured and replayed. Every op of a
step is deterministic given its inputs, so re-running it over the same inputs writes the same
KV, drafts and outputs. A failed capture marks its key: those steps take the per-phase path.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from dspark.engine.cuda_graph import PREFILL_GRAPH_MAX_TOKENS, prefill_buckets
from dspark.engine.follow import follow_inputs
from dspark.engine.input_batch import (
    HostStep,
    StepInputs,
    finalize,
    record_emitted,
    resolve_pending,
)
from dspark.engine.step_graph_capture import (
    IDLE,
    MIXED,
    CaptureFailed,
    StepGraphCapture,
    mixed_graphs_enabled,
)
from dspark.engine.step_layout import ROW_FIELDS, Layout, fill_host, pack_outputs
from dspark.sampling.sampler import sample_step
from dspark.spec.planner import allocate_top_b
from dspark.spec.verify import next_anchors

logger = logging.getLogger(__name__)


class StepGraphs(StepGraphCapture):
    def __init__(self, runner, use_graphs: bool = True):
        self.runner = runner
        self.spec = runner.spec
        self.k = self.spec.k if self.spec is not None else 0
        self.use_graphs = use_graphs  # False: run the same code eagerly (CPU tests)
        from dspark.spec.draft_graph import request_buckets

        self.buckets = request_buckets(runner.config.max_num_seqs)
        self.blocks = runner.max_blocks_per_seq
        self.max_model_len = runner.max_model_len
        # steps with prefill chunks: the stream as packed (up to mixed_tokens), compacted to a
        # prefill graphs' token bucket; attention under their promised query length
        limit = runner.config.max_num_batched_tokens
        self.mixed_query_len = limit
        self.mixed_tokens = min(limit, PREFILL_GRAPH_MAX_TOKENS)
        self.mixed_buckets = (sorted(set(prefill_buckets(self.mixed_tokens)) | {self.mixed_tokens})
                              if mixed_graphs_enabled() else [])  # fmt: skip
        biggest = Layout(self.buckets[-1], max(self.buckets[-1] * (1 + self.k),
                                               self.mixed_tokens), self.blocks)  # fmt: skip
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
        # the keys of steps with prefill chunks that start-up captures; a step beyond them
        # (many prompt tokens beside few rows) takes the per-phase path, never a first-use
        # capture (a stall of tens of ms or more: 59 of them, most now captured at start-up,
        # slowed the demo pair's adaptive server in the middle of its levels on the H200)
        self.mixed_keys = {key for rb in self.buckets for key in self.mixed_startup_keys(rb)}

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
        plain = g("max_capacity") == 0 and g("max_query_len") == 1  # (a plain decode step)
        # traces sync every step; the online estimator's coefficients change between steps; a
        # draft probe drafts for its first rows only: eager beside drafts to verify or prefill
        # chunks (those graphs draft for all rows or none); on a plain step, the plain family
        # that drafts for every row, of which the commit keeps the probe's rows' drafts
        # (SpecDecoder.rows_with_drafts; an eager probe: 28 ms against 9 ms plain steps, 8B)
        if spec is not None and (spec.trace is not None or spec.estimator is not None
                                 or (spec.draft_enabled and spec.probing and not plain)):
            return None
        if g("max_query_len") > (1 + self.k if g("max_capacity") > 0 else 1):
            return self._mixed_key(host, budget, rb, mode)  # (prefill chunks)
        if g("max_capacity") == 0:
            # a plain step that does not draft (drafting off) leaves the next anchors unwritten
            # (a step that drafts writes its own first): its own graph, six kernels fewer
            return ("plain", rb, mode) if spec is None or self.proposes() else (
                "plain", rb, mode, IDLE)  # fmt: skip
        if spec.sc.adaptive_policy not in ("fixed", "lagged"):
            return None  # threshold / early-stop choose lengths on the device: eager
        tb = self._trim_bucket(rb, host.forward_tokens(budget))
        if budget is None or (budget >= host.num_draft_slots() and tb == rb * (1 + self.k)):
            return "spec", rb, mode  # every row's 1 + K tokens, padding rows included
        # trimmed, or a lagged verify-all whose stream fills a smaller bucket (fewer drafts, as
        # after a probe, or fewer rows): allocate the budget, compact to a token bucket
        key = ("trim", rb, mode, tb)
        return None if key in self.failed else key

    def _mixed_key(self, host: HostStep, budget: int | None, rb: int, mode: str):
        """(family, rows bucket, mode, token bucket) of a step with prefill chunks; "mixed"
        when its rows verify drafts. None: not a key captured at start-up (mixed_keys: up to
        the bucket's verify stream plus MIXED_STARTUP_EXTRA_TOKENS tokens), or its policy
        chooses lengths on the device."""
        drafts = host.num_draft_slots() > 0 and budget != 0
        if drafts and self.spec.sc.adaptive_policy not in ("fixed", "lagged"):
            return None
        if host.get("num_tokens") > self.mixed_tokens:
            return None
        n = host.forward_tokens(budget)
        tb = next((b for b in self.mixed_buckets if b >= n), None)
        key = ("mixed" if drafts else "mixed_plain", rb, mode, tb)
        return key if key in self.mixed_keys and key not in self.failed else None

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
        """Whether this step drafts for every row: drafting is on, or a draft probe runs as a
        plain step (key_for runs every other probe eager)."""
        return self.spec is not None and self.spec.draft_enabled

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
        # a step with prefill chunks allocates only if its plan trims (-1: verify every draft)
        trims = family == "trim" or (family == "mixed" and budget is not None
                                     and budget < host.num_draft_slots())  # fmt: skip
        fill_host(host, lay, host_buf.numpy(), self._scratch(), self.k, budget if trims else None)
        self.dev_buf[: lay.size].copy_(host_buf[: lay.size], non_blocking=True)
        if self.spec is not None:
            self.spec._no_drafts = family in ("plain", "mixed_plain")
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
        if trims:  # scheduler overhead: the allocation's share of the replay
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
        plain = key[0] in ("plain", "mixed_plain") and (not synthetic or key[2] == "greedy")
        return 1 if plain else self.k + 1

    def _scratch(self) -> int:
        return self.spec.scratch_slot if self.spec is not None else self.runner.scratch_slot

    def _layout(self, key: tuple) -> Layout:
        family, rb = key[:2]  # a trimmed step is laid out with every draft slot
        if family in MIXED:  # the stream as packed, compacted inside the graph
            return Layout(rb, self.mixed_tokens, self.blocks)
        return Layout(rb, rb if family == "plain" else rb * (1 + self.k), self.blocks)

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
        spec_rows = family in ("spec", "trim", "mixed")  # rows verify draft slots
        # a prefill chunk's query: the prefill graphs' promise (their attention block shape)
        max_q = self.mixed_query_len if family in MIXED else 1 + self.k if spec_rows else 1
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
            num_reqs=rb, num_tokens=t, max_query_len=max_q,
            max_seq_len=self.max_model_len, num_samples=rb, all_greedy=mode == "greedy",
            max_capacity=self.k if spec_rows else 0, max_num_logits=t,
            # no row verifies: decode rows attend with no-spec's 1-token tile, not 1 + K's
            short_query_len=1 if family == "mixed_plain" else None,
        )  # fmt: skip

    def _step(self, key: tuple) -> torch.Tensor:
        rn, spec = self.runner, self.spec
        inp = self._inputs(key)
        if key[0] != "plain" and rn.last_counts is not None:  # (a step may follow: follow.py)
            follow_inputs(inp, rn.last_counts, rn.block_size,
                          self.dev_buf[self._layout(key).follows])  # fmt: skip
        if key[0] == "trim":
            finalize(inp, self._allocate(key), key[3], key[3])  # compacted to the bucket
        elif key[0] in MIXED:  # compacted to the bucket; logits rows <= 1 + its capacity a
            # row (K, or 0 where no row verifies: the LM head over padding rows is not free,
            # 7 of them a row cost ~4.4 ms a step on the 8B shape at 256 rows)
            finalize(inp, self._mixed_lengths(key, inp), key[3],
                     min(key[3], key[1] * (1 + inp.max_capacity)))  # fmt: skip
        else:
            finalize(inp, None, None, None)  # every draft slot verified; logits rows <= T
        if rn.feeds_pending:
            resolve_pending(inp, rn.last_tokens)  # tokens of the step still in flight
        # a plain step while drafting is off may skip the drafter's context (its rows' gaps
        # are rebuilt before they draft: spec/context_gaps.py), and with it the layer outputs
        skip = spec is not None and key[-1] == IDLE and spec.skip_idle_write
        hidden, aux = rn.eager_forward(inp.input_ids, inp.attn_metadata(), aux=not skip)
        logits = rn.model.compute_logits(hidden[inp.logits_indices])
        if spec is None:
            out, num_out = sample_step(logits, inp)
        else:
            out, num_out = spec.verify(logits, inp)
            if not skip:
                spec.drafter.write_context(aux, inp.positions, inp.slot_mapping,
                                           spec.kv_caches, rn.backend)  # fmt: skip
            if key[-1] != IDLE:  # (into the persistent buffers the draft graph reads, which
                # only a step that drafts replays; padding rows: position 0)
                next_anchors(inp.anchor_pos, out, num_out, self.anchors[: inp.num_reqs],
                             self.anchor_pos[: inp.num_reqs])  # fmt: skip
        if rn.feeds_pending:
            record_emitted(rn.last_tokens, inp, out, num_out, rn.last_counts)
        return pack_outputs(out, num_out, inp.lengths)

    def _mixed_lengths(self, key: tuple, inp: StepInputs) -> torch.Tensor:
        """Verified drafts per row of a step with prefill chunks: none ("mixed_plain"), every
        draft slot (fixed K; the lagged policy when its plan trims nothing: budget -1), or
        the lagged plan's allocation."""
        if key[0] == "mixed_plain":
            return torch.zeros_like(inp.capacities)
        if self.spec.sc.adaptive_policy == "fixed":
            return inp.capacities
        budget = self.dev_buf[self._layout(key).budget]
        return torch.where(budget < 0, inp.capacities, self._allocate(key))

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
