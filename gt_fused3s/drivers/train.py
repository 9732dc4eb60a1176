"""Graph Transformer training, backend against backend, on the dataset of a
YAML config: the work behind ``gt-fused3s train`` and ``scripts/train.py``.

Every backend trains the same model from the same initial weights (one
seeded initialisation, copied), on the same batches in the same order (a
seeded shuffle per epoch), with Adam, for ``steps`` optimizer steps; the
backends compute the same function, so their loss curves agree up to
rounding (exactly so at step 0). What differs is the time per step and the
memory a step needs:

* **ms/step**: wall clock of one whole step (zero grad, forward, loss,
  backward, optimizer step) between two device synchronisations, median
  over the steps after the first ``warmup`` (which train too, but carry
  first-call costs: the graph format build of a single graph, kernel loads).
* **peak MB** (CUDA): ``torch.cuda.max_memory_allocated`` over the timed
  steps, reset after the warmup steps, when the optimizer state exists:
  the peak of a steady training step, weights, gradients, Adam state and
  the batch included.
* On a GPU the model runs under autocast in ``dtype`` (``auto``: bf16, which
  trains without loss scaling; fp16 gets a ``GradScaler``); the dtype is
  printed with the table and written to every CSV row.

A collection (``level: graph``: batches of small graphs, pooled readout)
builds each batch's graph format in its step (a batch is a new graph, as
in ``infer``); a single graph (``level: node``, node readout) builds it
once, in the first step. Batches are made once and kept on the device.

**Runs.** Each entry of ``backends`` is a backend with an optional mode
(``pyg@compile``; see :data:`gt_fused3s.bench.common.MODES`). On a GPU,
``fused3s`` runs its whole training step (forward, loss, backward, Adam) as
CUDA-graph replays (``fused3s@graph``, :mod:`gt_fused3s.capture`) and
eagerly beside it; ``--eager`` leaves only the eager run. With
``compiled_runs`` (default) ``pyg`` is also run under ``torch.compile``,
default mode and ``reduce-overhead``, and ``fused3s`` as ``compile-graph``
(the model compiled by torch.compile, which fuses the layers around the
attention, inside the same whole-step CUDA graph; the faster of it and
``fused3s@graph`` is the one to use). Captured and compiled runs train on the
batches padded to at most ``max_buckets`` static shapes
(:mod:`gt_fused3s.data.bucket`; padding is masked out of the loss), so they
capture or compile a few shapes only; the steps that capture or compile
(the first of each shape) are left out of ms/step and reported as
``setup s``. Every run reports the GPU kernel time of a step (``kernel
ms``, from the profiler, after training) beside its wall time. On a CPU a
run may name ``@compile`` (torch.compile's C++ code, on the same padded
batches); the CUDA-graph modes need a GPU.

The task: with ``target: labels`` the dataset's own labels (OGB, LRGB, PyG);
``structure`` a generated one (:mod:`gt_fused3s.data.targets`: features from
node degrees; a graph's mean degree and share of leaves, or a node's mean
neighbour degree, standardised); ``auto`` (default) takes the labels where
the data has them, so an online config whose offline fallback is a bare
structure file still trains. ``loss: auto`` picks MSE for the generated
target, and for labels BCE (0/1 values, multi-label included), cross-entropy
(other integer classes) or MSE (real values); NaN labels are left out.

A backend that fails (out of memory, an error) gets a row with a note;
the run goes on.

**Data parallel.** Under ``torchrun --nproc_per_node=P gt-fused3s train``
every rank takes every P-th batch of the global step order (a step is P
batches), the model runs in ``DistributedDataParallel``, the losses are the
means over the ranks, and rank 0 alone logs and writes the CSV
(:mod:`gt_fused3s.distributed.data_parallel`). A single graph (a node-level
task) is partitioned instead (``distributed.partitioner``): each rank trains
on its nodes' rows, every attention layer exchanges the K and V halo, and the
parameters' gradients are summed over the ranks, so a step is the whole
graph's; the table adds the halo exchange's time per step and its share.
Data-parallel runs take every mode: eager runs are wrapped in DDP; the
compiled and captured ones run the bare model (rank 0's weights broadcast
first) and average the gradients with one all-reduce of their own after
the backward (:func:`gt_fused3s.distributed.data_parallel.sum_gradients`):
``@compile`` and ``@reduce-overhead`` after the compiled backward,
``@graph`` and ``@compile-graph`` inside the captured step, so a step is
one CUDA-graph replay (``compiled_runs`` adds its runs as in one process).
Partitioned runs are eager: a mode other than eager named in ``backends``
gets a ``skipped`` row saying why (the halo exchange is neither traced by
torch.compile nor captured), and ``compiled_runs`` and the captured
``fused3s@graph`` add none. Under torchrun ms/step and peak MB are the
largest rank's.
``checkpoint`` saves each run's weights and optimizer state; ``resume``
starts every run from a checkpoint's weights.

Config schema (YAML; defaults in :data:`DEFAULTS`)::

    device: auto          # auto (cuda if available, else cpu) | cpu | cuda | cuda:1
    dtype: auto           # auto (fp32 on cpu, bf16 autocast on cuda) | fp32 | fp16 | bf16
    seed: 0               # weights, data order, generated data
    steps: 60             # optimizer steps per backend (the loss curve's length)
    warmup: 2             # of those, the first ones left out of ms/step and peak MB
    lr: 0.001             # Adam
    weight_decay: 0.0
    backends: [fused3s, pyg]   # each may end in @eager, @graph, @compile, @reduce-overhead,
                               # @compile-graph (see gt_fused3s.bench.common.MODES); on a
                               # CPU @eager or @compile
    compiled_runs: true   # on a GPU: add pyg@compile, pyg@reduce-overhead, fused3s@compile-graph
                          # (under torchrun too, except for a partitioned graph)
    max_buckets: 4        # static shapes of the captured / compiled runs
    model: {hidden: 64, layers: 10, heads: 1, norm: layer, dropout: 0.0, self_loops: false,
            edge_features: false}   # edge_features: an attention bias per block from the
                                    # dataset's categorical edge features (bond types)
    target: auto          # auto | labels | structure
    loss: auto            # auto | mse | bce | ce
    quick: {steps: 6, warmup: 1}   # overrides of these keys under --quick
    checkpoint: null      # a folder: each run's weights and optimizer state, saved after it
    resume: null          # a checkpoint file: every run starts from its weights
    distributed: {partitioner: contiguous, head_chunks: 4}   # under torchrun, a single graph's
                          # nodes are partitioned over the ranks (contiguous | metis); the K/V
                          # halo exchange is pipelined in head_chunks chunks (1: no overlap)
    dataset:              # one entry, see gt_fused3s.data.load_dataset
      name: zinc
      kind: npz           # molecules | random_graphs | powerlaw | npz | ogb | lrgb | pyg
      params: {...}
      quick: {...}        # params overrides under --quick (then at most 2 batches)
      fallback: {kind: molecules, params: {...}}   # data unavailable / --offline
      max_batches: 16     # use the first batches only (default: all)
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import AttentionGraph
from ..capture import CudaGraphRunner
from ..data import check_entry, load_dataset, structural_task
from ..data.bucket import Buckets
from ..data.targets import STRUCTURAL_TARGETS
from ..distributed import data_parallel, single_graph
from ..models import GraphTransformer
from ..bench import common
from .stream import num_graphs
from ..bench.timing import kernel_time

DEFAULT_CONFIG = common.shipped_config("train.yaml")
#: the backend the speed and memory ratios compare with
BASELINE = "pyg"
#: the last losses averaged for ``loss_last`` (one batch's loss is noisy)
LAST_K = 5

DEFAULTS: dict[str, Any] = {
    "device": "auto",
    "dtype": "auto",
    "seed": 0,
    "steps": 60,
    "warmup": 2,
    "lr": 1e-3,
    "weight_decay": 0.0,
    "backends": ["fused3s", "pyg"],
    "compiled_runs": True,
    "max_buckets": 4,
    "model": {"hidden": 64, "layers": 10, "heads": 1, "norm": "layer", "dropout": 0.0,
              "self_loops": False, "edge_features": False},
    "target": "auto",
    "loss": "auto",
    "quick": {"steps": 6, "warmup": 1},
    "checkpoint": None,
    "resume": None,
    "distributed": dict(single_graph.SETTINGS),
    "dataset": None,
}
TARGETS = ("auto", "labels", "structure")
LOSSES = ("auto", "mse", "bce", "ce")
_HARNESS_KEYS = {"max_batches"}       # dataset keys besides the loader's
#: what loading a dataset raises when the data or its parameters are wrong
#: (DatasetUnavailableError is a RuntimeError, a missing file an OSError)
_LOAD_ERRORS = (ValueError, TypeError, OSError, ImportError, RuntimeError)
_QUICK_BATCHES = 2

#: columns of the per-step CSV, in order
CURVE_COLUMNS = ["step", "backend", "loss", "ms", "timed", "dataset", "hidden", "layers",
                 "dtype", "device", "device_name", "torch", "git_sha", "config"]
#: columns of the summary CSV (one row per run), in order
SUMMARY_COLUMNS = ["backend", "mode", "status", "note", "steps", "loss_first", "loss_last", "ms_median",
                   "ms_std", "kernel_ms", "peak_mem_mb", "reserved_mb", "speedup_vs_pyg",
                   "speedup_vs_pyg_best", "pyg_best", "mem_vs_pyg", "shapes", "setup_s", "ranks",
                   "exchange_ms", "exchange_share", "halo_rows", "dataset", "hidden", "layers", "dtype", "device",
                   "device_name", "torch", "git_sha", "config"]
#: the pyg runs the "best compiled" ratio takes the fastest of
_PYG_PEERS = ("pyg", "pyg@compile", "pyg@reduce-overhead")
#: the modes a run may name on a CPU: torch.compile runs there (inductor's C++
#: code); CUDA graphs (graph, compile-graph, reduce-overhead) do not
CPU_MODES = ("eager", "compile")
#: why a partitioned graph's runs other than eager are skipped under torchrun
PARTITIONED_SKIP = ("a partitioned graph trains eagerly under torchrun: its per-layer halo exchange "
                    "(an asynchronous point-to-point batch with host-side block sizes, inside an "
                    "autograd.Function) is neither traced by torch.compile nor captured in a CUDA graph")


# ------------------------------------------------------------------ config
def load_config(path: str | Path | None = None) -> dict:
    """Read a YAML training config and fill in :data:`DEFAULTS` (``model``
    and ``quick`` merged key by key). Unknown keys are errors."""
    return common.read_config(path, DEFAULT_CONFIG, validate_config)


def validate_config(raw: dict) -> dict:
    """:data:`DEFAULTS` completed by ``raw``, checked; ValueError names what is wrong."""
    cfg = common.merge_config(raw, DEFAULTS, open_keys=frozenset({"quick"}))
    common.check_backends(cfg["backends"])
    common.check_dtype(cfg["dtype"])
    _check_int("steps", cfg["steps"], 1)
    _check_int("warmup", cfg["warmup"], 0)
    if cfg["warmup"] >= cfg["steps"]:
        raise ValueError(f"warmup ({cfg['warmup']}) must be below steps ({cfg['steps']}): "
                         f"warmup steps are not timed")
    if not isinstance(cfg["lr"], (int, float)) or cfg["lr"] <= 0:
        raise ValueError(f"lr must be a positive number (got {cfg['lr']!r})")
    _check_int("max_buckets", cfg["max_buckets"], 1)
    _check_int("model.hidden", cfg["model"]["hidden"], 1)
    _check_int("model.layers", cfg["model"]["layers"], 1)
    if not isinstance(cfg["model"]["edge_features"], bool):
        raise ValueError(f"model.edge_features must be true or false (got {cfg['model']['edge_features']!r})")
    _check_choice("target", cfg["target"], TARGETS)
    single_graph.check_settings(cfg["distributed"])
    _check_choice("loss", cfg["loss"], LOSSES)
    bad = set(cfg["quick"]) - (set(DEFAULTS) - {"quick", "dataset"})
    if bad:
        raise ValueError(f"unknown quick keys {sorted(bad)}: quick overrides this config's "
                         f"top-level keys under --quick")
    if cfg["dataset"] is None:
        raise ValueError("the config names no dataset")
    check_entry(cfg["dataset"], _HARNESS_KEYS)
    return cfg


def _check_int(key: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key} must be an int >= {low} (got {value!r})")


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{key} must be one of {', '.join(choices)} (got {value!r})")


def quick_config(cfg: dict) -> dict:
    """``cfg`` with its ``quick`` overrides applied (the ``--quick`` smoke run)."""
    raw = {k: v for k, v in cfg.items() if k not in ("quick", "config")}
    for key, value in cfg["quick"].items():
        raw[key] = {**raw[key], **value} if isinstance(raw.get(key), dict) else value
    return validate_config(raw) | {"config": cfg.get("config", "")}


# -------------------------------------------------------------------- task
@dataclass
class Task:
    """What every backend trains on: the batches (on the device, ``x`` and
    ``y`` set) and how outputs are read and scored."""

    name: str
    batches: list
    readout: str          # "graph" (pooled per graph) or "node"
    out_channels: int
    loss: str             # mse | bce | ce
    target: str           # "labels" or a description of the generated target
    columns: dict         # describe_dataset's columns
    about: str            # describe_dataset's line: what the data is, sizes
    edge_vocab: tuple | None = None   # the dataset's categorical edge features (edge_attr)
    _padded: list | None = None   # the batches padded to buckets, made on first use

    def loss_of(self, out: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        """The mean loss of the outputs against ``y``, in fp32, over the rows
        ``mask`` flags (padded batches: the real graphs or nodes)."""
        return compute_loss(self.loss, out.float(), y, mask)


def compute_loss(kind: str, out: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """``mse``, ``bce`` (with logits) or ``ce`` (class indices) of ``out``
    against ``y``, over the rows of ``mask`` (bool [rows], default all). For
    mse and bce, NaN entries of ``y`` (OGB's missing labels) are left out
    too. Masking, not indexing: no host sync, static shapes."""
    if kind == "ce":
        per = F.cross_entropy(out, y.reshape(-1).long(), reduction="none")
        if mask is None:
            return per.mean()
        return (per * mask).sum() / mask.sum().clamp_min(1)
    y = y.reshape(out.shape).float()
    known = ~torch.isnan(y)
    if mask is not None:
        known = known & mask.reshape(-1, *([1] * (out.dim() - 1)))
    y = torch.where(known, y, torch.zeros_like(y))
    if kind == "bce":
        per = F.binary_cross_entropy_with_logits(out, y, reduction="none")
    else:
        per = (out - y) ** 2
    return (per * known).sum() / known.sum().clamp_min(1)


def label_loss(y: Tensor, num_classes: int | None, loss: str = "auto") -> tuple[str, int]:
    """The loss for labels ``y`` (every label of the run) and the model's
    output width: ``bce`` for 0/1 values (one output per column), ``ce`` for
    other integer classes (one output per class), else ``mse``."""
    if loss == "auto":
        seen = y[~torch.isnan(y)] if y.is_floating_point() else y
        if bool(((seen == 0) | (seen == 1)).all()):
            loss = "bce"
        else:
            loss = "mse" if y.is_floating_point() else "ce"
    if loss == "ce":
        return loss, max(int(y.max()) + 1, num_classes or 0)
    return loss, 1 if y.dim() == 1 else y.size(-1)


def load_task(cfg: dict, device: torch.device, *, quick: bool = False, offline: bool = False,
              progress: bool = True) -> Task:
    """Load the config's dataset (its fallback if unavailable or ``offline``),
    make its batches once, set their features and targets, move them to
    ``device``."""
    spec = cfg["dataset"]
    ds = load_dataset(spec, device=device, seed=cfg["seed"], quick=quick, offline=offline)
    limit = spec.get("max_batches")
    if quick:
        limit = min(limit or _QUICK_BATCHES, _QUICK_BATCHES)
    # collections are made on the host (the same graphs on any device, as in
    # infer); a single graph on the device, where a large one is made fastest
    batches = common.load_batches(ds, limit, "cpu" if ds.level == "graph" else device,
                                  progress=progress)
    columns, about = common.describe_dataset(ds, spec["kind"], batches)
    has_labels = all(getattr(b, "y", None) is not None for b in batches)
    target = cfg["target"]
    if target == "labels" and not has_labels:
        raise ValueError(f"dataset {ds.name}: target 'labels' but its batches have no labels "
                         f"(from {columns['source']}); use target: auto or structure")
    if target == "structure" or not has_labels:
        if cfg["loss"] not in ("auto", "mse"):
            raise ValueError(f"dataset {ds.name}: the generated target is a real value; its "
                             f"loss is mse (got loss: {cfg['loss']})")
        batches = structural_task(batches, ds.level, ds.num_features, cfg["seed"])
        loss, out_channels = "mse", 1
        target = f"{STRUCTURAL_TARGETS[ds.level]}, standardised"
    else:
        loss, out_channels = label_loss(torch.cat([b.y for b in batches]), ds.num_classes,
                                        cfg["loss"])
        target = "labels"
    return Task(ds.name, [b.to(device) for b in batches], ds.level, out_channels, loss, target,
                columns, about, ds.edge_vocab)


def step_order(num_batches: int, steps: int, seed: int) -> list[int]:
    """Batch of each step: a seeded shuffle of all batches per epoch, the
    same for every backend."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order += torch.randperm(num_batches, generator=g).tolist()
    return order[:steps]


# --------------------------------------------------------------------- run
@dataclass
class _Settings:
    """What every backend of one run shares."""

    cfg: dict
    device: torch.device
    dtype: torch.dtype
    progress: bool
    log: Callable[[str], None]
    env: dict                  # columns that are the same in every row
    world: int = 1             # data-parallel ranks (torchrun); 1: one process
    rank: int = 0
    local_graph: Any = None    # a single graph partitioned over the ranks: this rank's share


def run(cfg: dict, *, quick: bool = False, offline: bool = False, progress: bool = True,
        log: Callable[[str], None] | None = None,
        eager: bool = False) -> tuple[list[dict], list[dict], Task]:
    """Train every run of a validated config (apply :func:`quick_config`
    first for a smoke run; ``quick`` here shrinks the data; ``eager``: no
    CUDA-graph run of fused3s, see :func:`common.expand_runs`). Returns the
    rows (one per run), the per-step curve (dicts with the keys of
    :data:`CURVE_COLUMNS`) and the task."""
    log = log or common.log_stderr
    device = common.resolve_device(cfg["device"])
    world, rank, device = data_parallel.init(device)      # (1, 0) unless under torchrun
    if rank != 0:                                         # rank 0 speaks for all
        log, progress = (lambda msg: None), False
    dtype = common.resolve_dtype(cfg["dtype"], device, cuda_default=torch.bfloat16)
    env = {"hidden": cfg["model"]["hidden"], "layers": cfg["model"]["layers"],
           **common.run_info(device, dtype, cfg.get("config", ""))}
    log(common.run_header("train", env))
    try:
        task = load_task(cfg, device, quick=quick, offline=offline, progress=progress)
    except _LOAD_ERRORS as err:   # no file, no network, bad params: one line, no traceback
        raise ValueError(f"dataset {cfg['dataset'].get('name', cfg['dataset']['kind'])} "
                         f"not loaded: {common.short_error(err, None)}") from err
    env["dataset"] = task.name
    log(task.about)
    log(describe_run(task, cfg, env["dtype"]))
    s = _Settings(cfg, device, dtype, progress, log, env, world, rank)
    if world > 1 and task.readout == "node":       # one graph: partitioned over the ranks
        s.local_graph = _partition(task, cfg, world, rank)
        log(f"{task.name}: nodes partitioned over {world} ranks ({cfg['distributed']['partitioner']}); "
            f"rank 0 owns {s.local_graph.num_local} nodes and receives {s.local_graph.halo.numel()} halo rows")
    model = build_model(task, cfg, device)
    if cfg["resume"]:
        data_parallel.load_checkpoint(cfg["resume"], model)
        log(f"weights from {cfg['resume']}")
    initial = copy.deepcopy(model.state_dict())
    # data parallel: a global step is `world` batches, one per rank (a
    # partitioned graph: every rank trains on its share of the one batch)
    shards = 1 if s.local_graph is not None else world
    order = data_parallel.shard(step_order(len(task.batches), cfg["steps"] * shards, cfg["seed"]),
                                rank if shards > 1 else 0, shards)
    # under torchrun: data parallel runs every mode (see _Trainer); a
    # partitioned graph trains eagerly, other modes named in the config get
    # a skipped row (PARTITIONED_SKIP), none is added by compiled_runs
    runs = common.expand_runs(cfg["backends"], device, eager=eager or s.local_graph is not None,
                              compiled_runs=cfg["compiled_runs"] and s.local_graph is None,
                              cpu_modes=CPU_MODES)
    env["ranks"] = world
    rows, curve = [], []
    try:
        for name in runs:
            mode = common.parse_run(name)[1]
            if s.local_graph is not None and mode != "eager":   # the same on every rank
                log(f"{task.name}: {name} skipped: {PARTITIONED_SKIP}")
                rows.append({**env, "backend": name, "mode": mode, "steps": 0, "status": "skipped",
                             "note": f"skipped: {PARTITIONED_SKIP}"})
                continue
            row, points = train_backend(model, initial, name, task, order, s)
            common.free_cuda_memory(device)   # its optimizer state and graph formats are gone now
            rows.append(row)
            curve += [{**env, "backend": name, **p} for p in points]
    except KeyboardInterrupt:             # the runs that finished, for the table and the CSVs
        add_ratios(rows)
        raise common.Interrupted((rows, curve, task)) from None
    add_ratios(rows)
    return rows, curve, task


def _partition(task: Task, cfg: dict, world: int, rank: int):
    """This rank's share of the task's one graph, partitioned over ``world``
    ranks; the task keeps only this rank's rows of it
    (:func:`gt_fused3s.distributed.single_graph.split_graph`)."""
    lg, task.batches[0] = single_graph.split_graph(task.batches[0], world, rank, cfg["distributed"])
    return lg


def describe_run(task: Task, cfg: dict, dtype: str) -> str:
    """One line: the task, the model and the optimisation."""
    m = cfg["model"]
    return (f"task: {task.readout}-level {task.loss} on {task.target}; model: {m['layers']} "
            f"blocks, hidden {m['hidden']}, {m['heads']} head(s)"
            f"{', edge features ' + str(task.edge_vocab) if m['edge_features'] else ''}, {dtype}; Adam lr "
            f"{cfg['lr']:g}; {cfg['steps']} steps ({cfg['warmup']} warmup, untimed)")


def build_model(task: Task, cfg: dict, device: torch.device) -> GraphTransformer:
    """The model every backend starts from, seeded."""
    m = cfg["model"]
    if m["edge_features"] and task.edge_vocab is None:
        raise ValueError(f"model.edge_features: the dataset {task.name} has no categorical edge features")
    torch.manual_seed(cfg["seed"])
    model = GraphTransformer(task.batches[0].x.size(1), m["hidden"], task.out_channels,
                             num_layers=m["layers"], heads=m["heads"], norm=m["norm"],
                             readout=task.readout, dropout=m["dropout"],
                             self_loops=m["self_loops"],
                             edge_vocab=task.edge_vocab if m["edge_features"] else None)
    return model.to(device)


def edge_attr_of(model: GraphTransformer, data) -> Tensor | None:
    """The batch's edge features if the model reads them."""
    return data.edge_attr if model.edge_vocab is not None else None


def train_backend(model: GraphTransformer, initial: dict, name: str, task: Task,
                  order: list[int], s: _Settings) -> tuple[dict, list[dict]]:
    """Train ``model`` from the weights ``initial`` with the run ``name``
    (backend and mode) on the batches of ``order``; returns its row and its
    curve (one point per step done: a failed run keeps the steps before the
    failure)."""
    backend, mode = common.parse_run(name)
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)      # no gradients left from the previous run
    model.backend = backend
    model.train()
    torch.manual_seed(s.cfg["seed"])        # the same dropout masks for every backend
    points: list[dict] = []
    setup_ms: list[float] = []
    warmup = s.cfg["warmup"]
    bar = common.progress_bar(len(order), f"{task.name}: {name}", "step", s.progress)
    trainer = None

    def loop() -> None:
        nonlocal trainer
        trainer = _Trainer(model, task, mode, s)
        for step, b in enumerate(order):
            if step == warmup:                 # the optimizer state exists from here on
                common.reset_peak_memory(s.device)
            new_shape = trainer.first_of_shape(b)
            loss, ms = trainer.timed_step(b)
            if new_shape and mode != "eager":
                setup_ms.append(ms)            # a capture or a compile: not a step's time
            points.append({"step": step, "loss": loss, "ms": ms,
                           "timed": step >= warmup and not (new_shape and mode != "eager")})
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.update()

    with bar:
        _, error = common.guarded(loop, s.device)
    if s.cfg["checkpoint"] and s.rank == 0 and trainer is not None and not error:
        path = Path(s.cfg["checkpoint"]) / f"{task.name}_{name.replace('@', '-')}.pt"
        data_parallel.save_checkpoint(path, model, trainer.opt, run=name, steps=len(points))
        s.log(f"{task.name}: {name}: checkpoint {path}")
    row = {**s.env, "backend": name, "mode": mode, "steps": len(points), **curve_summary(points)}
    if error:
        s.log(f"{task.name}: {name} failed: {error}")
        return {**row, "status": common.status_of(error), "note": error}, points
    times = [p["ms"] for p in points if p["timed"]]
    if not times:
        note = "no timed step (every step was a warmup, capture or compile); raise steps"
        return {**row, "status": "error", "note": note}, points
    row.update(status="ok", note="", ms_median=statistics.median(times),
               ms_std=statistics.pstdev(times), peak_mem_mb=common.peak_memory_mb(s.device),
               reserved_mb=common.peak_reserved_mb(s.device),
               setup_s=sum(setup_ms) / 1e3 if setup_ms else None,
               shapes=trainer.num_shapes())
    if s.world > 1:
        _over_ranks(row, trainer, warmup, s.device)
    if s.device.type == "cuda":     # after training: these steps move the weights on
        reps = 3 if row["ms_median"] < 1000 else 1      # a large graph's step is long enough
        row["kernel_ms"] = kernel_time(lambda: trainer.step(order[-1]), name="", reps=reps, flush=False)
    return row, points


def _over_ranks(row: dict, trainer: "_Trainer", warmup: int, device: torch.device) -> None:
    """A distributed run's row: the largest rank's peak memory and step time
    (collectives: every rank calls this), and for a partitioned graph the
    median halo-exchange time of a timed step and its share of the step."""
    for key in ("peak_mem_mb", "reserved_mb"):
        if row[key] is not None:
            row[key] = data_parallel.max_over_ranks(row[key], device)
    row["ms_median"] = data_parallel.max_over_ranks(row["ms_median"], device)
    if trainer.local_graph is not None:
        ex = data_parallel.max_over_ranks(statistics.median(trainer.exchange_ms[warmup:]), device)
        halo = data_parallel.max_over_ranks(trainer.local_graph.halo.numel(), device)
        row.update(exchange_ms=ex, exchange_share=ex / row["ms_median"], halo_rows=int(halo))


class _Trainer:
    """One run's optimizer and training step (eager, captured or compiled)."""

    def __init__(self, model: GraphTransformer, task: Task, mode: str, s: _Settings):
        self.model, self.task, self.mode, self.device = model, task, mode, s.device
        if mode != "eager":
            _check_static_run(model, task, mode, s)
        # a captured optimizer step needs its state on the device (capturable).
        # Every run on a GPU takes the fused Adam (one kernel per step; the
        # capturable foreach one launched ~270 per-parameter kernels, 0.35 ms
        # of a ZINC step), the same optimizer for every backend.
        captured = mode in common.CAPTURED_MODES
        self.opt = torch.optim.Adam(model.parameters(), lr=s.cfg["lr"],
                                    weight_decay=s.cfg["weight_decay"], capturable=captured,
                                    fused=s.device.type == "cuda")
        # fp16 gradients underflow without loss scaling; bf16 and fp32 need none
        self.scaler = torch.amp.GradScaler(s.device.type, enabled=s.dtype == torch.float16)
        self.autocast = common.autocast(s.device, s.dtype, cache=mode == "eager")
        self.graphs: dict[int, Any] = {}         # single graph: its format, built once
        self.batches = task.batches if mode == "eager" else _padded(task, s.cfg["max_buckets"])
        self._shapes: set = set()
        self.forward = model
        self.world, self.local_graph = s.world, s.local_graph
        # Data parallel: gradients averaged over the ranks. Eagerly by DDP's
        # hooks (the all-reduce overlapped with the backward, bucket by
        # bucket). Every other mode compiles or captures the bare model and
        # averages the gradients with one all-reduce after the backward
        # (data_parallel.sum_gradients): inside the captured step (graph,
        # compile-graph: NCCL is recorded into the CUDA graph, DDP's hooks
        # and its host-side bucket bookkeeping are not), and after the
        # compiled backward (compile, reduce-overhead). The latter could be
        # torch.compile of the DDP module (dynamo's DDPOptimizer splits the
        # graph at DDP's 25 MB bucket boundaries to keep the overlap); the
        # explicit all-reduce is simpler and the same in every static mode:
        # the compiled graph is the one-process graph, whole, and the Graph
        # Transformers here have a few MB of gradients (hidden 64, 10 blocks:
        # 0.34M parameters, 1.3 MB; hidden 128: 5.3 MB), one bucket, which
        # DDP too reduces only once the backward has finished: no overlap is
        # lost (a model past 25 MB would lose it). Without DDP nothing
        # broadcasts rank 0's weights: done here, as DDP does at construction.
        self.average = s.world > 1 and s.local_graph is None
        self.reduce_after_backward = self.average and mode in ("compile", "reduce-overhead")
        if self.average and mode == "eager":
            self.forward = data_parallel.wrap(model, s.device)
        elif self.average:
            data_parallel.broadcast_parameters(model)
        self.exchange_ms: list[float] = []     # partitioned: the halo exchanges of each step
        if mode in common.COMPILED_MODES:
            self.forward = torch.compile(model, mode="reduce-overhead" if mode == "reduce-overhead"
                                         else None, dynamic=False)
        self.runner = CudaGraphRunner(self._step_fn()) if captured else None

    def _shape(self, index: int) -> tuple:
        d = self.batches[index]
        return (d.num_nodes, d.edge_index.size(1))

    def first_of_shape(self, index: int) -> bool:
        """Whether batch ``index`` is the first of its shape (a capture or a
        compile for the static runs)."""
        shape = self._shape(index)
        if shape in self._shapes:
            return False
        self._shapes.add(shape)
        return True

    def num_shapes(self) -> int:
        return len(self._shapes)

    def _graph(self, data, index: int):
        if self.task.readout == "graph":
            return None
        if index not in self.graphs:       # one graph: built once (exact), prepared for training
            graph = self.model.make_graph(data.edge_index, data.num_nodes)
            self.graphs[index] = self.model.prepare_graph(graph, backward=True)
        return self.graphs[index]

    def step(self, index: int) -> Tensor:
        """One optimizer step on batch ``index``; returns the loss (on the device)."""
        if self.local_graph is not None:
            return self._partitioned_step(self.batches[index])
        data = self.batches[index]
        if self.runner is not None:
            return self.runner(*self._static_inputs(data))
        self.opt.zero_grad(set_to_none=True)
        graph_level = self.task.readout == "graph"
        # eager: a single graph's format is built once and reused; compiled:
        # the forward builds it (static shapes, inside the compiled region)
        graph = self._graph(data, index) if self.mode == "eager" else None
        with self.autocast:
            out = self.forward(data.x, data.edge_index, data.batch if graph_level else None,
                               graph=graph, num_graphs=num_graphs(data),
                               edge_attr=edge_attr_of(self.model, data))
        mask = getattr(data, "graph_mask" if graph_level else "node_mask", None)
        loss = self.task.loss_of(out, data.y, mask)
        self.scaler.scale(loss).backward()
        if self.reduce_after_backward:      # data parallel, compiled: see __init__
            data_parallel.sum_gradients(self.model, average=True)
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    def _partitioned_step(self, data) -> Tensor:
        """A step on this rank's share of a partitioned graph: its rows'
        loss, weighted by its share of the nodes, and the parameters'
        gradients summed over the ranks (the whole graph's gradient).
        Returns this rank's share of the mean loss (summed over the ranks by
        :meth:`timed_step`)."""
        from ..distributed import exchange_timer
        lg, model = self.local_graph, self.model
        self.opt.zero_grad(set_to_none=True)
        with exchange_timer() as timer:
            with self.autocast:       # data: this rank's rows (a LocalBatch)
                out = model(data.x, None, graph=lg,
                            edge_attr=data.edge_attr if model.edge_vocab is not None else None)
            share = lg.num_local / data.num_nodes
            loss = self.task.loss_of(out, data.y) * share
            loss.backward()
        data_parallel.sum_gradients(model)
        self.opt.step()
        self.exchange_ms.append(timer.ms())
        return loss.detach()

    # -------------------------------------------------------------- captured
    def _static_inputs(self, data) -> tuple[Tensor, ...]:
        edge = (data.edge_attr,) if self.model.edge_vocab is not None else ()
        if self.task.readout == "graph":
            return data.x, data.edge_index, data.batch, data.graph_mask, data.y, *edge
        return data.x, data.y

    def _step_fn(self):
        """The whole training step as a function of the batch's tensors, for
        CUDA-graph capture: the graph format of a batch is built inside it
        (static mode); a single graph's is built once, before, and read.
        ``compile-graph``: the model is the torch.compile'd one, which builds
        the format inside the compiled region."""
        model, task, opt = self.forward, self.task, self.opt
        compiled = self.mode == "compile-graph"

        average = self.average

        def finish(out, y, mask):
            loss = task.loss_of(out, y, mask)
            loss.backward()
            if average:
                data_parallel.sum_gradients(self.model, average=True)
            opt.step()
            return loss.detach()

        if task.readout == "graph":
            def step(x, edge_index, batch, graph_mask, y, edge_attr=None):
                opt.zero_grad(set_to_none=True)     # the captured backward allocates the grads
                with self.autocast:
                    graph = None if compiled else AttentionGraph(edge_index, x.size(0), static=True)
                    out = model(x, edge_index, batch, graph=graph, num_graphs=graph_mask.numel(),
                                edge_attr=edge_attr)
                return finish(out, y, graph_mask)
            return step
        graph = None if compiled else self._graph(task.batches[0], 0)
        edge_index = task.batches[0].edge_index
        edge_attr = edge_attr_of(self.model, task.batches[0])

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with self.autocast:
                out = model(x, edge_index, None, graph=graph, edge_attr=edge_attr)
            return finish(out, y, None)
        return step

    def timed_step(self, index: int) -> tuple[float, float]:
        """(loss, ms) of one step, timed between device synchronisations."""
        common.sync(self.device)
        t0 = time.perf_counter()
        loss = self.step(index)
        common.sync(self.device)
        ms = (time.perf_counter() - t0) * 1e3
        if self.local_graph is not None:   # the shares of the whole graph's mean loss
            return data_parallel.mean_over_ranks(float(loss), self.device) * self.world, ms
        if self.world > 1:            # the global step's loss: the mean of the ranks' batches
            return data_parallel.mean_over_ranks(float(loss), self.device), ms
        return float(loss), ms


def _check_static_run(model: GraphTransformer, task: Task, mode: str, s: _Settings) -> None:
    """Raise (the run's row says why) where a captured or compiled run would
    not compute what the eager one does."""
    if s.device.type != "cuda" and mode not in CPU_MODES:
        raise ValueError(f"mode {mode} needs a CUDA device")
    if mode in common.CAPTURED_MODES and s.dtype == torch.float16:
        raise ValueError("fp16 trains with a GradScaler, whose step syncs the host: capture "
                         "needs bf16 or fp32 (dtype: bf16), or run eagerly")
    if model.self_loops:
        raise ValueError("self_loops adds a data-dependent number of edges per batch: add "
                         "the loops to the dataset for captured or compiled runs")
    if task.readout == "graph" and any(isinstance(m, torch.nn.BatchNorm1d) for m in model.modules()):
        raise ValueError("norm: batch sees the padding nodes of padded batches in training; "
                         "use norm: layer for captured or compiled runs")


def _padded(task: Task, max_buckets: int) -> list:
    """The task's batches padded to at most ``max_buckets`` static shapes
    (collections; a single graph is one static shape already), made once."""
    if task.readout != "graph":
        return task.batches
    if task._padded is None:
        buckets = Buckets.fit([(d.num_nodes, d.edge_index.size(1), num_graphs(d))
                               for d in task.batches], max_buckets)
        task._padded = [buckets.pad_batch(d) for d in task.batches]
    return task._padded


def curve_summary(points: list[dict]) -> dict:
    """First loss and the mean of the last :data:`LAST_K` (of what ran)."""
    if not points:
        return {}
    last = [p["loss"] for p in points[-LAST_K:]]
    return {"loss_first": points[0]["loss"], "loss_last": statistics.mean(last)}


def add_ratios(rows: list[dict]) -> None:
    """``speedup_vs_pyg`` = ms/step of eager pyg over the row's;
    ``speedup_vs_pyg_best`` = that of the fastest pyg run (eager or compiled)
    over the row's; ``mem_vs_pyg`` = the row's peak memory over eager pyg's
    (below 1: less memory). Ok rows only; a fused3s row that ran the
    reference path (no kernel on the device) gets a note instead."""
    ok = {r["backend"]: r for r in rows if r["status"] == "ok"}
    for name, r in list(ok.items()):
        if common.runs_reference_path(name, r["device"]):
            r["note"] = "; ".join(n for n in (r.get("note"), common.REFERENCE_PATH_NOTE) if n)
            del ok[name]
    base = ok.get(BASELINE)
    peers = [ok[n] for n in _PYG_PEERS if n in ok]
    best = min(peers, key=lambda r: r["ms_median"]) if peers else None
    for r in ok.values():
        if base is not None:
            r["speedup_vs_pyg"] = base["ms_median"] / r["ms_median"]
            if r.get("peak_mem_mb") and base.get("peak_mem_mb"):
                r["mem_vs_pyg"] = r["peak_mem_mb"] / base["peak_mem_mb"]
        if best is not None:
            r["speedup_vs_pyg_best"] = best["ms_median"] / r["ms_median"]
            r["pyg_best"] = best["backend"]


# ------------------------------------------------------------------ output
_TABLE = [  # header, key, format
    ("backend", "backend", "{}"), ("steps", "steps", "{:d}"),
    ("first loss", "loss_first", "{:.4f}"), (f"last loss (mean {LAST_K})", "loss_last", "{:.4f}"),
    ("ms/step", "ms_median", "{:.2f}"), ("±ms", "ms_std", "{:.2f}"),
    ("kernel ms", "kernel_ms", "{:.2f}"), ("peak MB", "peak_mem_mb", "{:.0f}"),
    ("reserved MB", "reserved_mb", "{:.0f}"),
    ("vs pyg", "speedup_vs_pyg", "{:.2f}x"), ("vs best pyg", "speedup_vs_pyg_best", "{:.2f}x"),
    ("mem/pyg", "mem_vs_pyg", "{:.2f}"), ("shapes", "shapes", "{}"), ("setup s", "setup_s", "{:.1f}"),
    ("exchange ms", "exchange_ms", "{:.1f}"), ("exchange share", "exchange_share", "{:.1%}"),
    ("note", "note", "{}"),
]
#: columns shown only where some row has them (a partitioned graph's)
_OPTIONAL = {"exchange_ms", "exchange_share"}


def format_table(rows: list[dict]) -> str:
    """The rows as a text table (one line per backend), with a legend."""
    exchange = any(r.get("exchange_ms") is not None for r in rows)
    columns = [c for c in _TABLE if exchange or c[1] not in _OPTIONAL]
    return common.text_table(rows, columns, {"backend", "note"},
                      "ms/step: median wall time of a training step (synchronised, warmup "
                      "steps and the first step of each shape of captured / compiled runs "
                      "excluded); kernel ms: GPU kernel time of a step (profiler); peak MB: CUDA "
                      "max allocated over the timed steps; reserved MB: max held by the "
                      "allocator, CUDA-graph pools included (allocated at capture, they are "
                      "not in peak MB); vs pyg: eager pyg's ms/step over "
                      "this row's; vs best pyg: the fastest pyg run's (eager or compiled); "
                      "mem/pyg: this row's peak over eager pyg's; shapes: static shapes "
                      "(buckets) the run saw; setup s: time of the steps that captured or compiled"
                      + ("; exchange ms: the halo exchanges of a step (forward and backward, "
                         "not overlapped with compute), share: of ms/step" if exchange else "") + ".")


def format_footer(rows: list[dict], task: Task) -> str:
    """What ran where, under the table (stdout, so that a saved table says it)."""
    r = rows[0]
    return (f"{task.name} ({task.columns['structure']} structure, target {task.target}), "
            f"{task.readout}-level {task.loss}; {r['layers']} blocks, hidden "
            f"{r['hidden']}; {r['dtype']} on {r['device_name']} ({r['device']}); torch "
            f"{r['torch']}, git {r['git_sha']}")


def plot_curves(curve: list[dict], path: str | Path, title: str) -> Path:
    from ..bench.plot import plot_loss_curves

    series: dict[str, tuple[list, list]] = {}
    for p in curve:
        steps, losses = series.setdefault(p["backend"], ([], []))
        steps.append(p["step"])
        losses.append(p["loss"])
    return plot_loss_curves(series, path, title)


# --------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    common.add_run_arguments(parser, DEFAULT_CONFIG,
                      csv_help="also write every step's loss and time per run to this CSV (and "
                               "the table to <name>_summary.csv beside it)",
                      plot_help="also draw the loss curves to this PNG (needs matplotlib)",
                      quick_help="smoke run: the config's 'quick' overrides (default 6 steps, "
                                 "1 warmup), the dataset's 'quick' params, at most 2 batches")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per backend")
    parser.add_argument("--lr", type=float, default=None, help="Adam learning rate")
    parser.add_argument("--hidden", type=int, default=None,
                        help="hidden size, overriding the config's model.hidden")


def main(args) -> int:
    """Run ``gt-fused3s train`` with parsed ``args``; prints the table.
    Exit status 0 if at least one backend trained, else 1."""
    cfg = load_config(args.config)
    if args.quick:
        cfg = quick_config(cfg)
    common.apply_run_arguments(cfg, args, ("device", "dtype", "warmup", "steps", "lr"))
    if args.hidden is not None:
        cfg["model"]["hidden"] = args.hidden
    cfg = common.revalidate(cfg, validate_config)

    try:
        (rows, curve, task), stopped = run(cfg, quick=args.quick, offline=args.offline,
                                           progress=not args.no_progress, eager=args.eager), False
    except common.Interrupted as stop:   # Ctrl-C: the finished runs are still printed and written
        (rows, curve, task), stopped = stop.result, True
        if not rows:
            raise
    if data_parallel.world_from_env()[1] != 0:       # under torchrun, rank 0 reports
        return 0 if any(r["status"] == "ok" for r in rows) else 1
    print(format_table(rows))
    print(format_footer(rows, task))
    if args.csv:
        common.write_csv(curve, CURVE_COLUMNS, args.csv)
        summary = Path(args.csv).with_name(Path(args.csv).stem + "_summary.csv")
        common.write_csv(rows, SUMMARY_COLUMNS, summary)
        print(f"wrote {args.csv} (every step) and {summary} (one row per run)", file=sys.stderr)
    if args.plot:
        title = f"{task.name}: training loss ({rows[0]['dtype']}, {rows[0]['device_name']})"
        common.save_plot(lambda: plot_curves(curve, args.plot, title), args.plot,
                  "the CSV has the curves")
    if stopped:
        print(f"interrupted (Ctrl-C): the {len(rows)} finished runs above"
              + (f" and in {args.csv}" if args.csv else ""), file=sys.stderr)
        return common.INTERRUPTED_EXIT
    return 0 if any(r["status"] == "ok" for r in rows) else 1
