"""Bar chart of the speedups of one backend over the others, per dataset
(and hidden size), like Figure 8 of the Fused3S paper: grouped bars, log-scale
y, a line at 1x, and a geometric-mean group at the end. Backends that ran out
of memory or were skipped get a label instead of a bar.

    gt-fused3s plot results/study.csv results/study.png

Also the loss curves of ``gt-fused3s train --plot`` (:func:`plot_loss_curves`)
and the sequence benchmark's times against length (:func:`plot_sequence_times`).

Needs matplotlib (``pip install "gt-fused3s[plot]"``), imported on use; draws
with the Agg canvas, so no display is needed.
"""
from __future__ import annotations

import csv
from pathlib import Path

from ..backends import BACKENDS
from .common import geomean

_LABELS = {"oom": "OOM", "skipped": "skip", "error": "err"}


def _save(fig, path: str | Path) -> Path:
    """Lay ``fig`` out and write it to the PNG ``path`` (its folder made)."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def _num(value) -> float | None:
    """A float from a row value (rows read back from a CSV hold strings)."""
    if value in (None, ""):
        return None
    return float(value)


def speedup_groups(rows: list[dict], backend: str = "fused3s"):
    """``(labels, others, values)``: one group per (dataset, hidden size) where
    ``backend`` ran with a speedup; ``values[g][b]`` is its speedup over
    ``others[b]``, or a string (the other backend's status) where there is
    none. (A fused3s row of a CPU run has none: it ran the reference path.)"""
    keys = list(dict.fromkeys((r["dataset"], str(r.get("hidden", ""))) for r in rows
                              if r.get("backend") == backend and r.get("status") == "ok"
                              and any(_num(v) is not None for k, v in r.items()
                                      if k.startswith("speedup_vs_"))))
    others = [b for b in BACKENDS if b != backend
              and any(r.get("backend") == b for r in rows)]
    by_key = {(r["dataset"], str(r.get("hidden", "")), r.get("backend")): r for r in rows}
    hiddens = {h for _, h in keys}
    labels, values = [], []
    for dataset, hidden in keys:
        mine = by_key[dataset, hidden, backend]
        labels.append(f"{dataset}\nC={hidden}" if len(hiddens) > 1 else dataset)
        group = {}
        for b in others:
            speedup = _num(mine.get(f"speedup_vs_{b}"))
            if speedup is None:                     # say why: OOM, skip, err
                other = by_key.get((dataset, hidden, b)) or {}
                speedup = _LABELS.get(other.get("status"), "")
            group[b] = speedup
        values.append(group)
    return labels, others, values


def plot_speedups(rows: list[dict], path: str | Path, backend: str = "fused3s",
                  title: str | None = None) -> Path:
    """Draw the speedups of ``backend`` over every other backend in ``rows``
    (the rows of :func:`gt_fused3s.drivers.infer.run`, or read from its CSV)
    to the PNG ``path``."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    labels, others, values = speedup_groups(rows, backend)
    if not labels:
        raise ValueError(f"no speedups of {backend} in the rows (on a CPU fused3s runs the reference "
                         f"path and has none; --backend pyg draws pyg's)")
    geo = {}
    for b in others:
        vals = [g[b] for g in values if isinstance(g[b], float)]
        geo[b] = geomean(vals) if vals else ""
    labels, values = labels + ["geo-mean"], values + [geo]

    fig = Figure(figsize=(max(6.0, 0.8 * len(labels) + 2), 4.2), dpi=150)
    ax = fig.subplots()
    width = 0.8 / max(len(others), 1)
    heights_all = [v for g in values for v in g.values() if isinstance(v, float)]
    floor, top = min(heights_all + [1.0]) / 1.5, max(heights_all + [1.0]) * 4
    for j, b in enumerate(others):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(labels))]
        heights = [g[b] if isinstance(g[b], float) else 0.0 for g in values]
        ax.bar(xs, heights, width, label=f"vs {b}")
        for x, g in zip(xs, values):
            if isinstance(g[b], float):
                ax.text(x, g[b], f"{g[b]:.1f}", ha="center", va="bottom", fontsize=5, rotation=90)
            elif g[b]:
                ax.text(x, floor * 1.05, g[b], ha="center", va="bottom", fontsize=5,
                        rotation=90, color="0.3")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(f"speedup of {backend} (log scale)")
    ax.set_title(title or f"Graph Transformer inference: {backend} speedup over other backends",
                 fontsize=9)
    ax.legend(loc="upper left", fontsize=7, ncol=len(others))
    ax.grid(axis="y", which="both", linewidth=0.3, alpha=0.5)
    return _save(fig, path)


def plot_loss_curves(series: dict[str, tuple[list, list]], path: str | Path,
                     title: str = "training loss") -> Path:
    """Draw one loss curve per backend (``series[backend] = (steps, losses)``)
    to the PNG ``path``; log-scale y when every loss is positive (a falling
    loss spans decades)."""
    from matplotlib.figure import Figure

    if not series:
        raise ValueError("no loss curves to plot")
    fig = Figure(figsize=(6.0, 4.0), dpi=150)
    ax = fig.subplots()
    for (backend, (steps, losses)), style in zip(series.items(), ("-", "--", ":", "-.") * 4):
        ax.plot(steps, losses, style, label=backend, linewidth=1.2)
    if all(v > 0 for _, losses in series.values() for v in losses):
        ax.set_yscale("log")
    _label(ax, "optimizer step", "loss", title)
    return _save(fig, path)


def plot_sequence_times(rows: list[dict], path: str | Path) -> Path:
    """Forward time against sequence length, one panel per mask, ours and
    FlexAttention (and dense SDPA where it ran), log-log: the rows of
    ``scripts/bench_sequence.py`` (or read from its CSV), like the paper's
    Fig. 6. Masks with a single length get no panel."""
    from matplotlib.figure import Figure

    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in rows:
        L = _num(r.get("L"))
        for key, label in (("ours_ms", "gt-fused3s"), ("flex_ms", "FlexAttention"), ("dense_sdpa_ms", "dense SDPA")):
            t = _num(r.get(key))
            if L and t:
                series.setdefault(r["mask"], {}).setdefault(label, []).append((L, t))
    masks = [m for m, s in series.items() if len({L for pts in s.values() for L, _ in pts}) > 1]
    if not masks:
        raise ValueError("no mask with times at two lengths or more in the rows")
    fig = Figure(figsize=(3.6 * len(masks), 3.4), dpi=150)
    axes = fig.subplots(1, len(masks), squeeze=False)[0]
    for ax, mask in zip(axes, masks):
        for (label, pts), style in zip(series[mask].items(), ("o-", "s--", "^:")):
            pts = sorted(pts)
            ax.plot([L for L, _ in pts], [t for _, t in pts], style, label=label, linewidth=1.2, markersize=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _label(ax, "sequence length (tokens)", "forward ms", mask)
    return _save(fig, path)


def _label(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axis labels, a small title and legend, a light grid: the line plots' look."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(which="both", linewidth=0.3, alpha=0.5)


def read_csv(path: str | Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def add_arguments(parser) -> None:
    parser.add_argument("csv", help="rows written by gt-fused3s infer --csv")
    parser.add_argument("png", help="the chart to write")
    parser.add_argument("--backend", default="fused3s", help="whose speedups (default fused3s)")


def main(args) -> int:
    rows = read_csv(args.csv)
    missing = {"dataset", "backend", "status"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"{args.csv} is not a CSV of gt-fused3s infer --csv: no column "
                         f"{', '.join(sorted(missing))}")
    plot_speedups(rows, args.png, args.backend)
    print(f"wrote {args.png}")
    return 0
