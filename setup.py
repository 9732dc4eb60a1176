"""Build hook; the metadata is in pyproject.toml.

A wheel (and so ``pip install .`` or ``pip install git+...``) carries the
CUDA sources and the configs inside the package, as ``gt_fused3s/csrc`` and
``gt_fused3s/configs``, copied from the top-level ``csrc/`` and ``configs/``
at build time, so that an installed package can compile its kernel on first
use (``gt_fused3s/_build.py``) and find its configs
(``gt_fused3s/bench/common.py: resolve_config_path``). An editable install
reads the checkout's folders and gets no copies.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
#: top-level folder -> the files of it a wheel carries
PACKAGE_DATA = {"csrc": ("*.cpp", "kernels/*.cu", "kernels/*.cuh", "kernels/*.h"), "configs": ("*.yaml",)}


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


setup(cmdclass={"build_py": BuildPyWithSources})
