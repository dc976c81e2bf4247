"""The cost table's JSON form (CostModel.to_dict / from_dict / to_json / from_json).

Schema 1. Fields added since (each verify point's rows, the context record) are optional:
a table written before them loads and prices steps at the profiled context.
"""

from __future__ import annotations

import json
import os
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
