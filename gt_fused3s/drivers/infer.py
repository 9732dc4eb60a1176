"""Graph Transformer inference, backend against backend, on the datasets of
a YAML config: the work behind ``gt-fused3s infer`` and ``scripts/infer.py``.

For every dataset, load it once; for every hidden size, build one model
(seeded: the same weights for every backend) and measure every backend,
the ``reference`` backend first (its outputs are the agreement target), in
eval mode under ``torch.inference_mode`` (fp16 or bf16 autocast on a GPU):

* **Single graph** (``level: node``): the graph lives on the device and its
  format is built once; ``fmt ms`` is that build (a second, warm build,
  synchronised and timed apart), *not* part of ``ms/fwd``. Then ``warmup``
  forwards and ``repeats`` timed forwards (CUDA events around each; no
  synchronisation between them). On a GPU with ``cuda_graphs`` (default)
  the timed forwards are replays of a CUDA graph of the forward, for every
  backend alike (``timing`` column): eager PyTorch launches each of the
  model's ~200 kernels from the host, and on a slow host that launch time,
  not the GPU, sets the pace of a small graph. A backend whose forward cannot
  be captured is timed eagerly, with a note.
* **Collection** (``level: graph``): streamed. Its first ``max_batches``
  batches are made once on the host (pinned memory); a forward copies its
  batch to the device and builds its format (a new batch is a new graph),
  so ``ms/fwd`` *includes* the build (``fmt ms`` says how much). With
  ``prefetch`` the next batch is copied and built on a side CUDA stream while
  the current one computes (:mod:`gt_fused3s.drivers.stream`). The timed run
  streams ``max(repeats, batches)`` forwards (batch ``r % batches`` for forward
  ``r``); a forward's time is the interval between the ends of consecutive
  forwards (CUDA events), so a wait for the next batch counts.
  ``graphs_per_s`` is the throughput of that run.

Then a separate profiled pass (every batch once, synchronised around each
forward, built inline) times the attention calls and the format builds
apart (:meth:`GraphTransformer.attention_timer`): ``attn ms``, ``attn %`` of
that pass, and the outputs, compared with the target (``max|diff|``). Peak
memory is ``torch.cuda.max_memory_allocated`` over the backend's runs (reset
before each backend). ``speedup_vs_<b>`` of a row is ``ms/fwd`` of backend
``b`` over this row's, same dataset and hidden size.

A backend that cannot run (flex on a CPU or on a collection of many batches
- FlexAttention compiles once per graph shape -, above its ``max_nodes``, out of
memory, an error) gets a row with a note instead of a time; the run goes on.

**Under torchrun** (``torchrun --nproc_per_node=P gt-fused3s infer ...``;
the process group from torchrun's environment, NCCL on GPUs, Gloo on CPUs,
:func:`gt_fused3s.distributed.data_parallel.init`), every rank loads each
dataset, and:

* a single graph (``readout: node``) is partitioned as ``gt-fused3s train``
  partitions it (``distributed: {partitioner, head_chunks}``,
  :func:`gt_fused3s.distributed.single_graph.split_graph`): each rank keeps
  its nodes' rows and computes them, every attention layer exchanging the
  K and V halo. Runs are eager (other modes get a ``skipped`` row; no CUDA
  graph of the halo exchange); the local plan is built by a first, untimed
  forward (``fmt ms`` is empty); ``attn ms`` includes the exchange. The
  outputs of the profiled pass are gathered from the ranks in the whole
  graph's node order, so ``max|diff|`` compares whole outputs;
* a collection's batches are sharded: rank r runs batches r, r + P, ...
  (a rank past the last batch idles; ``--quick`` loads one batch per rank)
  in every mode, with no communication; ``max|diff|`` is the largest
  rank's, ``graphs_per_s`` the ranks' sum.

Per run, ``ms/fwd`` (and ``attn ms``) are the slowest rank's, peak memory,
``kernel ms`` and ``fmt ms`` the largest rank's; a run that fails on a rank
fails (its note names the rank). The dataset columns (``batches``, sizes
per forward) describe the whole dataset; ``ranks`` is P. Only rank 0 logs,
prints the table and writes the CSV and the plot. Without torchrun nothing
of this applies.

Config schema (YAML; defaults in :data:`DEFAULTS`)::

    device: auto          # auto (cuda if available, else cpu) | cpu | cuda | cuda:1
    dtype: auto           # auto (fp32 on cpu, fp16 on cuda) | fp32 | fp16 | bf16 (autocast)
    seed: 0               # weights and generated data
    warmup: 2             # untimed forwards per backend
    repeats: 5            # timed forwards per backend (collections: at least one per batch)
    prefetch: false       # collections: build the next batch's format on a side stream
    cuda_graphs: true     # single graphs on a GPU: time CUDA-graph replays of the forward
    backends: [fused3s, pyg, reference, dense, flex]   # each may end in @eager, @graph,
                          # @compile, @reduce-overhead, @compile-graph (see gt_fused3s.bench.common.MODES)
    compiled_runs: true   # on a GPU: add pyg@compile, pyg@reduce-overhead, fused3s@compile-graph
    max_buckets: 4        # static shapes the captured / compiled runs pad batches to
    reference: reference  # backend the 'max diff' column compares with
    max_nodes: {dense: 4096, flex: 65536}   # skip a backend above N nodes per forward
    model: {hidden: 64, layers: 10, heads: 1, norm: layer, dropout: 0.0,
            out_channels: null, self_loops: false,   # hidden: a size or a list of sizes
            edge_features: false}   # an attention bias per block from the data's bond types
                                    # (dense and flex take none: skipped)
    distributed: {partitioner: contiguous, head_chunks: 4}   # under torchrun, a single graph's
                          # nodes are partitioned over the ranks (contiguous | metis); the K/V
                          # halo exchange is pipelined in head_chunks chunks (1: no overlap)
    datasets:             # each: see gt_fused3s.data.load_dataset
      - name: molecules
        kind: molecules   # molecules | random_graphs | powerlaw | npz | ogb | lrgb | pyg
        params: {...}     # arguments of the kind's loader
        quick: {...}      # params overrides under --quick
        fallback: {kind: npz, params: {...}}   # used when the data is unavailable / --offline
        max_batches: 4    # use the first batches only (default: all)
        readout: graph    # default: graph for collections, node for one graph
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..backends import BACKENDS, AttentionGraph
from ..capture import CudaGraphRunner
from ..data import check_entry, load_dataset
from ..data.bucket import Buckets
from ..distributed import data_parallel, single_graph
from ..distributed.partition import LocalGraph
from ..models import GraphTransformer
from ..bench.common import (
    INTERRUPTED_EXIT,
    REFERENCE_PATH_NOTE,
    add_run_arguments,
    apply_run_arguments,
    COMPILED_MODES,
    expand_runs,
    parse_run,
    autocast,
    check_backends,
    check_dtype,
    describe_dataset,
    free_cuda_memory,
    geomean,
    guarded,
    Interrupted,
    load_batches,
    log_stderr,
    merge_config,
    peak_memory_mb,
    peak_reserved_mb,
    progress_bar,
    read_config,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    revalidate,
    run_header,
    runs_reference_path,
    run_info,
    save_plot,
    shipped_config,
    short_error,
    split_args,
    status_of,
    sync,
    text_table,
)
from ..bench.common import resolve_config_path as _resolve_config_path
from ..bench.common import write_csv as _write_csv
from .stream import Staged, num_graphs, pin, stage, stream_batches, to_device
from ..bench.timing import Clock, kernel_time, time_forwards

DEFAULT_CONFIG = shipped_config("default.yaml")

DEFAULTS: dict[str, Any] = {
    "device": "auto",
    "dtype": "auto",
    "seed": 0,
    "warmup": 2,
    "repeats": 5,
    "prefetch": False,
    "cuda_graphs": True,
    "backends": ["fused3s", "pyg", "reference", "dense", "flex"],
    "compiled_runs": True,
    "max_buckets": 4,
    "reference": "reference",
    "max_nodes": {"dense": 4096, "flex": 65536},
    "model": {"hidden": 64, "layers": 10, "heads": 1, "norm": "layer", "dropout": 0.0,
              "out_channels": None, "self_loops": False, "edge_features": False},
    "distributed": dict(single_graph.SETTINGS),
    "datasets": [],
}
_HARNESS_KEYS = {"max_batches", "readout"}     # dataset keys besides the loader's

#: columns of the CSV, in order
COLUMNS = ["dataset", "hidden", "backend", "mode", "status", "note", "level", "structure", "source",
           "batches", "graphs_per_fwd", "nodes_per_fwd", "edges_per_fwd", "ms_median", "ms_mean",
           "ms_std", "ms_min", "ms_max", "kernel_ms", "graphs_per_s", "attn_ms", "attn_share",
           "format_ms", "peak_mem_mb", "reserved_mb", *(f"speedup_vs_{b}" for b in BACKENDS),
           "speedup_vs_pyg@compile", "speedup_vs_pyg@reduce-overhead", "speedup_vs_fused3s@graph",
           "speedup_vs_fused3s@compile-graph",
           "speedup_vs_pyg_best", "pyg_best", "max_abs_diff", "reference",
           "timing", "prefetch", "ranks", "device", "device_name", "dtype", "layers", "heads", "torch", "git_sha",
           "config"]


# ------------------------------------------------------------------ config
def resolve_config_path(path: str | Path | None) -> Path:
    """``path`` as given, else relative to the repository root; default
    ``configs/default.yaml``."""
    return _resolve_config_path(path, DEFAULT_CONFIG)


def load_config(path: str | Path | None = None) -> dict:
    """Read a YAML config and fill in :data:`DEFAULTS` (the ``model`` and
    ``max_nodes`` mappings are merged key by key). Unknown keys are errors."""
    return read_config(path, DEFAULT_CONFIG, validate_config)


def validate_config(raw: dict) -> dict:
    cfg = merge_config(raw, DEFAULTS, open_keys=frozenset({"max_nodes"}))
    check_backends(cfg["backends"])
    check_dtype(cfg["dtype"])
    hidden = _as_list(cfg["model"]["hidden"])
    if not hidden or not all(isinstance(h, int) and h > 0 for h in hidden):
        raise ValueError(f"model.hidden must be a positive int or a list of them "
                         f"(got {cfg['model']['hidden']!r})")
    for key, low in (("warmup", 0), ("repeats", 1)):
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{key} must be an int >= {low} (got {value!r})")
    single_graph.check_settings(cfg["distributed"])
    if not cfg["datasets"]:
        raise ValueError("the config lists no datasets")
    for spec in cfg["datasets"]:
        check_entry(spec, _HARNESS_KEYS)
    return cfg


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ------------------------------------------------------------------ helpers
#: --quick on a CPU: dense attention (O(N^2) per layer) only up to this many nodes
QUICK_CPU_DENSE_NODES = 1024


def _quick_on_cpu(cfg: dict, device: torch.device, dtype: torch.dtype, log) -> dict:
    """A smoke run on a CPU in about a minute: fp32 instead of fp16 or bf16
    (a CPU emulates their matmuls, 5-10x slower, and runs the reference
    path anyway), the smallest hidden size only (the others run the same
    code) and the dense backend on graphs of at most
    :data:`QUICK_CPU_DENSE_NODES` nodes; each change is said on the log."""
    if device.type != "cpu":
        return cfg
    cfg = {**cfg, "max_nodes": dict(cfg["max_nodes"]), "model": dict(cfg["model"])}
    hidden = _as_list(cfg["model"]["hidden"])
    if len(hidden) > 1:
        cfg["model"]["hidden"] = [min(hidden)]
        log(f"--quick on a CPU: hidden {min(hidden)} only (of {hidden})")
    if dtype != torch.float32:
        log(f"--quick on a CPU: fp32 instead of {cfg['dtype']} (a CPU emulates fp16/bf16 matmuls)")
        cfg["dtype"] = "fp32"
    if cfg["max_nodes"].get("dense", QUICK_CPU_DENSE_NODES + 1) > QUICK_CPU_DENSE_NODES:
        cfg["max_nodes"]["dense"] = QUICK_CPU_DENSE_NODES
        log(f"--quick on a CPU: dense attention on graphs of at most {QUICK_CPU_DENSE_NODES} nodes")
    return cfg


def _skip_reason(backend: str, device: torch.device, nodes: int, max_nodes: dict,
                 streamed_batches: int) -> str | None:
    if backend == "flex" and device.type != "cuda":
        return "skipped: flex runs on CUDA only"
    if backend == "flex" and streamed_batches > 1:
        # dynamic=False: a compile per graph shape, and every batch has its own
        return "skipped: flex compiles per graph shape (run it on single graphs)"
    limit = max_nodes.get(backend)
    if limit is not None and nodes > limit:
        return f"skipped: {nodes} nodes per forward > max_nodes.{backend}={limit}"
    return None


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
    offline: bool
    progress: bool
    log: Callable[[str], None]
    common: dict               # columns that are the same in every row
    runs: list                 # backend runs, "name" or "name@mode" (common.expand_runs)
    world: int = 1             # ranks (torchrun); 1: one process
    rank: int = 0


def run(cfg: dict, *, quick: bool = False, offline: bool = False, progress: bool = True,
        log: Callable[[str], None] | None = None, eager: bool = False) -> list[dict]:
    """Run the benchmark of a validated config; returns one row per
    (dataset, hidden size, run), with the keys of :data:`COLUMNS`.
    ``offline``: datasets with a ``fallback`` use it without trying their
    own loader; ``eager``: no CUDA-graph run of fused3s (see
    :func:`gt_fused3s.bench.common.expand_runs`)."""
    log = log or log_stderr
    device = resolve_device(cfg["device"])
    world, rank, device = data_parallel.init(device)      # (1, 0) unless under torchrun
    if rank != 0:                                         # rank 0 speaks for all
        log, progress = (lambda msg: None), False
    dtype = resolve_dtype(cfg["dtype"], device)
    warmup, repeats = int(cfg["warmup"]), int(cfg["repeats"])
    if quick:
        warmup, repeats = min(warmup, 1), min(repeats, 2)
        cfg = _quick_on_cpu(cfg, device, dtype, log)
        dtype = resolve_dtype(cfg["dtype"], device)
    runs = expand_runs(cfg["backends"], device, eager=eager, compiled_runs=cfg["compiled_runs"])
    if any(parse_run(r)[0] == "flex" or parse_run(r)[1] != "eager" for r in runs):
        # one compile per graph shape and head dim (flex), per bucket shape (compiled runs)
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    common = {"reference": cfg["reference"], "prefetch": bool(cfg["prefetch"]), "ranks": world,
              "layers": cfg["model"]["layers"], "heads": cfg["model"]["heads"],
              **run_info(device, dtype, cfg.get("config", ""))}
    log(run_header("infer", common))
    # no autocast cache: a CUDA graph must not capture casts cached outside it
    settings = _Settings(cfg, device, autocast(device, dtype, cache=False), warmup, repeats,
                         quick, offline, progress, log, common, runs, world, rank)
    rows: list[dict] = []
    try:
        for spec in cfg["datasets"]:
            _run_dataset(spec, settings, rows)
            free_cuda_memory(device)          # the dataset's batches are gone now
    except KeyboardInterrupt:
        raise Interrupted(rows) from None     # the rows of every finished (dataset, hidden size)
    return rows


def _run_dataset(spec: dict, s: _Settings, rows: list[dict]) -> None:
    """Append the rows of one dataset to ``rows``, one model (hidden size) at a time."""
    cfg, device = s.cfg, s.device
    name = spec.get("name", spec["kind"])
    base = {**s.common, "dataset": name}
    try:
        ds = load_dataset(spec, device=device, seed=cfg["seed"], quick=s.quick, offline=s.offline)
        streamed = ds.level == "graph"
        if streamed:     # host batches, pinned, made once: the stream copies them
            limit = s.world if s.quick else spec.get("max_batches")   # --quick: one per rank
            batches = [pin(b) for b in load_batches(ds, limit, "cpu", progress=s.progress)]
        else:            # one graph, on the device
            batches = [ds.get(0, device)]
    except Exception as err:   # missing file, offline, bad params: note it, go on
        s.log(f"{name}: dataset not loaded: {short_error(err, None)}")
        rows.append({**base, "backend": "-", "status": "error", "note": f"dataset: {short_error(err)}"})
        return

    sizes, line = describe_dataset(ds, spec["kind"], batches)     # the whole dataset's
    s.log(line)
    try:
        work = _work_of(batches, streamed, spec.get("readout") or ds.level, s)
    except ValueError as err:      # the same on every rank
        s.log(f"{name}: not run: {err}")
        rows.append({**base, **sizes, "backend": "-", "status": "error", "note": str(err)})
        return
    if work.lg is not None:
        s.log(f"{name}: nodes partitioned over {s.world} ranks ({cfg['distributed']['partitioner']}); "
              f"rank 0 owns {work.lg.num_local} nodes and receives {work.lg.halo.numel()} halo rows")
    elif s.world > 1:
        idle = s.world - len(batches)
        s.log(f"{name}: {len(batches)} batches sharded over {s.world} ranks (batch i on rank "
              f"i % {s.world}" + (f"; {idle} rank(s) without a batch idle" if idle > 0 else "") + ")")
    for hidden in _as_list(cfg["model"]["hidden"]):
        rows += _run_model(work, ds, hidden, {**base, **sizes, "hidden": hidden}, s)
        free_cuda_memory(device)


def _work_of(batches: list, streamed: bool, readout: str, s: _Settings) -> "_Work":
    """This rank's work on a dataset: every batch in one process; under
    torchrun, a collection's every P-th batch (:func:`data_parallel.shard`;
    ranks past the last batch have none), or its share of a single graph,
    partitioned as ``train`` does (:func:`single_graph.split_graph`).
    ValueError where the data cannot be shared out."""
    whole = {"max_nodes": max(d.num_nodes for d in batches), "total_batches": len(batches)}
    if s.world == 1:
        return _Work(batches, streamed, readout, s, **whole)
    if streamed:
        return _Work(data_parallel.shard(batches, s.rank, s.world), streamed, readout, s, **whole)
    if readout != "node":
        raise ValueError(f"readout: {readout} on a single graph: under torchrun its nodes are "
                         f"partitioned over the ranks, which needs readout: node")
    lg, local = single_graph.split_graph(batches[0], s.world, s.rank, s.cfg["distributed"])
    return _Work([local], streamed, readout, s, lg=lg, **whole)


def _run_model(work: _Work, ds, hidden: int, base: dict, s: _Settings) -> list[dict]:
    cfg, device, mcfg = s.cfg, s.device, s.cfg["model"]
    ref = cfg["reference"]
    torch.manual_seed(cfg["seed"])
    if mcfg["edge_features"] and ds.edge_vocab is None:
        raise ValueError(f"model.edge_features: the dataset {ds.name} has no categorical edge features")
    model = GraphTransformer(ds.num_features, hidden, mcfg["out_channels"] or ds.num_classes or 1,
                             num_layers=mcfg["layers"], heads=mcfg["heads"], backend=ref,
                             norm=mcfg["norm"], readout=work.readout, dropout=mcfg["dropout"],
                             self_loops=mcfg["self_loops"],
                             edge_vocab=ds.edge_vocab if mcfg["edge_features"] else None)
    model = model.to(device).eval()
    runs = s.runs
    # from the whole dataset's sizes: every rank skips the same runs
    skip = {name: _skip_reason(parse_run(name)[0], device, work.max_nodes, cfg["max_nodes"],
                               work.total_batches if work.streamed else 0)
            for name in {*runs, ref}}
    for name in skip:
        if model.edge_vocab is not None and parse_run(name)[0] in ("dense", "flex") and not skip[name]:
            skip[name] = "takes no per-edge bias (model.edge_features)"
        if work.lg is not None and parse_run(name)[1] != "eager" and not skip[name]:
            skip[name] = "skipped: a partitioned graph runs eagerly under torchrun"
    if not work.batches:           # a rank past a collection's last batch: nothing to measure
        rows = [dict(base, backend=name, mode=parse_run(name)[1], status="skipped" if skip[name] else "idle",
                     note=skip[name] or "") for name in runs]
        return _merge_ranks(rows, s)

    # The agreement target: the reference backend's outputs, from its own run
    # when it is benchmarked (first), else from one pass of its own.
    target, target_note = None, ""
    if ref not in runs and skip[ref]:
        target_note = f"no reference outputs ({ref} {skip[ref]})"
    elif ref not in runs:
        model.backend = ref
        target, error = guarded(lambda: work.measure(model, "eager", timed=False)["outputs"], device)
        target_note = f"no reference outputs ({ref}: {error})" if error else ""

    rows = {}
    for name in sorted(runs, key=lambda b: b != ref):
        backend, mode = parse_run(name)
        row = rows[name] = dict(base, backend=name, mode=mode)
        outputs = None
        if skip[name]:
            row.update(status="skipped", note=skip[name])
        else:
            model.backend = backend
            outputs, error = _measure_row(work, model, mode, row, s)
            if error:
                s.log(f"{base['dataset']} C={hidden}: {name} failed: {error}")
        if name == ref:
            target = outputs
            target_note = ("" if outputs is not None
                           else f"no reference outputs ({ref}: {row['note']})")
        if outputs is not None:
            if target is None:
                row["note"] = target_note
            else:
                diff, error = guarded(lambda: _max_abs_diff(outputs, target), device)
                row["max_abs_diff"] = diff
                if error:
                    row["note"] = f"outputs not compared: {error}"
    rows = [rows[b] for b in runs]
    if s.world > 1:
        rows = _merge_ranks(rows, s)
    for r in rows:
        if r.get("status") == "ok" and runs_reference_path(r["backend"], device):
            r["note"] = "; ".join(n for n in (r.get("note"), REFERENCE_PATH_NOTE) if n)
    add_speedups(rows)
    return rows


def _measure_row(work: _Work, model, mode: str, row: dict,
                 s: _Settings) -> tuple[list | None, str | None]:
    """Measure ``model`` with its current backend in ``mode`` into ``row``
    (status ok, oom or error); returns its outputs (None if it failed) and
    the error."""
    device = s.device
    bar = progress_bar(work.progress_total(), f"{row['dataset']} C={row['hidden']}: "
                       f"{row['backend']}", "graph" if work.streamed else "fwd", s.progress)
    reset_peak_memory(device)
    with bar:
        result, error = guarded(lambda: work.measure(model, mode, bar.update), device)
    if error:
        row.update(status=status_of(error), note=error)
        return None, error
    row.update(result, status="ok", note="", peak_mem_mb=peak_memory_mb(device),
               reserved_mb=peak_reserved_mb(device))
    return row.pop("outputs"), None


#: row keys a distributed run takes from its slowest rank's row (the largest ms_median)
_SLOWEST_KEYS = ("ms_median", "ms_mean", "ms_std", "ms_min", "ms_max", "attn_ms", "attn_share", "timing")
#: row keys a distributed run takes the largest of over the ranks
_MAX_KEYS = ("kernel_ms", "format_ms", "peak_mem_mb", "reserved_mb", "max_abs_diff")


def _merge_ranks(rows: list[dict], s: _Settings) -> list[dict]:
    """Every rank's rows of one (dataset, hidden size) as one set, on every
    rank (a collective; the ranks' rows are of the same runs, in order). A
    run failed where it failed on any rank (the note names the ranks);
    else its times are the slowest rank's, peak memory, kernel time, format
    build and ``max|diff|`` the largest rank's, ``graphs_per_s`` the ranks'
    sum (their batches run at once). Idle ranks (no batch of a collection)
    count for nothing."""
    every: list = [None] * s.world
    dist.all_gather_object(every, rows)
    merged = []
    for i in range(len(rows)):
        per_rank = [r[i] for r in every]
        failed = [(rank, r) for rank, r in enumerate(per_rank) if r.get("status") in ("oom", "error")]
        ran = [r for r in per_rank if r.get("status") == "ok"]
        out = dict(per_rank[0])     # rank 0 always has work (a collection's first batch)
        if failed:
            out.update({k: None for k in (*_SLOWEST_KEYS, *_MAX_KEYS, "graphs_per_s")},
                       status=failed[0][1]["status"],
                       note="; ".join(f"rank {rank}: {r.get('note')}" for rank, r in failed))
        elif ran:
            slowest = max(ran, key=lambda r: r.get("ms_median") or 0.0)
            out.update({k: slowest.get(k) for k in _SLOWEST_KEYS})
            for key in _MAX_KEYS:
                values = [r[key] for r in ran if r.get(key) is not None]
                out[key] = max(values) if values else None
            if any(r.get("graphs_per_s") is not None for r in ran):
                out["graphs_per_s"] = sum(r.get("graphs_per_s") or 0.0 for r in ran)
        merged.append(out)
    return merged


def _max_abs_diff(outputs: list, target: list) -> float:
    diff = max((float((o.float() - t.float()).abs().max()) if o.numel() else 0.0
                for o, t in zip(outputs, target)), default=0.0)
    return diff if math.isfinite(diff) else float("inf")


def add_speedups(rows: list[dict]) -> None:
    """Set ``speedup_vs_<b>`` = ms of run b / ms of the row's run on the ok
    rows of one (dataset, hidden size), and ``speedup_vs_pyg_best`` against
    the fastest pyg run (eager or compiled). A fused3s row that ran the
    reference path (no kernel on the device) gets none and is nobody's."""
    ok = {r["backend"]: r for r in rows if r.get("status") == "ok"
          and REFERENCE_PATH_NOTE not in (r.get("note") or "")}
    peers = [ok[b] for b in ok if parse_run(b)[0] == "pyg"]
    best = min(peers, key=lambda r: r["ms_median"]) if peers else None
    for r in ok.values():
        for b, other in ok.items():
            r[f"speedup_vs_{b}"] = other["ms_median"] / r["ms_median"]
        if best is not None:
            r["speedup_vs_pyg_best"] = best["ms_median"] / r["ms_median"]
            r["pyg_best"] = best["backend"]


def _timing_label(mode: str) -> str:
    """The ``timing`` column of a run of ``mode``."""
    return {"eager": "eager", "graph": "cuda-graph",
            "compile-graph": "cuda-graph of torch.compile"}.get(mode, f"torch.compile {mode}")


def _edge_attr(model, data):
    """The batch's edge features if the model reads them."""
    return data.edge_attr if model.edge_vocab is not None else None


class _Work:
    """The batches of one dataset, and how a model is measured on them."""

    def __init__(self, batches: list, streamed: bool, readout: str, s: _Settings, *,
                 lg: LocalGraph | None = None, max_nodes: int | None = None,
                 total_batches: int | None = None):
        self.batches, self.streamed, self.readout, self.s = batches, streamed, readout, s
        #: a single graph partitioned over the ranks: this rank's share
        #: (``batches``: its :class:`~gt_fused3s.distributed.single_graph.LocalBatch`)
        self.lg = lg
        #: the whole dataset's (every rank's batches): what skips a backend
        self.max_nodes = max_nodes if max_nodes is not None else max(d.num_nodes for d in batches)
        self.total_batches = total_batches if total_batches is not None else len(batches)
        self._padded: list | None = None

    def forward(self, model, data, graph=None):
        """``model`` on a batch on the device; ``graph`` None: the forward builds
        it. A partitioned graph: this rank's rows (a collective: the halo exchange)."""
        if self.lg is not None:
            with torch.inference_mode(), self.s.autocast:
                return model(data.x, None, graph=self.lg, edge_attr=_edge_attr(model, data))
        with torch.inference_mode(), self.s.autocast:
            return model(data.x, data.edge_index, data.batch if self.readout == "graph" else None,
                         graph=graph, num_graphs=num_graphs(data), edge_attr=_edge_attr(model, data))

    def _timed_count(self) -> int:
        return max(self.s.repeats, len(self.batches)) if self.streamed else self.s.repeats

    def progress_total(self) -> int:
        """Steps of :meth:`measure`: graphs (collections) or forwards (single graph)."""
        if not self.streamed:
            return self.s.warmup + self.s.repeats + 1
        graphs = [num_graphs(d) for d in self.batches]
        B = len(graphs)
        return sum(graphs[r % B] for r in range(self.s.warmup + self._timed_count())) + sum(graphs)

    # ------------------------------------------------------------ run modes
    def padded_batches(self) -> list:
        """The collection's host batches padded to at most ``max_buckets``
        static shapes (pinned), made once: what captured and compiled runs
        stream (:mod:`gt_fused3s.data.bucket`)."""
        if self._padded is None:
            buckets = Buckets.fit([(d.num_nodes, d.edge_index.size(1), num_graphs(d))
                                   for d in self.batches], self.s.cfg["max_buckets"])
            self._padded = [pin(buckets.pad_batch(d)) for d in self.batches]
        return self._padded

    def _runner(self, model, mode: str) -> Callable[[Any], Any]:
        """How a run of ``mode`` computes one forward of a batch on the
        device (a padded one for captured and compiled collections)."""
        graph_level = self.readout == "graph"
        if mode == "eager":
            return lambda data: self.forward(model, data)
        compiled = None
        if mode in COMPILED_MODES:
            compiled = torch.compile(model, mode="reduce-overhead" if mode == "reduce-overhead"
                                     else None, dynamic=False)
        if mode in ("compile", "reduce-overhead"):
            def run_compiled(data):
                with torch.inference_mode(), self.s.autocast:
                    out = compiled(data.x, data.edge_index, data.batch if graph_level else None,
                                   num_graphs=num_graphs(data), edge_attr=_edge_attr(model, data))
                # reduce-overhead returns its CUDA graph's static output, which
                # the next call overwrites (as our own replays do): keep a copy
                return out.clone() if mode == "reduce-overhead" else out
            return run_compiled

        def body(x, edge_index, *rest):
            # graph level: (batch, graph_mask[, edge_attr]); node level: ([edge_attr])
            batch, graph_mask, *edge = rest if graph_level else (None, None, *rest)
            edge_attr = edge[0] if edge else None
            with self.s.autocast:           # the batch's format is built inside the graph
                G = graph_mask.numel() if graph_mask is not None else None
                if compiled is not None:    # compile-graph: built inside the compiled region
                    return compiled(x, edge_index, batch, num_graphs=G, edge_attr=edge_attr)
                graph = AttentionGraph(edge_index, x.size(0), static=True)
                return model(x, None, batch, graph=graph, num_graphs=G, edge_attr=edge_attr)
        runner = CudaGraphRunner(body)

        def replay(data):
            inputs = ((data.x, data.edge_index, data.batch, data.graph_mask) if graph_level
                      else (data.x, data.edge_index))   # the runner takes tensors only
            if model.edge_vocab is not None:
                inputs = (*inputs, data.edge_attr)
            with torch.inference_mode():
                return runner(*inputs).clone()   # the static output is overwritten by the next replay
        return replay

    def measure(self, model, mode: str = "eager", step: Callable[[int], Any] = lambda n: None, *,
                timed: bool = True) -> dict:
        """The row's measurements (see the module docstring) and ``outputs``
        (one per batch); ``timed=False``: the profiled pass only."""
        out: dict[str, Any] = {}
        times, staged = None, None
        fwd = self._runner(model, mode)
        if self.streamed:
            if timed:
                times, graphs = self._time_stream(model, mode, fwd, step)
                out["graphs_per_s"] = graphs / (sum(times) / 1e3)
                out["timing"] = _timing_label(mode)
        else:
            out["format_ms"], staged = self._build_single(model)
            if timed:
                times, out["timing"] = self._time_single(model, mode, fwd, staged, step)
        if times:
            out.update(ms_median=statistics.median(times), ms_mean=statistics.mean(times),
                       ms_std=statistics.pstdev(times), ms_min=min(times), ms_max=max(times))
        return {**out, **self._profile(model, mode, fwd, staged, step)}

    def _build_single(self, model) -> tuple[float, Staged]:
        """The single graph's format, built once more after a warm-up build
        (extension load, first-call costs) and timed: it makes host syncs,
        so a synchronised wall clock. Returns (ms, the staged graph). A
        partitioned graph: (None, this rank's share): its local plan is built
        by a first, untimed forward (and kept in the LocalGraph)."""
        device, data = self.s.device, self.batches[0]
        if self.lg is not None:
            self.forward(model, data)
            sync(device)
            return None, Staged(data, self.lg)
        stage(data, model, device)              # dropped at once
        sync(device)
        t0 = time.perf_counter()
        staged = stage(data, model, device)
        sync(device)
        return (time.perf_counter() - t0) * 1e3, staged

    def _time_single(self, model, mode: str, fwd, staged: Staged, step) -> tuple[list[float], str]:
        """Forward times on one graph, and how they were taken: by replaying a
        CUDA graph of the whole forward on the prebuilt format (mode
        ``graph``, or ``cuda_graphs`` on a GPU: what a server does for a fixed
        graph; it takes the host's launch overhead, the same for every
        backend, out of the times), compiled, or eagerly."""
        device = self.s.device
        eager = mode == "eager"
        # eager and graph runs read the prebuilt format (graph: captured below)
        if mode in ("eager", "graph"):
            run = lambda: self.forward(model, staged.data, staged.graph)   # noqa: E731
        else:
            run = lambda: fwd(staged.data)   # noqa: E731
        for _ in range(self.s.warmup):
            run()
            step(1)
        sync(device)
        forward, timing = (lambda r: run()), _timing_label(mode)
        if self.lg is not None:       # the halo exchange's collectives are not captured
            timing = f"eager, partitioned over {self.s.world} ranks"
        elif device.type == "cuda" and (mode == "graph" or (eager and self.s.cfg["cuda_graphs"])):
            try:
                graph = self._capture(model, staged)
                forward, timing = (lambda r: graph.replay()), "cuda-graph"
            except Exception as err:      # a backend that syncs or cannot be captured
                sync(device)
                timing = f"eager (capture failed: {short_error(err, 80)})"
        return time_forwards(forward, self.s.repeats, device, lambda: step(1)), timing

    def _capture(self, model, staged: Staged) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one forward on the staged graph (warmed up on a side
        stream first, as capture requires)."""
        device = self.s.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(model, staged.data, staged.graph)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.forward(model, staged.data, staged.graph)
        return graph

    def _time_stream(self, model, mode: str, fwd, step) -> tuple[list[float], int]:
        device, B = self.s.device, len(self.batches)
        if mode == "eager":
            prefetch = bool(self.s.cfg["prefetch"])
            for st in stream_batches(self.batches, model, device,
                                     [r % B for r in range(self.s.warmup)], prefetch=prefetch):
                self.forward(model, st.data, st.graph)
                step(num_graphs(st.data))
            sync(device)
            clock, graphs = Clock(device), 0
            clock.mark()
            for st in stream_batches(self.batches, model, device,
                                     [r % B for r in range(self._timed_count())], prefetch=prefetch):
                self.forward(model, st.data, st.graph)
                clock.mark()
                graphs += num_graphs(st.data)
                step(num_graphs(st.data))
            return clock.intervals_ms(), graphs
        # Captured / compiled: padded host batches, copied per forward; one
        # batch of every shape first (its capture or compile), then the warmup.
        padded = self.padded_batches()
        firsts = {(d.num_nodes, d.edge_index.size(1)): i for i, d in reversed(list(enumerate(padded)))}
        for i in [*sorted(firsts.values()), *(r % B for r in range(self.s.warmup))]:
            fwd(to_device(padded[i], device))
            step(num_graphs(self.batches[i]))
        sync(device)
        clock, graphs = Clock(device), 0
        clock.mark()
        for r in range(self._timed_count()):
            fwd(to_device(padded[r % B], device))
            clock.mark()
            graphs += num_graphs(self.batches[r % B])
            step(num_graphs(self.batches[r % B]))
        return clock.intervals_ms(), graphs

    def _profile(self, model, mode: str, fwd, staged: Staged | None, step) -> dict:
        """One synchronised pass over the batches: the outputs (real rows of
        padded batches); for eager runs with the attention timer too
        (attention ms per forward and its share of the pass, the format ms of
        collections, built inside each forward); on a GPU the kernel time of
        one forward (profiler)."""
        device, total, outputs = self.s.device, 0.0, []
        eager = mode == "eager"
        padded = self.padded_batches() if self.streamed and not eager else None
        # the run's own forward, except where it is the eager one on a
        # prebuilt format (eager runs; a single graph's captured forward)
        use_fwd = not eager and (self.streamed or mode != "graph")
        # the attention timer times eager calls only (inside a CUDA graph or a
        # compiled region its events are never recorded)
        with (model.attention_timer() if eager else contextlib.nullcontext()) as timer:
            for i, data in enumerate(self.batches):
                if self.streamed:
                    with torch.inference_mode():
                        data, graph = to_device(padded[i] if padded else data, device), None
                else:                    # built once, apart (timed by _build_single)
                    data, graph = staged.data, staged.graph
                sync(device)
                t0 = time.perf_counter()
                out = fwd(data) if use_fwd else self.forward(model, data, graph)
                sync(device)
                total += time.perf_counter() - t0
                if self.lg is not None:   # every rank's rows, in the whole graph's order
                    out = single_graph.gather_rows(out, self.lg, data.num_nodes)
                real = self.batches[i]
                rows = num_graphs(real) if self.readout == "graph" else real.num_nodes
                outputs.append(out[:rows])
                step(num_graphs(real) if self.streamed else 1)
            attn, fmt = (timer.ms("attention"), timer.ms("format")) if eager else (0.0, 0.0)
        B = len(self.batches)
        out = {"attn_ms": attn / B if eager else None,
               "attn_share": attn / (total * 1e3) if total and eager else None, "outputs": outputs}
        if self.streamed and eager:
            out["format_ms"] = fmt / B
        if device.type == "cuda":
            with torch.inference_mode():
                first = to_device(padded[0] if padded else self.batches[0], device)
            one = ((lambda: fwd(first if self.streamed else staged.data)) if use_fwd or self.streamed
                   else (lambda: self.forward(model, staged.data, staged.graph)))
            out["kernel_ms"] = kernel_time(one, name="", reps=3, flush=False)
        return out


# ------------------------------------------------------------------ output
_TABLE = [  # header, key, format
    ("dataset", "dataset", "{}"), ("C", "hidden", "{}"), ("backend", "backend", "{}"),
    ("N/fwd", "nodes_per_fwd", "{:d}"), ("E/fwd", "edges_per_fwd", "{:d}"),
    ("ms/fwd", "ms_median", "{:.2f}"), ("±ms", "ms_std", "{:.2f}"),
    ("kernel ms", "kernel_ms", "{:.2f}"),
    ("attn ms", "attn_ms", "{:.2f}"), ("attn %", "attn_share", "{:.0%}"),
    ("fmt ms", "format_ms", "{:.2f}"), ("peak MB", "peak_mem_mb", "{:.0f}"),
    ("vs pyg", "speedup_vs_pyg", "{:.2f}x"), ("vs best pyg", "speedup_vs_pyg_best", "{:.2f}x"),
    ("vs ref", "speedup_vs_reference", "{:.2f}x"),
    ("max|diff|", "max_abs_diff", "{:.1e}"), ("timing", "timing", "{}"), ("note", "note", "{}"),
]
_LEFT = ("dataset", "backend", "timing", "note")


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (one line per dataset, hidden
    size and backend), with a legend."""
    ranks = max((r.get("ranks") or 1 for r in rows), default=1)
    legend = "" if ranks == 1 else (
        f" Under torchrun ({ranks} ranks): ms/fwd and attn ms are the slowest rank's, kernel ms and "
        f"peak MB the largest rank's; a single graph is partitioned (attn ms includes the halo "
        f"exchange; fmt ms -: its local plan is built by an untimed first forward; max|diff| over "
        f"the gathered output), a collection's batches are sharded over the ranks.")
    return text_table(rows, _TABLE, _LEFT,
                      "ms/fwd: median per forward (wall, what a user waits); kernel ms: GPU "
                      "kernel time of a forward (profiler); fmt ms: the graph format's build, "
                      "included in ms/fwd for batched graphs (a new batch is a new graph), apart "
                      "for single graphs; vs X: ms/fwd of X over this row's; vs best pyg: the "
                      "fastest pyg run's (eager or compiled). Runs name@mode: @graph CUDA-graph "
                      "replays, @compile / @reduce-overhead torch.compile, @compile-graph "
                      "both (padded batches)." + legend)


def format_summary(rows: list[dict], backends: tuple[str, ...] = (
        "fused3s@graph", "fused3s@compile-graph", "fused3s")) -> list[str]:
    """Lines for the end of a run: the geometric-mean speedup of each of
    ``backends`` (our runs) over each other run (all datasets, then
    synthetic structures only), and which datasets ran on real structures
    and which on synthetic ones."""
    lines = []
    names = list(dict.fromkeys(r["backend"] for r in rows if r.get("status") == "ok"))
    if any(REFERENCE_PATH_NOTE in (r.get("note") or "") for r in rows):
        lines.append(f"fused3s: no speedup reported: with no CUDA kernel on {rows[0].get('device')} "
                     f"it ran the reference path")
    for backend in (b for b in backends if b in names):
        mine = [r for r in rows if r.get("backend") == backend and r.get("status") == "ok"]
        for label, subset in (("all", mine),
                              ("synthetic", [r for r in mine if r.get("structure") == "synthetic"])):
            parts = []
            for b in [*names, "pyg_best"]:
                vals = [r[f"speedup_vs_{b}"] for r in subset if b != backend
                        and r.get(f"speedup_vs_{b}") is not None]
                if vals:
                    parts.append(f"vs {b} {geomean(vals):.2f}x (n={len(vals)})")
            if parts:
                lines.append(f"{backend} speedup, geometric mean over {label} datasets x hidden: "
                             + ", ".join(parts))
    by_kind: dict[str, list[str]] = {"real": [], "synthetic": []}
    seen = set()
    for r in rows:
        if r.get("structure") and r["dataset"] not in seen:
            seen.add(r["dataset"])
            by_kind[r["structure"]].append(f"{r['dataset']} [{r['source']}]")
    lines.append("real structures: " + ("; ".join(by_kind["real"]) or "none"))
    lines.append("synthetic structures: " + ("; ".join(by_kind["synthetic"]) or "none"))
    failed = sorted({r["dataset"] for r in rows if r.get("backend") == "-"})
    if failed:
        lines.append("not loaded: " + ", ".join(failed) + " (why, and what to do: the lines "
                     "'dataset not loaded' above)")
    return lines


def write_csv(rows: list[dict], path: str | Path) -> None:
    _write_csv(rows, COLUMNS, path)


# --------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    add_run_arguments(parser, DEFAULT_CONFIG, csv_help="also write the rows to this CSV file",
                      plot_help="also draw the speedups of fused3s over the other backends to "
                                "this PNG (needs matplotlib)",
                      quick_help="smoke run: each dataset's 'quick' params, one batch, "
                                 "1 warmup and 2 timed forwards")
    parser.add_argument("--datasets", nargs="+", default=None,
                        help="only these dataset names of the config")
    parser.add_argument("--hidden", nargs="+", type=int, default=None,
                        help="hidden sizes, overriding the config's model.hidden")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="batched graphs: build the next batch's format on a side CUDA "
                             "stream while the current one computes (--no-prefetch: inline)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="single graphs on a GPU: time replays of a CUDA graph of the "
                             "forward (default) or eager forwards (--no-cuda-graphs)")


def main(args) -> int:
    """Run ``gt-fused3s infer`` with parsed ``args``; prints the table."""
    cfg = load_config(args.config)
    apply_run_arguments(cfg, args, ("device", "dtype", "warmup", "repeats", "prefetch",
                                    "cuda_graphs"))
    if args.hidden:
        cfg["model"]["hidden"] = args.hidden
    names = split_args(args.datasets)
    if names:
        missing = set(names) - {d.get("name", d["kind"]) for d in cfg["datasets"]}
        if missing:
            raise ValueError(f"datasets {sorted(missing)} are not in {cfg['config']}")
        cfg["datasets"] = [d for d in cfg["datasets"] if d.get("name", d["kind"]) in names]
    cfg = revalidate(cfg, validate_config)

    try:
        rows, stopped = run(cfg, quick=args.quick, offline=args.offline, progress=not args.no_progress,
                            eager=args.eager), False
    except Interrupted as stop:     # Ctrl-C: what finished is still printed and written
        rows, stopped = stop.result, True
        if not rows:
            raise
    if not stopped:             # under torchrun: no rank leaves while another still talks
        data_parallel.leave()
    if data_parallel.world_from_env()[1] != 0:       # under torchrun, rank 0 reports
        return 0 if any(r["status"] == "ok" for r in rows) else 1
    print(format_table(rows))
    print("\n".join(format_summary(rows)))
    if args.csv:
        write_csv(rows, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot and not any(r.get("speedup_vs_pyg") for r in rows if r.get("backend") == "fused3s"):
        print("no plot: fused3s has no speedups in these rows (on a CPU it runs the reference path); "
              "gt-fused3s plot CSV PNG --backend pyg draws pyg's", file=sys.stderr)
    elif args.plot:
        from ..bench.plot import plot_speedups
        save_plot(lambda: plot_speedups(rows, args.plot), args.plot,
                  f"draw it from the CSV where matplotlib is installed: "
                  f"gt-fused3s plot CSV {args.plot}")
    if stopped:
        print(f"interrupted (Ctrl-C): {len(rows)} finished rows above"
              + (f" and in {args.csv}" if args.csv else ""), file=sys.stderr)
        return INTERRUPTED_EXIT
    return 0 if any(r["status"] == "ok" for r in rows) else 1
