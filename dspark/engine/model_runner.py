"""The model runner owns every device tensor: weights, KV cache, step inputs, sampling.

One step: build the inputs (one host->device copy), let the speculative decoder pick verify
lengths, run the target over the ragged stream, sample or verify, start the one
device->host copy of the emitted tokens, launch the drafter for the next step, then wait for
the copy. The drafter's work overlaps the host's bookkeeping of this step.

Tensor parallel (`tensor_parallel_size` N > 1): this runner is rank 0; it starts ranks
1..N-1, each with its own ModelRunner over its shard, and broadcasts every step's host arrays
to them before running the step itself (protocol in dspark/engine/distributed.py). With N = 1
nothing of that exists: no process group, no extra work.
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from dspark.attention import select_backend
from dspark.config import EngineConfig, schedules_ahead
from dspark.engine.follow import follow_enabled, follow_extra, follow_inputs
from dspark.engine.input_batch import (
    HostStep,
    finalize,
    pack_step,
    record_emitted,
    resolve_pending,
    upload_step,
)
from dspark.engine.kv_sizing import drafter_share, num_kv_blocks
from dspark.engine.scheduler import SchedulerOutput
from dspark.engine.step_clock import clock_for
from dspark.engine.step_graph import CaptureFailed, StepGraphs
from dspark.engine.step_graph_capture import mixed_graphs_enabled
from dspark.engine.step_layout import pack_outputs, unpack_outputs
from dspark.forward_context import ForwardContext, forward_context
from dspark.layers.parallel import SINGLE, tensor_parallel
from dspark.models.config import ModelConfig
from dspark.models.target import load_target
from dspark.sampling.sampler import sample_step
from dspark.spec.context_gaps import mark_gaps, rebuild_gaps, rows_to_rebuild

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    emitted: list[list[int]]  # per scheduled row: tokens to commit (empty for non-sampling rows)
    verified: list[int]  # per row: drafts sent to the target
    drafted: list[int]  # per row: drafts that were available (capacity)
    num_tokens: int = 0  # tokens in the target forward


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_cfg: ModelConfig, device: torch.device, dtype,
        world=None,  # distributed.TPWorld of a tensor-parallel worker (ranks >= 1)
    ):  # fmt: skip
        self.world = world
        self._finalizer = None
        self.released = False
        if world is None and config.tensor_parallel_size > 1:
            from dspark.engine.distributed import launch

            self.world = launch(config, model_cfg, device, dtype)
            self._finalizer = weakref.finalize(self, self.world.shutdown)
        self.tp = self.world.tp if self.world is not None else SINGLE
        try:
            self._init(config, model_cfg, self.world.device if self.world else device, dtype)
        except BaseException as e:
            if self._finalizer is not None:
                self._finalizer()
                detail = self.world.worker_errors()
                if detail:
                    raise RuntimeError(f"{e}\n{detail}") from e
            raise

    def _init(self, config: EngineConfig, model_cfg: ModelConfig, device: torch.device, dtype):
        self.config = config
        self.model_cfg = model_cfg
        self.device = device
        self.step_clock = clock_for(device)  # DSPARK_STEP_CLOCK=1 (step_clock.py)
        self.dtype = dtype
        self.block_size = config.block_size
        dummy = config.load_format == "dummy"
        self.backend = select_backend(config.attention_backend, device)
        self.spec = None
        self.last_kind = "plain"  # the kind of the step launched last, without speculation
        self.last_all_sample = False  # ... and whether every row of it sampled
        with tensor_parallel(self.tp):  # layers built here are sharded over the group
            self.model = load_target(model_cfg, config.model, dtype, device, dummy)
            if config.speculative_config is not None:
                from dspark.spec.decoder import SpecDecoder

                self.spec = SpecDecoder(config, self.model, model_cfg, device, dtype,
                                        self.backend)  # fmt: skip
        self.aux_layer_ids = self.spec.aux_layer_ids if self.spec is not None else ()
        # decode / verify rows of steps with prefill chunks get a decode-sized attention tile
        self.backend.short_query_len = 1 + (self.spec.k if self.spec is not None else 0)
        # the token each request slot sampled last (the extra slot: padding rows), for the
        # inputs of a step scheduled while the previous one is in flight (PENDING_TOKEN)
        self.scratch_slot = config.max_num_seqs
        self.feeds_pending = schedules_ahead(config)  # (else the buffer is never read)
        self.last_tokens = torch.zeros(config.max_num_seqs + 1, dtype=torch.int64,
                                       device=device)  # fmt: skip
        # ... and how many tokens it emitted then, for a speculative step that follows the one
        # in flight (follow.py; None where no step follows: without speculation or async
        # scheduling, or with DSPARK_FOLLOW=0, whose steps then pay nothing for it)
        follows = self.feeds_pending and self.spec is not None and follow_enabled()
        self.last_counts = torch.zeros_like(self.last_tokens) if follows else None
        self.num_blocks = num_kv_blocks(self)
        max_len = config.max_model_len or model_cfg.max_position_embeddings
        self.max_model_len = min(max_len, (self.num_blocks - 1) * self.block_size)
        shape = (model_cfg.num_hidden_layers, self.num_blocks, self.block_size)
        kv_shape = (*shape, model_cfg.num_key_value_heads // self.tp.size, model_cfg.head_dim)
        self.k_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.kv_caches = [(self.k_cache[i], self.v_cache[i]) for i in range(shape[0])]
        if self.spec is not None:
            self.spec.kv_caches = self.spec.drafter.new_kv_caches(
                self.num_blocks, self.block_size, device)
        # kernel compiles now, not as ~1 s stalls under traffic (DSPARK_ATTENTION_WARMUP=0: off)
        if device.type == "cuda" and os.environ.get("DSPARK_ATTENTION_WARMUP", "1") != "0":
            heads = model_cfg.num_attention_heads // self.tp.size
            try:
                n = self.backend.warmup(*self.kv_caches[0], heads)
                logger.info("attention kernels: %d launch variants compiled", n)
            except Exception:  # serving still works: variants then compile on first use
                logger.exception("attention kernel warm-up failed")
        self.graphs = self.prefill_graphs = None
        self.step_graphs: StepGraphs | None = None
        # Collectives inside CUDA graphs are untested here: eager under tensor parallelism
        # unless DSPARK_TP_CUDA_GRAPHS=1.
        graphs_ok = self.tp.size == 1 or os.environ.get("DSPARK_TP_CUDA_GRAPHS") == "1"
        if (device.type == "cuda" and self.backend.name == "triton" and not config.enforce_eager
                and graphs_ok):  # fmt: skip
            from dspark.engine.cuda_graph import CudaGraphRunner, decode_graph_max_tokens

            k = self.spec.k if self.spec is not None else 0
            max_tokens = decode_graph_max_tokens(config.max_num_batched_tokens,
                                                 config.max_num_seqs, k)  # fmt: skip
            self.graphs = CudaGraphRunner(self, max_query_len=1 + k, max_tokens=max_tokens)
            try:
                self.graphs.capture()
                if self.spec is not None:
                    self.spec.capture_graphs(
                        config.max_num_seqs, self.max_model_len, self.max_blocks_per_seq
                    )
            except Exception:  # serve eagerly rather than not at all, and say so
                if self.tp.size > 1:
                    raise  # ranks must agree on graphs; a one-sided fallback would diverge
                logger.exception("CUDA graph capture failed: running eagerly (slower)")
                self.graphs = None
                if self.spec is not None:
                    self.spec.draft_graphs = None
            if self.graphs is not None and self._wants_prefill_graphs():
                from dspark.engine.cuda_graph import capture_prefill_graphs

                self.prefill_graphs = capture_prefill_graphs(self, self.graphs)
            if self.graphs is not None and self.world is None and self.tp.size == 1:
                try:
                    from dspark.engine.cuda_graph import capture_guard

                    self.step_graphs = StepGraphs(self)
                    # trimmed-step graphs up front too (DSPARK_CAPTURE_TRIMS=0: on first use);
                    # one guard: garbage is collected once, not before each of ~300 graphs
                    with capture_guard():
                        self.step_graphs.capture_all(
                            trims=os.environ.get("DSPARK_CAPTURE_TRIMS") != "0")
                    if self.spec is not None:  # trimmed lagged steps are graphs too
                        self.spec.graph_steps = self.spec.graph_trims = True
                except Exception:  # the per-phase graphs above still serve
                    logger.exception("whole-step CUDA graph capture failed: not using them")
                    self.step_graphs = None
        if self.spec is not None and self.spec.needs_cost_model:
            from dspark.spec.profiler import install_cost_model

            install_cost_model(self)
        logger.info(
            "KV cache: %d blocks x %d tokens (%s, %s backend)%s",
            self.num_blocks, self.block_size, device, self.backend.name, drafter_share(self),
        )  # fmt: skip

    @property
    def max_blocks_per_seq(self) -> int:
        """Widest block table a step can carry: a sequence at max_model_len plus its K
        lookahead draft slots, and a following step's K + 1 more (follow.py: a row that the
        step in flight ends by length is still laid out, a wasted row)."""
        k = self.spec.k if self.spec is not None else 0
        extra = follow_extra(k) if self.last_counts is not None else 0
        return -(-(self.max_model_len + k + 1 + extra) // self.block_size) + 1

    # -- memory ---------------------------------------------------------------------------
    def _captures_graphs_of_prefill_chunks(self) -> bool:
        """Whether this runner can capture graphs over prefill chunks' token counts."""
        return (self.device.type == "cuda" and self.backend.name == "triton"
                and not self.config.enforce_eager and self.tp.size == 1)  # fmt: skip

    def _wants_prefill_graphs(self) -> bool:
        """Whether the per-phase path's prefill CUDA graphs are to be captured."""
        return (self._captures_graphs_of_prefill_chunks()
                and os.environ.get("DSPARK_PREFILL_GRAPHS", "1") != "0")  # fmt: skip

    def _graphs_of_prefill_chunks(self) -> int:
        """How many sets of graphs over prefill chunks' token counts are to be captured (their
        pools are reserved first): the per-phase path's prefill graphs, and the whole-step
        graphs of steps with prefill chunks (step_graph.py)."""
        mixed = self._captures_graphs_of_prefill_chunks() and mixed_graphs_enabled()
        return int(self._wants_prefill_graphs()) + int(mixed)

    # -- the step ---------------------------------------------------------------------------
    def num_graph_captures(self) -> int:
        """Whole-step graphs captured or failed so far (a first-use capture stalls its step)."""
        sg = self.step_graphs
        return 0 if sg is None else len(sg.graphs) + len(sg.failed)

    def launch(self, sched: SchedulerOutput, block_tables: np.ndarray, follows: bool = False):
        """Queue one step's device work and return `wait`, which blocks until the emitted
        tokens are on the host and returns the StepResult. The host works in between (outputs
        of an earlier step; with async scheduling, the next step's launch). At most two steps
        are in flight: a launch comes after the wait of the step launched two before it. On
        the CPU, and under tensor parallelism, the work is done when this returns.
        `follows`: the rows are those of the speculative step in flight, scheduled from the
        state before it (follow.py)."""
        rows = sched.rows
        host = pack_step(rows, block_tables, self.block_size, follows)
        if self.spec is None:  # (a speculative step's kind: SpecDecoder.last_kind, at plan)
            self.last_kind = "mixed" if host.get("max_query_len") > 1 else "plain"
        # every row samples (no prompt chunk but a prompt's last): a step the next one may
        # follow, if it drafts for every row (follow.py)
        self.last_all_sample = host.get("num_samples") == len(rows)
        # the lagged policy's budget, from the packed rows and stale confidences (host only)
        plan = self.spec.plan(host, sched.draft_room) if self.spec is not None else None
        if self.spec is not None and self.spec.skip_idle_write:
            self._context_gaps(rows, block_tables, host)
        key = None if self.step_graphs is None else self.step_graphs.key_for(host, plan)
        if key is not None and host.get("follows") and not self.step_graphs.captured(key):
            key = None  # (a following step is never a graph's first use)
        clock = self.step_clock.begin()  # (None unless DSPARK_STEP_CLOCK=1)
        if key is not None:  # the whole device half as (at most) two graph replays
            try:
                wait_graph = self.step_graphs.start(host, key, plan)
            except CaptureFailed:
                pass  # logged; the step runs on the per-phase path below
            else:
                self.step_clock.end(clock, host, self.spec, plan)
                width = self.step_graphs.width(key)
                # the cost model's input: the packed count would price a trimmed step as
                # verify-all (its learned fixed term then went far negative on the H200)
                num_tokens = host.forward_tokens(plan)
                return lambda: self._unpack(wait_graph(), len(rows), key[1], width, rows,
                                            num_tokens)  # fmt: skip
        if self.world is None:
            wait_step = self.run_step(host, plan)
        else:
            with self.world.step_guard():
                self.world.send_step(host, plan)  # the workers run the same step
                result = self.run_step(host, plan)()

                def wait_step():
                    return result

        self.step_clock.end(clock, host, self.spec, plan)

        def wait() -> StepResult:
            host_out, inp, width = wait_step()
            return self._unpack(host_out, inp.num_reqs, inp.num_reqs, width, rows,
                                inp.num_tokens)  # fmt: skip

        return wait

    def _context_gaps(self, rows, block_tables: np.ndarray, host: HostStep) -> None:
        """Skipped context writes (spec/context_gaps.py): a step that skips marks its rows'
        gaps; a step that drafts first rebuilds the gaps of the rows it drafts for."""
        spec = self.spec
        if spec.skips_context_write(host.get("max_capacity"), host.get("max_query_len")):
            mark_gaps(rows)
            spec.gaps_marked = True
        elif spec.draft_enabled and spec.gaps_marked:  # (no scan of the rows a step after
            idx = rows_to_rebuild(rows, spec.probing)  # a drafting step found none)
            if idx:
                spec.rebuilt_tokens += rebuild_gaps(self, rows, block_tables, idx)
            elif not spec.probing:  # (a running request left out of that step keeps its
                spec.gaps_marked = False  # gap: it drafts from the context it has)

    @torch.inference_mode()
    def run_step(self, host: HostStep, plan: int | None):
        """The device half of a step (every tensor-parallel rank, in lockstep): queues it and
        returns `wait`, which on rank 0 returns (host copy of the packed outputs, inputs,
        output width) once they are on the host, and None on the other ranks."""
        draft_buf = self.spec.draft_tokens if self.spec is not None else None
        inp = upload_step(host, self.device, draft_buf)
        if host.get("follows"):  # rows move by what the step in flight emits (follow.py)
            follow_inputs(inp, self.last_counts, self.block_size, 1)
            inp.max_seq_len += follow_extra(self.spec.k)
        if self.spec is not None:
            self.spec.choose_lengths(inp, plan)  # calls finalize() with the verify lengths
        else:
            finalize(inp, None, None, None)
        if self.feeds_pending:
            resolve_pending(inp, self.last_tokens)  # tokens of the step still in flight
        hidden, aux = self.forward(inp.input_ids, inp.attn_metadata(), inp.num_tokens)
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        if self.spec is not None:
            out, num_out = self.spec.verify(logits, inp)
            if self.world is not None:
                out, num_out = self.world.agree_tokens(out, num_out)
        else:
            out, num_out = sample_step(logits, inp)
        if self.feeds_pending:
            record_emitted(self.last_tokens, inp, out, num_out, self.last_counts)
        host_out, done = None, None
        if self.tp.rank == 0:
            packed = pack_outputs(out, num_out, inp.lengths)
            host_out = packed.to("cpu", non_blocking=True)
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        if self.spec is not None:
            self.spec.propose(inp, aux, out, num_out)  # overlaps the host's commit work
            if self.world is not None:
                self.world.agree_drafts(self.spec, inp.slots)
                if self.world.check:
                    self.world.check_same("verify lengths", inp.lengths)
        width = out.shape[1]

        def wait():
            if done is not None:
                done.synchronize()
            return None if host_out is None else (host_out.numpy(), inp, width)

        return wait

    def forward(self, input_ids: torch.Tensor, md, num_tokens: int):
        """Target forward over a ragged stream: CUDA-graph replay when a bucket fits (decode
        and verify graphs, then prefill graphs)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                t = graphs.bucket_for(num_tokens, md.num_reqs, md.max_query_len)
                if t is not None:
                    return graphs.run_raw(input_ids, md, num_tokens, t)
        return self.eager_forward(input_ids, md)

    def eager_forward(self, input_ids: torch.Tensor, md, aux: bool = True):
        """The target forward over `md`'s ragged stream, without graph replay (also what every
        CUDA graph captures). Returns (hidden, aux hidden states for the drafter; None
        without `aux`)."""
        with forward_context(ForwardContext(md, self.backend, self.kv_caches)):
            return self.model(input_ids, md.positions, self.aux_layer_ids if aux else ())

    # -- tensor parallel ---------------------------------------------------------------------
    def profile_cost(self, max_tokens=None, context_len=256, repeats=5, warmup=2):
        """Profile the cost table (`dspark profile`); with tensor parallelism every rank runs
        the same forwards and rank 0's timings are returned."""
        from dspark.spec.profiler import profile_cost_model

        if self.world is not None and self.tp.rank == 0:
            with self.world.step_guard():
                self.world.send_profile(max_tokens, context_len, repeats, warmup)
                return profile_cost_model(self, max_tokens, context_len, repeats, warmup)
        return profile_cost_model(self, max_tokens, context_len, repeats, warmup)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (rank 0; idempotent, also run at exit)."""
        if self._finalizer is not None:
            self._finalizer()

    def release_memory(self) -> None:
        """Drop the weights, KV caches and CUDA graphs (their memory pools) and return the
        memory to the device, so that another engine can start in this process. The runner
        cannot run steps afterwards (`released`)."""
        self.shutdown()
        self.released = True
        self.graphs = self.prefill_graphs = self.step_graphs = None
        if self.spec is not None:
            self.spec.draft_graphs = None
            self.spec.kv_caches = []
        self.spec = self.model = None
        self.k_cache = self.v_cache = None
        self.kv_caches = []
        gc.unfreeze()  # the engine froze what existed at start-up (llm_engine.py)
        gc.collect()  # graphs and modules sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @staticmethod
    def _unpack(host: np.ndarray, num_reqs: int, bucket: int, width: int, rows,
                num_tokens: int) -> StepResult:  # fmt: skip
        out, num_out, lengths = unpack_outputs(host, num_reqs, bucket, width)
        emitted = [out[i, : num_out[i]].tolist() for i in range(num_reqs)]
        drafted = [row.num_draft_slots for row in rows]
        return StepResult(emitted, lengths.tolist(), drafted, num_tokens)

