"""PNG plots of `dspark bench serve` results: output throughput and median TPOT against
concurrency, one line per arm (result file), plus mean acceptance length when any arm
reports it.

    python -m dspark.bench.plot base.json fixed_k.json adaptive.json -o sweep.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_arm(path: str | Path, label: str | None = None) -> tuple[str, list[dict]]:
    """(label, per-level results) from a result JSON written by `dspark bench serve`."""
    path = Path(path)
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise ValueError(f"{path}: not a dspark bench result file (no 'results' list)")
    label = label or (doc.get("config") or {}).get("label") or path.stem
    return label, doc["results"]


def _x(level: dict) -> float:
    # Unlimited concurrency: at most num_prompts requests are in flight.
    return float(level.get("max_concurrency") or level.get("num_prompts") or 0)


def plot_arms(arms: list[tuple[str, list[dict]]], out_path: str | Path,
              title: str | None = None) -> Path:
    """Write the plot for `arms` = [(label, results), ...] to `out_path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def acc_len(r: dict) -> float | None:
        return (r.get("spec_decode") or {}).get("mean_acceptance_length")

    panels = [
        ("output tok/s", lambda r: r.get("output_throughput")),
        # a TPOT of 0 is "not measured" (older results of unstreamed output), never a time
        ("TPOT p50 (ms)", lambda r: (r.get("tpot_ms") or {}).get("median") or None),
    ]
    if any(acc_len(r) is not None for _, results in arms for r in results):
        panels.append(("mean acceptance length", acc_len))

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    xs_all = set()
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (ylabel, get) in zip(axes[0], panels, strict=True):
        for i, (label, results) in enumerate(arms):  # one colour per arm in every panel
            points = sorted((_x(r), get(r)) for r in results if get(r) is not None and _x(r) > 0)
            if points:
                xs, ys = zip(*points, strict=True)
                xs_all.update(xs)
                ax.plot(xs, ys, marker="o", label=label, color=cycle[i % len(cycle)])
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    for ax in axes[0]:
        if len(xs_all) > 1:
            ax.set_xscale("log", base=2)
            ticks = sorted(xs_all)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png", dpi=110)
    plt.close(fig)
    return out_path


def plot_result_files(paths: list[str | Path], out_path: str | Path,
                      labels: list[str] | None = None, title: str | None = None) -> Path:
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} result files")
    arms = [load_arm(p, labels[i] if labels else None) for i, p in enumerate(paths)]
    return plot_arms(arms, out_path, title)


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result JSON files (one arm each)")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per file")
    p.add_argument("--title", default=None)


def run_plot(args: argparse.Namespace) -> int:
    labels = args.labels.split(",") if args.labels else None
    out = plot_result_files(args.results, args.output, labels, args.title)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark.bench.plot", description=__doc__)
    add_plot_arguments(p)
    return run_plot(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
