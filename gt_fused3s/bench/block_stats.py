"""Block statistics of the graphs, without and with a locality reordering
(issue 13): windows, blocks, non-zeros per block, K/V rows gathered and
m16n8k16 invocations of one forward per head, for the 16 x 8 BSB and for
8-row windows of 8 x 16 blocks (FlashSparse's swap-and-transpose), and the
K/V rows of taller windows that share one K/V tile (``kv_w*_over_w16``).

Counts, not timings: computed from the edges alone (graph.format_stats) on
any device, no kernel runs. The only time measured is the reordering's own
(median wall time of ``reps`` calls on the chosen device; on the CPU with
the thread count of the run).
"""
from __future__ import annotations

import platform
import statistics
import time

import torch

from ..graph import format_stats, window_ranks
from ..reorder import reorder
from .common import git_sha
from .kernel import ALL_GRAPHS, SINGLE_GRAPHS, load_graph

DEFAULT_GRAPHS = SINGLE_GRAPHS + ("zinc", "molhiv", "peptides", "powerlaw200k")
DEFAULT_METHODS = ("identity", "cuthill_mckee", "label_propagation")

COLUMNS = ["graph", "num_nodes", "num_edges", "method", "reorder_ms",
           "w16_windows", "w16_tcbs", "w16_nnz_per_tcb", "w16_nnz_per_tcb_cv", "w16_mma_fwd",
           "w16_kv_mb",
           "w8_windows", "w8_blocks", "w8_nnz_per_block", "w8_nnz_per_block_cv", "w8_mma_fwd",
           "w8_kv_mb",
           "w8_over_w16_mma", "w16_mma_vs_identity", "w8_mma_vs_identity",
           "kv_w32_over_w16", "kv_w64_over_w16", "kv_w128_over_w16",
           "head_dim", "batch", "device", "threads", "torch", "git"]


def _time(fn, reps: int, device: torch.device) -> tuple[float, object]:
    out, times = None, []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


#: window heights whose shared K/V rows are counted (against 16 rows)
SHARED_WINDOWS = (32, 64, 128)


def kv_rows(edge_index: torch.Tensor, num_nodes: int, rows: int) -> int:
    """K and V rows gathered once per window of ``rows`` rows: the window's
    columns (distinct (source, copy) pairs, as the builders form them). At
    16 rows this is the BSB's count; taller windows are what a kernel whose
    warps share one K/V tile per window of several 16-row MMA tiles would
    gather (the fused kernels are bound by L2 traffic, see ncu_bounds)."""
    src, dst = edge_index[0].long(), edge_index[1].long()
    return int(window_ranks(src, dst, num_nodes, rows)[-1].sum())


def graph_rows(name: str, edge_index: torch.Tensor, num_nodes: int, methods=DEFAULT_METHODS, *,
               head_dim: int = 128, reps: int = 3) -> list[dict]:
    """One row per method for one graph (see :data:`COLUMNS`); the
    ``*_vs_identity`` ratios need ``"identity"`` first in ``methods``."""
    device = edge_index.device
    rows, base = [], None
    for method in methods:
        ms, order = _time(lambda: reorder(edge_index, num_nodes, method), reps, device)
        ei = order.relabel(edge_index)
        a = format_stats(ei, num_nodes, "16x8", head_dim)
        b = format_stats(ei, num_nodes, "8x16", head_dim)
        row = {
            "graph": name, "num_nodes": num_nodes, "num_edges": a["num_edges"], "method": method,
            "reorder_ms": 0.0 if method == "identity" else ms,
            "w16_windows": a["num_windows"], "w16_tcbs": a["num_blocks"],
            "w16_nnz_per_tcb": a["nnz_per_block_mean"], "w16_nnz_per_tcb_cv": a["nnz_per_block_cv"],
            "w16_mma_fwd": a["mma_fwd"], "w16_kv_mb": a["kv_bytes_fwd"] / 2**20,
            "w8_windows": b["num_windows"], "w8_blocks": b["num_blocks"],
            "w8_nnz_per_block": b["nnz_per_block_mean"], "w8_nnz_per_block_cv": b["nnz_per_block_cv"],
            "w8_mma_fwd": b["mma_fwd"], "w8_kv_mb": b["kv_bytes_fwd"] / 2**20,
            "w8_over_w16_mma": b["mma_fwd"] / a["mma_fwd"] if a["mma_fwd"] else float("nan"),
            "head_dim": head_dim,
        }
        kv16 = kv_rows(ei, num_nodes, 16)
        for tall in SHARED_WINDOWS:
            row[f"kv_w{tall}_over_w16"] = kv_rows(ei, num_nodes, tall) / kv16 if kv16 else float("nan")
        if method == "identity":
            base = row
        if base is not None:
            row["w16_mma_vs_identity"] = row["w16_mma_fwd"] / max(base["w16_mma_fwd"], 1)
            row["w8_mma_vs_identity"] = row["w8_mma_fwd"] / max(base["w16_mma_fwd"], 1)
        rows.append(row)
    return rows


def run(graphs=DEFAULT_GRAPHS, methods=DEFAULT_METHODS, *, head_dim: int = 128, batch: int = 1024,
        device: str = "cpu", reps: int = 3, log=print) -> list[dict]:
    """Rows for every graph found (a missing file is skipped with a note):
    the single graphs whole, collections as their first ``batch`` graphs
    (block-diagonal), power-law graphs generated with the kernel
    benchmark's parameters."""
    dev = torch.device(device)
    common = {"batch": batch, "device": _device_name(dev), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "git": git_sha()}
    rows = []
    for name in graphs:
        if name not in ALL_GRAPHS:
            raise ValueError(f"unknown graph {name!r} (known: {', '.join(ALL_GRAPHS)})")
        try:
            ei, n = load_graph(name, dev, batch)
        except FileNotFoundError as e:
            log(f"[skip] {name}: {e}")
            continue
        label = f"{name} x{batch}" if name in ("zinc", "molhiv", "peptides") else name
        for r in graph_rows(label, ei, n, methods, head_dim=head_dim, reps=reps):
            rows.append({**r, **common})
            log(format_row(rows[-1]))
    return rows


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or "cpu"


HEADER = ("| graph | N | E | order | order ms | 16x8 TCBs | nnz/TCB | 16x8 MMA | "
          "8x16 blocks | nnz/block | 8x16 MMA | 8x16 / 16x8 | MMA vs 16x8 caller's order |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: dict) -> str:
    """One markdown table row (MMA in thousands per head, D = ``head_dim``)."""
    rel = r.get("w16_mma_vs_identity")
    rel8 = r.get("w8_mma_vs_identity")
    vs = f"{rel:.3f} / {rel8:.3f}" if rel is not None else ""
    return (f"| {r['graph']} | {r['num_nodes']} | {r['num_edges']} | {r['method']} | "
            f"{r['reorder_ms']:.1f} | {r['w16_tcbs']} | {r['w16_nnz_per_tcb']:.2f} | "
            f"{r['w16_mma_fwd'] / 1e3:.1f}k | {r['w8_blocks']} | {r['w8_nnz_per_block']:.2f} | "
            f"{r['w8_mma_fwd'] / 1e3:.1f}k | {r['w8_over_w16_mma']:.3f} | {vs} |")
