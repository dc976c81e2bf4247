"""Trace-replay simulator for adaptive-verification policies (CPU, no model, no GPU).

A trace is a list of engine steps; each step records, per decoding request, the drafter's
conditional confidences [R, K] and the realised outcome: how many drafts would have been
accepted had the whole block been verified (optionally the per-slot accept bits). Replaying a
policy gives per-step verify lengths l_r; standard rejection sampling with a shorter block
accepts min(l_r, accept_len_r) drafts and emits one more token (correction or bonus), and the
step costs `cost.step_time_ms(R + other + sum l, R)`.

Traces are JSONL (one step per line); `synthetic_trace` makes calibrated random ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.spec.cost_model import CostModel
from dspark.spec.planner import Planner
from dspark.spec.rates import decode_rate, mean_survival


@dataclass
class TraceStep:
    conf: np.ndarray  # [R, K] conditional confidences
    accept_len: np.ndarray | None = None  # [R] drafts accepted if all were verified
    capacities: np.ndarray | None = None  # [R] drafts per request (default K)
    accept_bits: np.ndarray | None = None  # [R, K] per-slot accept bits (optional)
    request_ids: np.ndarray | None = None  # [R] ids, align stale confidences across steps
    num_other_tokens: int = 0  # prefill tokens in the same forward
    num_sampling_reqs: int | None = None  # default R

    def __post_init__(self) -> None:
        self.conf = np.asarray(self.conf, dtype=np.float64)
        if self.conf.ndim != 2:
            raise ValueError(f"conf must be [R, K], got shape {self.conf.shape}")
        num_reqs, k = self.conf.shape
        if self.accept_bits is not None:
            self.accept_bits = np.asarray(self.accept_bits, dtype=bool).reshape(num_reqs, k)
            if self.accept_len is None:
                self.accept_len = np.cumprod(self.accept_bits, axis=1).sum(axis=1)
        if self.accept_len is None:
            raise ValueError("a trace step needs accept_len or accept_bits")
        self.accept_len = np.asarray(self.accept_len, dtype=np.int64).reshape(num_reqs)
        caps = np.full(num_reqs, k) if self.capacities is None else self.capacities
        self.capacities = np.minimum(np.asarray(caps, dtype=np.int64).reshape(num_reqs), k)
        if self.request_ids is not None:
            self.request_ids = np.asarray(self.request_ids, dtype=np.int64).reshape(num_reqs)
        if self.num_sampling_reqs is None:
            self.num_sampling_reqs = num_reqs

    def to_dict(self) -> dict:
        d = {"conf": self.conf.tolist(), "accept_len": self.accept_len.tolist(),
             "capacities": self.capacities.tolist(),
             "num_other_tokens": int(self.num_other_tokens),
             "num_sampling_reqs": int(self.num_sampling_reqs)}
        if self.accept_bits is not None:
            d["accept_bits"] = self.accept_bits.astype(int).tolist()
        if self.request_ids is not None:
            d["request_ids"] = self.request_ids.tolist()
        return d


@dataclass
class SimResult:
    policy: str
    num_steps: int
    total_time_ms: float
    emitted_tokens: int  # accepted drafts + one correction/bonus per sampling request
    drafted: int  # sum of capacities
    verified: int  # sum of l_r
    accepted_drafts: int
    predicted_tokens: float  # expected emitted tokens under the (current) confidences
    step_verified: np.ndarray = field(repr=False)  # [S]
    step_emitted: np.ndarray = field(repr=False)  # [S]
    step_time_ms: np.ndarray = field(repr=False)  # [S]
    num_req_steps: int = 0  # sum over steps of R

    @property
    def throughput(self) -> float:
        """Realised tokens per ms."""
        return self.emitted_tokens / self.total_time_ms

    @property
    def predicted_throughput(self) -> float:
        """Expected tokens per ms under the confidences (what the planner believes)."""
        return self.predicted_tokens / self.total_time_ms

    @property
    def mean_verified_per_req(self) -> float:
        return self.verified / max(self.num_req_steps, 1)

    @property
    def mean_accepted_per_req(self) -> float:
        return self.accepted_drafts / max(self.num_req_steps, 1)

    @property
    def trim_fraction(self) -> float:
        return 1.0 - self.verified / max(self.drafted, 1)

    def summary(self) -> dict:
        return {"policy": self.policy, "tokens_per_s": 1e3 * self.throughput,
                "predicted_tokens_per_s": 1e3 * self.predicted_throughput,
                "mean_verified_per_req": self.mean_verified_per_req,
                "mean_accepted_per_req": self.mean_accepted_per_req,
                "trim_fraction": self.trim_fraction, "num_steps": self.num_steps}


def _stale_conf(old: TraceStep | None, cur: TraceStep) -> np.ndarray | None:
    """Old confidences aligned to the current rows (by request id when both have ids, else by
    row); rows without history are NaN, which the planner replaces by its prior."""
    if old is None:
        return None
    if old.request_ids is None or cur.request_ids is None:
        return old.conf
    k = max(old.conf.shape[1], cur.conf.shape[1])
    out = np.full((cur.conf.shape[0], k), np.nan)
    row_of = {int(rid): i for i, rid in enumerate(old.request_ids)}
    for i, rid in enumerate(cur.request_ids):
        j = row_of.get(int(rid))
        if j is not None:
            out[i, : old.conf.shape[1]] = old.conf[j]
    return out


def simulate(trace: Sequence[TraceStep], policy: str | Planner, cost: CostModel, *,
             lag: int = 2, min_predicted_gain: float = 0.04, threshold: float = 0.5,
             prior_conf: float = 1.0, snap_to_graphs: bool = True) -> SimResult:
    """Replay `policy` over `trace`. The lagged policy plans its budget from the confidences
    of `lag` steps earlier (prior before that); the others use the current confidences."""
    planner = policy if isinstance(policy, Planner) else Planner(
        policy, cost, min_predicted_gain=min_predicted_gain, threshold=threshold,
        prior_conf=prior_conf, snap_to_graphs=snap_to_graphs)
    n = len(trace)
    verified_s, emitted_s, time_s = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n)
    drafted = accepted_total = num_req_steps = 0
    predicted = 0.0
    for t, step in enumerate(trace):
        num_reqs = step.conf.shape[0]
        if planner.policy == "lagged":
            old = trace[t - lag] if t - lag >= 0 else None
            stale = _stale_conf(old, step)
            rate = None  # with prefill tokens, drafts are valued at the decoding rate (engine)
            if step.num_other_tokens > 0:
                rate = decode_rate(cost, mean_survival(stale, prior_conf),
                                   step.num_sampling_reqs, None)  # fmt: skip
            planner.plan_cpu(stale, step.capacities, step.num_other_tokens,
                             step.num_sampling_reqs, opportunity_rate=rate)
        lengths = planner.allocate_device(
            torch.as_tensor(step.conf), torch.as_tensor(step.capacities),
            num_other_tokens=step.num_other_tokens,
            num_sampling_reqs=step.num_sampling_reqs).numpy()
        accepted = np.minimum(lengths, step.accept_len)
        surv = np.cumprod(np.clip(step.conf, 0.0, 1.0), axis=1)
        in_plan = np.arange(surv.shape[1])[None, :] < lengths[:, None]
        verified_s[t] = lengths.sum()
        emitted_s[t] = accepted.sum() + step.num_sampling_reqs
        time_s[t] = cost.step_time_ms(num_reqs + step.num_other_tokens + lengths.sum(),
                                      num_reqs)
        predicted += step.num_sampling_reqs + float(surv[in_plan].sum())
        drafted += int(step.capacities.sum())
        accepted_total += int(accepted.sum())
        num_req_steps += num_reqs
    return SimResult(
        policy=planner.policy, num_steps=n, total_time_ms=float(time_s.sum()),
        emitted_tokens=int(emitted_s.sum()), drafted=drafted, verified=int(verified_s.sum()),
        accepted_drafts=accepted_total, predicted_tokens=predicted, step_verified=verified_s,
        step_emitted=emitted_s, step_time_ms=time_s, num_req_steps=num_req_steps)


def save_trace(path: str | os.PathLike, trace: Sequence[TraceStep]) -> None:
    with open(path, "w") as f:
        for step in trace:
            f.write(json.dumps(step.to_dict()) + "\n")


def load_trace(path: str | os.PathLike) -> list[TraceStep]:
    steps = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                d = json.loads(line)
                if "conf" in d:  # other lines (e.g. a {"meta": ...} header) are skipped
                    steps.append(TraceStep(**d))
    return steps


def synthetic_trace(num_steps: int, num_reqs: int, num_positions: int,
                    per_position_rates: Sequence[float] | float, seed: int = 0, *,
                    request_spread: float = 1.0, step_noise: float = 0.3,
                    churn: float = 0.0) -> list[TraceStep]:
    """Calibrated random trace. Slot k of request r accepts (given the earlier slots did) with
    q = sigmoid(logit(rate_k) + u_r + eps), u_r ~ N(0, request_spread) persistent per request
    (so stale confidences carry information), eps ~ N(0, step_noise) fresh per step; the
    recorded confidence is q itself. With `churn`, each request is replaced by a new one
    (new id, new u_r) with that probability per step."""
    rng = np.random.default_rng(seed)
    rates = np.broadcast_to(np.asarray(per_position_rates, dtype=np.float64), (num_positions,))
    base = np.log(rates) - np.log1p(-rates)
    ids = np.arange(num_reqs)
    u = rng.normal(0.0, request_spread, num_reqs)
    next_id = num_reqs
    trace = []
    for _ in range(num_steps):
        if churn > 0:
            new = rng.random(num_reqs) < churn
            ids = ids.copy()
            ids[new] = next_id + np.arange(new.sum())
            next_id += int(new.sum())
            u = np.where(new, rng.normal(0.0, request_spread, num_reqs), u)
        z = base[None, :] + u[:, None] + rng.normal(0.0, step_noise, (num_reqs, num_positions))
        q = 1.0 / (1.0 + np.exp(-z))
        bits = rng.random(q.shape) < q
        trace.append(TraceStep(conf=q, accept_bits=bits, request_ids=ids.copy()))
    return trace
