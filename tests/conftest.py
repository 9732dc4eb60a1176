"""Fixtures shared by the test files."""
import os
import shutil
import subprocess
from pathlib import Path

# Every plan of a test groups its per-edge arrays by destination where its
# edges come in another order (plan.edge_grouping; by default only plans of
# a million edges and more, which no test builds): the kernel paths' tests
# then run the grouped calls, their results compared as before.
os.environ.setdefault("GT_FUSED3S_EDGE_GROUPING_MIN_EDGES", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def ops():
    """``torch.ops.gt_fused3s`` of the built extension, built once per run.
    The cuda test files use it for every test (``pytest.mark.usefixtures``
    in their ``pytestmark``), so a failed build is each test's error, not a
    skip; the ones that call an op directly take it as an argument."""
    from gt_fused3s._build import load_extension
    return load_extension()


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(owner, name)`` wraps ``owner.name`` (a function, or a
    classmethod looked up on its class) so that every call appends to the
    returned list (or to ``calls``, shared between several names) and then
    runs the original."""
    def install(owner, name, calls=None):
        calls = [] if calls is None else calls
        orig = getattr(owner, name)          # a classmethod comes back bound to owner

        def counting(*args, **kwargs):
            calls.append(1)
            return orig(*args, **kwargs)
        monkeypatch.setattr(owner, name, staticmethod(counting) if isinstance(owner, type) else counting)
        return calls
    return install


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """CPU stand-ins for the CUDA ops (tests/stand_in_kernels.py): CPU tensors
    take the kernel path through the registered ops. Returns the stand-ins
    (``.calls`` lists the ops run)."""
    import stand_in_kernels
    stand_ins = stand_in_kernels.install(monkeypatch)
    yield stand_ins
    stand_ins.lib._destroy()


@pytest.fixture
def schedule_builds(monkeypatch):
    """A list that gets, for every kernel schedule a plan builds, whether
    torch.compile was tracing the build (True: built by the compiled graph,
    False: eagerly)."""
    import gt_fused3s.plan as plan_mod
    builds = []
    schedule = plan_mod.work_schedule

    def recording(*args):
        builds.append(torch.compiler.is_compiling())
        return schedule(*args)
    monkeypatch.setattr(plan_mod, "work_schedule", recording)
    return builds


@pytest.fixture(scope="session")
def host_program(tmp_path_factory):
    """build(source, *flags): tests/<source> (a host program over the kernels'
    headers in csrc/kernels) built with nvcc; its path. Skips where nvcc is
    not installed."""
    root = Path(__file__).resolve().parents[1]
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")

    def build(source: str, *flags: str) -> Path:
        if nvcc is None:
            pytest.skip(f"nvcc not found: {source} is built and run where it is installed")
        exe = tmp_path_factory.mktemp("host") / Path(source).stem
        subprocess.run([nvcc, "-std=c++17", "-O1", "-I", str(root / "csrc" / "kernels"), "-x", "cu", *flags,
                        str(root / "tests" / source), "-o", str(exe)], check=True)
        return exe
    return build
