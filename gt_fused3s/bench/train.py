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

Config schema (YAML; defaults in :data:`DEFAULTS`)::

    device: auto          # auto (cuda if available, else cpu) | cpu | cuda | cuda:1
    dtype: auto           # auto (fp32 on cpu, bf16 autocast on cuda) | fp32 | fp16 | bf16
    seed: 0               # weights, data order, generated data
    steps: 60             # optimizer steps per backend (the loss curve's length)
    warmup: 2             # of those, the first ones left out of ms/step and peak MB
    lr: 0.001             # Adam
    weight_decay: 0.0
    backends: [fused3s, pyg]
    model: {hidden: 64, layers: 10, heads: 1, norm: layer, dropout: 0.0, self_loops: false}
    target: auto          # auto | labels | structure
    loss: auto            # auto | mse | bce | ce
    quick: {steps: 6, warmup: 1}   # overrides of these keys under --quick
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

from ..data import check_entry, load_dataset, structural_task
from ..data.targets import STRUCTURAL_TARGETS
from ..models import GraphTransformer
from . import common
from .stream import num_graphs

DEFAULT_CONFIG = common.REPO_ROOT / "configs" / "train.yaml"
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
    "model": {"hidden": 64, "layers": 10, "heads": 1, "norm": "layer", "dropout": 0.0,
              "self_loops": False},
    "target": "auto",
    "loss": "auto",
    "quick": {"steps": 6, "warmup": 1},
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
    _check_int("model.hidden", cfg["model"]["hidden"], 1)
    _check_int("model.layers", cfg["model"]["layers"], 1)
    _check_choice("target", cfg["target"], TARGETS)
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

    def loss_of(self, out: Tensor, y: Tensor) -> Tensor:
        """The mean loss of the outputs against ``y``, in fp32."""
        return compute_loss(self.loss, out.float(), y)


def compute_loss(kind: str, out: Tensor, y: Tensor) -> Tensor:
    """``mse``, ``bce`` (with logits) or ``ce`` (class indices) of ``out``
    against ``y``. For mse and bce, NaN entries of ``y`` (OGB's missing
    labels) are left out by masking, not indexing: no host sync."""
    if kind == "ce":
        return F.cross_entropy(out, y.reshape(-1).long())
    y = y.reshape(out.shape).float()
    known = ~torch.isnan(y)
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
                columns, about)


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


def run(cfg: dict, *, quick: bool = False, offline: bool = False, progress: bool = True,
        log: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict], Task]:
    """Train every backend of a validated config (apply :func:`quick_config`
    first for a smoke run; ``quick`` here shrinks the data). Returns the
    rows (one per backend), the per-step curve (dicts with the keys of
    :data:`CURVE_COLUMNS`) and the task."""
    log = log or common.log_stderr
    device = common.resolve_device(cfg["device"])
    dtype = common.resolve_dtype(cfg["dtype"], device, cuda_default=torch.bfloat16)
    env = {"hidden": cfg["model"]["hidden"], "layers": cfg["model"]["layers"],
           **common.run_info(device, dtype, cfg.get("config", ""))}
    log(common.run_header("train", env))
    try:
        task = load_task(cfg, device, quick=quick, offline=offline, progress=progress)
    except _LOAD_ERRORS as err:   # no file, no network, bad params: one line, no traceback
        raise ValueError(f"dataset {cfg['dataset'].get('name', cfg['dataset']['kind'])} "
                         f"not loaded: {common.short_error(err)}") from err
    env["dataset"] = task.name
    log(task.about)
    log(describe_run(task, cfg, env["dtype"]))
    s = _Settings(cfg, device, dtype, progress, log, env)
    model = build_model(task, cfg, device)
    initial = copy.deepcopy(model.state_dict())
    order = step_order(len(task.batches), cfg["steps"], cfg["seed"])
    rows, curve = [], []
    for backend in cfg["backends"]:
        row, points = train_backend(model, initial, backend, task, order, s)
        common.free_cuda_memory(device)   # its optimizer state and graph formats are gone now
        rows.append(row)
        curve += [{**env, "backend": backend, **p} for p in points]
    add_ratios(rows)
    return rows, curve, task


def describe_run(task: Task, cfg: dict, dtype: str) -> str:
    """One line: the task, the model and the optimisation."""
    m = cfg["model"]
    return (f"task: {task.readout}-level {task.loss} on {task.target}; model: {m['layers']} "
            f"blocks, hidden {m['hidden']}, {m['heads']} head(s), {dtype}; Adam lr "
            f"{cfg['lr']:g}; {cfg['steps']} steps ({cfg['warmup']} warmup, untimed)")


def build_model(task: Task, cfg: dict, device: torch.device) -> GraphTransformer:
    """The model every backend starts from, seeded."""
    m = cfg["model"]
    torch.manual_seed(cfg["seed"])
    model = GraphTransformer(task.batches[0].x.size(1), m["hidden"], task.out_channels,
                             num_layers=m["layers"], heads=m["heads"], norm=m["norm"],
                             readout=task.readout, dropout=m["dropout"],
                             self_loops=m["self_loops"])
    return model.to(device)


def train_backend(model: GraphTransformer, initial: dict, backend: str, task: Task,
                  order: list[int], s: _Settings) -> tuple[dict, list[dict]]:
    """Train ``model`` from the weights ``initial`` with ``backend`` on the
    batches of ``order``; returns its row and its curve (one point per step
    done: a failed run keeps the steps before the failure)."""
    model.load_state_dict(initial)
    model.zero_grad(set_to_none=True)      # no gradients left from the previous backend
    model.backend = backend
    model.train()
    torch.manual_seed(s.cfg["seed"])        # the same dropout masks for every backend
    trainer = _Trainer(model, task, s)
    points: list[dict] = []
    warmup = s.cfg["warmup"]
    bar = common.progress_bar(len(order), f"{task.name}: {backend}", "step", s.progress)

    def loop() -> None:
        for step, b in enumerate(order):
            if step == warmup:                 # the optimizer state exists from here on
                common.reset_peak_memory(s.device)
            loss, ms = trainer.timed_step(task.batches[b], b)
            points.append({"step": step, "loss": loss, "ms": ms, "timed": step >= warmup})
            bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
            bar.update()

    with bar:
        _, error = common.guarded(loop, s.device)
    row = {**s.env, "backend": backend, "steps": len(points), **curve_summary(points)}
    if error:
        s.log(f"{task.name}: {backend} failed: {error}")
        return {**row, "status": common.status_of(error), "note": error}, points
    times = [p["ms"] for p in points if p["timed"]]
    row.update(status="ok", note="", ms_median=statistics.median(times),
               ms_std=statistics.pstdev(times), peak_mem_mb=common.peak_memory_mb(s.device))
    return row, points


class _Trainer:
    """One backend's optimizer and training step."""

    def __init__(self, model: GraphTransformer, task: Task, s: _Settings):
        self.model, self.task, self.device = model, task, s.device
        self.opt = torch.optim.Adam(model.parameters(), lr=s.cfg["lr"],
                                    weight_decay=s.cfg["weight_decay"])
        # fp16 gradients underflow without loss scaling; bf16 and fp32 need none
        self.scaler = torch.amp.GradScaler(s.device.type, enabled=s.dtype == torch.float16)
        self.autocast = common.autocast(s.device, s.dtype)
        # one graph: its format is built once and kept (full-graph training);
        # a collection's batches are new graphs, built in their step
        self.graphs: dict[int, Any] = {}

    def _graph(self, data, index: int):
        if self.task.readout == "graph":
            return None
        if index not in self.graphs:
            self.graphs[index] = self.model.make_graph(data.edge_index, data.num_nodes)
        return self.graphs[index]

    def step(self, data, index: int) -> Tensor:
        """One optimizer step on batch ``data``; returns the loss (on the device)."""
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            out = self.model(data.x, data.edge_index,
                             data.batch if self.task.readout == "graph" else None,
                             graph=self._graph(data, index), num_graphs=num_graphs(data))
        loss = self.task.loss_of(out, data.y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss.detach()

    def timed_step(self, data, index: int) -> tuple[float, float]:
        """(loss, ms) of one step, timed between device synchronisations."""
        common.sync(self.device)
        t0 = time.perf_counter()
        loss = self.step(data, index)
        common.sync(self.device)
        return float(loss), (time.perf_counter() - t0) * 1e3


def curve_summary(points: list[dict]) -> dict:
    """First loss and the mean of the last :data:`LAST_K` (of what ran)."""
    if not points:
        return {}
    last = [p["loss"] for p in points[-LAST_K:]]
    return {"loss_first": points[0]["loss"], "loss_last": statistics.mean(last)}


def add_ratios(rows: list[dict]) -> None:
    """``speedup_vs_pyg`` = ms/step of pyg over the row's; ``mem_vs_pyg`` =
    the row's peak memory over pyg's (below 1: less memory). Ok rows only."""
    base = next((r for r in rows if r["backend"] == BASELINE and r["status"] == "ok"), None)
    if base is None:
        return
    for r in rows:
        if r["status"] != "ok":
            continue
        r["speedup_vs_pyg"] = base["ms_median"] / r["ms_median"]
        if r.get("peak_mem_mb") and base.get("peak_mem_mb"):
            r["mem_vs_pyg"] = r["peak_mem_mb"] / base["peak_mem_mb"]


# ------------------------------------------------------------------ output
_TABLE = [  # header, key, format
    ("backend", "backend", "{}"), ("steps", "steps", "{:d}"),
    ("first loss", "loss_first", "{:.4f}"), (f"last loss (mean {LAST_K})", "loss_last", "{:.4f}"),
    ("ms/step", "ms_median", "{:.2f}"), ("±ms", "ms_std", "{:.2f}"),
    ("peak MB", "peak_mem_mb", "{:.0f}"), ("vs pyg", "speedup_vs_pyg", "{:.2f}x"),
    ("mem/pyg", "mem_vs_pyg", "{:.2f}"), ("note", "note", "{}"),
]


def format_table(rows: list[dict]) -> str:
    """The rows as a text table (one line per backend), with a legend."""
    return common.text_table(rows, _TABLE, {"backend", "note"},
                      "ms/step: median wall time of a training step (synchronised, warmup "
                      "steps excluded); peak MB: CUDA max allocated over those steps; vs pyg: "
                      "pyg's ms/step over this row's; mem/pyg: this row's peak over pyg's.")


def format_footer(rows: list[dict], task: Task) -> str:
    """What ran where, under the table (stdout, so that a saved table says it)."""
    r = rows[0]
    return (f"{task.name} ({task.columns['structure']} structure, target {task.target}), "
            f"{task.readout}-level {task.loss}; {r['layers']} blocks, hidden "
            f"{r['hidden']}; {r['dtype']} on {r['device_name']} ({r['device']}); torch "
            f"{r['torch']}, git {r['git_sha']}")


def plot_curves(curve: list[dict], path: str | Path, title: str) -> Path:
    from .plot import plot_loss_curves

    series: dict[str, tuple[list, list]] = {}
    for p in curve:
        steps, losses = series.setdefault(p["backend"], ([], []))
        steps.append(p["step"])
        losses.append(p["loss"])
    return plot_loss_curves(series, path, title)


# --------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    common.add_run_arguments(parser, DEFAULT_CONFIG,
                      csv_help="also write every step's loss and time per backend to this CSV",
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

    rows, curve, task = run(cfg, quick=args.quick, offline=args.offline,
                            progress=not args.no_progress)
    print(format_table(rows))
    print(format_footer(rows, task))
    if args.csv:
        common.write_csv(curve, CURVE_COLUMNS, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot:
        title = f"{task.name}: training loss ({rows[0]['dtype']}, {rows[0]['device_name']})"
        common.save_plot(lambda: plot_curves(curve, args.plot, title), args.plot,
                  "the CSV has the curves")
    return 0 if any(r["status"] == "ok" for r in rows) else 1
