"""Capturing whole-step graphs before serving: dummy steps for every key a step can take.

A first-use capture stalls its step (~0.1-1 s in the middle of traffic: a warm-up run, the
capture and a garbage collection), so `capture_all` runs one dummy step per key at start-up.
Dummy steps verify K drafts (or decode one token, or carry one-token rows for the steps with
prefill chunks) of an empty context in the reserved block 0; their drafts go to the scratch
row and they write nothing to the KV cache (the sentinel slot).
"""

from __future__ import annotations

import logging
import os

import torch

from dspark.attention.base import SENTINEL_SLOT
from dspark.engine.step_layout import ROW_FIELDS

logger = logging.getLogger("dspark.engine.step_graph")  # (the log name users filter on)

MIXED = ("mixed", "mixed_plain")  # families of steps with prefill chunks (step_graph.py)
IDLE = "idle"  # last element of the key of a plain step that does not draft (key_for)
# steps with prefill chunks captured at start-up: up to this many tokens beyond the request
# bucket's decode/verify stream (a typical step admits one or two prompts); larger ones take
# the per-phase path (StepGraphs.mixed_keys), never a first-use capture
MIXED_STARTUP_EXTRA_TOKENS = 1024


def mixed_graphs_enabled() -> bool:
    """Whole-step graphs for steps with prefill chunks (DSPARK_MIXED_GRAPHS=0: the per-phase
    path's, as before them)."""
    return os.environ.get("DSPARK_MIXED_GRAPHS", "1") != "0"


class CaptureFailed(RuntimeError):
    """A whole-step graph could not be captured (the key is not tried again)."""


class StepGraphCapture:
    """Mixin of StepGraphs: its captures (at start-up, with dummy steps, or on first use)."""

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
        """Capture every key a step can take before serving; `trims=False` leaves the lagged
        policy's trimmed steps to first use. A trimmed step's budget fills its token bucket.
        Steps with prefill chunks: `mixed_startup_keys`."""
        families = ("plain",) if self.spec is None else ("plain", "spec")
        methods = set() if self.spec is None else {self.spec.draft_method(True),
                                                   self.spec.draft_method(False)}  # fmt: skip
        lagged = self.spec is not None and self.spec.sc.adaptive_policy == "lagged"
        trims = trims and lagged
        # plain steps that do not draft (StepGraphs.key_for): only where drafting can be off
        idle = lagged and self.spec.drafting.enabled
        for rb in reversed(self.buckets):  # largest first: the pool fits every later graph
            keys = [(family, rb, mode) for family in families for mode in ("greedy", "sample")]
            if idle:
                keys += [("plain", rb, mode, IDLE) for mode in ("greedy", "sample")]
            for key in keys:
                self._dummy_inputs(key)
                if self.spec is not None:
                    self.spec._no_drafts = key[0] == "plain"
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
            for key in self.mixed_startup_keys(rb):
                self._dummy_inputs(key, min(rb, key[3]))
                if self.spec is not None:
                    self.spec._no_drafts = key[0] == "mixed_plain"
                self.dev_buf[self._layout(key).budget] = -1  # every draft slot verified
                self._replay(key, lambda key=key: self._step(key))
            for method in sorted(methods):
                self._replay(("draft", rb, method), lambda rb=rb, m=method: self._draft(rb, m))
        if self.use_graphs:
            torch.cuda.synchronize()

    def captured(self, key: tuple) -> bool:
        """Whether `key` replays a graph captured before (or runs uncaptured: CPU tests). A
        step that follows the one in flight (follow.py) takes the per-phase path where not:
        a first use's warm-up run would record the tokens it emits where its replay then
        reads its pending inputs."""
        return not self.use_graphs or key in self.graphs

    def mixed_startup_keys(self, rb: int) -> list[tuple]:
        """Keys of steps with prefill chunks captured at start-up for request bucket rb: token
        buckets from its fewest rows up to its decode/verify stream plus
        MIXED_STARTUP_EXTRA_TOKENS; with speculation, both those whose rows verify drafts and
        those whose rows do not (the first prompts; a drafting-off adaptive engine's steps:
        on the H200, leaving those to first use cost the demo pair's adaptive server 56
        captures in the middle of its measured levels)."""
        i = self.buckets.index(rb)
        fewest = (self.buckets[i - 1] if i else 0) + 2  # one more row, one with 2+ tokens
        most = rb * (1 + self.k) + MIXED_STARTUP_EXTRA_TOKENS
        families = ("mixed_plain",) if self.spec is None else ("mixed", "mixed_plain")
        buckets = [tb for tb in self.mixed_buckets if tb <= most]
        buckets = [tb for tb in buckets if tb >= fewest] or buckets[-1:]
        return [(family, rb, mode, tb) for family in families for tb in buckets
                for mode in ("greedy", "sample")]  # fmt: skip

    def draft_step(self, num_reqs: int, greedy: bool = False):
        """The drafter's part of a whole-step graph for `num_reqs` rows, as a callable (for
        the cost profile: drafting costs what it costs in serving, not an eager pass)."""
        rb = next(b for b in self.buckets if b >= num_reqs)
        self._dummy_inputs(("spec", rb, "greedy" if greedy else "sample"))
        method = self.spec.draft_method(greedy)
        return lambda: self._replay(("draft", rb, method), lambda: self._draft(rb, method))

    def _dummy_inputs(self, key: tuple, real_rows: int | None = None) -> None:
        """A dummy step of `real_rows` rows (default: the whole bucket), the rest padding;
        1 + K tokens a row (spec, trim), or one (plain and the prefill families)."""
        lay = self._layout(key)
        r, t = lay.rows, lay.tokens
        q = 1 if key[0] in MIXED else t // r  # tokens per row: 1 + K or 1
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
