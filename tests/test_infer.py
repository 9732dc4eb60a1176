"""The main job: `gt-fused3s infer` on the default config's code path, in a
tiny setting (--quick), end to end through the CLI."""
import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gt_fused3s.drivers import infer
from gt_fused3s.cli import main

REPO = Path(__file__).resolve().parents[1]
CPU_BACKENDS = ["fused3s", "pyg", "reference", "dense"]


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_default_config_quick_via_cli(tmp_path, capsys):
    out = tmp_path / "infer.csv"
    rc = main(["infer", "--device", "cpu", "--config", "configs/default.yaml", "--quick", "--no-progress",
               "--csv", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    rows = _rows(out)
    datasets = [d["name"] for d in yaml.safe_load(open(REPO / "configs/default.yaml"))["datasets"]]
    assert sorted({r["dataset"] for r in rows}) == sorted(datasets)
    for name in datasets:
        by_backend = {r["backend"]: r for r in rows if r["dataset"] == name}
        assert set(by_backend) == {"fused3s", "pyg", "reference", "dense", "flex"}
        assert by_backend["flex"]["status"] == "skipped"               # CPU: CUDA only
        for b in CPU_BACKENDS:
            r = by_backend[b]
            assert r["status"] == "ok", r["note"]
            assert float(r["ms_median"]) > 0 and 0 < float(r["attn_share"]) < 1
            assert float(r["attn_ms"]) > 0 and float(r["format_ms"]) > 0
            assert float(r["max_abs_diff"]) < 1e-4                      # agreement
            if b == "fused3s":      # no kernel on a CPU: the reference path, no speedup reported
                assert r["speedup_vs_pyg"] == "" and "ran the reference path" in r["note"]
            else:
                assert float(r["speedup_vs_pyg"]) > 0
            assert f"{name} " in table and b in table
        assert float(by_backend["pyg"]["speedup_vs_pyg"]) == 1.0
        assert float(by_backend["reference"]["max_abs_diff"]) == 0.0
    assert rows[0]["device"] == "cpu" and rows[0]["dtype"] == "fp32"
    assert table.splitlines()[0].split()[:5] == ["dataset", "C", "backend", "N/fwd", "E/fwd"]
    _check_speedups(rows)
    assert "synthetic structures: molecules" in table and "real structures: none" in table
    assert "fused3s: no speedup reported: with no CUDA kernel on cpu it ran the reference path" in table


def _check_speedups(rows):
    """speedup_vs_b of backend a = ms(b) / ms(a), for every pair of ok rows
    of one dataset and hidden size; none against a backend that did not run."""
    groups = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["hidden"]), []).append(r)
    for group in groups.values():
        ok = {r["backend"]: r for r in group if r["status"] == "ok" and "reference path" not in r["note"]}
        for r in group:         # fused3s on a CPU: the reference path, no speedups either way
            if "reference path" in r["note"]:
                assert all(r[f"speedup_vs_{b}"] == "" for b in infer.BACKENDS)
        for a, ra in ok.items():
            for b in infer.BACKENDS:
                value = ra[f"speedup_vs_{b}"]
                if b in ok:
                    assert float(value) == pytest.approx(
                        float(ok[b]["ms_median"]) / float(ra["ms_median"]), rel=1e-9)
                    assert float(value) * float(ok[b][f"speedup_vs_{a}"]) == pytest.approx(1.0)
                else:
                    assert value == ""


def test_overrides_skips_and_missing_data(tmp_path, capsys):
    cfg = {"warmup": 0, "repeats": 1, "backends": ["pyg", "dense"],
           "max_nodes": {"dense": 10}, "model": {"hidden": 16, "layers": 2, "heads": 2},
           "datasets": [{"name": "mols", "kind": "molecules",
                         "params": {"num_graphs": 6, "batch_size": 3}, "max_batches": 1},
                        {"name": "gone", "kind": "npz", "params": {"structure": "no/such.npz"}}]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "o.csv"
    assert main(["infer", "--device", "cpu", "--config", str(path), "--backends", "reference,pyg", "dense",
                 "--no-progress", "--csv", str(out)]) == 0
    rows = {(r["dataset"], r["backend"]): r for r in _rows(out)}
    assert rows["mols", "reference"]["status"] == "ok"
    assert rows["mols", "reference"]["batches"] == "1"
    assert rows["mols", "dense"]["status"] == "skipped"
    assert "max_nodes.dense=10" in rows["mols", "dense"]["note"]
    assert rows["gone", "-"]["status"] == "error" and "no/such.npz" in rows["gone", "-"]["note"]
    assert rows["mols", "pyg"]["hidden"] == "16"
    # --datasets picks entries; an unknown one is an error with a clear line
    assert main(["infer", "--device", "cpu", "--config", str(path), "--datasets", "mols", "--backends", "pyg",
                 "--no-progress"]) == 0
    with pytest.raises(SystemExit) as err:
        main(["infer", "--device", "cpu", "--config", str(path), "--datasets", "nope"])
    assert err.value.code == 2 and "nope" in capsys.readouterr().err


@pytest.mark.parametrize("bad, match", [
    ({"datasets": [{"kind": "molecules"}], "bogus": 1}, "unknown config keys"),
    ({"datasets": [{"kind": "molecules"}], "backends": ["fast"]}, "unknown backends"),
    ({"datasets": [{"kind": "molecules"}], "model": {"width": 3}}, "unknown model keys"),
    ({"datasets": [{"kind": "molecules", "parms": {}}]}, "unknown keys"),
    ({"datasets": []}, "no datasets"),
    ({"datasets": [{"kind": "molecules"}], "dtype": "fp8"}, "dtype"),
    ({"datasets": [{"kind": "molecules"}], "model": {"hidden": [64, 0]}}, "model.hidden"),
    ({"datasets": [{"kind": "molecules", "fallback": {"kind": "nope"}}]}, "unknown"),
    ({"datasets": [{"kind": "molecules"}], "repeats": 0}, r"repeats must be an int >= 1 \(got 0\)"),
    ({"datasets": [{"kind": "molecules"}], "warmup": -1}, r"warmup must be an int >= 0 \(got -1\)"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        infer.validate_config(bad)


def test_cli_errors_are_one_line(tmp_path, capsys):
    """A broken YAML, a CSV that infer did not write, CUDA asked for where
    there is none: exit 2 with one line naming the problem."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("datasets: [1,\n")
    other = tmp_path / "other.csv"
    other.write_text("x,y\n1,2\n")
    cases = [(["infer", "--config", str(bad)], r"is not valid YAML \(line 2, column 1\)"),
             (["plot", str(other), str(tmp_path / "o.png")], "is not a CSV of gt-fused3s infer --csv")]
    if not torch.cuda.is_available():
        cases.append((["train", "--device", "cuda", "--quick", "--offline"], "CUDA is not available here"))
    for argv, match in cases:
        with pytest.raises(SystemExit) as err:
            main(argv)
        msg = capsys.readouterr().err.strip()
        assert err.value.code == 2 and len(msg.splitlines()) == 1, msg
        assert re.search(match, msg), msg


def test_every_shipped_config_is_valid():
    # configs/train*.yaml are gt-fused3s train's (checked in test_train.py),
    # configs/bench-*.yaml those of the scripts/bench_*.py they name
    configs = sorted(p for p in (REPO / "configs").glob("*.yaml")
                     if not p.name.startswith(("train", "bench-")))
    assert (REPO / "configs/default.yaml") in configs
    for path in configs:
        cfg = infer.load_config(path)
        assert cfg["datasets"], path


def test_npz_config_quick(tmp_path):
    from gt_fused3s.data import data_dirs
    if not any((d / "zinc.npz").is_file() for d in data_dirs()):
        pytest.skip("zinc.npz not found in $GT_FUSED3S_DATA, ../shared/data or .data")
    out = tmp_path / "zinc.csv"
    assert main(["infer", "--device", "cpu", "--config", "configs/zinc.yaml", "--quick", "--no-progress",
                 "--backends", "fused3s", "reference", "--csv", str(out)]) == 0
    rows = _rows(out)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert float(rows[0]["graphs_per_fwd"]) == 64 and float(rows[0]["max_abs_diff"]) < 1e-4


def test_script_is_a_thin_cli(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/infer.py"), "--quick",
                           "--datasets", "molecules", "--backends", "pyg", "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "molecules" in proc.stdout and "pyg" in proc.stdout


def _tiny_config(tmp_path, **overrides):
    cfg = {"warmup": 0, "repeats": 1, "backends": ["fused3s", "pyg", "reference"],
           "model": {"hidden": 16, "layers": 2, "heads": 2},
           "datasets": [{"name": "mols", "kind": "molecules",
                         "params": {"num_graphs": 6, "batch_size": 3}},
                        {"name": "plaw", "kind": "powerlaw",
                         "params": {"num_nodes": 200, "avg_degree": 4, "max_degree": 30}}]}
    cfg.update(overrides)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("failing", ["pyg", "reference"])
def test_oom_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch, failing):
    from gt_fused3s import backends

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setitem(backends.BACKENDS, failing, out_of_memory)
    out = tmp_path / "o.csv"
    assert main(["infer", "--device", "cpu", "--config", str(_tiny_config(tmp_path)),
                 "--no-progress", "--csv", str(out)]) == 0
    rows = {(r["dataset"], r["backend"]): r for r in _rows(out)}
    assert {d for d, _ in rows} == {"mols", "plaw"}                # both datasets ran
    for dataset in ("mols", "plaw"):
        assert rows[dataset, failing]["status"] == "oom"
        assert rows[dataset, failing]["note"] == "out of memory"
        assert rows[dataset, failing]["ms_median"] == ""
        ok = [b for b in ("fused3s", "pyg", "reference") if b != failing]
        for b in ok:
            assert rows[dataset, b]["status"] == "ok"
            assert rows[dataset, b][f"speedup_vs_{failing}"] == ""
        if failing == "reference":                                 # no agreement target
            assert rows[dataset, "fused3s"]["max_abs_diff"] == ""
            assert "no reference outputs" in rows[dataset, "fused3s"]["note"]
        else:
            assert float(rows[dataset, "fused3s"]["max_abs_diff"]) < 1e-4
    _check_speedups(_rows(out))


def test_hidden_list_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "o.csv", tmp_path / "fig" / "speedups.png"
    path = _tiny_config(tmp_path, model={"hidden": [8, 16], "layers": 1, "heads": 1})
    assert main(["infer", "--device", "cpu", "--config", str(path), "--no-progress",
                 "--csv", str(out), "--plot", str(png), "--no-prefetch"]) == 0
    rows = _rows(out)
    assert sorted({(r["dataset"], r["hidden"]) for r in rows}) == [
        ("mols", "16"), ("mols", "8"), ("plaw", "16"), ("plaw", "8")]
    assert all(r["prefetch"] == "False" for r in rows)
    _check_speedups(rows)
    # a CPU run: fused3s ran the reference path, so it has no speedups to draw
    assert not png.exists()
    captured = capsys.readouterr()
    assert "no plot: fused3s has no speedups" in captured.err
    assert "fused3s speedup, geometric mean" not in captured.out
    assert all(float(r["speedup_vs_reference"]) > 0 for r in rows if r["backend"] == "pyg")   # the rest remain
    # pyg's chart, from the CSV; its groups: each (dataset, hidden), values or labels
    png2 = tmp_path / "again.png"
    assert main(["plot", str(out), str(png2), "--backend", "pyg"]) == 0 and png2.stat().st_size > 1000
    with pytest.raises(SystemExit):
        main(["plot", str(out), str(png2)])
    assert "no speedups of fused3s in the rows" in capsys.readouterr().err
    from gt_fused3s.bench.plot import speedup_groups
    assert speedup_groups(rows)[0] == []
    for r in rows:                                  # as if reference had run out of memory on one
        if (r["dataset"], r["hidden"]) == ("mols", "8"):
            r.update({"status": "oom"} if r["backend"] == "reference" else {"speedup_vs_reference": ""})
    labels, others, values = speedup_groups(rows, "pyg")
    assert labels == ["mols\nC=8", "mols\nC=16", "plaw\nC=8", "plaw\nC=16"]
    assert others == ["fused3s", "reference"]
    assert values[0]["reference"] == "OOM" and isinstance(values[1]["reference"], float)
    assert values[1]["fused3s"] == ""


def test_streamed_and_single_rows(tmp_path):
    out = tmp_path / "o.csv"
    assert main(["infer", "--device", "cpu", "--config", str(_tiny_config(tmp_path)),
                 "--no-progress", "--csv", str(out), "--backends", "fused3s"]) == 0
    mols, plaw = _rows(out)
    # a collection: 2 batches streamed, throughput; a single graph: no throughput
    assert mols["level"] == "graph" and mols["batches"] == "2" and float(mols["graphs_per_s"]) > 0
    assert plaw["level"] == "node" and plaw["batches"] == "1" and plaw["graphs_per_s"] == ""
    assert float(mols["format_ms"]) > 0 and float(plaw["format_ms"]) > 0
    assert mols["structure"] == plaw["structure"] == "synthetic"


# ------------------------------------------------------- the paper's study
PAPER_BATCHED = ["Peptides-func", "Peptides-struct", "PascalVOC-SP", "COCO-SP", "ogbg-molhiv",
                 "ogbg-molpcba", "ogbg-ppa", "ogbg-code2", "ZINC"]
PAPER_SINGLE = ["Cora", "Citeseer", "Pubmed", "GitHub", "ogbn-arxiv", "ogbn-products", "Reddit",
                "Yelp", "AmazonProducts"]


def _needs_shared_data():
    from gt_fused3s.data import data_dirs
    names = ("zinc", "molhiv", "peptides", "cora", "citeseer", "pubmed", "github")
    if not all(any((d / f"{n}.npz").is_file() for d in data_dirs()) for n in names):
        pytest.skip("the npz files of shared/data are not in $GT_FUSED3S_DATA, "
                    "../shared/data or .data")


def test_offline_study_config_resolves():
    from gt_fused3s.bench.kernel import POWERLAW
    from gt_fused3s.data import load_dataset
    _needs_shared_data()
    cfg = infer.load_config("configs/study.yaml")
    assert cfg["model"]["hidden"] == [64, 128] and cfg["model"]["layers"] == 10
    assert cfg["model"]["heads"] == 1 and cfg["dtype"] == "fp16"
    assert cfg["backends"] == ["fused3s", "pyg", "reference", "dense", "flex"]
    names = [d["name"] for d in cfg["datasets"]]
    assert names == ["zinc", "molhiv", "peptides", "cora", "pubmed", "github", "powerlaw-200k",
                     "powerlaw-1m"]
    for spec in cfg["datasets"]:
        ds = load_dataset(spec)                     # lazy: reads npz files, generates nothing
        if spec["kind"] == "npz":
            assert not ds.info.get("synthetic")
            if ds.level == "graph":
                assert spec["params"]["batch_size"] == 1024 and spec["max_batches"] <= 8
        else:
            assert ds.info["synthetic"] and ds.level == "node"
            p = spec["params"]
            assert {k: p[k] for k in ("alpha", "max_degree", "avg_degree")} == {
                k: POWERLAW[k] for k in ("alpha", "max_degree", "avg_degree")}
        small = load_dataset(spec, quick=True)[0]
        assert small.num_nodes > 0 and small.edge_index.size(1) > 0
    assert {d["params"]["num_nodes"] for d in cfg["datasets"] if d["kind"] == "powerlaw"} == {
        200_000, 1_000_000}


@pytest.mark.parametrize("config, names", [("configs/study-batched.yaml", PAPER_BATCHED),
                                           ("configs/study-single.yaml", PAPER_SINGLE)])
def test_online_study_configs_fall_back_offline(config, names):
    from gt_fused3s.data import load_dataset
    _needs_shared_data()
    cfg = infer.load_config(config)
    assert [d["name"] for d in cfg["datasets"]] == names
    assert cfg["model"]["hidden"] == [64, 128, 256] and cfg["model"]["layers"] == 10
    for spec in cfg["datasets"]:
        assert spec["kind"] in ("ogb", "lrgb", "pyg") and "fallback" in spec
        if config.endswith("batched.yaml"):
            assert spec["params"]["batch_size"] == 1024
        ds = load_dataset(spec, quick=True, offline=True)
        assert ds.info["fallback_reason"] == "offline run" and ds.name == spec["name"]
        assert ds.level == ("graph" if config.endswith("batched.yaml") else "node")
        b = ds[0]
        assert b.num_nodes > 0 and b.x.size(1) == ds.num_features


def test_edge_features_rows_agree_and_dense_is_skipped(tmp_path):
    """model.edge_features: every backend that takes a per-edge bias agrees
    with the reference; dense (no per-edge bias) is a skipped row."""
    out = tmp_path / "o.csv"
    cfg = _tiny_config(tmp_path, backends=["fused3s", "pyg", "reference", "dense"],
                       model={"hidden": 16, "layers": 2, "heads": 2, "edge_features": True})
    assert main(["infer", "--device", "cpu", "--config", str(cfg), "--no-progress", "--csv", str(out)]) == 0
    rows = _rows(out)
    for r in rows:
        if r["backend"] == "dense":
            assert r["status"] == "skipped" and "per-edge bias" in r["note"]
        else:
            assert r["status"] == "ok", r
            assert float(r["max_abs_diff"] or 0) < 1e-4


def test_ctrl_c_keeps_the_finished_rows(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second dataset: the first one's rows are printed and
    written, and the exit status is a shell's for an interrupt (130)."""
    real = infer._run_dataset

    def second_interrupted(spec, s, rows):
        if spec["name"] == "plaw":
            raise KeyboardInterrupt
        real(spec, s, rows)

    monkeypatch.setattr(infer, "_run_dataset", second_interrupted)
    out = tmp_path / "o.csv"
    assert main(["infer", "--device", "cpu", "--config", str(_tiny_config(tmp_path)), "--no-progress",
                 "--csv", str(out)]) == 130
    assert {r["dataset"] for r in _rows(out)} == {"mols"}
    captured = capsys.readouterr()
    assert "mols" in captured.out and "interrupted (Ctrl-C): 3 finished rows above and in" in captured.err


def test_quick_on_a_cpu_is_fp32_and_keeps_dense_small():
    """--quick on a CPU (a smoke run: configs/study.yaml took 9 min on 2
    cores, study-single.yaml more than 18): fp32 instead of fp16 (emulated
    on CPUs), the smallest hidden size, the O(N^2) dense backend on small
    graphs only, each said on the log; a GPU run keeps the config."""
    cfg = infer.load_config(infer.resolve_config_path("configs/study.yaml"))
    said = []
    quick = infer._quick_on_cpu(cfg, torch.device("cpu"), torch.float16, said.append)
    assert quick["dtype"] == "fp32" and quick["max_nodes"]["dense"] == infer.QUICK_CPU_DENSE_NODES
    assert quick["model"]["hidden"] == [64]
    assert len(said) == 3 and "hidden 64 only" in said[0] and "fp32 instead of fp16" in said[1]
    assert cfg["dtype"] == "fp16" and cfg["model"]["hidden"] == [64, 128]              # not modified
    assert cfg["max_nodes"]["dense"] > infer.QUICK_CPU_DENSE_NODES
    assert infer._quick_on_cpu(cfg, torch.device("cuda"), torch.float16, said.append) is cfg
    assert infer._skip_reason("dense", torch.device("cpu"), 2708, quick["max_nodes"], 1).startswith("skipped")
