"""The plan's choice between the 16-row and the 8-row window formats (issue
13, item 4): a linear cost model of the kernels' time, fitted on the GPU.

Per format (16 or 8 rows) and pass (the forward kernel; the backward's two
passes, over the graph's format and the transposed one), the kernel time is
modelled as a non-negative combination of what the builder counts::

    t = c0 + c1 * H * W + c2 * H * B * D/64 + c3 * H * N * D/64 + c4 * L * D/64 + c5 * H * C * D/64

with W the non-empty windows, B the blocks, N the nodes (the dense reads and
writes of q and out), C the columns (the K and V rows gathered: what the
kernels' L2 traffic follows, README "Where the limit is"), L the longest
walk of one warp (8 rows: the longest window, which one warp walks alone;
16 rows: the longest window cut at the schedule's split bound), H heads and
D the head dim; the backward sums the graph's and the transposed graph's
counts and takes the longer walk. The
coefficients are fitted (:func:`fit`, non-negative least squares on relative
errors) to kernel times measured side by side on one GPU
(``python scripts/bench_kernel.py --fit-cost-model``: calibration graphs,
held-out graphs, the CSV and the fitted dictionary); :data:`COEFFICIENTS`
holds the fit the package ships, with the GPU and git sha it came from.

The choice (:func:`choose_window_rows`) is the format of the lower predicted
forward + backward time (forward alone with ``backward=False``) at the given
heads and head dim; without them, 8 rows only where every setting of the
fit predicts them faster. It models the kernels of the GPU it was fitted on
(an H100): on another GPU its choices are not measured; refit there. Not
modelled: a locality reordering (no measured graph gained from one once its
gathers are paid, README "Asking for a reordered plan"; a plan reorders only
when asked), and the CUDA-core residue of the issue, which is not built.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .graph import _check_edge_index, _check_num_nodes, _check_range, window_ranks

__all__ = ["COEFFICIENTS", "format_features", "design_row", "predict", "choose_window_rows", "fit", "nnls"]

FEATURES = ("const", "heads_windows", "heads_blocks_d", "heads_nodes_d", "longest_walk_d", "heads_columns_d")

#: Fitted by ``python scripts/bench_kernel.py --fit-cost-model`` (see the
#: module docstring); ``COEFFICIENTS[rows][pass]`` = c0 .. c5 of the model in
#: milliseconds per unit; ``settings``: the (heads, head dim) it was fitted on.
COEFFICIENTS: dict = {
    "gpu": "NVIDIA H100 80GB HBM3",
    "git": "18924ec",                   # the kernels of that commit; docs/cost_model_h100_18924ec.csv
    "settings": [(1, 128), (8, 32), (8, 64)],
    16: {"fwd": [0.00408106, 1.06789e-06, 0, 1.08143e-07, 0.000154664, 4.55155e-08],
         "bwd": [0.0054136, 7.11609e-07, 0, 2.11105e-07, 0.000246416, 5.60179e-08]},
    8: {"fwd": [0.00249373, 7.43013e-07, 0, 7.83455e-08, 0.000553141, 4.19565e-08],
        "bwd": [0.00221227, 4.55096e-07, 0, 1.70776e-07, 0.000697004, 5.09276e-08]},
}

#: The 16-row schedule splits windows longer than this many blocks (at least:
#: :func:`gt_fused3s.schedule.chunk_bounds`), so no warp walks more.
SPLIT_BOUND16 = 32


def _counts(src: Tensor, dst: Tensor, num_nodes: int, rows: int, cols: int) -> dict:
    """Non-empty windows, blocks, the longest window (in blocks) and the
    columns (K / V rows gathered) of the ``rows``-row format of the edges
    (``cols`` columns a block)."""
    cols_per_win = window_ranks(src, dst, num_nodes, rows)[5]
    blocks = (cols_per_win + cols - 1) // cols
    if blocks.numel() == 0:
        return {"windows": 0, "blocks": 0, "longest": 0, "columns": 0}
    # one read-back of the four counts
    w, b, m, c = torch.stack([(blocks > 0).sum(), blocks.sum(), blocks.max(), cols_per_win.sum()]).tolist()
    return {"windows": int(w), "blocks": int(b), "longest": int(m), "columns": int(c)}


def format_features(edge_index: Tensor, num_nodes: int) -> dict:
    """The builder's counts of both formats of a graph, for the graph and its
    transpose (the backward's second pass): ``{rows: {"graph": counts,
    "transposed": counts}}`` for rows 16 and 8, and ``"nodes"``. Four sorts of
    the edges and one host read-back each (not for a static build)."""
    edge_index = _check_edge_index(edge_index)
    N = _check_num_nodes(num_nodes)
    _check_range("edge_index", edge_index, 0, N)
    src, dst = edge_index[0].long(), edge_index[1].long()
    out = {"nodes": N}
    for rows, cols in ((16, 8), (8, 16)):
        out[rows] = {"graph": _counts(src, dst, N, rows, cols), "transposed": _counts(dst, src, N, rows, cols)}
    return out


def design_row(features: dict, rows: int, pass_: str, heads: int, head_dim: int) -> list[float]:
    """The model's inputs (:data:`FEATURES`) for one format and pass."""
    parts = [features[rows]["graph"]] + ([features[rows]["transposed"]] if pass_ == "bwd" else [])
    s = head_dim / 64
    longest = max(p["longest"] for p in parts)
    if rows == 16:
        longest = min(longest, SPLIT_BOUND16)
    return [1.0,
            float(heads * sum(p["windows"] for p in parts)),
            heads * sum(p["blocks"] for p in parts) * s,
            heads * features["nodes"] * len(parts) * s,
            longest * s,
            heads * sum(p["columns"] for p in parts) * s]


def predict(features: dict, rows: int, heads: int, head_dim: int, *, backward: bool = True,
            coefficients: dict | None = None) -> float:
    """Predicted kernel milliseconds of the ``rows``-row format: the forward
    (+ the backward's two passes with ``backward``)."""
    coef = COEFFICIENTS if coefficients is None else coefficients
    passes = ("fwd", "bwd") if backward else ("fwd",)
    if any(coef[rows][p] is None for p in passes):
        raise RuntimeError("gt_fused3s.cost_model: no fitted coefficients (run "
                           "`python scripts/bench_kernel.py --fit-cost-model` on a GPU)")
    return sum(float(np.dot(coef[rows][p], design_row(features, rows, p, heads, head_dim))) for p in passes)


def choose_window_rows(features: dict, heads: int | None = None, head_dim: int | None = None, *,
                       backward: bool = True, coefficients: dict | None = None) -> int:
    """16 or 8: the format of the lower predicted time (the module's
    docstring). Without ``heads`` and ``head_dim``: 8 only where the 8-row
    format is predicted faster in every setting of the fit (a missing one
    of the two is taken from each setting), so that a choice made before
    the head dim is known keeps the default 16 rows wherever some setting
    would lose. Head dims above 128 take 16 rows (the 8-row kernels stop
    there)."""
    coef = COEFFICIENTS if coefficients is None else coefficients
    if head_dim is not None and head_dim > 128:
        return 16
    settings = [(heads, head_dim)] if heads is not None and head_dim is not None else [
        (heads or h, head_dim or d) for h, d in coef["settings"]]
    if not settings:
        raise ValueError("choose_window_rows: give heads and head_dim (the coefficients list no settings)")
    faster8 = [predict(features, 8, h, d, backward=backward, coefficients=coef)
               < predict(features, 16, h, d, backward=backward, coefficients=coef) for h, d in settings]
    return 8 if all(faster8) else 16


# ---------------------------------------------------------------- the fit
def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


def fit(samples: list[dict]) -> dict:
    """Coefficients from measured samples, each ``{"features": format_features(...),
    "heads", "head_dim", "rows", "pass", "ms"}``: per (rows, pass), the
    non-negative least squares of the relative error (each sample's row
    divided by its time, so that small and large graphs count alike)."""
    out: dict = {"settings": sorted({(s["heads"], s["head_dim"]) for s in samples})}
    for rows in (16, 8):
        out[rows] = {}
        for pass_ in ("fwd", "bwd"):
            sel = [s for s in samples if s["rows"] == rows and s["pass"] == pass_ and s["ms"] > 0]
            if not sel:
                out[rows][pass_] = None
                continue
            a = np.array([design_row(s["features"], rows, pass_, s["heads"], s["head_dim"]) for s in sel])
            t = np.array([s["ms"] for s in sel])
            scale = np.abs(a).max(0)
            scale[scale == 0] = 1.0                 # columns of one unit, for a well-posed solve
            x = nnls(a / t[:, None] / scale, np.ones(len(sel)))
            out[rows][pass_] = (x / scale).tolist()
    return out
