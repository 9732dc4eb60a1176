"""Graph Transformer inference, backend against backend, on the datasets of
a YAML config: the work behind ``gt-fused3s infer`` and ``scripts/infer.py``.

For every dataset: load it (its first ``max_batches`` batches, moved to the
device once), build one model (seeded: the same weights for every backend),
compute the agreement target with the ``reference`` backend, then for each
backend: warm up, time ``repeats`` forwards (batch ``r % B`` for forward
``r``; CUDA events on a GPU, ``perf_counter`` on a CPU; no per-layer
synchronisation), then one profiled pass over the batches that times the
attention calls and the graph-format build apart and collects the outputs.

A forward includes building the graph's format (every batch is a new graph
to the model), so ``ms/fwd`` is end to end. A backend that cannot run
(flex on a CPU, dense above its node limit, out of memory, an error) gets a
row with a note instead of a time; the run goes on.

Config schema (YAML; defaults in :data:`DEFAULTS`)::

    device: auto          # auto (cuda if available, else cpu) | cpu | cuda | cuda:1
    dtype: auto           # auto (fp32 on cpu, fp16 on cuda) | fp32 | fp16 | bf16 (autocast)
    seed: 0               # weights and generated data
    warmup: 2             # untimed forwards per backend
    repeats: 5            # timed forwards per backend
    backends: [fused3s, pyg, reference, dense, flex]
    reference: reference  # backend the 'max diff' column compares with
    max_nodes: {dense: 4096, flex: 65536}   # skip a backend above N nodes per forward
    model: {hidden: 64, layers: 10, heads: 1, norm: layer, dropout: 0.0,
            out_channels: null, self_loops: false}
    datasets:             # each: see gt_fused3s.data.load_dataset
      - name: molecules
        kind: molecules   # molecules | powerlaw | npz | ogb | lrgb | pyg
        params: {...}     # arguments of the kind's loader
        quick: {...}      # params overrides under --quick
        max_batches: 4    # use the first batches only (default: all)
        readout: graph    # default: graph for collections, node for one graph
"""
from __future__ import annotations

import contextlib
import copy
import csv
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from tqdm import tqdm

from ..backends import BACKENDS
from ..data import load_dataset
from ..data.base import REPO_ROOT
from ..models import GraphTransformer
from .common import free_cuda_memory, git_sha, short_error

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"

DEFAULTS: dict[str, Any] = {
    "device": "auto",
    "dtype": "auto",
    "seed": 0,
    "warmup": 2,
    "repeats": 5,
    "backends": ["fused3s", "pyg", "reference", "dense", "flex"],
    "reference": "reference",
    "max_nodes": {"dense": 4096, "flex": 65536},
    "model": {"hidden": 64, "layers": 10, "heads": 1, "norm": "layer", "dropout": 0.0,
              "out_channels": None, "self_loops": False},
    "datasets": [],
}
_DATASET_KEYS = {"name", "kind", "params", "quick", "max_batches", "readout"}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: columns of the CSV, in order
COLUMNS = ["dataset", "backend", "status", "note", "level", "batches", "graphs_per_fwd",
           "nodes_per_fwd", "edges_per_fwd", "ms_median", "ms_mean", "ms_std", "ms_min",
           "ms_max", "attn_ms", "attn_share", "format_ms", "speedup_vs_pyg", "max_abs_diff",
           "reference", "device", "device_name", "dtype", "hidden", "layers", "heads",
           "torch", "git_sha", "config"]


# ------------------------------------------------------------------ config
def resolve_config_path(path: str | Path | None) -> Path:
    """``path`` as given, else relative to the repository root; default
    ``configs/default.yaml``."""
    if path is None:
        return DEFAULT_CONFIG
    p = Path(path).expanduser()
    for cand in (p, REPO_ROOT / p):
        if cand.is_file():
            return cand.resolve()
    raise FileNotFoundError(f"config {str(path)!r} not found (also tried {REPO_ROOT / p})")


def load_config(path: str | Path | None = None) -> dict:
    """Read a YAML config and fill in :data:`DEFAULTS` (the ``model`` and
    ``max_nodes`` mappings are merged key by key). Unknown keys are errors."""
    path = resolve_config_path(path)
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    cfg = validate_config(raw)
    cfg["config"] = str(path)
    return cfg


def validate_config(raw: dict) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"a config is a mapping (got {type(raw).__name__})")
    unknown = set(raw) - set(DEFAULTS) - {"config", "description"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = copy.deepcopy(DEFAULTS)
    for key, value in raw.items():
        if key in ("model", "max_nodes"):
            extra = set(value or {}) - set(DEFAULTS[key]) if key == "model" else set()
            if extra:
                raise ValueError(f"unknown model keys {sorted(extra)}; "
                                 f"known: {sorted(DEFAULTS[key])}")
            cfg[key].update(value or {})
        else:
            cfg[key] = value
    bad = [b for b in cfg["backends"] if b not in BACKENDS]
    if bad:
        raise ValueError(f"unknown backends {bad}; choose from {sorted(BACKENDS)}")
    if cfg["dtype"] != "auto" and cfg["dtype"] not in _DTYPES:
        raise ValueError(f"dtype must be auto, fp32, fp16 or bf16 (got {cfg['dtype']!r})")
    if not cfg["datasets"]:
        raise ValueError("the config lists no datasets")
    for spec in cfg["datasets"]:
        if not isinstance(spec, dict) or "kind" not in spec:
            raise ValueError(f"each dataset needs a 'kind' (got {spec!r})")
        extra = set(spec) - _DATASET_KEYS
        if extra:
            raise ValueError(f"dataset {spec.get('name', spec['kind'])!r}: unknown keys "
                             f"{sorted(extra)}; known: {sorted(_DATASET_KEYS)}")
    return cfg


# ------------------------------------------------------------------ helpers
def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but CUDA is not available here")
    return device


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in _DTYPES.items() if v == dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _skip_reason(backend: str, device: torch.device, nodes: int, max_nodes: dict) -> str | None:
    if backend == "flex" and device.type != "cuda":
        return "skipped: flex runs on CUDA only"
    limit = max_nodes.get(backend)
    if limit is not None and nodes > limit:
        return f"skipped: {nodes} nodes per forward > max_nodes.{backend}={limit}"
    return None


def time_forwards(forward: Callable[[int], Any], count: int, device: torch.device,
                  on_step: Callable[[], None] | None = None) -> list[float]:
    """Milliseconds of ``forward(r)`` for r = 0 .. count-1: CUDA events around
    each call on a GPU (one synchronisation at the end), ``perf_counter``
    on a CPU (where every op is synchronous)."""
    if device.type == "cuda":
        events = []
        for r in range(count):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward(r)
            end.record()
            events.append((start, end))
            if on_step:
                on_step()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in events]
    times = []
    for r in range(count):
        t0 = time.perf_counter()
        forward(r)
        times.append((time.perf_counter() - t0) * 1e3)
        if on_step:
            on_step()
    return times


# --------------------------------------------------------------------- run
@dataclass
class _Settings:
    """What every dataset of one run shares."""
    cfg: dict
    device: torch.device
    autocast: Any              # a reusable context manager (torch.autocast or a no-op)
    warmup: int
    repeats: int
    quick: bool
    progress: bool
    log: Callable[[str], None]
    common: dict               # columns that are the same in every row


def run(cfg: dict, *, quick: bool = False, progress: bool = True,
        log: Callable[[str], None] | None = None) -> list[dict]:
    """Run the benchmark of a validated config; returns one row per
    (dataset, backend), with the keys of :data:`COLUMNS`."""
    log = log or (lambda msg: tqdm.write(msg, file=sys.stderr))
    device = _device(cfg["device"])
    dtype = _dtype(cfg["dtype"], device)
    warmup, repeats = int(cfg["warmup"]), int(cfg["repeats"])
    if quick:
        warmup, repeats = min(warmup, 1), min(repeats, 2)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    common = {"reference": cfg["reference"], "device": str(device),
              "device_name": device_name(device), "dtype": _dtype_name(dtype),
              "hidden": cfg["model"]["hidden"], "layers": cfg["model"]["layers"],
              "heads": cfg["model"]["heads"], "torch": torch.__version__, "git_sha": git_sha(),
              "config": cfg.get("config", "")}
    log(f"gt-fused3s infer: device {common['device_name']} ({device}), {common['dtype']}, "
        f"torch {torch.__version__}, git {common['git_sha']}")
    settings = _Settings(cfg, device, autocast, warmup, repeats, quick, progress, log, common)
    rows: list[dict] = []
    for spec in cfg["datasets"]:
        rows += _run_dataset(spec, settings)
        free_cuda_memory(device)          # the dataset's batches and model are gone now
    return rows


def _run_dataset(spec: dict, settings: _Settings) -> list[dict]:
    cfg, device, log = settings.cfg, settings.device, settings.log
    name = spec.get("name", spec["kind"])
    base = {**settings.common, "dataset": name}
    try:
        ds = load_dataset(spec, device=device, seed=cfg["seed"], quick=settings.quick)
        limit = 1 if settings.quick else spec.get("max_batches")
        n_batches = len(ds) if limit is None else min(len(ds), int(limit))
        batches = [ds[i] for i in tqdm(range(n_batches), desc=f"{name}: load", leave=False,
                                       disable=not settings.progress, file=sys.stderr)]
    except Exception as err:   # missing file, offline, bad params: note it, go on
        log(f"{name}: dataset not loaded: {type(err).__name__}: {err}")
        return [{**base, "backend": "-", "status": "error", "note": f"dataset: {short_error(err)}"}]

    readout = spec.get("readout") or ds.level
    nodes = [d.num_nodes for d in batches]
    sizes = {"level": ds.level, "batches": n_batches,
             "graphs_per_fwd": round(statistics.mean(
                 d.ptr.numel() - 1 if "ptr" in d else 1 for d in batches), 1),
             "nodes_per_fwd": round(statistics.mean(nodes)),
             "edges_per_fwd": round(statistics.mean(d.edge_index.size(1) for d in batches))}
    mcfg = cfg["model"]
    torch.manual_seed(cfg["seed"])
    model = GraphTransformer(ds.num_features, mcfg["hidden"],
                             mcfg["out_channels"] or ds.num_classes or 1,
                             num_layers=mcfg["layers"], heads=mcfg["heads"],
                             backend=cfg["reference"], norm=mcfg["norm"], readout=readout,
                             dropout=mcfg["dropout"], self_loops=mcfg["self_loops"])
    model = model.to(device).eval()

    def forward(d):
        with torch.inference_mode(), settings.autocast:
            return model(d.x, d.edge_index, d.batch if readout == "graph" else None)

    # The agreement target: the reference backend on every batch.
    target, target_note = None, ""
    skip = _skip_reason(cfg["reference"], device, max(nodes), cfg["max_nodes"])
    if skip:
        target_note = f"no reference outputs ({cfg['reference']} {skip})"
    else:
        try:
            model.backend = cfg["reference"]
            target = [forward(d).float() for d in batches]
        except Exception as err:
            target_note = f"no reference outputs ({cfg['reference']}: {short_error(err)})"
            free_cuda_memory(device)
    if target_note:
        log(f"{name}: {target_note}")

    rows = []
    for backend in cfg["backends"]:
        row = {**base, **sizes, "backend": backend}
        skip = _skip_reason(backend, device, max(nodes), cfg["max_nodes"])
        if skip:
            rows.append({**row, "status": "skipped", "note": skip})
            continue
        model.backend = backend
        bar = tqdm(total=settings.warmup + settings.repeats + n_batches,
                   desc=f"{name}: {backend}", leave=False, disable=not settings.progress,
                   file=sys.stderr)
        try:
            row.update(_measure(forward, batches, device, settings.warmup, settings.repeats,
                                model, target, bar.update))
            row.update(status="ok", note=target_note if target is None else "")
        except Exception as err:
            oom = isinstance(err, torch.cuda.OutOfMemoryError)
            row.update(status="oom" if oom else "error", note="out of memory" if oom
                       else short_error(err))
            log(f"{name}: {backend} failed: {row['note']}")
            free_cuda_memory(device)
        finally:
            bar.close()
        rows.append(row)

    pyg = next((r for r in rows if r["backend"] == "pyg" and r["status"] == "ok"), None)
    for r in rows:
        if pyg and r["status"] == "ok":
            r["speedup_vs_pyg"] = pyg["ms_median"] / r["ms_median"]
    return rows


def _measure(forward, batches, device, warmup, repeats, model, target, step) -> dict:
    B = len(batches)
    for r in range(warmup):
        forward(batches[r % B])
        step()
    _sync(device)
    times = time_forwards(lambda r: forward(batches[r % B]), repeats, device, step)

    # Profiled pass: every batch once, attention and format timed apart.
    outs, total = [], 0.0
    with model.attention_timer() as timer:
        for d in batches:
            _sync(device)
            t0 = time.perf_counter()
            outs.append(forward(d))
            _sync(device)
            total += time.perf_counter() - t0
            step()
        attn, fmt = timer.ms("attention"), timer.ms("format")
    diff = None
    if target is not None:
        diff = max(float((o.float() - t).abs().max()) if o.numel() else 0.0
                   for o, t in zip(outs, target))
        if not math.isfinite(diff):
            diff = float("inf")
    return {"ms_median": statistics.median(times), "ms_mean": statistics.mean(times),
            "ms_std": statistics.pstdev(times), "ms_min": min(times), "ms_max": max(times),
            "attn_ms": attn / B, "attn_share": attn / (total * 1e3) if total else None,
            "format_ms": fmt / B, "max_abs_diff": diff}


# ------------------------------------------------------------------ output
_TABLE = [  # header, key, format
    ("dataset", "dataset", "{}"), ("backend", "backend", "{}"),
    ("N/fwd", "nodes_per_fwd", "{:d}"), ("E/fwd", "edges_per_fwd", "{:d}"),
    ("ms/fwd", "ms_median", "{:.2f}"), ("±ms", "ms_std", "{:.2f}"),
    ("attn ms", "attn_ms", "{:.2f}"), ("attn %", "attn_share", "{:.0%}"),
    ("fmt ms", "format_ms", "{:.2f}"), ("vs pyg", "speedup_vs_pyg", "{:.2f}x"),
    ("max|diff|", "max_abs_diff", "{:.1e}"), ("note", "note", "{}"),
]


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (one line per dataset and backend)."""
    cells = [[h for h, _, _ in _TABLE]]
    for r in rows:
        cells.append([fmt.format(r[k]) if r.get(k) not in (None, "")
                      else ("" if k == "note" else "-") for _, k, fmt in _TABLE])
    widths = [max(len(c[i]) for c in cells) for i in range(len(_TABLE))]
    right = {i for i, (_, k, _) in enumerate(_TABLE) if k not in ("dataset", "backend", "note")}
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(line, widths))).rstrip()
             for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_csv(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})


# --------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None,
                        help=f"YAML config (default {DEFAULT_CONFIG.relative_to(REPO_ROOT)})")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="backends to run, overriding the config (space or comma separated)")
    parser.add_argument("--datasets", nargs="+", default=None,
                        help="only these dataset names of the config")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default=None, choices=["auto", *_DTYPES])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: each dataset's 'quick' params, one batch, "
                             "1 warmup and 2 timed forwards")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _split(values: list[str] | None) -> list[str] | None:
    return None if values is None else [v for s in values for v in s.split(",") if v]


def main(args) -> int:
    """Run ``gt-fused3s infer`` with parsed ``args``; prints the table."""
    cfg = load_config(args.config)
    for key in ("device", "dtype", "warmup", "repeats"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    backends = _split(args.backends)
    if backends:
        cfg["backends"] = backends
    names = _split(args.datasets)
    if names:
        missing = set(names) - {d.get("name", d["kind"]) for d in cfg["datasets"]}
        if missing:
            raise ValueError(f"datasets {sorted(missing)} are not in {cfg['config']}")
        cfg["datasets"] = [d for d in cfg["datasets"] if d.get("name", d["kind"]) in names]
    path = cfg.pop("config")
    cfg = validate_config(cfg) | {"config": path}

    rows = run(cfg, quick=args.quick, progress=not args.no_progress)
    print(format_table(rows))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    return 0 if any(r["status"] == "ok" for r in rows) else 1
