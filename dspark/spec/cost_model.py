"""Step-time cost model for adaptive verification.

    step_time_ms(num_tokens, num_reqs) = fixed_overhead_ms          (scheduler, sampler, launch)
                                       + draft_cost(num_reqs)       (drafter: not trimmable)
                                       + verify_cost(num_tokens)    (target forward)

The drafter has two tables over the same request counts: sampled drafts (the [R, K, V]
distributions and a sample per slot) and greedy drafts (argmax only: every request at
temperature 0), about half the cost at 8B scale; `use_greedy_drafts` picks the one the next
steps pay (a table without greedy times uses the sampled one).

`num_tokens` is the total token count of the target forward (anchors + verified drafts +
prefill tokens); `num_reqs` the number of decoding requests. Both costs are tables of measured
points (medians), interpolated piecewise-linearly, held flat below the first point, and
extrapolated linearly past the last one. Tables are made monotone non-decreasing (running max)
when built: timing noise and tile-size dips must never make more tokens look cheaper.

With `graph_sizes` (captured CUDA-graph token buckets) the verify cost inside the captured range
is a staircase: a token count pays for the bucket it rounds up to (a 121-token batch replays the
128 graph). Past the largest bucket the step runs eagerly and the measured points apply.

The planner maximises a *ratio* (expected tokens / step time), so the non-trimmable terms
matter: leaving them out makes every draft token look expensive and over-trims. A flat table
(more tokens cost nothing) silently disables trimming; `describe_problem()` says so, and callers
must surface it loudly.

Context. Every row of a step reads its whole context's K and V in every layer, so a step's time
grows with the sum of its rows' contexts, which the token table cannot see: it was profiled on
rows of one context (`profile_context_len`, `verify_reqs` rows at each point). A table that
knows that slope (`context_ms_per_token`, measured by the profiler) prices a step at its own
context: the table's point less the context it was measured with, plus the step's
(`set_step_context`: the sum of its rows' contexts before the step; the query tokens' own keys
are in both and cancel):

    verify(n | C) = table(n) - slope * profile_context_len * verify_reqs(n)   (zero context)
                  + slope * C                                                  (per step)

The first line is a table over n (cached, like the rest); the second is added with the fixed
term. Without it the H200's 8B-shaped profile (256-token rows) understated plain steps of 256
rows over ~640 tokens by ~3.5 ms and overstated 64-row verify steps by ~0.9 ms, errors the
online fixed terms then carried per batch-size bucket, with opposite signs per kind of step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.spec import cost_table_io

_MIN_STEP_MS = 1e-6


def _interp(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """Piecewise-linear; flat below xp[0]; linear extrapolation (last slope) past xp[-1]."""
    if xp.size == 0:
        return np.zeros_like(x, dtype=np.float64)
    y = np.interp(x, xp, fp)
    if xp.size >= 2:
        slope = (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
        y = np.where(x > xp[-1], fp[-1] + slope * (x - xp[-1]), y)
    return y


@dataclass
class CostModel:
    """Monotone step-time model; see the module docstring. Times in milliseconds."""

    verify_tokens: np.ndarray  # [P] int-valued token counts, increasing
    verify_ms: np.ndarray  # [P] target-forward time at those counts
    draft_reqs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [Q] request counts
    draft_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [Q] drafter time
    draft_greedy_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [Q] or [0]
    fixed_overhead_ms: float = 0.0
    graph_sizes: tuple[int, ...] | None = None  # captured token buckets (sorted)
    provenance: dict[str, Any] = field(default_factory=dict)
    # context pricing (module docstring); all three known, or the table's context is assumed
    verify_reqs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [P] rows profiled
    context_ms_per_token: float = 0.0  # every layer's K and V of one context token, read
    profile_context_len: float = 0.0  # the context of every profiled row
    step_context_ms: float = field(default=0.0, init=False, compare=False)  # slope * C
    _context_slope: float = field(default=0.0, init=False, repr=False, compare=False)  # or 0
    # the verify table at zero context (_price_context; verify_ms where context is not priced)
    _verify_priced: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False,
                                       repr=False, compare=False)  # fmt: skip
    # host lookup tables of the per-step planner (dense over integer token counts)
    _verify_dense: np.ndarray = field(default_factory=lambda: np.zeros(0), init=False,
                                      repr=False, compare=False)  # fmt: skip
    _draft_by_reqs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _decode_by_reqs: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    greedy_drafts: bool = field(default=False, init=False, compare=False)

    def __post_init__(self) -> None:
        # optional companions of a table's points, in the points' sorted order
        io = cost_table_io
        self.verify_reqs = io.companion(self.verify_tokens, self.verify_reqs, "verify table",
                                        "token counts", "request counts")  # fmt: skip
        self.verify_tokens, self.verify_ms = io.monotone_table(
            self.verify_tokens, self.verify_ms, "verify table")
        self.draft_greedy_ms = io.companion(self.draft_reqs, self.draft_greedy_ms, "draft table",
                                            "request counts", "greedy times")  # fmt: skip
        self.draft_reqs, self.draft_ms = io.monotone_table(
            self.draft_reqs, self.draft_ms, "draft table")
        self._price_context()
        self.fixed_overhead_ms = float(self.fixed_overhead_ms)
        if not np.isfinite(self.fixed_overhead_ms) or self.fixed_overhead_ms < 0:
            raise ValueError("fixed_overhead_ms must be finite and >= 0")
        if self.graph_sizes is not None:
            sizes = sorted({int(g) for g in self.graph_sizes})
            if not sizes or sizes[0] < 1:
                raise ValueError("graph_sizes must be positive token counts")
            self.graph_sizes = tuple(sizes)
        self.provenance = dict(self.provenance or {})

    def _price_context(self) -> None:
        """Validate the context fields; build the zero-context verify table (monotone, >= 0)."""
        self.context_ms_per_token = float(self.context_ms_per_token)
        self.profile_context_len = float(self.profile_context_len)
        for name in ("context_ms_per_token", "profile_context_len"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be finite and >= 0")
        self._verify_priced = self.verify_ms
        self._context_slope = self.context_ms_per_token if self.prices_context else 0.0
        if self.prices_context:
            credit = self.context_ms_per_token * self.profile_context_len * self.verify_reqs
            self._verify_priced = np.maximum.accumulate(np.maximum(self.verify_ms - credit, 0.0))

    @property
    def prices_context(self) -> bool:
        """Whether steps are priced at their own context (set_step_context) rather than at
        the profiled one."""
        return (self.context_ms_per_token > 0 and self.profile_context_len > 0
                and self.verify_reqs.size == self.verify_tokens.size > 0)

    def set_step_context(self, context_tokens: float) -> None:
        """The step being priced: the sum of its rows' contexts before it (tokens). Every step
        price from now on includes its read (0 where the table does not price context)."""
        self.step_context_ms = self._context_slope * context_tokens  # (every plan: no property)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_measurements(
        cls,
        token_counts: Sequence[int],
        times_ms: Sequence[float],
        draft_reqs: Sequence[int] | None = None,
        draft_times_ms: Sequence[float] | None = None,
        fixed_ms: float = 0.0,
        provenance: dict[str, Any] | None = None,
        graph_sizes: Sequence[int] | None = None,
        draft_greedy_times_ms: Sequence[float] | None = None,
        verify_reqs: Sequence[int] | None = None,
        context_ms_per_token: float = 0.0,
        profile_context_len: float = 0.0,
    ) -> CostModel:
        """Build from profiled medians (verify times per token count, draft times per R;
        `verify_reqs`: the rows of each verify point's batch, for context pricing)."""
        return cls(
            verify_tokens=np.asarray(token_counts),
            verify_ms=np.asarray(times_ms),
            draft_reqs=np.asarray(draft_reqs if draft_reqs is not None else []),
            draft_ms=np.asarray(draft_times_ms if draft_times_ms is not None else []),
            draft_greedy_ms=np.asarray(draft_greedy_times_ms or []),
            fixed_overhead_ms=fixed_ms,
            graph_sizes=tuple(graph_sizes) if graph_sizes is not None else None,
            provenance=provenance or {},
            verify_reqs=np.asarray(verify_reqs if verify_reqs is not None else []),
            context_ms_per_token=context_ms_per_token, profile_context_len=profile_context_len,
        )

    @classmethod
    def analytic(
        cls,
        weight_read_ms: float = 4.0,
        ms_per_token: float = 0.01,
        fixed_overhead_ms: float = 1.0,
        draft_base_ms: float = 0.5,
        draft_ms_per_req: float = 0.005,
        max_tokens: int = 8192,
        max_reqs: int = 512,
        graph_sizes: Sequence[int] | None = None,
    ) -> CostModel:
        """Roofline-like model for tests and CPU runs.

        verify(n) = max(weight_read_ms, n * ms_per_token): memory-bound (weights read once per
        step) until the compute term takes over; draft(R) = draft_base_ms + R * draft_ms_per_req.
        """
        knee = weight_read_ms / ms_per_token if ms_per_token > 0 else float(max_tokens)
        grid = np.geomspace(1, max_tokens, 48)
        pts = np.unique(np.concatenate([
            np.rint(grid), [1, max_tokens],
            np.clip([np.floor(knee), np.ceil(knee)], 1, max_tokens)]).astype(np.int64))
        verify = np.maximum(weight_read_ms, pts * ms_per_token)
        reqs = np.array([1, max(2, max_reqs)])
        return cls(
            verify_tokens=pts, verify_ms=verify, draft_reqs=reqs,
            draft_ms=draft_base_ms + reqs * draft_ms_per_req,
            fixed_overhead_ms=fixed_overhead_ms,
            graph_sizes=tuple(graph_sizes) if graph_sizes is not None else None,
            provenance={"source": "analytic", "weight_read_ms": weight_read_ms,
                        "ms_per_token": ms_per_token},
        )

    # ------------------------------------------------------------------ evaluation
    def graph_bucket(self, num_tokens):
        """Captured bucket each token count rounds up to; -1 where past the captured range."""
        n = np.asarray(num_tokens)
        if not self.graph_sizes:
            return np.full(n.shape, -1, dtype=np.int64)
        sizes = np.asarray(self.graph_sizes, dtype=np.int64)
        idx = np.searchsorted(sizes, n, side="left")
        return np.where(idx < sizes.size, sizes[np.minimum(idx, sizes.size - 1)], -1)

    def verify_cost_ms(self, num_tokens) -> np.ndarray:
        n = np.asarray(num_tokens, dtype=np.float64)
        if self.graph_sizes:
            bucket = self.graph_bucket(np.ceil(n).astype(np.int64))
            n = np.where(bucket >= 0, bucket, n)
        return _interp(n, self.verify_tokens, self._verify_priced)  # (at zero context)

    def draft_cost_ms(self, num_reqs) -> np.ndarray:
        greedy = self.greedy_drafts and self.draft_greedy_ms.size
        table = self.draft_greedy_ms if greedy else self.draft_ms
        return _interp(np.asarray(num_reqs, dtype=np.float64), self.draft_reqs, table)

    def use_greedy_drafts(self, greedy: bool) -> bool:
        """Price the drafter as greedy (every request at temperature 0) or sampled from now
        on. Returns True when the prices changed (device tables built from them are stale)."""
        greedy = bool(greedy)
        if greedy == self.greedy_drafts:
            return False
        self.greedy_drafts = greedy
        self._draft_by_reqs.clear()
        self._decode_by_reqs.clear()
        return bool(self.draft_greedy_ms.size)

    def step_time_ms(self, num_tokens, num_reqs) -> np.ndarray:
        """Vectorized over numpy arrays (broadcast); returns float64 ms, always > 0."""
        t = self.fixed_overhead_ms + self.step_context_ms + (self.draft_cost_ms(num_reqs)
                                                             + self.verify_cost_ms(num_tokens))
        return np.maximum(t, _MIN_STEP_MS)

    def step_time_lookup(self, num_tokens: np.ndarray, num_reqs: int) -> np.ndarray:
        """`step_time_ms` for integer token counts and one request count, bit for bit, from
        dense tables built once (the planner calls this every step; interpolating each time
        costs tens of microseconds). The fixed term is added at lookup: it is corrected
        online."""
        return self.add_fixed(self.variable_lookup(num_tokens, num_reqs))

    def variable_lookup(self, num_tokens: np.ndarray, num_reqs: int) -> np.ndarray:
        """The drafter + verify part of `step_time_lookup` (fixed by the table: cacheable)."""
        n = np.asarray(num_tokens, dtype=np.int64)
        verify = self._verify_table(int(n.max()) + 1 if n.size else 1)
        return self.draft_lookup(num_reqs) + verify[n]

    def add_fixed(self, variable_ms):
        """Step times from their variable parts (variable_lookup), the current fixed term and
        the step's context read (a float for a float: the planner's bound asks every step)."""
        if isinstance(variable_ms, float):
            return max(self.fixed_overhead_ms + self.step_context_ms + variable_ms, _MIN_STEP_MS)
        return np.maximum((self.fixed_overhead_ms + self.step_context_ms) + variable_ms,
                          _MIN_STEP_MS)

    def add_fixed_list(self, variable_ms: list[float]) -> list[float]:
        """`add_fixed` over a list of Python floats, element for element the same numbers (the
        planner's search on small batches: small_search.py)."""
        base = self.fixed_overhead_ms + self.step_context_ms
        return [max(base + v, _MIN_STEP_MS) for v in variable_ms]

    def draft_lookup(self, num_reqs: int) -> float:
        """`draft_cost_ms` of one request count, cached."""
        draft = self._draft_by_reqs.get(num_reqs)
        if draft is None:
            if len(self._draft_by_reqs) > 1024:
                self._draft_by_reqs.clear()
            draft = self._draft_by_reqs[num_reqs] = float(self.draft_cost_ms(num_reqs))
        return draft

    def decode_variable(self, num_reqs: int, k: int) -> tuple[float, tuple[float, ...]]:
        """The variable parts of a decode-only step of `num_reqs` requests, cached, as Python
        floats: (the forward of one token per request, (every request verifying l = 1..k
        drafts, the drafter paid) for each l). Add the fixed term (`add_fixed`)."""
        key = (num_reqs, k)
        hit = self._decode_by_reqs.get(key)
        if hit is None:
            if len(self._decode_by_reqs) > 1024:
                self._decode_by_reqs.clear()
            spec = self.variable_lookup(num_reqs * np.arange(2, k + 2), num_reqs)
            hit = self._decode_by_reqs[key] = (self.verify_lookup(num_reqs),
                                               tuple(spec.tolist()))  # fmt: skip
        return hit

    def verify_lookup(self, num_tokens: int) -> float:
        """`verify_cost_ms` of one integer token count, from the same dense table."""
        return float(self._verify_table(num_tokens + 1)[num_tokens])

    def _verify_table(self, need: int) -> np.ndarray:
        """verify_cost_ms over 0..size-1 (size >= need, a power of two >= 1024), cached."""
        if self._verify_dense.size < need:
            size = max(1024, 1 << (need - 1).bit_length())
            self._verify_dense = self.verify_cost_ms(np.arange(size))
        return self._verify_dense

    def as_tensor_table(self, max_tokens: int, num_reqs: int, device=None, dtype=None):
        """Step time per total token count 0..max_tokens for `num_reqs` requests, as a tensor
        (index = tokens). Used by the device-side early-stop policy."""
        import torch

        t = self.step_time_ms(np.arange(int(max_tokens) + 1), int(num_reqs))
        return torch.as_tensor(t, dtype=dtype or torch.float32, device=device)

    # ------------------------------------------------------------------ graph snapping
    def budget_candidates(self, num_fixed_tokens: int, max_budget: int) -> np.ndarray:
        """Draft budgets n in [0, max_budget] worth considering with captured graphs: those
        whose total `num_fixed_tokens + n` fills a bucket exactly, every n past the captured
        range (eager), and `max_budget` itself (verify-all). Without graphs: all n."""
        max_budget = int(max_budget)
        if not self.graph_sizes:
            return np.arange(max_budget + 1)
        # per step: built from the bucket sizes, not by testing every n (planning is hot)
        sizes = np.asarray(self.graph_sizes, dtype=np.int64) - int(num_fixed_tokens)
        inside = sizes[(sizes >= 0) & (sizes <= max_budget)]  # sorted, all below `beyond`
        beyond = np.arange(max(int(sizes[-1]) + 1, 0), max_budget + 1)
        cand = np.concatenate([inside, beyond])
        if cand.size == 0 or cand[-1] != max_budget:
            cand = np.append(cand, max_budget)
        return cand

    def snap_budget(self, num_fixed_tokens: int, budget: int, max_budget: int) -> int:
        """Grow `budget` to fill its graph bucket (the padding is paid for anyway)."""
        budget = int(min(max(budget, 0), max_budget))
        bucket = int(self.graph_bucket(num_fixed_tokens + budget))
        if bucket < 0:
            return budget
        return int(min(max_budget, bucket - num_fixed_tokens))

    # ------------------------------------------------------------------ diagnostics
    def is_flat(self, rel_tol: float = 0.05) -> bool:
        """True when the table says extra tokens cost (almost) nothing: the verify-cost rise
        over the measured range is below `rel_tol` of the smallest step time."""
        if self.verify_tokens.size < 2:
            return True
        rise = float(self.verify_ms[-1] - self.verify_ms[0])
        base = float(self.step_time_ms(self.verify_tokens[0], 1))
        return rise <= rel_tol * base

    def describe_problem(self, rel_tol: float = 0.05) -> str | None:
        """A human-readable warning when this table cannot drive trimming, else None."""
        if self.verify_tokens.size == 0:
            return ("cost model has no verify measurements: adaptive verification cannot "
                    "trim and will verify every draft token")
        if self.verify_tokens.size < 2:
            return ("cost model has a single verify point: every token count costs the same, "
                    "so adaptive verification will never trim (profile more token counts)")
        if self.is_flat(rel_tol):
            rise = float(self.verify_ms[-1] - self.verify_ms[0])
            return (f"cost model is flat: verifying {int(self.verify_tokens[-1])} tokens costs "
                    f"only {rise:.4g} ms more than {int(self.verify_tokens[0])} "
                    f"(< {rel_tol:.0%} of a step), so adaptive verification will almost never "
                    "trim; re-profile over a wider token range if this is unexpected")
        return None

    def provenance_mismatches(self, expected: dict[str, Any]) -> list[str]:
        """Keys of `expected` whose recorded provenance differs (for loading a saved table)."""
        return [f"{k}: table has {self.provenance.get(k)!r}, engine has {v!r}"
                for k, v in expected.items() if k in self.provenance
                and self.provenance[k] != v]

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return cost_table_io.to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**cost_table_io.fields_from_dict(d))

    def to_json(self, path: str | os.PathLike) -> None:
        """Atomic write (temp file + rename)."""
        cost_table_io.write_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> CostModel:
        return cls.from_dict(cost_table_io.read_json(path))
