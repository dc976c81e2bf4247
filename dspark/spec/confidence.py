"""Confidence sources for adaptive verification.

* Sequential Temperature Scaling (STS, paper §3.2.1): the drafter's confidence head emits one
  logit per slot; `c_k = sigmoid(logit_k / T_k)` with per-position temperatures fitted left to
  right so that the *cumulative product* (prefix survival) is calibrated. Per position it is
  order-preserving, so the head's ranking (AUC of each slot's conditional confidence) is kept.
* `OnlineAcceptanceEstimator`: for drafters without a head. Per-position logistic
  `p_k = sigmoid(w * x + b_k)` (one shared slope w >= 0, per-position intercepts) on the
  log-odds of the draft distribution's max probability, refit online from censored outcomes.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dspark.sampling.processors import GREEDY_EPS

# ---------------------------------------------------------------------- metrics


def ece(probs, labels, num_bins: int = 20, mask=None) -> float:
    """Expected calibration error with equal-width bins: sum_b (n_b / n) |mean p - mean y|."""
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
        p, y = p[m], y[m]
    if p.size == 0:
        return 0.0
    b = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    sp = np.bincount(b, weights=p, minlength=num_bins)
    sy = np.bincount(b, weights=y, minlength=num_bins)
    return float(np.abs(sp - sy).sum() / p.size)


def auc(scores, labels, mask=None) -> float:
    """ROC AUC (Mann-Whitney U with average ranks for ties); NaN if one class is absent."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if mask is not None:
        m = np.asarray(mask, dtype=bool).reshape(-1)
        s, y = s[m], y[m]
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    s_sorted = s[order]
    ranks = np.empty(s.size)
    # Average ranks over runs of equal scores.
    starts = np.flatnonzero(np.r_[True, s_sorted[1:] != s_sorted[:-1]])
    ends = np.r_[starts[1:], s.size]
    avg = (starts + ends + 1) / 2.0  # 1-based average rank of each run
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


# ---------------------------------------------------------------------- STS


def apply_sts(logits, temperatures: Sequence[float]):
    """Conditional confidences sigmoid(logit_k / T_k); logits [..., K] (torch or numpy).
    K may be shorter than the temperatures (a shorter K uses the first slots). A tensor of
    temperatures may also hold one row per logits row ([R, K'], e.g. each row's sampling
    mode's)."""
    k = logits.shape[-1]
    width = temperatures.shape[-1] if isinstance(temperatures, torch.Tensor) else len(temperatures)
    if width < k:
        raise ValueError(f"{width} STS temperatures for {k} slots")
    if isinstance(logits, torch.Tensor):
        if isinstance(temperatures, torch.Tensor):  # already on the device (graph capture)
            return torch.sigmoid(logits / temperatures[..., :k].to(logits.dtype))
        t = torch.as_tensor(list(temperatures)[:k], dtype=logits.dtype, device=logits.device)
        return torch.sigmoid(logits / t)
    t = np.asarray(temperatures, dtype=np.float64)[:k]
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64) / t))


def default_sts_grid() -> np.ndarray:
    return np.unique(np.concatenate([np.geomspace(0.125, 8.0, 97), [1.0]]))


def prefix_labels(accepted_prefix_len, verified_len, k: int):
    """Labels y[n, j] = 1 iff drafts 0..j were all accepted, and the mask of observed entries.

    Censoring: prefix j is observed iff slot j was verified (j < verified_len). Entries past
    the verified length are unknown even when an earlier rejection "implies" 0: using those
    would select on the outcome (only rejected blocks would contribute) and bias low.
    """
    acc = np.asarray(accepted_prefix_len, dtype=np.int64).reshape(-1, 1)
    ver = (np.full(acc.shape, k) if verified_len is None
           else np.asarray(verified_len, dtype=np.int64).reshape(-1, 1))
    j = np.arange(k)[None, :]
    return (j < acc), (j < ver)


def fit_sts(logits, accepted_prefix_len, verified_len=None, grid=None,
            num_bins: int = 20) -> list[float]:
    """Fit per-position temperatures left to right (paper §3.2.1).

    logits [N, K] raw head logits; accepted_prefix_len [N] accepted drafts per block;
    verified_len [N] drafts verified per block (None = all K, no censoring). For k = 1..K, with
    T_1..T_{k-1} fixed, choose T_k from `grid` minimising the ECE of prod_{i<=k} sigmoid(l_i/T_i)
    against the observed prefix-accepted indicator. Positions without observations keep T=1.
    """
    x = np.asarray(logits, dtype=np.float64)
    n, k = x.shape
    y, observed = prefix_labels(accepted_prefix_len, verified_len, k)
    grid = default_sts_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    temps: list[float] = []
    prefix = np.ones(n)
    for j in range(k):
        m = observed[:, j]
        best_t = 1.0
        if m.any():
            errs = [ece(prefix[m] / (1.0 + np.exp(-x[m, j] / t)), y[m, j], num_bins)
                    for t in grid]
            # Prefer T closest to 1 among (numerically) equal errors.
            errs = np.asarray(errs)
            near = np.flatnonzero(errs <= errs.min() + 1e-12)
            best_t = float(grid[near[np.argmin(np.abs(np.log(grid[near])))]])
        temps.append(best_t)
        prefix = prefix / (1.0 + np.exp(-x[:, j] / best_t))
    return temps


# An STS file holds one list of per-position temperatures (`sts_temperatures`), fitted on all
# calibration blocks, and optionally one per sampling mode (`sts_temperatures_by_mode`:
# "greedy" for requests at temperature 0, "sampled" for the others): acceptance differs
# between them (trained pair, position 1: 0.85 greedy, 0.66 sampled), and one fit over both
# is off for each. The engine uses a mode's list where the file has it.
SAMPLING_MODES = ("greedy", "sampled")


def save_sts(path: str | os.PathLike, temperatures: Sequence[float],
             provenance: dict[str, Any] | None = None,
             by_mode: dict[str, Sequence[float]] | None = None) -> None:  # fmt: skip
    prov = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(provenance or {})}
    d: dict[str, Any] = {"sts_temperatures": [float(t) for t in temperatures]}
    if by_mode:
        d["sts_temperatures_by_mode"] = {m: [float(t) for t in ts] for m, ts in by_mode.items()}
    d["provenance"] = prov
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
    os.replace(tmp, path)


def load_sts(path: str | os.PathLike) -> tuple[list[float], dict[str, Any]]:
    """Returns (temperatures, provenance). Also reads SGLang's `temperatures` spelling."""
    temps, _, prov = load_sts_by_mode(path)
    return temps, prov


def load_sts_by_mode(path: str | os.PathLike):
    """(temperatures, {mode: temperatures} for the modes the file fits apart, provenance)."""
    with open(path) as f:
        d = json.load(f)

    def positive(temps, name: str) -> list[float]:
        if not temps or any(not (float(t) > 0) for t in temps):
            raise ValueError(f"{path}: no positive `{name}` list")
        return [float(t) for t in temps]

    temps = positive(d.get("sts_temperatures", d.get("temperatures")), "sts_temperatures")
    by_mode = d.get("sts_temperatures_by_mode") or {}
    if not isinstance(by_mode, dict) or set(by_mode) - set(SAMPLING_MODES):
        raise ValueError(f"{path}: `sts_temperatures_by_mode` keys must be among "
                         f"{list(SAMPLING_MODES)}")  # fmt: skip
    modes = {m: positive(ts, f"sts_temperatures_by_mode.{m}") for m, ts in by_mode.items()}
    return temps, modes, dict(d.get("provenance", {}))


# ---------------------------------------------------------------------- online estimator

_STAT_NAMES = ("n", "g_b", "g_w", "h_bb", "h_bw", "h_ww")


def features_from_draft_probs(draft_max_prob: torch.Tensor, clamp: float = 40.0) -> torch.Tensor:
    """x = log-odds of the draft distribution's max probability, [R, K].

    Non-anticipation: the feature is a function of the draft *distribution* at slot k (known
    before d_k is drawn), never of the drawn token, so conditioning verification on it does not
    select on the proposal. Probabilities are clamped to float eps before the log-odds.
    """
    p = draft_max_prob.to(torch.float32)
    eps = torch.finfo(torch.float32).eps
    p = p.clamp(eps, 1.0 - eps)
    return (torch.log(p) - torch.log1p(-p)).clamp(-clamp, clamp)


def features_from_draft_logits(draft_logits: torch.Tensor, clamp: float = 40.0) -> torch.Tensor:
    """Same feature from logits [R, K, V], computed in log space: max - logsumexp(others)."""
    lg = draft_logits.float()
    top, idx = lg.max(dim=-1, keepdim=True)
    others = lg.scatter(-1, idx, float("-inf")).logsumexp(dim=-1)
    return (top.squeeze(-1) - others).clamp(-clamp, clamp)


class OnlineAcceptanceEstimator:
    """Per-position logistic acceptance model refit from censored verification outcomes.

    predict/observe run on the device without host syncs; only `refit` (every `every` steps)
    copies the [6, K] sufficient statistics to the host and takes one damped Newton step on
    that window's log-likelihood (statistics are reset after each refit, so the model tracks
    workload drift). Cold start w=0.5, b=-0.2: survival is then a running product of sigmoids
    and an unfitted estimator degrades to uniform-depth truncation.
    """

    def __init__(self, num_positions: int, device=None, slope: float = 0.5,
                 intercept: float = -0.2, ridge: float = 1e-3, damping_obs: float = 50.0,
                 max_step: float = 4.0) -> None:
        self.num_positions = k = int(num_positions)
        self.device = torch.device(device or "cpu")
        self._stat_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.w = torch.tensor(float(slope), device=self.device)
        self.b = torch.full((k,), float(intercept), device=self.device)
        self.ridge, self.damping_obs, self.max_step = ridge, damping_obs, max_step
        self.stats = torch.zeros(len(_STAT_NAMES), k, dtype=self._stat_dtype, device=self.device)
        self.num_observe_calls = 0  # host counter: no sync
        self._last_refit = 0
        self.num_refits = 0

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Conditional acceptance probabilities [R, K'] (K' <= K) for features x [R, K']."""
        return torch.sigmoid(self.w * x + self.b[: x.shape[-1]])

    def observe(self, x: torch.Tensor, num_verified: torch.Tensor,
                num_accepted: torch.Tensor) -> None:
        """Accumulate one step's outcomes. x [R, K'] features of the drafts; num_verified [R]
        drafts actually verified; num_accepted [R] accepted among them (<= num_verified).

        Slot k is observed iff k < verified and k <= accepted (it was verified and reached);
        its label is 1 iff k < accepted. Trimmed slots and slots after the first rejection are
        never counted (censoring).
        """
        r, k = x.shape
        pos = torch.arange(k, device=x.device)
        ver = num_verified.to(x.device).reshape(-1, 1)
        acc = num_accepted.to(x.device).reshape(-1, 1)
        obs = ((pos < ver) & (pos <= acc)).to(self._stat_dtype)
        y = (pos < acc).to(self._stat_dtype)
        xd = x.to(self._stat_dtype)
        p = self.predict(x).to(self._stat_dtype)
        resid = (y - p) * obs
        wgt = p * (1 - p) * obs
        step = torch.stack([obs, resid, resid * xd, wgt, wgt * xd, wgt * xd * xd]).sum(dim=1)
        self.stats[:, :k] += step
        self.num_observe_calls += 1

    def maybe_refit(self, every: int = 100) -> bool:
        """Refit when `every` observe calls have happened since the last refit."""
        if self.num_observe_calls - self._last_refit < every:
            return False
        self.refit()
        return True

    def refit(self) -> None:
        """One damped Newton step (host, float64) on the accumulated window, then reset."""
        self._last_refit = self.num_observe_calls
        # The only host sync of the estimator; copy: on CPU .numpy() shares the buffer.
        s = self.stats.double().cpu().numpy().copy()
        self.stats.zero_()
        n, g_b, g_w, h_bb, h_bw, h_ww = s
        if n.sum() <= 0:
            return
        k = self.num_positions
        w0 = float(self.w.cpu())
        b0 = self.b.double().cpu().numpy()
        lam = self.ridge
        # Parameters theta = (w, b_0..b_{K-1}); Hessian of the negative log-likelihood.
        h = np.zeros((k + 1, k + 1))
        h[0, 0] = h_ww.sum() + lam
        h[0, 1:] = h[1:, 0] = h_bw
        h[1:, 1:] = np.diag(h_bb + lam)
        g = np.concatenate([[g_w.sum() - lam * w0], g_b - lam * b0])
        try:
            delta = np.linalg.solve(h, g)
        except np.linalg.LinAlgError:
            return
        if not np.all(np.isfinite(delta)):
            return
        delta = np.clip(delta, -self.max_step, self.max_step)
        delta[0] *= n.sum() / (n.sum() + self.damping_obs)
        delta[1:] *= n / (n + self.damping_obs)
        w_new = max(0.0, w0 + float(delta[0]))
        self.w.fill_(w_new)
        self.b.copy_(torch.as_tensor(b0 + delta[1:], dtype=self.b.dtype))
        self.num_refits += 1

    def coefficients(self) -> tuple[float, list[float]]:
        """(slope, intercepts) on the host; syncs, for logs and metrics only."""
        return float(self.w.cpu()), self.b.cpu().tolist()


def draft_confidences(draft, temperature, synthetic_rates, use_head: bool, sts, estimator):
    """(conf [R, K] float32, head logits or None, estimator features or None) of a round of
    drafts: the allocation's conditional acceptance probabilities."""
    if synthetic_rates is not None:  # the scheduler sees the true conditional probabilities
        return synthetic_rates.expand(temperature.shape[0], -1).float(), None, None
    if use_head:
        logits = draft.conf_logits.float()
        if sts is None:
            return torch.sigmoid(logits), logits, None
        # each row's sampling mode's temperatures (row 0: greedy, row 1: sampled)
        return apply_sts(logits, sts[(temperature > GREEDY_EPS).long()]).float(), logits, None
    feats = features_from_draft_probs(draft.max_probs)
    return estimator.predict(feats).float(), None, feats


def confidence_source(sc, drafter_cfg, k: int, device):
    """(use the drafter's head?, online estimator or None, STS temperatures [2, K] per sampling
    mode (greedy, sampled) or None) for a speculative config (`confidence_source`,
    `confidence_calibration_path`)."""
    has_head = drafter_cfg.enable_confidence_head
    if sc.confidence_source == "head" and not has_head:
        raise ValueError(
            "speculative_config.confidence_source is 'head' but the drafter has no "
            "confidence head; use 'auto' or 'online'"
        )
    use_head = has_head and sc.confidence_source in ("auto", "head")
    estimator = None if use_head else OnlineAcceptanceEstimator(k, device)
    sts = None
    if sc.confidence_calibration_path:
        temps, by_mode, _ = load_sts_by_mode(sc.confidence_calibration_path)
        rows = [by_mode.get(m, temps) for m in SAMPLING_MODES]
        if min(len(r) for r in rows) < k:
            raise ValueError(
                f"calibration file has {min(len(r) for r in rows)} temperatures, need {k} "
                "(speculative_config.confidence_calibration_path)"
            )
        # [2, K] (row 0 greedy, row 1 sampled), a device tensor: drafting runs inside CUDA
        # graphs (no host->device copy there)
        sts = torch.tensor([r[:k] for r in rows], dtype=torch.float32, device=device)
    return use_head, estimator, sts
