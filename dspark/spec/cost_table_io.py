"""The cost table's JSON form (CostModel.to_dict / from_dict / to_json / from_json) and the
checks a table's points pass on the way in (monotone_table, companion).

Schema 1. Fields added since (each verify point's rows, the context record) are optional:
a table written before them loads and prices steps at the profiled context.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

SCHEMA_VERSION = 1


def to_dict(cm) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "dspark_cost_model",
        "fixed_overhead_ms": cm.fixed_overhead_ms,
        "verify": {"num_tokens": cm.verify_tokens.tolist(), "ms": cm.verify_ms.tolist(),
                   "num_reqs": cm.verify_reqs.tolist()},
        "context": {"ms_per_token": cm.context_ms_per_token,
                    "profile_context_len": cm.profile_context_len},
        "draft": {"num_reqs": cm.draft_reqs.tolist(), "ms": cm.draft_ms.tolist(),
                  "greedy_ms": cm.draft_greedy_ms.tolist()},
        "graph_sizes": list(cm.graph_sizes) if cm.graph_sizes else None,
        "provenance": cm.provenance,
    }


def fields_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    """CostModel's constructor arguments from a dict of `to_dict`'s form."""
    version = d.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"unsupported cost model schema_version {version!r} "
                         f"(expected {SCHEMA_VERSION})")
    draft, context = d.get("draft", {}), d.get("context", {})
    return {
        "verify_tokens": np.asarray(d["verify"]["num_tokens"]),
        "verify_ms": np.asarray(d["verify"]["ms"]),
        "draft_reqs": np.asarray(draft.get("num_reqs", [])),
        "draft_ms": np.asarray(draft.get("ms", [])),
        "draft_greedy_ms": np.asarray(draft.get("greedy_ms", [])),
        "fixed_overhead_ms": d.get("fixed_overhead_ms", 0.0),
        "graph_sizes": tuple(d["graph_sizes"]) if d.get("graph_sizes") else None,
        "provenance": d.get("provenance", {}),
        "verify_reqs": np.asarray(d["verify"].get("num_reqs", [])),
        "context_ms_per_token": context.get("ms_per_token", 0.0),
        "profile_context_len": context.get("profile_context_len", 0.0),
    }


def write_json(d: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomic write (temp file + rename)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(d, f, indent=1)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def monotone_table(xs: Sequence[float], ys: Sequence[float], what: str):
    x = np.asarray(xs, dtype=np.float64).reshape(-1)
    y = np.asarray(ys, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"{what}: {x.size} points but {y.size} times")
    if x.size and (not np.all(np.isfinite(x)) or not np.all(np.isfinite(y))):
        raise ValueError(f"{what}: non-finite values")
    if x.size and (x.min() < 0 or y.min() < 0):
        raise ValueError(f"{what}: negative token/request count or time")
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    # Duplicate x (repeated measurements of one shape): keep the largest time.
    ux, inv = np.unique(x, return_inverse=True)
    uy = np.full(ux.shape, -np.inf)
    np.maximum.at(uy, inv, y)
    return ux, np.maximum.accumulate(uy) if uy.size else uy


def companion(xs, values, table: str, xs_name: str, name: str) -> np.ndarray:
    """`values` (one per point of xs, or none) in the order of monotone_table's points (a
    running max, the largest of duplicates)."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    n = np.asarray(xs).size
    if v.size and v.size != n:
        raise ValueError(f"{table}: {n} {xs_name} but {v.size} {name}")
    return monotone_table(xs, v, table)[1] if v.size else v
