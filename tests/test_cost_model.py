"""The plan's cost model (issue 13, item 4: ``gt_fused3s.cost_model``): the
non-negative least squares, the fit, the builder's counts it reads, the
shipped coefficients against the device run they were fitted on
(docs/cost_model_h100_18924ec.csv), and ``window_rows="auto"``."""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from gt_fused3s import GraphPlan, cost_model
from gt_fused3s.bench.cost import evaluate, generated_graph, read_csv, samples_of
from gt_fused3s.data.synthetic import molecule_batch
from graph_cases import GRAPH_CASES

CSV = Path(__file__).resolve().parents[1] / "docs" / "cost_model_h100_18924ec.csv"


def _brute_nnls(a, b):
    """min ||a x - b||, x >= 0, by every support (small n)."""
    best, best_x = math.inf, None
    for k in range(a.shape[1] + 1):
        for sup in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if sup:
                x[list(sup)] = np.linalg.lstsq(a[:, sup], b, rcond=None)[0]
            if (x >= -1e-12).all():
                r = np.linalg.norm(a @ x - b)
                if r < best - 1e-12:
                    best, best_x = r, x
    return best_x


def test_nnls_equals_the_best_support():
    rng = np.random.default_rng(0)
    for _ in range(25):
        a, b = rng.normal(size=(12, 5)), rng.normal(size=12)
        np.testing.assert_allclose(cost_model.nnls(a, b), _brute_nnls(a, b), atol=1e-9)


def _features(rng):
    def counts():
        return {"windows": int(rng.integers(1, 10**5)), "blocks": int(rng.integers(1, 10**6)),
                "longest": int(rng.integers(1, 600)), "columns": int(rng.integers(1, 10**7))}
    return {"nodes": int(rng.integers(1, 10**6)),
            16: {"graph": counts(), "transposed": counts()}, 8: {"graph": counts(), "transposed": counts()}}


def test_fit_recovers_the_coefficients_of_its_model():
    rng = np.random.default_rng(1)
    true = {r: {p: list(rng.uniform(0, 1e-5, 6) * [1e3, 1, 1, 1, 1e2, 1]) for p in ("fwd", "bwd")} for r in (16, 8)}
    true[8]["fwd"][3] = 0.0                                     # a zero coefficient stays zero
    samples = []
    for _ in range(40):
        f = _features(rng)
        for (h, d), r, p in itertools.product([(1, 128), (8, 64)], (16, 8), ("fwd", "bwd")):
            ms = float(np.dot(true[r][p], cost_model.design_row(f, r, p, h, d)))
            samples.append({"features": f, "heads": h, "head_dim": d, "rows": r, "pass": p, "ms": ms})
    got = cost_model.fit(samples)
    assert got["settings"] == [(1, 128), (8, 64)]
    for r, p in itertools.product((16, 8), ("fwd", "bwd")):
        np.testing.assert_allclose(got[r][p], true[r][p], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_features_count_what_the_builders_build(case):
    ei, n = GRAPH_CASES[case]()
    f = cost_model.format_features(ei, n)
    assert f["nodes"] == n
    for rows in (16, 8):
        plan = GraphPlan.from_edge_index(ei, n, window_rows=rows)
        for side, fmt in (("graph", plan.bsb), ("transposed", plan._transposed())):
            per_window = (fmt.rw_offset[1:] - fmt.rw_offset[:-1]).long()
            expect = {"windows": int((per_window > 0).sum()), "blocks": fmt.num_tcbs,
                      "longest": int(per_window.max()) if per_window.numel() else 0,
                      "columns": int((fmt.cols >= 0).sum())}          # exact builds: no capacity padding
            assert f[rows][side] == expect, (rows, side)


def test_features_refuse_an_index_out_of_range():
    with pytest.raises(ValueError, match="edge_index"):
        cost_model.format_features(torch.tensor([[0, 5], [1, 2]]), 4)


def test_shipped_coefficients_are_the_fit_of_the_shipped_run():
    rows = read_csv(CSV)
    refit = cost_model.fit(samples_of([r for r in rows if r["split"] == "calibration"]))
    assert [tuple(s) for s in cost_model.COEFFICIENTS["settings"]] == refit["settings"]
    assert cost_model.COEFFICIENTS["gpu"] == rows[0]["gpu"]
    for r, p in itertools.product((16, 8), ("fwd", "bwd")):
        np.testing.assert_allclose(cost_model.COEFFICIENTS[r][p], refit[r][p], rtol=1e-5)


def test_shipped_model_picks_the_faster_format_where_it_matters():
    """On every graph and setting of the device run (calibration and held
    out): where one format is over 15% faster the model picks it, and its
    picks cost at most 1% over always picking the faster one (geometric)."""
    ev = evaluate(read_csv(CSV), cost_model.COEFFICIENTS)
    assert len(ev) == 69
    clear = [e for e in ev if max(e["ms16"], e["ms8"]) > 1.15 * min(e["ms16"], e["ms8"])]
    assert len(clear) >= 12 and all(e["pick"] == e["best"] for e in clear), \
        [(e["graph"], e["setting"]) for e in clear if e["pick"] != e["best"]]
    assert math.exp(sum(math.log(e["loss"]) for e in ev) / len(ev)) <= 1.01


def test_choice_by_heads_and_head_dim():
    ei, n = GRAPH_CASES["random_1003"]()
    f = cost_model.format_features(ei, n)
    assert cost_model.choose_window_rows(f, 1, 256) == 16          # the 8-row kernels stop at 128
    no_fit = {"settings": [], 16: {"fwd": None, "bwd": None}, 8: {"fwd": None, "bwd": None}}
    with pytest.raises(RuntimeError, match="no fitted coefficients"):
        cost_model.predict(f, 16, 1, 64, coefficients=no_fit)
    with pytest.raises(ValueError, match="give heads and head_dim"):
        cost_model.choose_window_rows(f, coefficients=no_fit)
    # without heads / head_dim: 8 rows only where every setting of the fit predicts them faster
    zero = [0.0] * 6
    split = {"settings": [(1, 64), (8, 64)], 16: {"fwd": [1.0] + zero[1:], "bwd": zero},
             8: {"fwd": [0.0, 0.5 / f[8]["graph"]["windows"]] + zero[2:], "bwd": zero}}   # 8 rows: 0.5 H ms
    assert cost_model.choose_window_rows(f, 1, 64, coefficients=split) == 8
    assert cost_model.choose_window_rows(f, 8, 64, coefficients=split) == 16
    assert cost_model.choose_window_rows(f, coefficients=split) == 16
    assert cost_model.choose_window_rows(f, heads=1, coefficients=split) == 8       # H = 1 in each setting
    # the prediction grows with the heads and the head dim
    assert cost_model.predict(f, 8, 8, 64) > cost_model.predict(f, 8, 1, 64) > cost_model.predict(f, 8, 1, 32)
    assert cost_model.predict(f, 8, 1, 64, backward=False) < cost_model.predict(f, 8, 1, 64)


def test_auto_takes_the_model_choice():
    ei, _ = molecule_batch(64)
    n = int(ei.max()) + 1
    assert GraphPlan.from_edge_index(ei, n, window_rows="auto").window_rows == 8
    banded, nb = generated_graph("banded:4000:32:256", "cpu")          # long, full windows: 16 measured faster
    assert cost_model.choose_window_rows(cost_model.format_features(banded, nb)) == 16
    assert GraphPlan.from_edge_index(banded, nb, window_rows="auto").window_rows == 16
    n = 2000                                             # a hub: 125 blocks in one 8-row window
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])
    assert GraphPlan.from_edge_index(hub, n, window_rows="auto").window_rows == 16


def test_script_refits_from_the_csv_on_the_cpu():
    import subprocess
    import sys
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_kernel.py"
    r = subprocess.run([sys.executable, script, "--fit-cost-model", "--from-csv", str(CSV)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "COEFFICIENTS: dict = {" in r.stdout and "\"settings\": [(1, 128), (8, 32), (8, 64)]" in r.stdout
    assert "held-out: " in r.stderr and "| calibration | github | d128h1fp16 |" in r.stderr
    r = subprocess.run([sys.executable, script, "--from-csv", str(CSV)], capture_output=True, text=True)
    assert r.returncode == 2 and "--from-csv needs --fit-cost-model" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, script, "--fit-cost-model"], capture_output=True, text=True)
        assert r.returncode == 2 and "--fit-cost-model needs a CUDA GPU" in r.stderr
