"""CUDA graphs for the drafter's proposal (backbone pass + sequential Markov loop).

The proposal is K slots of small kernels per step (Markov bias, sampling, confidence), far
too many launches to run eagerly at every step. It is captured once per request-count bucket;
replay copies the step's per-request inputs into persistent buffers. Padding rows (past the
real requests) have an empty context (anchor position 0, block table of the sentinel block)
and their outputs are ignored.
"""

from __future__ import annotations

import logging

import torch

from dspark.models.dspark_drafter import DraftOutput

logger = logging.getLogger(__name__)


def request_buckets(max_reqs: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    return sorted({s for s in sizes if s < max_reqs} | {max_reqs})


class DraftGraphRunner:
    def __init__(self, spec, max_reqs: int, max_ctx_len: int, max_blocks: int):
        self.spec = spec
        self.max_ctx_len = max_ctx_len
        self.buckets = request_buckets(max_reqs)
        dev = spec.device
        r = self.buckets[-1]
        self.anchors = torch.zeros(r, dtype=torch.int64, device=dev)
        self.anchor_pos = torch.zeros(r, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(r, max_blocks, dtype=torch.int32, device=dev)
        self.temperature = torch.ones(r, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(r, dtype=torch.int64, device=dev)
        self.rounds = torch.zeros(r, dtype=torch.int64, device=dev)
        # one graph per (bucket, sampling method): batches of greedy rows only draft greedily
        self.methods = sorted({spec.sc.draft_sample_method, "greedy"})
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], DraftOutput] = {}

    def _propose(self, r: int, method: str) -> DraftOutput:
        s = self.spec
        return s.drafter.propose(
            self.anchors[:r], self.anchor_pos[:r], self.block_tables[:r], self.max_ctx_len,
            s.kv_caches, s.backend, s.k, self.temperature[:r], self.seeds[:r], self.rounds[:r],
            method, s.needs_max_probs,
        )  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        from dspark.engine.cuda_graph import capture_guard

        with capture_guard():
            self._capture_all()

    def _capture_all(self) -> None:
        pool = None
        for r in reversed(self.buckets):
            for method in self.methods:
                for _ in range(2):
                    self._propose(r, method)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._propose(r, method)
                pool = pool or g.pool()
                self.graphs[r, method], self.outputs[r, method] = g, out
        torch.cuda.synchronize()
        logger.info("captured %d drafter CUDA graphs for %s requests x %s drafts",
                    len(self.graphs), self.buckets, self.methods)  # fmt: skip

    def run(self, anchors, anchor_pos, block_tables, temperature, seeds, rounds, method: str):
        n = anchors.shape[0]
        r = next((b for b in self.buckets if b >= n), None)
        if r is None:
            return None
        self.anchors[:n].copy_(anchors)
        self.anchors[n:r].zero_()
        self.anchor_pos[:n].copy_(anchor_pos)
        self.anchor_pos[n:r].zero_()
        nb = block_tables.shape[1]
        self.block_tables[:n, :nb].copy_(block_tables)
        self.block_tables[:n, nb:].zero_()
        self.block_tables[n:r].zero_()
        self.temperature[:n].copy_(temperature)
        self.temperature[n:r].fill_(1.0)
        self.seeds[:n].copy_(seeds)
        self.rounds[:n].copy_(rounds)
        self.graphs[r, method].replay()
        o = self.outputs[r, method]
        return DraftOutput(
            o.token_ids[:n],
            None if o.probs is None else o.probs[:n],
            None if o.conf_logits is None else o.conf_logits[:n],
            None if o.max_probs is None else o.max_probs[:n],
        )
