"""Helpers shared by the benchmark harnesses (kernel, inference, training):
the run's environment (device, dtype, git sha), YAML configs with defaults,
errors that become table rows, datasets loaded for a run, text tables and
CSV files. Kept here so that ``infer`` and ``train`` read, check, time and
report alike."""
from __future__ import annotations

import contextlib
import copy
import csv
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[2]
#: the package's folder: a wheel carries the configs in its configs/ (setup.py)
PACKAGE_ROOT = Path(__file__).resolve().parents[1]

#: config names of the dtypes a run can compute in (autocast below fp32)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ------------------------------------------------------------- environment
def git_sha() -> str:
    """Short sha of the checkout (``-dirty`` if modified); ``$GT_FUSED3S_GIT_SHA``
    wins (a copy of the tree without ``.git``, as on the GPU machine). An
    installed package is no checkout: it says its version, never the sha of
    a repository that happens to hold its environment."""
    if os.environ.get("GT_FUSED3S_GIT_SHA"):
        return os.environ["GT_FUSED3S_GIT_SHA"]
    if not ((REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "gt_fused3s").is_dir()):
        from .. import __version__
        return f"unknown (installed gt-fused3s {__version__})"
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=10, check=False)
        sha = out.stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT,
                                   capture_output=True, text=True, timeout=10,
                                   check=False).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA if available, else the CPU; an explicit CUDA device
    where there is none is an error (not a silent CPU run)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def resolve_dtype(name: str, device: torch.device,
                  cuda_default: torch.dtype = torch.float16) -> torch.dtype:
    """The dtype of a config's ``dtype``: ``auto`` is fp32 on a CPU and
    ``cuda_default`` on a GPU."""
    if name == "auto":
        return cuda_default if device.type == "cuda" else torch.float32
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def autocast(device: torch.device, dtype: torch.dtype, *, cache: bool = True):
    """A reusable context that runs a model in ``dtype`` (torch.autocast), or
    a no-op for fp32. ``cache=False`` for CUDA-graph capture, which must not
    capture casts cached outside it."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def run_info(device: torch.device, dtype: torch.dtype, config: str = "") -> dict:
    """Columns every result row of a run carries: where and with what it ran."""
    return {"device": str(device), "device_name": device_name(device), "dtype": dtype_name(dtype),
            "torch": torch.__version__, "git_sha": git_sha(), "config": config}


def run_header(command: str, info: dict) -> str:
    """The first line a harness logs: device, dtype, versions."""
    return (f"gt-fused3s {command}: device {info['device_name']} ({info['device']}), "
            f"{info['dtype']}, torch {info['torch']}, git {info['git_sha']}")


def log_stderr(msg: str) -> None:
    """Log a line without breaking the progress bars."""
    tqdm.write(msg, file=sys.stderr)


def progress_bar(total: int, desc: str, unit: str, enabled: bool = True) -> tqdm:
    """A transient progress bar on stderr (gone once done: the table stays)."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, disable=not enabled,
                file=sys.stderr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_mb` (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """MiB of the most tensor memory allocated on a GPU since the last
    :func:`reset_peak_memory`; None on a CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_reserved_mb(device: torch.device) -> float | None:
    """MiB of the most GPU memory the caching allocator held since the last
    :func:`reset_peak_memory` (tensors, cached blocks and the private pools
    of CUDA graphs, which are allocated when a graph is captured and do not
    show in :func:`peak_memory_mb` afterwards); None on a CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device) / 2**20


def free_cuda_memory(device: torch.device | str = "cuda") -> None:
    """Return cached blocks after a backend ran out of memory or finished."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ errors
def short_error(err: BaseException, limit: int | None = 160) -> str:
    """One line naming the error, for a table cell or a note (cut at
    ``limit`` characters; ``None``: the whole first line, for a log line
    whose end says what to do)."""
    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
    msg = f"{type(err).__name__}: {msg}" if msg else type(err).__name__
    return msg if limit is None or len(msg) <= limit else msg[:limit - 3] + "..."


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a run, carrying what finished before it (``result``:
    the rows, or the run's usual return value) so that the command can still
    print and write them."""

    def __init__(self, result: Any):
        super().__init__()
        self.result = result


INTERRUPTED_EXIT = 130      # a shell's status for a run ended by Ctrl-C


def guarded(fn: Callable[[], Any], device: torch.device) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, note)`` if it raised: "out of memory" or the
    error in one line, so that one backend's failure becomes a row and the
    run goes on. Frees the device's cached memory afterwards."""
    result, note = None, None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - whatever it is, it becomes the row's note
        note = "out of memory" if is_oom(err) else short_error(err)
    if note:
        gc.collect()            # the error's frames are gone: free the tensors they held
    free_cuda_memory(device)    # and what the caching allocator keeps, for the next backend
    return result, note


def status_of(note: str) -> str:
    """The status column of a row that failed with ``note`` (from :func:`guarded`)."""
    return "oom" if note == "out of memory" else "error"


# ------------------------------------------------------------------ config
def shipped_config(name: str) -> Path:
    """A config of the project's ``configs/``: the checkout's, else the one an
    installed package carries."""
    checkout = REPO_ROOT / "configs" / name
    return checkout if checkout.is_file() else PACKAGE_ROOT / "configs" / name


def resolve_config_path(path: str | Path | None, default: Path) -> Path:
    """``path`` as given, else relative to the repository root, else to the
    installed package (``configs/default.yaml`` outside a checkout); None:
    ``default``."""
    if path is None:
        return default
    p = Path(path).expanduser()
    tried = [p, REPO_ROOT / p, PACKAGE_ROOT / p]
    for cand in tried:
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"config {str(path)!r} not found (tried {', '.join(str(c) for c in tried)})")


def read_config(path: str | Path | None, default: Path,
                validate: Callable[[dict], dict]) -> dict:
    """Read a YAML config (see :func:`resolve_config_path`), check and
    complete it with ``validate``; ``config`` is the file read."""
    path = resolve_config_path(path, default)
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:     # one line: where the YAML breaks
            mark = getattr(err, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ValueError(f"config {path} is not valid YAML{where}: "
                             f"{getattr(err, 'problem', None) or err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must be a mapping of keys (got {type(raw).__name__})")
    cfg = validate(raw)
    cfg["config"] = str(path)
    return cfg


def revalidate(cfg: dict, validate: Callable[[dict], dict]) -> dict:
    """Check a config again after command-line overrides, keeping its path."""
    path = cfg.pop("config", "")
    return validate(cfg) | {"config": path}


def merge_config(raw: Any, defaults: dict, *, open_keys: frozenset[str] = frozenset()) -> dict:
    """``defaults`` overridden by ``raw``, a config's mapping. A mapping of
    ``defaults`` (``model``) is merged key by key. Unknown keys are errors,
    so that a typo fails instead of being ignored, except inside the
    mappings of ``open_keys`` (e.g. ``max_nodes: {backend: N}``)."""
    if not isinstance(raw, dict):   # a ValueError: the CLI reports those in one line
        raise ValueError(f"a config is a mapping (got {type(raw).__name__})")  # noqa: TRY004
    unknown = set(raw) - set(defaults) - {"config", "description"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(defaults)}")
    cfg = copy.deepcopy(defaults)
    for key, value in raw.items():
        if not isinstance(defaults.get(key), dict):
            cfg[key] = value
            continue
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping (got {value!r})")
        extra = set(value or {}) - set(defaults[key]) if key not in open_keys else set()
        if extra:
            raise ValueError(f"unknown {key} keys {sorted(extra)}; known: {sorted(defaults[key])}")
        cfg[key].update(value or {})
    return cfg


#: how a run executes the model (the part after ``@`` in a backend entry):
#: ``eager``; ``graph``: whole forwards / training steps as CUDA-graph replays
#: (gt_fused3s.capture, batches padded to buckets); ``compile`` and
#: ``reduce-overhead``: ``torch.compile`` of the model in that mode (batches
#: padded to the same buckets, so it compiles a few shapes only);
#: ``compile-graph``: both, the model compiled by torch.compile (default
#: mode: its layers fused) inside whole steps captured as CUDA graphs
MODES = ("eager", "graph", "compile", "reduce-overhead", "compile-graph")
#: the modes whose whole step or forward is a CUDA-graph replay of our runner
CAPTURED_MODES = ("graph", "compile-graph")
#: the modes that run the model through torch.compile
COMPILED_MODES = ("compile", "reduce-overhead", "compile-graph")


#: the note of a fused3s row where no kernel ran (its speedups would compare
#: the reference code with itself or with pyg: none are reported)
REFERENCE_PATH_NOTE = "no CUDA kernel here: fused3s ran the reference path (no speedup reported)"


def runs_reference_path(name: str, device: torch.device) -> bool:
    """Whether the run ``name`` (backend[@mode]) is fused3s on a device
    where the fused kernel does not run, so it computes with the reference
    path: its times say nothing about the kernel."""
    from ..ops import kernel_available
    return parse_run(name)[0] == "fused3s" and not kernel_available(torch.device(device))


def parse_run(name: str) -> tuple[str, str]:
    """``"pyg@compile"`` -> ``("pyg", "compile")``; no suffix: eager."""
    backend, _, mode = name.partition("@")
    return backend, mode or "eager"


def run_label(backend: str, mode: str) -> str:
    """The row name of a run: the backend, with its mode unless eager."""
    return backend if mode == "eager" else f"{backend}@{mode}"


def check_backends(names: list[str]) -> None:
    from ..backends import BACKENDS

    if not names:
        raise ValueError(f"no backends listed; choose from {sorted(BACKENDS)}")
    bad = [b for b in names if parse_run(b)[0] not in BACKENDS]
    if bad:
        raise ValueError(f"unknown backends {bad}; choose from {sorted(BACKENDS)}")
    bad = [b for b in names if parse_run(b)[1] not in MODES]
    if bad:
        raise ValueError(f"unknown modes in {bad}; a backend may end in @" + ", @".join(MODES))


def expand_runs(names: list[str], device: torch.device, *, eager: bool,
                compiled_runs: bool, cpu_modes: tuple[str, ...] = ("eager",)) -> list[str]:
    """The runs of a config's ``backends`` on ``device``. On a GPU, unless
    ``eager``: ``fused3s`` without a mode runs as CUDA-graph replays
    (``fused3s@graph``) and its eager run is added beside it; with
    ``compiled_runs``, ``pyg@compile`` and ``pyg@reduce-overhead`` are added
    after ``pyg`` (the peers a careful PyG user would run), and
    ``fused3s@compile-graph`` after ``fused3s@graph`` (the same whole-step
    capture around the model compiled by torch.compile, which also fuses
    the layers around the attention). On a CPU every run is as named, in
    one of ``cpu_modes`` (other modes are errors there: CUDA graphs, and
    ``reduce-overhead``, which is torch.compile's CUDA graphs)."""
    runs: list[str] = []

    def add(name):
        if name not in runs:
            runs.append(name)
    for name in names:
        backend, mode = parse_run(name)
        if device.type != "cuda":
            if mode not in cpu_modes:
                raise ValueError(f"{name}: mode {mode} needs a CUDA device")
            add(name)
            continue
        if backend == "fused3s" and "@" not in name and not eager:
            add("fused3s@graph")
            if compiled_runs:
                add("fused3s@compile-graph")
        add(name)
        if backend == "pyg" and "@" not in name and compiled_runs:
            add("pyg@compile")
            add("pyg@reduce-overhead")
    return runs


def check_dtype(name: str) -> None:
    if name != "auto" and name not in DTYPES:
        raise ValueError(f"dtype must be auto, fp32, fp16 or bf16 (got {name!r})")


# ---------------------------------------------------------------- datasets
def load_batches(ds, limit: int | None, device: torch.device | str, *,
                 progress: bool = True) -> list:
    """The first ``limit`` batches of ``ds`` (all if None), made on ``device``."""
    count = len(ds) if limit is None else min(len(ds), int(limit))
    return [ds.get(i, device) for i in tqdm(range(count), desc=f"{ds.name}: load", leave=False,
                                            disable=not progress, file=sys.stderr)]


def describe_dataset(ds, kind: str, batches: list) -> tuple[dict, str]:
    """Columns saying what a run's data is (real or synthetic structure, its
    source and fallback, sizes per forward) and a line for the log."""
    from ..drivers.stream import num_graphs

    source = str(ds.info.get("source", kind))
    if "fallback_reason" in ds.info:
        source += f" (fallback: {ds.info['fallback_reason']})"
    cols = {"level": ds.level, "structure": "synthetic" if ds.info.get("synthetic") else "real",
            "source": source, "batches": len(batches),
            "graphs_per_fwd": round(statistics.mean(map(num_graphs, batches)), 1),
            "nodes_per_fwd": round(statistics.mean(d.num_nodes for d in batches)),
            "edges_per_fwd": round(statistics.mean(d.edge_index.size(1) for d in batches))}
    unit = "graph" if ds.level == "node" else "batch" if len(batches) == 1 else "batches"
    line = (f"{ds.name}: {cols['structure']} structure from {source}; {len(batches)} {unit}, "
            f"{cols['nodes_per_fwd']} nodes and {cols['edges_per_fwd']} edges per forward")
    return cols, line


# ------------------------------------------------------------------ output
def text_table(rows: list[dict], columns: list[tuple[str, str, str]], left: set[str],
               legend: str = "") -> str:
    """``rows`` as a fixed-width text table: ``columns`` are (header, key,
    format); keys in ``left`` are left-aligned, the rest right-aligned; a
    missing value is ``-`` (blank for a ``note``); ``legend`` goes below."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) not in (None, "")
                      else ("" if k == "note" else "-") for _, k, fmt in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    right = {i for i, (_, k, _) in enumerate(columns) if k not in left}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip()
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    if legend:
        lines.append(legend)
    return "\n".join(lines)


def write_csv(rows: list[dict], columns: list[str], path: str | Path) -> None:
    """``rows`` under the header ``columns`` (missing values empty)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})


def save_plot(draw: Callable[[], Any], path: str | Path, hint: str = "") -> None:
    """``draw()`` a chart to ``path``; without matplotlib, say so and how to
    draw it elsewhere instead of failing the run (the CSV has the data)."""
    try:
        draw()
        print(f"wrote {path}", file=sys.stderr)
    except ImportError as err:
        print(f"no plot ({err}){'; ' + hint if hint else ''}", file=sys.stderr)


def geomean(values) -> float:
    """Geometric mean of positive numbers."""
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


# --------------------------------------------------------------------- CLI
def add_run_arguments(parser, default_config: Path, *, csv_help: str, plot_help: str,
                      quick_help: str) -> None:
    """The arguments ``infer`` and ``train`` share (config, backends, device,
    dtype, warmup, offline fallbacks, outputs, smoke run, progress bars)."""
    parser.add_argument("--config", default=None,
                        help=f"YAML config (default {default_config.relative_to(REPO_ROOT)})")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="backends to run, overriding the config (space or comma separated)")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default=None, choices=["auto", *DTYPES])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--offline", action="store_true",
                        help="use each dataset's fallback (local npz or synthetic stand-in) "
                             "without trying its download")
    parser.add_argument("--csv", default=None, help=csv_help)
    parser.add_argument("--plot", default=None, help=plot_help)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--eager", action="store_true",
                        help="on a GPU, run fused3s eagerly only (default: also its whole "
                             "forward or training step as CUDA-graph replays, fused3s@graph)")
    parser.add_argument("--no-compiled-runs", action="store_true",
                        help="on a GPU, do not add the torch.compile runs (pyg@compile, "
                             "pyg@reduce-overhead, fused3s@compile-graph)")


def split_args(values: list[str] | None) -> list[str] | None:
    """``--backends a,b c`` -> ``[a, b, c]``."""
    return None if values is None else [v for s in values for v in s.split(",") if v]


def apply_run_arguments(cfg: dict, args, keys: tuple[str, ...]) -> None:
    """Command-line values given (not None) for ``keys``, ``--backends`` and
    ``--no-compiled-runs`` override the config's."""
    for key in keys:
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    backends = split_args(args.backends)
    if backends:
        cfg["backends"] = backends
    if getattr(args, "no_compiled_runs", False):
        cfg["compiled_runs"] = False
