"""The plumbing of ``scripts/bench_kernel.py --reorder`` on the CPU: with the
CPU stand-ins of the ops (every column the GPU run fills, except the
profiler's kernel times), as a dry run without them (the reference path),
and the script's refusal without a GPU. Not a measurement."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from gt_fused3s import GraphPlan
from gt_fused3s.bench import kernel
from graph_cases import GRAPH_CASES

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernel.py"
GRAPHS = {"cora": "random_1003", "zinc": "duplicates"}


@pytest.fixture
def small_graphs(monkeypatch):
    """load_graph gives small graph cases under the benchmark's names."""
    def load(name, device, batch=1024):
        ei, n = GRAPH_CASES[GRAPHS[name]]()
        return ei.to(device), n
    monkeypatch.setattr(kernel, "load_graph", load)


def test_reorder_benchmark_through_the_ops(stand_in_kernels, small_graphs, tmp_path):
    out = tmp_path / "reorder.csv"
    lines = []
    rows = kernel.run_reorder(list(GRAPHS), ["d32h8bf16"], "cuthill_mckee", quick=True, out=str(out),
                              device="cpu", log=lines.append)
    assert {"fwd", "bwd"} <= set(stand_in_kernels.calls)
    assert [r["graph"] for r in rows] == list(GRAPHS)
    for r in rows:
        assert not r.get("notes"), r.get("notes")
        for key in ("fwd_ms", "fb_ms", "api_fwd_ms", "api_fb_ms", "tcbs", "mma_fwd", "nnz_per_tcb"):
            assert isinstance(r[key], (int, float)) and isinstance(r[key + "_r"], (int, float)), key
        for key in ("order_ms", "plan_build_ms", "plan_build_ms_r", "perm_fwd_ms", "perm_fb_ms"):
            assert r[key] >= 0
        assert r["tcbs_r"] <= r["tcbs"] * 1.5 and r["mma_fwd_ratio"] == r["mma_fwd_r"] / r["mma_fwd"]
        # the reordered plan's output and gradients are the caller's
        assert r["max_diff"] < 2e-2 and r["max_grad_diff"] < 5e-2
    # the statistics are those of the two formats
    ei, n = GRAPH_CASES["random_1003"]()
    st = GraphPlan.from_edge_index(ei, n, reorder="cuthill_mckee").bsb.stats(32, variants=False)
    assert rows[0]["tcbs_r"] == st["num_tcbs"] and rows[0]["mma_fwd_r"] == st["mma_fwd"]
    assert rows[0]["tcbs"] == GraphPlan.from_edge_index(ei, n).bsb.num_tcbs
    with open(out) as f:
        assert len(list(csv.DictReader(f))) == 2
    table = "\n".join(lines)
    assert "| cora | d32h8bf16 |" in table and "TCBs r" in table


def test_dry_run_without_a_kernel(small_graphs):
    lines = []
    rows = kernel.run_reorder(["zinc"], ["d128h1fp16"], "label_propagation", quick=True, backward=False,
                              device="cpu", log=lines.append)
    (r,) = rows
    assert "fwd_ms" not in r and "fb_ms" not in r          # no op to time
    assert r["api_fwd_ms"] >= 0 and r["tcbs_r"] > 0 and r["max_diff"] == 0.0
    assert "dry run" in "\n".join(lines)


def _script():
    spec = importlib.util.spec_from_file_location("bench_kernel_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_without_a_gpu(monkeypatch, capsys, small_graphs):
    mod = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main(["--reorder", "cuthill_mckee"]) == 2
    assert "--dry-run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mod.main(["--dry-run"])
    assert mod.main(["--reorder", "identity", "--dry-run", "--graphs", "zinc", "--settings", "d32h8bf16",
                     "--quick", "--no-backward"]) == 0
    assert "| zinc | d32h8bf16 |" in capsys.readouterr().out
