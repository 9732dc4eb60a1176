"""A wheel is a real package: it carries the CUDA sources (so an installed
package can compile its kernel on first use) and the configs (so
``gt-fused3s infer --config configs/default.yaml`` works outside a
checkout), and config paths resolve through the installed package."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gt_fused3s.bench import common

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_the_cuda_sources_and_the_configs(tmp_path):
    src = tmp_path / "src"         # a copy: the build leaves build/ and egg-info behind
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in ("gt_fused3s", "csrc", "configs"):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel, = (tmp_path / "dist").glob("gt_fused3s-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {"gt_fused3s/csrc/bindings.cpp"}
    expected |= {f"gt_fused3s/csrc/kernels/{p.name}" for p in (ROOT / "csrc" / "kernels").iterdir() if p.is_file()}
    expected |= {f"gt_fused3s/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    assert len(expected) > 20 and expected <= names, sorted(expected - names)


def test_configs_resolve_through_the_installed_package(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "gt_fused3s"
    (package / "configs").mkdir(parents=True)
    shutil.copy2(ROOT / "configs" / "default.yaml", package / "configs" / "default.yaml")
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path / "no-checkout")
    monkeypatch.setattr(common, "PACKAGE_ROOT", package)
    monkeypatch.chdir(tmp_path)
    found = common.resolve_config_path("configs/default.yaml", None)
    assert found == (package / "configs" / "default.yaml").resolve()
    assert common.shipped_config("default.yaml") == package / "configs" / "default.yaml"
    with pytest.raises(FileNotFoundError, match="tried .*no-checkout.*site-packages"):
        common.resolve_config_path("configs/missing.yaml", None)


def test_an_installed_package_reports_no_foreign_git_sha(tmp_path, monkeypatch):
    """A virtual environment inside someone's repository must not label our
    results with that repository's sha."""
    import subprocess
    import gt_fused3s
    monkeypatch.delenv("GT_FUSED3S_GIT_SHA", raising=False)
    outer = tmp_path / "their-project"
    site = outer / ".venv" / "lib" / "python3" / "site-packages"
    site.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    monkeypatch.setattr(common, "REPO_ROOT", site.parent)
    assert common.git_sha() == f"unknown (installed gt-fused3s {gt_fused3s.__version__})"
    monkeypatch.setattr(common, "REPO_ROOT", ROOT)        # the checkout: its own sha
    assert "installed" not in common.git_sha()
