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


# ------------------------------------------- ahead-of-time build (setup.py)
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_ahead_of_time_build_is_off_by_default_and_fails_in_one_line_without_cuda_torch():
    """GT_FUSED3S_BUILD_EXT=1 at install time builds the kernel with
    torch.utils.cpp_extension; by default setup.py needs no torch at all
    (test_packaging builds the wheel so), and on a CPU-only torch the switch
    is one clear line."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "GT_FUSED3S_BUILD_EXT"}
    out = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = ['setup.py', '--version']; "
                          "sys.modules['torch'] = None; runpy.run_path('setup.py')"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == gt_fused3s.__version__, out.stderr
    if torch.version.cuda is None:
        out = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120, env={**env, "GT_FUSED3S_BUILD_EXT": "1"})
        assert out.returncode != 0
        assert out.stderr.strip().splitlines() == [
            f"gt-fused3s: GT_FUSED3S_BUILD_EXT=1: torch {torch.__version__} is a CPU-only build; "
            f"the kernel needs a CUDA build of torch"]


def test_arch_list():
    assert _build.parse_arch_list("8.0;9.0a 8.6+PTX") == [(8, 0, ""), (9, 0, "a"), (8, 6, "+PTX")]
    for bad, match in (("7.5;8.0", "needs compute capability >= 8.0"), ("Hopper", "not an architecture"),
                       (";", "names no architecture")):
        with pytest.raises(ValueError, match=match):
            _build.parse_arch_list(bad)
    runs = lambda text, cap: _build._runs_on(_build.parse_arch_list(text), cap)   # noqa: E731
    assert runs("8.0", (8, 9)) and runs("8.0;9.0", (9, 0)) and runs("9.0a", (9, 0))
    assert not runs("8.0", (9, 0)) and not runs("9.0a", (10, 0)) and not runs("8.6", (8, 0))
    assert runs("8.0+PTX", (12, 0)) and not runs("9.0+PTX", (8, 9))


def _prebuilt_package(tmp_path, **stamp):
    import json
    pkg = tmp_path / "gt_fused3s"
    pkg.mkdir(exist_ok=True)
    lib = pkg / "_C.cpython-312-x86_64-linux-gnu.so"
    lib.write_bytes(b"")
    stamp = {"torch": torch.__version__, "cuda": "13.0", "arch_list": "8.0;9.0",
             "sources": _build.source_digest(_build._csrc_dir()), **stamp}
    (pkg / _build.PREBUILT_STAMP).write_text(json.dumps(stamp))
    return pkg, lib


def _pretend_gpus(monkeypatch, *caps):
    _pretend_cuda_torch(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])


def test_jit_arch_override(monkeypatch):
    """GT_FUSED3S_JIT_ARCH: the sm_80 code paths as PTX for a Hopper GPU (the
    driver compiles them), refused where nothing built would run."""
    _pretend_gpus(monkeypatch, (9, 0))
    assert _build._arch_flags(torch) == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("GT_FUSED3S_JIT_ARCH", "8.0+PTX")
    assert _build._arch_flags(torch) == ["-gencode=arch=compute_80,code=sm_80",
                                         "-gencode=arch=compute_80,code=compute_80"]
    monkeypatch.setenv("GT_FUSED3S_JIT_ARCH", "9.0a")
    assert _build._arch_flags(torch) == ["-gencode=arch=compute_90a,code=sm_90a"]
    monkeypatch.setenv("GT_FUSED3S_JIT_ARCH", "8.6+PTX;9.0a")     # every entry built
    assert len(_build._arch_flags(torch)) == 3
    monkeypatch.setenv("GT_FUSED3S_JIT_ARCH", "8.0")             # sm_80 machine code only
    with pytest.raises(RuntimeError, match="builds no code that runs on compute capability 9.0"):
        _build._arch_flags(torch)


def test_a_prebuilt_library_is_used_only_where_its_stamp_fits(tmp_path, monkeypatch):
    _pretend_gpus(monkeypatch, (9, 0), (8, 6))
    assert _build._prebuilt(torch, tmp_path) is None                 # none built: no word
    pkg, lib = _prebuilt_package(tmp_path)
    assert _build._prebuilt(torch, pkg) == lib
    for stamp, why in (({"torch": "2.0.0"}, "built for torch 2.0.0"),
                       ({"sources": "0" * 40}, "its sources differ"),
                       ({"arch_list": "9.0"}, "does not run on compute capability 8.6")):
        pkg, lib = _prebuilt_package(tmp_path, **stamp)
        with pytest.warns(RuntimeWarning, match=f"{lib.name} is not used .*{why}.*compiled on first use"):
            assert _build._prebuilt(torch, pkg) is None
    (pkg / _build.PREBUILT_STAMP).unlink()
    with pytest.warns(RuntimeWarning, match="could not be checked"):
        assert _build._prebuilt(torch, pkg) is None


def test_a_fitting_prebuilt_library_is_loaded_without_compiling(tmp_path, monkeypatch):
    _pretend_gpus(monkeypatch, (9, 0))
    pkg, lib = _prebuilt_package(tmp_path)
    monkeypatch.setattr(_build, "_prebuilt", lambda torch: lib)
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: pytest.fail("compiled"))
    monkeypatch.setattr(_build, "_ORIGIN", None)
    assert _build.load_extension() is torch.ops.gt_fused3s
    assert loaded == [str(lib)] and _build.extension_origin() == f"prebuilt {lib}"
