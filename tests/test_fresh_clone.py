"""Every shipped config on a fresh clone: no npz files of ``../shared/data``,
no ``$GT_FUSED3S_DATA``, no network (every name lookup fails) and no
standard input. Each dataset either loads (a real loader, or its fallback)
or fails in one line that says what to do; nothing waits on stdin; the
download's own error is shown beside the fallback's."""
from __future__ import annotations

import io
import socket
import sys
from pathlib import Path

import pytest
import yaml

from gt_fused3s.cli import main
from gt_fused3s.data import base, load_dataset

REPO = Path(__file__).resolve().parents[1]
#: configs with datasets (bench-sequence.yaml drives a kernel benchmark)
CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml")
                 if "dataset" in yaml.safe_load(p.read_text()) or "datasets" in yaml.safe_load(p.read_text()))
#: what a failure must tell the user to do (one of)
WHAT_TO_DO = ("set GT_FUSED3S_DATA", "pip install", "without --offline")


class _NoStdin(io.StringIO):
    def readline(self, *args):
        raise AssertionError("read standard input")

    read = readline


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """The checkout is an empty folder with no ../shared/data beside it."""
    clone = tmp_path / "work" / "clone"
    clone.mkdir(parents=True)
    monkeypatch.setattr(base, "REPO_ROOT", clone)
    monkeypatch.delenv(base.DATA_ENV, raising=False)
    monkeypatch.chdir(clone)

    def no_network(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution (no network in this test)")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.setattr(sys, "stdin", _NoStdin())
    return clone


def _entries(name: str) -> list[dict]:
    cfg = yaml.safe_load((REPO / "configs" / name).read_text())
    return cfg.get("datasets") or [cfg["dataset"]]


def test_the_configs_are_found():
    assert {"default.yaml", "cora.yaml", "zinc.yaml", "ogbg-molhiv.yaml", "train.yaml",
            "train-molhiv.yaml", "study-single.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "online"])
@pytest.mark.parametrize("config", CONFIGS)
def test_each_dataset_loads_or_fails_in_one_line_that_says_what_to_do(fresh_clone, config, offline):
    for spec in _entries(config):
        try:
            ds = load_dataset(spec, quick=True, offline=offline)
        except (OSError, ImportError, RuntimeError) as err:
            msg = str(err)
            assert "\n" not in msg and any(h in msg for h in WHAT_TO_DO), msg
            if spec.get("fallback") and not offline:         # the download's own error, then the fallback's
                assert "could not be downloaded" in msg and "the fallback" in msg and "failed too" in msg, msg
            continue
        assert ds[0].num_nodes > 0
        if spec.get("fallback"):
            assert ds.info["fallback_reason"]


def test_a_config_whose_files_are_missing_fails_in_one_line(fresh_clone, capsys):
    rc = main(["infer", "--device", "cpu", "--config", "configs/cora.yaml", "--quick", "--offline",
               "--no-progress", "--backends", "reference"])
    err = capsys.readouterr().err
    assert rc == 1
    line, = [s for s in err.splitlines() if s.startswith("cora: dataset not loaded")]
    assert line.endswith("set GT_FUSED3S_DATA to the folder that holds cora.npz"), line
    assert "shared/data/cora.npz" in line and "..." not in line
    with pytest.raises(SystemExit) as stop:
        main(["train", "--device", "cpu", "--config", "configs/train-molhiv.yaml", "--quick", "--offline",
              "--no-progress"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    line, = [s for s in err.splitlines() if "error:" in s]
    assert "ogbg-molhiv: offline run; the fallback (npz) failed too" in line
    assert "set GT_FUSED3S_DATA to the folder that holds molhiv.npz" in line and "without --offline" in line


def test_an_installed_package_keeps_its_data_out_of_site_packages(tmp_path, monkeypatch):
    """Outside a checkout, downloads go to the user's cache and the data
    folders of a checkout are not searched."""
    site = tmp_path / "lib" / "python3" / "site-packages"
    monkeypatch.setattr(base, "REPO_ROOT", site.parent)
    monkeypatch.setattr(base, "IN_CHECKOUT", False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(base.DATA_ENV, raising=False)
    (site.parent.parent / "shared" / "data").mkdir(parents=True)
    assert base.download_root() == tmp_path / "cache" / "gt_fused3s" / "datasets"
    assert base.data_dirs() == []
    monkeypatch.setattr(base, "IN_CHECKOUT", True)
    assert base.download_root() == site.parent / ".data" / "datasets"
