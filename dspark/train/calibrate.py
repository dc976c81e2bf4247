"""`dspark calibrate`: fit Sequential Temperature Scaling (paper §3.2.1) for a drafter's
confidence head on held-out prompts.

The engine runs with speculation at a fixed K (every drafted token is verified: no trimming,
so no slot is censored except near a request's end) and `SpecDecoder.start_trace()` records,
per verified block, the head's raw logits and how many drafts were verified and accepted.
`fit_sts` then picks per-position temperatures left to right so that the cumulative product
prod_{i<=k} sigmoid(l_i / T_i) matches the observed "prefix of length k accepted" rate.
ECE and AUC of that prefix survival are reported per position before (T = 1) and after.
Calibrating at temperature 0 and above also fits each sampling mode apart (greedy, sampled:
their acceptance differs), written next to the pooled fit; the engine uses each row's mode's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

import numpy as np

from dspark.sampling.processors import GREEDY_EPS
from dspark.spec.confidence import (
    SAMPLING_MODES,
    apply_sts,
    auc,
    ece,
    fit_sts,
    prefix_labels,
    save_sts,
)


def run_trace(llm, prompts: Sequence, temperatures: Sequence[float], max_tokens: int,
              seed: int = 0):
    """Generate every prompt at every temperature with tracing on; returns the stacked
    (conf_logits [n, K], accepted [n], verified [n], greedy [n]) of all verified blocks
    (greedy: the block's sampling temperature was 0)."""
    from dspark import SamplingParams

    spec = llm.engine.runner.spec
    if spec is None or not spec.use_head:
        raise ValueError("calibrate needs speculation with a drafter that has a confidence head")
    spec.start_trace()
    greedy = []  # per trace record
    try:
        for i, temp in enumerate(temperatures):
            params = [SamplingParams(temperature=float(temp), max_tokens=max_tokens,
                                     seed=seed + 1000 * i + j, ignore_eos=True)
                      for j in range(len(prompts))]
            llm.generate(list(prompts), params, use_tqdm=False)
            greedy += [float(temp) <= GREEDY_EPS] * (len(spec.trace) - len(greedy))
        trace = spec.trace
    finally:
        spec.trace = None
    if not trace:
        raise ValueError("no verified draft blocks were recorded (prompts too short?)")
    logits = np.concatenate([r["conf_logits"] for r in trace]).astype(np.float64)
    accepted = np.concatenate([r["accepted"] for r in trace]).astype(np.int64)
    verified = np.concatenate([r["verified"] for r in trace]).astype(np.int64)
    modes = np.concatenate([np.full(len(r["accepted"]), g) for r, g in zip(trace, greedy)])
    return logits, accepted, verified, modes


def calibration_table(logits, accepted, verified, temps: Sequence[float]) -> list[dict]:
    """Per position: observed blocks, empirical prefix acceptance, ECE/AUC before and after."""
    k = logits.shape[1]
    y, observed = prefix_labels(accepted, verified, k)
    before = np.cumprod(1.0 / (1.0 + np.exp(-logits)), axis=1)
    after = np.cumprod(apply_sts(logits, temps), axis=1)
    reached = (np.arange(k)[None, :] <= np.asarray(accepted)[:, None]) & observed
    rows = []
    for j in range(k):
        m = observed[:, j]
        r = reached[:, j]
        rows.append({
            "pos": j + 1, "n": int(m.sum()), "temperature": float(temps[j]),
            "prefix_rate": float(y[m, j].mean()) if m.any() else float("nan"),
            "cond_rate": float(y[r, j].mean()) if r.any() else float("nan"),
            "pred_before": float(before[m, j].mean()) if m.any() else float("nan"),
            "pred_after": float(after[m, j].mean()) if m.any() else float("nan"),
            "ece_before": ece(before[:, j], y[:, j], mask=m),
            "ece_after": ece(after[:, j], y[:, j], mask=m),
            "auc_before": auc(before[:, j], y[:, j], mask=m),
            "auc_after": auc(after[:, j], y[:, j], mask=m),
        })  # fmt: skip
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'pos':>3} {'n':>6} {'T':>6} {'accept':>7} {'pred0':>6} {'pred1':>6} "
            f"{'ECE0':>6} {'ECE1':>6} {'AUC0':>6} {'AUC1':>6}")
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['pos']:>3} {r['n']:>6} {r['temperature']:>6.3f} {r['prefix_rate']:>7.3f} "
            f"{r['pred_before']:>6.3f} {r['pred_after']:>6.3f} {r['ece_before']:>6.3f} "
            f"{r['ece_after']:>6.3f} {r['auc_before']:>6.3f} {r['auc_after']:>6.3f}")
    return "\n".join(lines)


def calibrate(
    model: str,
    drafter: str,
    prompts: Sequence,
    output: str | None,
    num_speculative_tokens: int = 7,
    temperatures: Sequence[float] = (1.0,),
    max_tokens: int = 128,
    seed: int = 0,
    draft_sample_method: str = "probabilistic",
    engine_kwargs: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Trace, fit, report and (if output) save the STS file; returns temperatures + table."""
    from dspark import LLM

    spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": num_speculative_tokens,
            "draft_sample_method": draft_sample_method, "adaptive_policy": "fixed",
            "enable_adaptive_verification": False, "confidence_source": "head"}
    t0 = time.time()
    llm = LLM(model, seed=seed, speculative_config=spec, **(engine_kwargs or {}))
    try:
        logits, accepted, verified, greedy = run_trace(llm, prompts, temperatures, max_tokens,
                                                       seed)  # fmt: skip
    finally:
        del llm
        gc.collect()
    log(f"calibration: {len(prompts)} prompts x temperatures {list(temperatures)}, "
        f"{logits.shape[0]} verified blocks, K={logits.shape[1]} ({time.time() - t0:.1f}s)")
    fit = _fit_and_report(logits, accepted, verified, log)
    by_mode = {}
    if greedy.any() and not greedy.all():  # both modes: each also gets its own fit
        for mode, sel in zip(SAMPLING_MODES, (greedy, ~greedy)):
            log(f"-- {mode} blocks only ({int(sel.sum())})")
            part = logits[sel], accepted[sel], verified[sel]
            by_mode[mode] = _fit_and_report(*part, log)
            pooled = calibration_table(*part, fit["temperatures"])
            by_mode[mode]["pooled_ece"] = float(np.nanmean([r["ece_after"] for r in pooled]))
            log(f"   (the pooled fit on these blocks: mean ece {by_mode[mode]['pooled_ece']:.4f})")
    if output:
        save_sts(output, fit["temperatures"], {
            "model": model, "drafter": drafter, "num_speculative_tokens": num_speculative_tokens,
            "temperatures": list(map(float, temperatures)), "num_prompts": len(prompts),
            "num_blocks": int(logits.shape[0]), "max_tokens": max_tokens,
            "draft_sample_method": draft_sample_method, **fit["mean"],
        }, {mode: f["temperatures"] for mode, f in by_mode.items()})  # fmt: skip
        log(f"wrote {output}")
    return {"temperatures": fit["temperatures"], "table": fit["table"],
            "num_blocks": int(logits.shape[0]), **fit["mean"], "by_mode": by_mode}


def _fit_and_report(logits, accepted, verified, log) -> dict:
    temps = fit_sts(logits, accepted, verified)
    rows = calibration_table(logits, accepted, verified, temps)
    log(format_table(rows))
    mean = {key: float(np.nanmean([r[key] for r in rows]))
            for key in ("ece_before", "ece_after", "auc_before", "auc_after")}
    log("mean over positions: " + ", ".join(f"{k} {v:.4f}" for k, v in mean.items()))
    return {"temperatures": temps, "table": rows, "mean": mean}
