"""The main job: `gt-fused3s infer` on the default config's code path, in a
tiny setting (--quick), end to end through the CLI."""
import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gt_fused3s.bench import infer
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
            assert float(r["speedup_vs_pyg"]) > 0
            assert f"{name} " in table and b in table
        assert float(by_backend["pyg"]["speedup_vs_pyg"]) == 1.0
        assert float(by_backend["reference"]["max_abs_diff"]) == 0.0
    assert rows[0]["device"] == "cpu" and rows[0]["dtype"] == "fp32"
    assert table.splitlines()[0].split()[:4] == ["dataset", "backend", "N/fwd", "E/fwd"]


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
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        infer.validate_config(bad)


def test_every_shipped_config_is_valid():
    configs = sorted((REPO / "configs").glob("*.yaml"))
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
