"""SpecDecoder: the speculative half of a step (DSpark drafter + adaptive verification).

Per-request device buffers, indexed by the request's persistent slot, carry one round's
drafts to the next step: draft tokens [S, K], draft distributions [S, K, V] (probabilistic
drafts), the conditional confidences used for allocation [S, K] and the online estimator's
features [S, K]. Confidences are also copied to a host buffer asynchronously: the planner's
budget uses that stale copy (non-anticipating), the allocation uses the live device values.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from dspark.config import EngineConfig
from dspark.engine.input_batch import StepInputs, finalize
from dspark.models.config import ModelConfig
from dspark.models.dspark_drafter import DrafterConfig, DSparkDrafter, check_compatible
from dspark.sampling.sampler import sample_step
from dspark.spec.confidence import confidence_source, draft_confidences
from dspark.spec.cruise import Cruise
from dspark.spec.drafting import DECIDE_MIN_S, PROBE_ROWS, DraftingDecision
from dspark.spec.host_copy import LandedCopies
from dspark.spec.online_cost import fixed_costs_by_mode
from dspark.spec.planner import REUSE_CLEAR_PLANS, REUSE_TRIMMED_PLANS, Planner
from dspark.spec.rates import RateMemo
from dspark.spec.step_planning import RATE_MEMO_PLANS, StepPlanning
from dspark.spec.synthetic import verify_synthetic
from dspark.spec.tracing import STEP_KINDS, Overhead, decoder_metrics, trace_record
from dspark.spec.verify import VerifyInputs, next_anchors, verify, verify_greedy

CONF_PUSH_EVERY = 4  # steps whose plan stood copy their confidences to the host one in this many

logger = logging.getLogger(__name__)


class SpecDecoder(StepPlanning):
    def __init__(
        self, config: EngineConfig, target, target_cfg: ModelConfig, device, dtype, backend
    ):
        sc = config.speculative_config
        self.sc = sc
        self.tensor_parallel_size = config.tensor_parallel_size
        self.k = sc.num_speculative_tokens
        self.device = device
        self.backend = backend
        dcfg = DrafterConfig.from_pretrained(sc.model)
        check_compatible(dcfg, target_cfg, self.k)
        dummy = config.load_format == "dummy"
        self.drafter = DSparkDrafter.from_pretrained(sc.model, target, dtype, device, dummy)
        self.aux_layer_ids = tuple(dcfg.target_layer_ids)
        # one row per request slot, plus a scratch row for whole-step graphs' padding rows
        self.scratch_slot = config.max_num_seqs
        slots = config.max_num_seqs + 1
        self.draft_tokens = torch.zeros(slots, self.k, dtype=torch.int64, device=device)
        self.draft_probs = None
        if sc.draft_sample_method == "probabilistic":
            shape = (slots, self.k, target_cfg.vocab_size)
            self.draft_probs = torch.zeros(shape, dtype=torch.float32, device=device)
        # NaN until a slot's first drafts: unknown (the planner's prior, the decision skips it)
        self.conf = torch.full((slots, self.k), float("nan"), dtype=torch.float32, device=device)
        self.conf_logits = torch.zeros(slots, self.k, dtype=torch.float32, device=device)
        self.trace: list[dict] | None = None  # per-step records while tracing (host syncs!)
        self.features = torch.zeros(slots, self.k, dtype=torch.float32, device=device)
        # the planner reads copies of `conf` that have landed, never waiting for one (and
        # never the newest queued: it holds the drafts the planned step verifies); three
        # buffers: a following step (follow.py) is planned before the step in flight is
        # waited for, when the copy before the newest may still be on its way, and the one
        # before that, which has landed, must not be overwritten yet
        self.host_confs = LandedCopies((slots, self.k), device, depth=3, fill=float("nan"))
        # drafting steps in a row whose copy was skipped (_copy_conf_to_host; 0: the last
        # drafting step queued its copy, which _stale must not read)
        self._conf_skips = 0
        # per slot, the copy generation from which the landed confidences are its current
        # request's (stale_confidences.slot_assigned: a reused slot holds the last request's)
        self._conf_from = np.zeros(slots, dtype=np.int64)
        self._unmarked_slots: set[int] = set()  # (stale_confidences.slot_assigned)
        self.synthetic_rates = None
        if sc.rejection_sample_method == "synthetic":  # benchmarks: known acceptance profile
            rates = torch.tensor(sc.synthetic_acceptance_rates[: self.k], dtype=torch.float32)
            self.synthetic_rates = rates.to(device)
            logger.warning("SYNTHETIC acceptance (benchmark mode, not lossless): rates %s",
                           rates.tolist())  # fmt: skip
        self.use_head, self.estimator, self.sts = confidence_source(sc, dcfg, self.k, device)
        self._policy = sc.adaptive_policy
        self.cost = None
        self._online_cost = False
        self._step_reqs, self._step_other = 0, 0  # of the step planned last
        self.last_stood = False  # ... and whether a cruise or standing plan stood for it
        self._settled = {}  # settled plans standing (step_planning.py)
        self._step_trimmed = False  # ... and whether its plan trimmed
        self._prediction: tuple | None = None  # see take_prediction
        self.cost_status = "not needed by this policy"
        self.planner: Planner | None = None
        if not self.needs_cost_model:
            self.planner = Planner(self._policy, threshold=sc.confidence_threshold)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.last_budget: int | None = None
        # draft skipping (lagged policy): whether this step proposes drafts for the next one
        self.drafting = DraftingDecision(self.k, sc.min_predicted_gain,
                                         sc.draft_skipping and self.tensor_parallel_size == 1,
                                         sc.plain_probes, DECIDE_MIN_S)  # fmt: skip
        # while drafting is off, plain decode steps skip the drafter's context write, and
        # gaps are rebuilt before drafting again (context_gaps.py; not under tensor
        # parallelism: the rebuild runs on rank 0's side only)
        self.skip_idle_write = sc.skip_idle_context_write and self.tensor_parallel_size == 1
        self.gaps_marked = False  # a step skipped the write since a drafting step found none
        self.rebuilt_tokens = 0  # tokens the target ran again to rebuild gaps
        self.draft_enabled = True
        self.probing = False  # a draft probe on a few of the rows while skipping (rows_with_drafts)
        self.draft_graphs = None
        self.overhead = Overhead()  # scheduler overhead: planning (host), allocation
        self._no_drafts = False
        self.step_counts = dict.fromkeys(STEP_KINDS, 0)  # planned steps by kind (/metrics)
        self.last_kind = "plain"  # ... and the last one's
        self._fixed_by_mode = fixed_costs_by_mode()  # online fixed costs: greedy / sampled
        self._pending_periods: list[tuple] = []  # step periods not landed yet (land_periods)
        self._tables_context_ms = 0.0  # the context read the planner's device tables priced
        self.fixed_costs = self._fixed_by_mode[True]  # the mode of the step planned last
        # whole-step graphs (set by the runner) run verify-all steps (graph_steps) and trimmed
        # lagged plans (graph_trims); else a trimmed plan pays the per-phase path's extra cost
        self.graph_steps = self.graph_trims = False
        self.ran_as_graph = False

    def capture_graphs(self, max_reqs: int, max_ctx_len: int, max_blocks: int) -> None:
        from dspark.spec.draft_graph import DraftGraphRunner

        self.draft_graphs = DraftGraphRunner(self, max_reqs, max_ctx_len, max_blocks)
        self.draft_graphs.capture()

    def set_cost_model(self, cost, status: str) -> None:
        """Install the cost model (loaded or profiled) and build the planner."""
        self.cost = cost
        self.cost_status = status
        # not under tensor parallelism: every rank's early-stop table must stay identical
        self._online_cost = (
            self.sc.online_cost_correction
            and self.tensor_parallel_size == 1
            and cost is not None
            and cost.provenance.get("source") == "profiled"
        )
        self._fixed_by_mode = fixed_costs_by_mode()
        self.fixed_costs = self._fixed_by_mode[True]
        self._pending_periods = []  # (priced on the table replaced)
        self._settled = {}  # (a settled plan stands only under the model that settled it)
        self.rate_memo = RateMemo(RATE_MEMO_PLANS)  # (... and an opportunity rate priced by it)
        self.cruise = Cruise()  # (... and a streak of its plans)
        self._untrimmed_left, self._untrimmed_probed = 0, {}  # (step_planning.py)
        self.planner = Planner(
            self._policy,
            cost,
            min_predicted_gain=self.sc.min_predicted_gain,
            threshold=self.sc.confidence_threshold,
            snap_to_graphs=self.sc.snap_budget_to_graphs,
            reuse_clear_plans=REUSE_CLEAR_PLANS,
            reuse_trimmed_plans=REUSE_TRIMMED_PLANS,
        )

    @property
    def needs_max_probs(self) -> bool:  # the online estimator's input; a head makes it dead work
        return self.estimator is not None

    @property
    def needs_cost_model(self) -> bool:
        return self._policy in ("lagged", "early_stop")

    @property
    def eager_trims(self) -> bool:  # trimmed plans take the per-phase path (no trimmed graphs)
        return self.graph_steps and not self.graph_trims

    # -- allocate (device, live confidences) ----------------------------------------------------
    def choose_lengths(self, inp: StepInputs, budget: int | None) -> None:
        self.ran_as_graph = False
        # host-known: no row verifies a draft this step
        self._no_drafts = inp.max_capacity == 0 or budget == 0
        if inp.max_capacity == 0 or self._policy == "fixed":
            finalize(inp, None, None, None)
            return
        num_drafts = inp.max_num_logits - inp.num_samples  # draft slots laid out
        if budget is not None and budget >= num_drafts:
            # the plan trims nothing: verify all, as the fixed policy (no allocation overhead)
            finalize(inp, None, None, None)
            return
        timer = self.overhead.alloc_timer(self.device)
        conf = self.conf[inp.slots]
        caps = inp.capacities * inp.samples.long()
        other = inp.num_tokens - num_drafts - inp.num_reqs  # non-draft tokens beyond one per row
        lengths = self.planner.allocate_device(
            conf, caps, budget=budget, num_other_tokens=other, num_sampling_reqs=inp.num_samples
        )
        if budget is not None:
            # the host knows the exact totals: the forward runs on exactly these tokens
            n_tok = inp.num_tokens - num_drafts + budget
            finalize(inp, lengths, n_tok, inp.num_samples + budget)
        else:
            finalize(inp, lengths, None, None)  # upper bounds; padding at the tail
        self.overhead.add_alloc(timer.stop())

    # -- verify -------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, inp: StepInputs):
        out, num_out = self._verify(logits, inp)
        self._after_verify(inp, out, num_out)
        return out, num_out

    def _verify(self, logits: torch.Tensor, inp: StepInputs):
        slots = inp.slots
        if self._no_drafts and (self.synthetic_rates is None or inp.all_greedy):
            # nothing to verify (drafting skipped, or a zero budget): plain sampling draws the
            # same token as verification of zero drafts, with a fraction of its kernels (also
            # in synthetic mode, whose token after the accepted run is the argmax: at T = 0 a
            # plain step of the benchmark then costs what a no-speculation step costs)
            return sample_step(logits, inp)
        if self.synthetic_rates is not None:
            return verify_synthetic(
                logits, inp.cu_num_logits, self.draft_tokens[slots], self.synthetic_rates,
                inp.seeds, inp.anchor_pos, inp.rounds,
            )  # fmt: skip
        if inp.all_greedy:
            return verify_greedy(logits, inp.cu_num_logits, self.draft_tokens[slots])
        vin = VerifyInputs(
            target_logits=logits,
            cu_num_logits=inp.cu_num_logits,
            draft_token_ids=self.draft_tokens[slots],
            draft_probs=self.draft_probs,  # the whole buffer: rows are picked inside
            draft_rows=slots,
            temperature=inp.temperature,
            top_k=inp.top_k,
            top_p=inp.top_p,
            min_p=inp.min_p,
            seeds=inp.seeds,
            anchor_positions=inp.anchor_pos,
            rounds=inp.rounds,
        )
        return verify(vin, self.sc.rejection_sample_method)

    def _after_verify(self, inp: StepInputs, out: torch.Tensor, num_out: torch.Tensor) -> None:
        slots = inp.slots
        if self.trace is not None:
            self._record(inp, num_out)
        if self.estimator is not None and inp.max_capacity > 0:
            has = inp.samples & (inp.capacities > 0)
            verified = torch.where(has, inp.lengths, 0)
            accepted = torch.where(has, (num_out - 1).clamp(min=0), 0)
            self.estimator.observe(self.features[slots], verified, accepted)
            self.estimator.maybe_refit()

    def start_trace(self) -> None:
        """Record, per step, the confidences and outcomes of every verified block (for
        `dspark calibrate` and the replay simulator). Costs a host sync per step."""
        self.trace = []

    def _record(self, inp: StepInputs, num_out: torch.Tensor) -> None:
        record = trace_record(inp, num_out, self.conf, self.conf_logits)
        if record is not None:
            self.trace.append(record)

    # -- draft --------------------------------------------------------------------------------
    def skips_context_write(self, max_capacity: int, max_query_len: int) -> bool:
        """Whether the step planned last writes no drafter context (context_gaps.py): the
        option is on, drafting is off, and it is a plain decode step (no draft verified, no
        prefill chunk). The runner marks its rows' gaps by the same test."""
        return (self.skip_idle_write and not self.draft_enabled and max_capacity == 0
                and max_query_len == 1)  # fmt: skip

    def propose(self, inp: StepInputs, aux: torch.Tensor, out: torch.Tensor, num_out):
        if not self.skips_context_write(inp.max_capacity, inp.max_query_len):
            self.drafter.write_context(aux, inp.positions, inp.slot_mapping, self.kv_caches,
                                       self.backend)  # fmt: skip
        if not self.draft_enabled:
            return  # context written (or its gap kept): drafting can resume at any step
        # a probe refreshes the survival estimate on a few rows, not the whole batch
        rows = slice(0, PROBE_ROWS) if self.probing else slice(None)
        anchors, anchor_pos = next_anchors(inp.anchor_pos[rows], out[rows], num_out[rows])
        self.draft(anchors, anchor_pos, inp.block_tables[rows], inp.temperature[rows],
                   inp.seeds[rows], inp.rounds[rows] + 1, inp.slots[rows],
                   self.draft_method(inp.all_greedy), inp.max_seq_len + self.k + 1)  # fmt: skip
        self._copy_conf_to_host()

    def draft_method(self, all_greedy: bool) -> str:
        # All rows greedy: probabilistic drafts would be one-hot argmaxes that greedy
        # verification never reads, so skip sampling and the [R,K,V] distributions (a row's
        # temperature is fixed for life: these drafts are never verified by sampling).
        return "greedy" if all_greedy else self.sc.draft_sample_method

    def draft(self, anchors, anchor_pos, block_tables, temperature, seeds, rounds, slots,
              method: str, max_ctx_len: int, use_graphs: bool = True) -> None:
        """Draft the next round of the given rows into the per-request buffers (drafts,
        distributions, confidences). Sync-free; with use_graphs=False it can itself be
        captured (the whole-step graphs)."""
        draft = None
        if use_graphs and self.draft_graphs is not None:
            draft = self.draft_graphs.run(anchors, anchor_pos, block_tables, temperature, seeds,
                                          rounds, method)  # fmt: skip
        if draft is None:
            draft = self.drafter.propose(
                anchors, anchor_pos, block_tables, max_ctx_len, self.kv_caches, self.backend,
                self.k, temperature, seeds, rounds, method, self.needs_max_probs,
            )  # fmt: skip
        self.draft_tokens[slots] = draft.token_ids
        if self.draft_probs is not None and draft.probs is not None:
            self.draft_probs[slots] = draft.probs
        conf, logits, feats = draft_confidences(draft, temperature, self.synthetic_rates,
                                                self.use_head, self.sts, self.estimator)
        if logits is not None:
            self.conf_logits[slots] = logits
        if feats is not None:
            self.features[slots] = feats
        self.conf[slots] = conf

    def rows_with_drafts(self) -> int | float:
        """The step just run left drafts for the next step in its rows below this: all of
        them (inf), a probe's first PROBE_ROWS, or none. (Once per step, not per row: the
        commit loop compares each row's index.)"""
        if not self.draft_enabled:
            return 0
        return PROBE_ROWS if self.probing else math.inf

    def _copy_conf_to_host(self) -> None:
        """Queue the confidences' copy to the host for the lagged policy's later plans (the
        one reader: its budget and drafting decision); a step whose plan stood (a cruise's,
        or a standing plan's: neither reads confidences) skips it, but for one in
        CONF_PUSH_EVERY in a row (the plan that reads them next, a decision or a search,
        reads one at most that many steps older than without skipping). The copy and its
        event took 13-18 µs a step in the H100 host's loop (demo pair, c = 16-128, T = 0 / 1,
        fifty-seventh session, offline --host-timers), ~15% of the gap to fixed K's step
        then, when only cruised steps skipped it."""
        if self._policy != "lagged":
            return
        if self.last_stood and self._conf_skips < CONF_PUSH_EVERY - 1:
            self._conf_skips += 1  # (the newest copy then holds older drafts)
            return
        self._conf_skips = 0
        self.host_confs.push(self.conf)

    # -- observability --------------------------------------------------------------------------
    def metrics(self) -> dict:
        return decoder_metrics(self)
