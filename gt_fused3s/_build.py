"""Lazy JIT build of the CUDA extension (``torch.ops.gt_fused3s.*``).

Nothing here runs at import: the extension is compiled (ninja, through
``torch.utils.cpp_extension.load``) the first time a CUDA tensor needs it, for
the architectures of the visible GPUs, and cached on disk:

* ``$GT_FUSED3S_BUILD_DIR`` if set, else the torch extensions directory
  (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), in a folder
  named after a hash of the sources, flags and torch version, so that a
  stale build is never loaded;
* a later process with the same sources loads the cached library at once.

``load_extension()`` returns the op namespace (``torch.ops.gt_fused3s``) or
raises ``RuntimeError`` saying why not (no CUDA torch, no GPU, no nvcc, no
ninja, GPU too old, compiler error). ``extension_available()`` never raises
and remembers a failure.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

_LOCK = threading.RLock()
_OPS = None            # torch.ops.gt_fused3s once loaded
_FAILURE: str | None = None   # reason of the first failed attempt

_COMPILE_MESSAGE = "gt_fused3s: compiling the CUDA extension (first use, ~1-2 min)..."
_MIN_CAPABILITY = (8, 0)   # mma.sync m16n8k16 with bf16 needs sm_80


def _csrc_dir() -> Path:
    """Sources: ``gt_fused3s/csrc`` in an installed package, else ``csrc`` of the
    repository checkout (``$GT_FUSED3S_CSRC`` overrides both)."""
    env = os.environ.get("GT_FUSED3S_CSRC")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here / "csrc", here.parent / "csrc"]
    for c in candidates:
        if (c / "bindings.cpp").is_file():
            return c
    raise RuntimeError("gt_fused3s: the CUDA sources (csrc/bindings.cpp) were not found; looked in "
                       + ", ".join(str(c) for c in candidates))


def _sources(csrc: Path) -> tuple[list[str], list[Path]]:
    """(sources to compile, every file whose content defines the build)."""
    kernels = sorted((csrc / "kernels").glob("*.cu"))
    headers = sorted(p for ext in ("*.cuh", "*.h") for p in (csrc / "kernels").glob(ext))
    sources = [csrc / "bindings.cpp"] + kernels
    return [str(p) for p in sources], sources + headers


def _arch_flags(torch) -> list[str]:
    """-gencode for every visible GPU (sm_90a on Hopper for its own instructions)."""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    flags = []
    for major, minor in caps:
        if (major, minor) < _MIN_CAPABILITY:
            raise RuntimeError(f"gt_fused3s: the fused kernel needs a GPU of compute capability >= "
                               f"{_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} (found {major}.{minor})")
        arch = f"{major}{minor}" + ("a" if major == 9 and minor == 0 else "")
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _build_root(torch) -> Path:
    env = os.environ.get("GT_FUSED3S_BUILD_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root
    cu = (torch.version.cuda or "cpu").replace(".", "")
    return Path(get_default_build_root()) / f"py{sys.version_info[0]}{sys.version_info[1]}_cu{cu}"


def _load() -> object:
    import torch
    if torch.version.cuda is None:
        raise RuntimeError(f"gt_fused3s: torch {torch.__version__} is a CPU-only build; the fused "
                           f"kernel needs a CUDA build of torch")
    if not torch.cuda.is_available():
        raise RuntimeError("gt_fused3s: no CUDA GPU is visible (torch.cuda.is_available() is False)")
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("gt_fused3s: no CUDA toolchain found (nvcc); install the CUDA toolkit "
                           "matching torch " + torch.version.cuda + " or set CUDA_HOME")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("gt_fused3s: ninja is needed to build the CUDA extension (pip install ninja)")

    from . import ops  # noqa: F401  (defines the op schemas the library implements)
    csrc = _csrc_dir()
    sources, deps = _sources(csrc)
    cuda_flags = ["-O3", "--use_fast_math", "-lineinfo"] + _arch_flags(torch)
    cflags = ["-O3"]
    cccl = Path(cpp_extension.CUDA_HOME) / "include" / "cccl"
    include_paths = [str(csrc)] + ([str(cccl)] if cccl.is_dir() else [])

    h = hashlib.sha1()
    for p in deps:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(repr((cuda_flags, cflags, torch.__version__, torch.version.cuda)).encode())
    name = f"gt_fused3s_ext_{h.hexdigest()[:12]}"
    build_dir = _build_root(torch) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    lib = build_dir / f"{name}.so"
    if not lib.is_file():
        warnings.warn(_COMPILE_MESSAGE, RuntimeWarning, stacklevel=4)
    try:
        cpp_extension.load(name=name, sources=sources, extra_cflags=cflags, extra_cuda_cflags=cuda_flags,
                           extra_include_paths=include_paths, build_directory=str(build_dir),
                           is_python_module=False, verbose=os.environ.get("GT_FUSED3S_VERBOSE_BUILD") == "1")
    except Exception as e:   # compiler errors come as RuntimeError with the build log
        raise RuntimeError(f"gt_fused3s: building the CUDA extension in {build_dir} failed:\n{e}") from e
    return torch.ops.gt_fused3s


def load_extension():
    """The compiled ops (``torch.ops.gt_fused3s``), building them on first use.

    Raises:
        RuntimeError: why the extension cannot be had here (the same reason on
            every later call in this process).
    """
    global _OPS, _FAILURE
    if _OPS is not None:
        return _OPS
    with _LOCK:
        if _OPS is not None:
            return _OPS
        if _FAILURE is not None:
            raise RuntimeError(_FAILURE)
        try:
            _OPS = _load()
        except Exception as e:
            _FAILURE = str(e) if isinstance(e, RuntimeError) else f"gt_fused3s: {type(e).__name__}: {e}"
            raise RuntimeError(_FAILURE) from e
        return _OPS


def extension_available() -> bool:
    """True if the fused kernel can run here (building it if needed). Never raises."""
    if _OPS is not None:
        return True
    if _FAILURE is not None:
        return False
    try:
        load_extension()
        return True
    except Exception:
        return False


def failure_reason() -> str | None:
    """Why the last build/load attempt failed (None if it did not)."""
    return _FAILURE
