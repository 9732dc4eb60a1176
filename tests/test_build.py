"""The lazy build explains why the kernel cannot run, once, without raising
from extension_available() (checked here by faking each missing piece)."""
import pytest
import torch
from torch.utils import cpp_extension

import gt_fused3s
from gt_fused3s import _build


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    monkeypatch.setattr(_build, "_OPS", None)
    monkeypatch.setattr(_build, "_FAILURE", None)


def _pretend_cuda_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_cpu_only_torch():
    assert _build.extension_available() is False
    assert gt_fused3s.WITH_CUDA_EXT is False
    with pytest.raises(RuntimeError, match="CPU-only build; the fused kernel needs a CUDA build"):
        _build.load_extension()
    assert "CPU-only" in _build.failure_reason()


def test_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        _build.load_extension()


def test_no_nvcc(monkeypatch):
    _pretend_cuda_torch(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(RuntimeError, match=r"no CUDA toolchain found \(nvcc\)"):
        _build.load_extension()
    # the failure is remembered: later calls answer at once, the same way
    assert _build.extension_available() is False
    with pytest.raises(RuntimeError, match="no CUDA toolchain"):
        _build.load_extension()


def test_no_ninja(monkeypatch):
    _pretend_cuda_torch(monkeypatch)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match="ninja is needed"):
        _build.load_extension()


def test_sources_are_found_and_complete():
    csrc = _build._csrc_dir()
    sources, deps = _build._sources(csrc)
    names = {p.rsplit("/", 1)[-1] for p in sources}
    assert "bindings.cpp" in names and "bsb_build.cu" in names
    assert any(n.startswith("fused3s_fwd_hdim") for n in names)
    assert any(p.name == "fused3s_params.h" for p in deps)
