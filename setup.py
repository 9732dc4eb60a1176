"""Build hook; the metadata is in pyproject.toml.

A wheel (and so ``pip install .`` or ``pip install git+...``) carries the
CUDA sources and the configs inside the package, as ``gt_fused3s/csrc`` and
``gt_fused3s/configs``, copied from the top-level ``csrc/`` and ``configs/``
at build time, so that an installed package can compile its kernel on first
use (``gt_fused3s/_build.py``) and find its configs
(``gt_fused3s/bench/common.py: resolve_config_path``). An editable install
reads the checkout's folders and gets no copies.

Ahead-of-time build, off by default: with ``GT_FUSED3S_BUILD_EXT=1`` the
kernel is compiled at install time by ``torch.utils.cpp_extension``
(``CUDAExtension``, ninja) for the architectures of ``TORCH_CUDA_ARCH_LIST``
(default: the visible GPUs), into ``gt_fused3s/_C*.so`` beside a stamp
``_C.json`` that ``_build.py`` checks before loading it. torch must be
importable while building, so pip needs ``--no-build-isolation``::

    GT_FUSED3S_BUILD_EXT=1 TORCH_CUDA_ARCH_LIST="8.0;9.0" pip install --no-build-isolation .
"""
import importlib.util
import json
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
#: top-level folder -> the files of it a wheel carries
PACKAGE_DATA = {"csrc": ("*.cpp", "kernels/*.cu", "kernels/*.cuh", "kernels/*.h"), "configs": ("*.yaml",)}
#: the switch of the ahead-of-time build
BUILD_EXT_ENV = "GT_FUSED3S_BUILD_EXT"


class BuildPyWithSources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for folder, patterns in PACKAGE_DATA.items():
            for pattern in patterns:
                for src in sorted((ROOT / folder).glob(pattern)):
                    dst = Path(self.build_lib) / "gt_fused3s" / folder / src.relative_to(ROOT / folder)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)


def _fail(msg: str):
    raise SystemExit(f"gt-fused3s: {BUILD_EXT_ENV}=1: {msg}")


def _build_module():
    """gt_fused3s/_build.py, read by path (importing the package needs its dependencies)."""
    spec = importlib.util.spec_from_file_location("_gt_fused3s_build", ROOT / "gt_fused3s" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ahead_of_time_build() -> dict:
    """``setup()`` arguments of the ahead-of-time build ({} unless asked for)."""
    if os.environ.get(BUILD_EXT_ENV, "0") != "1":
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        _fail(f"torch must be importable while building ({e}); install torch first and build "
              f"with pip install --no-build-isolation")
    if torch.version.cuda is None:
        _fail(f"torch {torch.__version__} is a CPU-only build; the kernel needs a CUDA build of torch")
    if cpp_extension.CUDA_HOME is None:
        _fail(f"no CUDA toolkit found (nvcc); install the one matching torch's CUDA {torch.version.cuda} "
              f"or set CUDA_HOME")
    build = _build_module()
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not arch_list or arch_list == "native":
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        if not caps:
            _fail('no GPU is visible to build for: set TORCH_CUDA_ARCH_LIST, e.g. "8.0;9.0"')
        arch_list = ";".join(f"{a}.{b}" for a, b in caps)
    try:
        build.parse_arch_list(arch_list)
    except ValueError as e:
        _fail(str(e))
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list      # CUDAExtension reads it
    csrc = ROOT / "csrc"
    sources = [os.path.relpath(p, ROOT) for p in build._sources(csrc)[0]]
    stamp = {"torch": torch.__version__, "cuda": torch.version.cuda, "arch_list": arch_list,
             "sources": build.source_digest(csrc)}

    class BuildExtensionWithStamp(cpp_extension.BuildExtension):
        def run(self):
            super().run()
            lib = Path(self.get_ext_fullpath(f"gt_fused3s.{build.PREBUILT_NAME}"))
            (lib.parent / build.PREBUILT_STAMP).write_text(json.dumps(stamp, indent=1) + "\n")

    ext = cpp_extension.CUDAExtension(
        f"gt_fused3s.{build.PREBUILT_NAME}", sources,
        include_dirs=build.include_dirs(csrc, cpp_extension.CUDA_HOME),
        extra_compile_args={"cxx": build.CFLAGS, "nvcc": build.CUDA_FLAGS})
    return {"ext_modules": [ext], "cmdclass": {"build_ext": BuildExtensionWithStamp}}


aot = ahead_of_time_build()
setup(cmdclass={"build_py": BuildPyWithSources, **aot.pop("cmdclass", {})}, **aot)
