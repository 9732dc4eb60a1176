"""Lazy JIT build of the CUDA extension (``torch.ops.gt_fused3s.*``).

Nothing here runs at import: the extension is compiled (ninja, through
``torch.utils.cpp_extension.load``) the first time a CUDA tensor needs it, for
the architectures of the visible GPUs, and cached on disk:

* ``$GT_FUSED3S_BUILD_DIR`` if set, else the torch extensions directory
  (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``), in a folder
  named after a hash of the sources, flags and torch version, so that a
  stale build is never loaded;
* a later process with the same sources loads the cached library at once.

An ahead-of-time build (``GT_FUSED3S_BUILD_EXT=1`` at ``pip install``, see
``setup.py``) leaves ``gt_fused3s/_C*.so`` and its stamp ``_C.json`` (torch
and CUDA versions, a digest of the sources, ``TORCH_CUDA_ARCH_LIST``) in the
package; it is loaded instead of compiling when the stamp matches this torch,
these sources and the visible GPUs, and otherwise passed over with a warning
that says why (then the JIT build runs as above).

``load_extension()`` returns the op namespace (``torch.ops.gt_fused3s``) or
raises ``RuntimeError`` saying why not (no CUDA torch, no GPU, no nvcc, no
ninja, GPU too old, compiler error). ``extension_available()`` never raises
and remembers a failure; ``extension_origin()`` says which library was
loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import warnings
from pathlib import Path

_LOCK = threading.RLock()
_OPS = None            # torch.ops.gt_fused3s once loaded
_FAILURE: str | None = None   # reason of the first failed attempt
_ORIGIN: str | None = None    # "prebuilt <path>" or "jit <path>" once loaded

#: compiler flags of both builds (the JIT adds -gencode for the visible GPUs
#: or $GT_FUSED3S_JIT_ARCH; the ahead-of-time build takes them from
#: TORCH_CUDA_ARCH_LIST)
CUDA_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
CFLAGS = ["-O3"]
#: the ahead-of-time build: module name (in the package) and its stamp file
PREBUILT_NAME = "_C"
PREBUILT_STAMP = "_C.json"

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


def include_dirs(csrc: Path, cuda_home: str | None) -> list[str]:
    """The sources' folder, and CUDA's CCCL headers where the toolkit keeps them apart."""
    cccl = Path(cuda_home) / "include" / "cccl" if cuda_home else None
    return [str(csrc)] + ([str(cccl)] if cccl is not None and cccl.is_dir() else [])


def source_digest(csrc: Path) -> str:
    """sha1 of the name and content of every file that defines the build."""
    h = hashlib.sha1()
    for p in _sources(csrc)[1]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def parse_arch_list(text: str) -> list[tuple[int, int, str]]:
    """``TORCH_CUDA_ARCH_LIST`` ("8.0;9.0a 9.0+PTX") as (major, minor, suffix)
    triples, suffix "", "a" or "+PTX". Raises ValueError on an entry that is
    not an architecture number, or one older than the kernel needs."""
    archs = []
    for entry in text.replace(",", ";").replace(" ", ";").split(";"):
        if not entry:
            continue
        base, ptx = (entry[:-4], "+PTX") if entry.endswith("+PTX") else (entry, "")
        base, arch_a = (base[:-1], "a") if base.endswith("a") else (base, "")
        try:
            major, minor = (int(v) for v in base.split("."))
        except ValueError:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not an architecture "
                             f"such as 8.0, 9.0a or 9.0+PTX") from None
        if (major, minor) < _MIN_CAPABILITY:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {entry!r}: the fused kernel needs compute "
                             f"capability >= {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]}")
        archs.append((major, minor, arch_a + ptx))
    if not archs:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST {text!r} names no architecture")
    return archs


def _runs_on(archs: list[tuple[int, int, str]], cap: tuple[int, int]) -> bool:
    """Whether code built for ``archs`` runs on a GPU of capability ``cap``:
    machine code of the same major version and a minor <= the GPU's (an
    arch-specific "a" build only on its own capability), or PTX of an older
    or equal capability, which the driver compiles."""
    for major, minor, suffix in archs:
        if "a" in suffix.replace("+PTX", ""):
            if (major, minor) == cap:
                return True
        elif major == cap[0] and minor <= cap[1]:
            return True
        if suffix.endswith("+PTX") and (major, minor) <= cap:
            return True
    return False


def _prebuilt(torch, package: Path | None = None) -> Path | None:
    """The library of an ahead-of-time build in ``package`` (default: this
    package) if its stamp fits this torch, the sources it would compile and
    every visible GPU; else None (with a warning that says why, if there is
    a library)."""
    package = package or Path(__file__).resolve().parent
    libs = sorted(package.glob(f"{PREBUILT_NAME}.*.so")) + sorted(package.glob(f"{PREBUILT_NAME}.so"))
    if not libs:
        return None
    lib, stamp_path = libs[0], package / PREBUILT_STAMP
    try:
        stamp = json.loads(stamp_path.read_text())
        archs = parse_arch_list(stamp["arch_list"])
        why = None
        if stamp["torch"] != torch.__version__ or stamp["cuda"] != torch.version.cuda:
            why = (f"built for torch {stamp['torch']} + CUDA {stamp['cuda']}, this is torch "
                   f"{torch.__version__} + CUDA {torch.version.cuda}")
        elif stamp["sources"] != source_digest(_csrc_dir()):
            why = f"its sources differ from those in {_csrc_dir()}"
        else:
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            missing = [f"{a}.{b}" for a, b in caps if not _runs_on(archs, (a, b))]
            if missing:
                why = (f"built for TORCH_CUDA_ARCH_LIST={stamp['arch_list']!r}, which does not run on "
                       f"compute capability {', '.join(missing)}")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        why = f"its stamp {stamp_path} could not be checked ({type(e).__name__}: {e})"
    if why is not None:
        warnings.warn(f"gt_fused3s: the ahead-of-time build {lib.name} is not used ({why}); the "
                      f"kernel is compiled on first use instead", RuntimeWarning, stacklevel=5)
        return None
    return lib


def _arch_flags(torch) -> list[str]:
    """-gencode for every visible GPU (sm_90a on Hopper for its own
    instructions), or for ``$GT_FUSED3S_JIT_ARCH`` (``TORCH_CUDA_ARCH_LIST``
    entries: "8.0+PTX" builds the sm_80 code paths as PTX, which the driver
    compiles for a newer GPU: Ampere's kernels tested on a Hopper GPU)."""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    for major, minor in caps:
        if (major, minor) < _MIN_CAPABILITY:
            raise RuntimeError(f"gt_fused3s: the fused kernel needs a GPU of compute capability >= "
                               f"{_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]} (found {major}.{minor})")
    override = os.environ.get("GT_FUSED3S_JIT_ARCH")
    if override:
        archs = parse_arch_list(override)
        missing = [f"{a}.{b}" for a, b in caps if not _runs_on(archs, (a, b))]
        if missing:
            raise RuntimeError(f"gt_fused3s: GT_FUSED3S_JIT_ARCH={override!r} builds no code that runs on "
                               f"compute capability {', '.join(missing)} (add +PTX to run an older "
                               f"architecture's code through the driver)")
        flags = []
        for major, minor, suffix in archs:
            arch = f"{major}{minor}" + ("a" if suffix.startswith("a") else "")
            flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
            if suffix.endswith("+PTX"):
                flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
        return flags
    flags = []
    for major, minor in caps:
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
    global _ORIGIN
    from . import ops  # noqa: F401  (defines the op schemas the library implements)
    prebuilt = _prebuilt(torch)
    if prebuilt is not None:
        _arch_flags(torch)       # the same clear error for a GPU older than sm_80
        torch.ops.load_library(str(prebuilt))
        _ORIGIN = f"prebuilt {prebuilt}"
        return torch.ops.gt_fused3s
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("gt_fused3s: no CUDA toolchain found (nvcc); install the CUDA toolkit "
                           "matching torch " + torch.version.cuda + " or set CUDA_HOME")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("gt_fused3s: ninja is needed to build the CUDA extension (pip install ninja)")

    csrc = _csrc_dir()
    sources, deps = _sources(csrc)
    cuda_flags = CUDA_FLAGS + _arch_flags(torch)
    cflags = list(CFLAGS)
    include_paths = include_dirs(csrc, cpp_extension.CUDA_HOME)

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
    _ORIGIN = f"jit {lib}"
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


def extension_origin() -> str | None:
    """Which library the ops come from once loaded: ``"prebuilt <path>"`` (the
    ahead-of-time build) or ``"jit <path>"``; None before."""
    return _ORIGIN


def failure_reason() -> str | None:
    """Why the last build/load attempt failed (None if it did not)."""
    return _FAILURE
