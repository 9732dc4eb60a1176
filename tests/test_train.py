"""`gt-fused3s train`: the training harness end to end through the CLI, on
the CPU, with generated data (no download, no structure file needed)."""
import csv
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from gt_fused3s.drivers import train
from gt_fused3s.cli import main
from gt_fused3s.data import molecules_dataset, power_law_dataset, structural_task
from gt_fused3s.data.targets import degree_bucket, graph_target, in_degree

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIGS = sorted((REPO / "configs").glob("train*.yaml"))


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _curves(rows):
    """{backend: [loss of step 0, 1, ...]} from the per-step CSV."""
    curves = {}
    for r in rows:
        curves.setdefault(r["backend"], []).append(float(r["loss"]))
    return curves


def _config(tmp_path, **overrides):
    """A tiny config: one batch of 16 generated molecules, 10 blocks of width 16."""
    cfg = {"device": "cpu", "steps": 40, "warmup": 1, "lr": 0.001, "seed": 0,
           "model": {"hidden": 16, "layers": 10},
           "dataset": {"name": "mols", "kind": "molecules", "max_batches": 1,
                       "params": {"num_graphs": 16, "batch_size": 16, "num_features": 8}}}
    cfg.update(overrides)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_default_config_quick_offline_via_cli(tmp_path, capsys):
    """The shipped default, shrunk (--quick) and on its generated fallback
    (--offline): both backends train, the table and the CSV say so."""
    out = tmp_path / "curves.csv"
    rc = main(["train", "--config", "configs/train.yaml", "--device", "cpu", "--quick",
               "--offline", "--no-progress", "--csv", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["backend", "steps", "first", "loss"]
    quick = train.load_config("configs/train.yaml")["quick"]
    for backend in ("fused3s", "pyg"):
        row = next(line for line in lines if line.startswith(backend + " "))
        assert row.split()[1] == str(quick["steps"])
    assert "fp32 on" in table and "(cpu)" in table and "git " in table
    assert "fallback: offline run" in captured.err           # the log says what ran
    rows = _rows(out)
    assert list(rows[0])[:5] == ["step", "backend", "loss", "ms", "timed"]
    assert {r["backend"] for r in rows} == {"fused3s", "pyg"}
    for backend, losses in _curves(rows).items():
        assert len(losses) == quick["steps"] and all(map(math.isfinite, losses))
    steps = [r for r in rows if r["backend"] == "pyg"]
    assert [int(r["step"]) for r in steps] == list(range(quick["steps"]))
    assert [r["timed"] for r in steps] == ["False"] * quick["warmup"] + ["True"] * (
        quick["steps"] - quick["warmup"])
    assert all(float(r["ms"]) > 0 for r in rows)
    assert rows[0]["dtype"] == "fp32" and rows[0]["device"] == "cpu" and rows[0]["git_sha"]


def test_backends_agree_and_the_loss_falls(tmp_path):
    """Same weights, same batches, same function: the losses of fused3s (its
    CPU path) and pyg are equal at step 0 and close after; the generated
    target is learnable, so the loss falls well within 40 steps (on one
    batch, the mean of the last 5 losses is below 0.3x the first for seeds
    0-9; 0.5x is asserted)."""
    cfg = train.load_config(_config(tmp_path))
    rows, curve, task = train.run(cfg, progress=False, log=lambda msg: None)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    curves = _curves([{k: str(v) for k, v in p.items()} for p in curve])
    fused, pyg = curves["fused3s"], curves["pyg"]
    assert fused[0] == pytest.approx(pyg[0], rel=1e-6)
    for a, b in zip(fused[:5], pyg[:5]):
        assert a == pytest.approx(b, rel=1e-3)
    for losses in (fused, pyg):
        assert statistics.mean(losses[-5:]) < 0.5 * losses[0]
    by_backend = {r["backend"]: r for r in rows}
    assert by_backend["pyg"]["speedup_vs_pyg"] == 1.0
    # a CPU has no kernel: fused3s ran the reference path, and no speedup is reported for it
    assert by_backend["fused3s"].get("speedup_vs_pyg") is None
    assert "ran the reference path" in by_backend["fused3s"]["note"]
    assert by_backend["fused3s"]["loss_last"] == pytest.approx(statistics.mean(fused[-5:]))
    assert by_backend["fused3s"].get("peak_mem_mb") is None          # CPU: no peak
    assert task.readout == "graph" and task.loss == "mse" and task.out_channels == 1


@pytest.mark.parametrize("failing", ["pyg", "fused3s"])
def test_oom_is_a_row_and_the_run_goes_on(tmp_path, monkeypatch, capsys, failing):
    from gt_fused3s import backends

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setitem(backends.BACKENDS, failing, out_of_memory)
    out = tmp_path / "o.csv"
    assert main(["train", "--config", str(_config(tmp_path)), "--steps", "3",
                 "--no-progress", "--csv", str(out)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith(failing + " "))
    assert row.endswith("out of memory") and row.split()[1] == "0"
    other = "fused3s" if failing == "pyg" else "pyg"
    assert {r["backend"] for r in _rows(out)} == {other}         # no steps of the failed one
    assert len(_rows(out)) == 3


def test_exit_status_and_clear_errors(tmp_path, monkeypatch, capsys):
    from gt_fused3s import backends

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    for name in ("fused3s", "pyg"):
        monkeypatch.setitem(backends.BACKENDS, name, broken)
    assert main(["train", "--config", str(_config(tmp_path)), "--steps", "2",
                 "--no-progress"]) == 1                         # nothing trained
    assert "RuntimeError: kernel exploded" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:                      # a bad value: one line, 2
        main(["train", "--config", str(_config(tmp_path)), "--backends", "fast"])
    assert err.value.code == 2 and "unknown backends ['fast']" in capsys.readouterr().err
    missing = _config(tmp_path, dataset={"kind": "npz", "params": {"structure": "no/such.npz"}})
    with pytest.raises(SystemExit) as err:                      # no data: one line, 2
        main(["train", "--config", str(missing), "--no-progress"])
    assert err.value.code == 2 and "no/such.npz" in capsys.readouterr().err
    with pytest.raises(ValueError, match="its loss is mse"):     # bce on a real target
        train.run(train.load_config(_config(tmp_path, loss="bce")), progress=False,
                  log=lambda msg: None)


GOOD = {"dataset": {"kind": "molecules"}}


@pytest.mark.parametrize("bad, match", [
    ({**GOOD, "epochs": 3}, "unknown config keys"),
    ({**GOOD, "backends": ["fused3s", "fast"]}, "unknown backends"),
    ({**GOOD, "backends": []}, "no backends"),
    ({**GOOD, "model": {"width": 3}}, "unknown model keys"),
    ({**GOOD, "model": {"hidden": [64, 128]}}, "model.hidden"),
    ({**GOOD, "steps": 0}, "steps must be an int >= 1"),
    ({**GOOD, "steps": 5, "warmup": 5}, "warmup"),
    ({**GOOD, "lr": -1}, "lr must be a positive"),
    ({**GOOD, "target": "labelz"}, "target must be one of"),
    ({**GOOD, "loss": "hinge"}, "loss must be one of"),
    ({**GOOD, "quick": {"dataset": {}}}, "unknown quick keys"),
    ({**GOOD, "dtype": "fp8"}, "dtype"),
    ({}, "names no dataset"),
    ({"dataset": {"kind": "molecules", "parms": {}}}, "unknown keys"),
    ({"dataset": {"kind": "nope"}}, "kind 'nope' is unknown"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        train.validate_config(bad)


def test_shipped_train_configs():
    """Every configs/train*.yaml is valid; the 200k graph is the study's."""
    assert [p.name for p in TRAIN_CONFIGS] == ["train-200k.yaml", "train-ddp-zinc1024.yaml",
                                               "train-molhiv.yaml", "train-scale-powerlaw.yaml",
                                               "train-zinc1024.yaml", "train.yaml"]
    multi_gpu = {"train-ddp-zinc1024.yaml", "train-scale-powerlaw.yaml"}     # fused3s alone, under torchrun
    for path in TRAIN_CONFIGS:
        cfg = train.load_config(path)
        want = ["fused3s"] if path.name in multi_gpu else ["fused3s", "pyg"]
        assert cfg["model"]["layers"] == 10 and cfg["backends"] == want
        assert "fallback" in cfg["dataset"] or cfg["dataset"]["kind"] == "powerlaw"
        train.quick_config(cfg)
    study = yaml.safe_load((REPO / "configs/study.yaml").read_text())
    study_200k = next(d for d in study["datasets"] if d["name"] == "powerlaw-200k")
    big = train.load_config("configs/train-200k.yaml")
    assert big["dataset"]["params"] == study_200k["params"]
    assert big["steps"] - big["warmup"] == 5
    molhiv = train.load_config("configs/train-molhiv.yaml")
    assert molhiv["dataset"]["kind"] == "ogb" and molhiv["target"] == "auto"


def test_quick_config_overrides():
    cfg = train.quick_config(train.load_config("configs/train.yaml"))
    assert cfg["steps"] == 8 and cfg["warmup"] == 1 and cfg["lr"] == 0.001
    assert cfg["model"]["hidden"] == 16 and cfg["model"]["layers"] == 10   # merged


def test_single_graph_node_target_quick(tmp_path, capsys):
    """The 200k config's code path (one graph, node readout, format built
    once), shrunk."""
    out = tmp_path / "big.csv"
    assert main(["train", "--config", "configs/train-200k.yaml", "--device", "cpu", "--quick",
                 "--no-progress", "--csv", str(out)]) == 0
    assert "node-level mse" in capsys.readouterr().out
    curves = _curves(_rows(out))
    assert len(curves["fused3s"]) == 4
    assert curves["fused3s"][0] == pytest.approx(curves["pyg"][0], rel=1e-6)


def test_dataset_labels_pick_the_loss(tmp_path):
    """A dataset with labels trains on them (auto): PyG's FakeDataset, 3 classes
    (32 graphs, so that every class occurs whatever torch's random stream:
    labels of only 0 and 1 would rightly be taken for binary)."""
    path = _config(tmp_path, steps=3, dataset={
        "name": "fake", "kind": "pyg",
        "params": {"cls": "FakeDataset", "num_graphs": 32, "avg_num_nodes": 12,
                   "num_channels": 4, "num_classes": 3, "task": "graph", "batch_size": 16}})
    rows, curve, task = train.run(train.load_config(path), progress=False, log=lambda m: None)
    assert task.target == "labels" and task.loss == "ce" and task.out_channels == 3
    assert [r["status"] for r in rows] == ["ok", "ok"] and len(curve) == 6


def test_label_loss_and_masked_loss():
    assert train.label_loss(torch.tensor([[0], [1]]), 1) == ("bce", 1)      # ogbg-molhiv
    assert train.label_loss(torch.tensor([0, 2, 5]), 4) == ("ce", 6)
    assert train.label_loss(torch.tensor([[0.0, 1.0], [1.0, math.nan]]), 2) == ("bce", 2)
    assert train.label_loss(torch.tensor([0.5, -2.0]), None) == ("mse", 1)
    assert train.label_loss(torch.tensor([0.5, -2.0]), None, "bce") == ("bce", 1)
    out = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = torch.tensor([[0.0, math.nan], [3.0, 5.0]])                      # NaN: no label
    assert float(train.compute_loss("mse", out, y)) == pytest.approx((1 + 0 + 1) / 3)
    order = train.step_order(3, 7, 0)                            # every batch once per epoch
    assert len(order) == 7 and sorted(order[:3]) == [0, 1, 2] == sorted(order[3:6])


def test_structural_targets():
    assert degree_bucket(torch.tensor([0, 1, 7, 8, 15, 16, 10**6])).tolist() == [
        0, 1, 7, 8, 8, 9, 15]
    # a star of 4 nodes (hub 0) and a path of 3: mean degree and leaf fraction
    from gt_fused3s.data import make_data, symmetric_coalesce
    ei = symmetric_coalesce(torch.tensor([0, 0, 0, 4, 5]), torch.tensor([1, 2, 3, 5, 6]), 7)
    data = make_data(torch.zeros(7, 1), ei, 7, ptr=torch.tensor([0, 4, 7]))
    assert graph_target(data, in_degree(data)).tolist() == pytest.approx(
        [6 / 4 / 4 + 3 / 4, 4 / 3 / 4 + 2 / 3])
    batches = structural_task([molecules_dataset(num_graphs=8, batch_size=4).get(i)
                               for i in range(2)], "graph", 5)
    y = torch.cat([b.y for b in batches])
    assert y.shape == (8, 1) and float(y.mean()) == pytest.approx(0, abs=1e-6)
    assert batches[0].x.shape[1] == 5
    # the same degree -> the same feature vector, in every batch
    deg = in_degree(batches[0])
    same = deg == deg[0]
    assert torch.equal(batches[0].x[same], batches[0].x[0].expand(int(same.sum()), -1))
    node = structural_task([power_law_dataset(num_nodes=300, avg_degree=6, max_degree=30)[0]],
                           "node", 4)[0]
    assert node.y.shape == (300, 1) and float(node.y.std()) == pytest.approx(1, rel=1e-4)


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fig" / "loss.png"
    assert main(["train", "--config", str(_config(tmp_path)), "--steps", "3", "--no-progress",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_script_is_a_thin_cli(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/train.py"), "--config",
                           str(_config(tmp_path)), "--steps", "2", "--backends", "pyg",
                           "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "pyg" in proc.stdout and "gt-fused3s train: device" in proc.stderr


def test_edge_features_train_the_same_on_every_backend(tmp_path):
    """model.edge_features: an attention bias per block from the batches'
    bond types; fused3s (its CPU path) and pyg give the same losses, and the
    edge encoders learn (their weights move)."""
    cfg = train.load_config(_config(tmp_path, steps=8, model={"hidden": 16, "layers": 3,
                                                              "edge_features": True}))
    rows, curve, task = train.run(cfg, progress=False, log=lambda msg: None)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert task.edge_vocab == (4,)
    curves = _curves([{k: str(v) for k, v in p.items()} for p in curve])
    for a, b in zip(curves["fused3s"], curves["pyg"]):
        assert a == pytest.approx(b, rel=1e-3)
    model = train.build_model(task, cfg, torch.device("cpu"))
    assert all(b.edge_encoder is not None for b in model.blocks)
    data = task.batches[0]
    with pytest.raises(ValueError, match="pass edge_attr"):
        model(data.x, data.edge_index, data.batch)


def test_ctrl_c_keeps_the_finished_runs(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second run: the first run's row and curve are
    printed and written; exit status 130."""
    real = train.train_backend

    def second_interrupted(model, initial, name, *args):
        if name == "pyg":
            raise KeyboardInterrupt
        return real(model, initial, name, *args)

    monkeypatch.setattr(train, "train_backend", second_interrupted)
    out = tmp_path / "curves.csv"
    assert main(["train", "--config", str(_config(tmp_path, steps=3)), "--no-progress",
                 "--csv", str(out)]) == 130
    assert {r["backend"] for r in csv.DictReader(open(out))} == {"fused3s"}
    assert "interrupted (Ctrl-C): the 1 finished runs above" in capsys.readouterr().err
