"""Block statistics of graph.format_stats and BSBGraph.stats (16-row
windows of 16 x 8 TCBs and 8-row windows of 8 x 16 blocks) against counts
made with Python loops, on the CPU (issue 13)."""
from collections import Counter

import pytest
import torch

from graph_cases import GRAPH_CASES
from gt_fused3s.graph import BSBGraph, format_stats

CASES = dict(GRAPH_CASES)
CASES["empty_graph"] = lambda: (torch.zeros(2, 0, dtype=torch.long), 0)
CASES["window_16_rows_17_cols"] = lambda: (torch.stack([torch.arange(17), torch.arange(17) % 16]), 17)


def _brute_format(ei: torch.Tensor, n: int, rows: int, width: int, D: int) -> dict:
    """The block counts with Python loops: per window, column (j, c) exists
    if some row has more than c edges from j; columns ascending, cut into
    blocks of ``width``; a row's c-th copy of edge j -> i sits in column (j, c)."""
    R = (n + rows - 1) // rows
    per_row = Counter((d, s) for s, d in ei.t().tolist())
    blocks_per_win, nnz, kv_rows, singles = [], [], 0, 0
    for w in range(R):
        cols = sorted({(s, c) for (d, s), m in per_row.items() if d // rows == w for c in range(m)})
        kv_rows += len(cols)
        nb = (len(cols) + width - 1) // width
        blocks_per_win.append(nb)
        rank = {col: i for i, col in enumerate(cols)}
        count = [0] * nb
        for (d, s), m in per_row.items():
            if d // rows == w:
                for c in range(m):
                    count[rank[(s, c)] // width] += 1
        nnz += count
        singles += sum(1 for (s, c) in cols if sum(1 for (d, s2), m in per_row.items()
                                                    if s2 == s and d // rows == w and m > c) == 1)
    B = sum(blocks_per_win)
    if (rows, width) == (16, 8):
        mma = B * D // 16 + sum((b + 1) // 2 for b in blocks_per_win) * D // 8
    else:
        mma = B * D // 8
    return {"num_windows": R, "num_blocks": B, "nnz": nnz, "kv_rows": kv_rows, "mma_fwd": mma,
            "blocks_per_win": blocks_per_win, "single_nnz": singles}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stats_equal_brute_force_counts(case):
    ei, n = CASES[case]()
    D = 48
    g = BSBGraph.from_edge_index(ei, n)
    s = g.stats(head_dim=D)
    for fmt, rows, width in (("16x8", 16, 8), ("8x16", 8, 16)):
        want = _brute_format(ei, n, rows, width, D)
        got = format_stats(ei, n, fmt, D)
        assert got["num_windows"] == want["num_windows"]
        assert got["num_blocks"] == want["num_blocks"]
        assert got["kv_rows"] == want["kv_rows"]
        assert got["kv_bytes_fwd"] == 2 * want["kv_rows"] * D * 2
        assert got["mma_fwd"] == want["mma_fwd"]
        assert got["num_edges"] == ei.size(1) == sum(want["nnz"])
        assert got["nnz_per_block_max"] == max(want["nnz"], default=0)
        assert got["single_nnz_share"] == pytest.approx(want["single_nnz"] / max(ei.size(1), 1))
        if want["num_blocks"]:
            nnz = torch.tensor(want["nnz"], dtype=torch.float64)
            assert got["nnz_per_block_mean"] == pytest.approx(nnz.mean().item())
            assert got["nnz_per_block_cv"] == pytest.approx((nnz.std(unbiased=False) / nnz.mean()).item())
        prefix = "" if fmt == "16x8" else "w8_"
        assert s[prefix + "mma_fwd"] == want["mma_fwd"]
        assert s[prefix + "kv_rows"] == want["kv_rows"]
        assert s[prefix + "num_windows"] == want["num_windows"]
    # the BSB's own arrays agree with the 16x8 count
    assert s["num_tcbs"] == g.num_tcbs == format_stats(ei, n)["num_blocks"]
    assert s["w8_num_blocks"] == _brute_format(ei, n, 8, 16, D)["num_blocks"]
    assert s["mma_fwd_kernel"] == sum((b + 1) // 2 for b in _brute_format(ei, n, 16, 8, D)
                                      ["blocks_per_win"]) * D // 4


def test_stats_keys_and_arguments():
    ei, n = GRAPH_CASES["random_1003"]()
    g = BSBGraph.from_edge_index(ei, n)
    s = g.stats()
    for key in ("num_nodes", "num_edges", "num_windows", "num_tcbs", "tcb_per_rw_mean",
                "tcb_per_rw_cv", "tcb_per_rw_max", "nnz_per_tcb_mean", "nnz_per_tcb_cv", "density"):
        assert key in s
    assert s["head_dim"] == 128 and s["mma_fwd"] == format_stats(ei, n, "16x8", 128)["mma_fwd"]
    assert "w8_num_blocks" not in g.stats(variants=False)
    assert g.stats(head_dim=64)["mma_fwd"] * 2 == s["mma_fwd"]
    with pytest.raises(ValueError, match="head_dim"):
        g.stats(head_dim=40)
    with pytest.raises(ValueError, match="fmt"):
        format_stats(ei, n, "4x32")
    with pytest.raises(ValueError, match="edge_index"):
        format_stats(ei, 10)


def test_block_stats_rows():
    """The table's rows are format_stats of the relabelled graph; the
    caller's order is the identity row."""
    from gt_fused3s.bench.block_stats import COLUMNS, format_row, graph_rows
    from gt_fused3s.reorder import reorder
    ei, n = GRAPH_CASES["random_1003"]()
    rows = graph_rows("r", ei, n, ("identity", "cuthill_mckee"), head_dim=64, reps=1)
    assert [r["method"] for r in rows] == ["identity", "cuthill_mckee"]
    base = format_stats(ei, n, "16x8", 64)
    assert rows[0]["w16_tcbs"] == base["num_blocks"] and rows[0]["w16_mma_vs_identity"] == 1.0
    cm = reorder(ei, n, "cuthill_mckee").relabel(ei)
    assert rows[1]["w8_mma_fwd"] == format_stats(cm, n, "8x16", 64)["mma_fwd"]
    assert rows[1]["w16_mma_vs_identity"] == rows[1]["w16_mma_fwd"] / base["mma_fwd"]
    assert set(rows[1]) <= set(COLUMNS)
    assert format_row(rows[1]).count("|") == 14
    assert rows[0]["kv_w32_over_w16"] <= 1.0 and rows[0]["kv_w128_over_w16"] <= rows[0]["kv_w64_over_w16"]


def test_kernel_benchmark_prints_the_block_statistics():
    """scripts/bench_kernel.py's rows carry both formats' counts for the
    setting's head dim, and its block table prints them beside the kernel
    time (the counts checked against the brute-force ones)."""
    from gt_fused3s.bench.kernel import block_stat_columns, format_block_stats
    ei, n = GRAPH_CASES["random_1003"]()
    cols = block_stat_columns(BSBGraph.from_edge_index(ei, n), 64)
    want16, want8 = _brute_format(ei, n, 16, 8, 64), _brute_format(ei, n, 8, 16, 64)
    assert cols["stat_num_tcbs"] == want16["num_blocks"] and cols["stat_mma_fwd"] == want16["mma_fwd"]
    assert cols["stat_w8_num_blocks"] == want8["num_blocks"] and cols["stat_w8_mma_fwd"] == want8["mma_fwd"]
    assert cols["stat_kv_bytes_fwd"] == 2 * want16["kv_rows"] * 64 * 2
    rows = [{"graph": "g", "setting": "d64h8bf16", "fused3s_kernel_ms": 0.25, **cols},
            {"graph": "h", "setting": "d64h8bf16"}]          # a row without statistics is left out
    table = format_block_stats(rows).splitlines()
    assert len(table) == 3 and table[2].startswith("| g | d64h8bf16 | 0.2500 | " + str(want16["num_blocks"]))
    assert f"| {want8['num_blocks']} |" in table[2]


def test_kv_rows_of_taller_windows():
    """K/V rows per window: distinct (source, copy) pairs, counted here by
    brute force; at 16 rows the BSB's count."""
    from gt_fused3s.bench.block_stats import kv_rows
    ei, n = GRAPH_CASES["duplicates"]()
    assert kv_rows(ei, n, 16) == format_stats(ei, n, "16x8")["kv_rows"]
    for rows in (16, 32, 64):
        want = 0
        for w in range((n + rows - 1) // rows):
            inside = (ei[1] // rows) == w
            srcs = ei[0][inside].tolist()
            dsts = ei[1][inside].tolist()
            # a source's copies: the most times it appears with one destination row
            per = {}
            for s_, d_ in zip(srcs, dsts):
                per.setdefault(s_, {}).setdefault(d_, 0)
                per[s_][d_] += 1
            want += sum(max(c.values()) for c in per.values())
        assert kv_rows(ei, n, rows) == want


@pytest.mark.parametrize("case", ["dense_pairs", "random_1003", "duplicates", "no_edges"])
def test_pair_runs(case):
    """nnz_per_pair_*: the edges of the TCB pairs (2p, 2p + 1) of each window,
    counted here window by window."""
    ei, n = GRAPH_CASES[case]()
    g = BSBGraph.from_edge_index(ei, n)
    s = g.stats(variants=False)
    nnz, rw = g.tcb_nnz().tolist(), g.rw_offset.tolist()
    runs = [sum(nnz[t:min(t + 2, rw[w + 1])]) for w in range(len(rw) - 1) for t in range(rw[w], rw[w + 1], 2)]
    assert s["nnz_per_pair_max"] == max(runs, default=0)
    assert s["nnz_per_pair_mean"] == pytest.approx(sum(runs) / len(runs) if runs else 0.0)
    if case == "dense_pairs":
        assert s["nnz_per_pair_max"] == 256
