"""The common structure every loader returns, and where data files live.

A :class:`GraphDataset` is a sequence of *batches*; each batch is one graph as
the model sees it: a single graph, or ``B`` graphs as one block-diagonal graph
(a batch of graphs is just a graph with ``batch`` / ``ptr`` on top). Batches are
made on demand, so a loader never holds more than the raw structure.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor
from torch_geometric.data import Data

#: the source checkout this package runs from (``<repo>/gt_fused3s/data/base.py``);
#: in an installed package, the folder above ``site-packages`` (see :data:`IN_CHECKOUT`)
REPO_ROOT = Path(__file__).resolve().parents[2]
#: whether :data:`REPO_ROOT` is a checkout of this repository (an editable
#: install), not the folder of an installed wheel
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "gt_fused3s").is_dir()
DATA_ENV = "GT_FUSED3S_DATA"


def download_root() -> Path:
    """Where the online loaders download to by default: ``<repo>/.data/datasets``
    in a checkout (ignored by git), else ``$XDG_CACHE_HOME/gt_fused3s/datasets``
    (``~/.cache/gt_fused3s/datasets``), never inside an installed package."""
    if IN_CHECKOUT:
        return REPO_ROOT / ".data" / "datasets"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "gt_fused3s" / "datasets"


class DatasetUnavailableError(RuntimeError):
    """A dataset is not on disk and could not be fetched (offline, no file).

    ``reason`` is what went wrong and ``hint`` what to do; the message is
    both (a caller with a fallback shows the reason and its own hint)."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"{reason}. {hint}" if hint else reason)
        self.reason, self.hint = reason, hint


@dataclass(eq=False)
class GraphDataset:
    """Batches of graphs, made on demand by ``make_batch(i, device)``.

    Every batch is a PyG :class:`~torch_geometric.data.Data` with

    - ``x``          float [N, F] node features (``F = num_features``),
    - ``edge_index`` int64 [2, E] (source, destination),
    - ``num_nodes``  N,
    - ``batch``      int64 [N] graph of each node and ``ptr`` int64 [G + 1]
      node offsets (``level == "graph"`` only: collections of graphs),
    - ``y``          labels where the source has them,
    - ``edge_attr``  int64 [E, C] categorical edge features (bond types: from
      the source where it has them, generated for structures that have
      none), with ``edge_vocab`` the size of each of the C columns.

    Args:
        name: the dataset's name in tables.
        level: ``"node"`` (one graph, node-level readout) or ``"graph"``
            (a collection batched ``batch_size`` graphs at a time, pooled readout).
        num_features: F.
        num_batches: number of batches.
        make_batch: ``(i, device) -> Data`` for ``0 <= i < num_batches``.
        num_classes: output width suggested by the labels, if known.
        info: free-form facts for reports (source, graph count, sizes;
            ``synthetic``: a generated structure; ``fallback_reason``: why
            the entry's fallback was loaded instead, see :func:`load_dataset`).
        device: where ``ds[i]`` makes batches; :meth:`get` takes another.
            Generators draw on that device (CPU and CUDA generators give
            different graphs for one seed).
        edge_vocab: the sizes of the categorical edge feature columns of
            ``edge_attr`` (None: the batches carry none).
    """

    name: str
    level: str
    num_features: int
    num_batches: int
    make_batch: Callable[[int, torch.device], Data] = field(repr=False)
    num_classes: int | None = None
    info: dict = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    edge_vocab: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.level not in ("node", "graph"):
            raise ValueError(f"level must be 'node' or 'graph' (got {self.level!r})")
        self.device = torch.device(self.device)

    def __len__(self) -> int:
        return self.num_batches

    def get(self, i: int, device: torch.device | str | None = None) -> Data:
        """Batch ``i``, made on ``device`` (default :attr:`device`)."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"{self.name}: batch {i} outside [0, {self.num_batches})")
        return self.make_batch(i, torch.device(device) if device is not None else self.device)

    def __getitem__(self, i: int) -> Data:
        return self.get(i)

    def __iter__(self) -> Iterator[Data]:
        for i in range(self.num_batches):
            yield self.get(i)


def make_data(x: Tensor, edge_index: Tensor, num_nodes: int, ptr: Tensor | None = None,
              y: Tensor | None = None, edge_attr: Tensor | None = None) -> Data:
    """One batch in the layout of :class:`GraphDataset` (``ptr`` given: a
    collection, ``batch`` is derived from it)."""
    data = Data(x=x, edge_index=edge_index, num_nodes=int(num_nodes))
    if edge_attr is not None:
        data.edge_attr = edge_attr
    if ptr is not None:
        data.ptr = ptr
        data.batch = torch.repeat_interleave(
            torch.arange(ptr.numel() - 1, device=ptr.device), ptr[1:] - ptr[:-1],
            output_size=int(num_nodes))
    if y is not None:
        data.y = y
    return data


def seeded_generator(seed: int, device: torch.device | str = "cpu",
                     stream: int = 0) -> torch.Generator:
    """A generator on ``device`` for ``(seed, stream)``: batch ``i`` of a dataset
    uses stream ``i``, so a batch is the same whatever order batches are made in.
    (CPU and CUDA generators give different numbers for one seed.)"""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed((int(seed) * 1_000_003 + int(stream)) % (2**63))
    return g


def random_features(num_nodes: int, num_features: int, *, seed: int = 0, stream: int = 0,
                    device: torch.device | str = "cpu") -> Tensor:
    """float32 [num_nodes, num_features] standard normal, seeded."""
    g = seeded_generator(seed, device, stream)
    return torch.randn(num_nodes, num_features, generator=g, device=device)


def data_dirs() -> list[Path]:
    """Folders searched for structure files, in order: ``$GT_FUSED3S_DATA``,
    and in a checkout ``<repo>/../shared/data`` and ``<repo>/.data`` (the
    ignored folder a device run carries its data in). Only those that exist
    are listed."""
    dirs = []
    if os.environ.get(DATA_ENV):
        dirs.append(Path(os.environ[DATA_ENV]).expanduser())
    if IN_CHECKOUT:
        dirs += [REPO_ROOT.parent / "shared" / "data", REPO_ROOT / ".data"]
    return [d for d in dirs if d.is_dir()]


def resolve_path(path: str | os.PathLike) -> Path:
    """Find a data file named in a config.

    ``$VARS`` and ``~`` are expanded; a relative path is tried against the
    working directory, then the repository root; failing those, the file's
    name is looked up in :func:`data_dirs`. So ``../shared/data/zinc.npz``
    works from the checkout, and on a machine that keeps the files elsewhere
    setting ``GT_FUSED3S_DATA`` (or copying them to ``<repo>/.data``) suffices.
    The error of a file found nowhere is one line that says so.
    """
    raw = Path(os.path.expandvars(os.fspath(path))).expanduser()
    tried = [raw] if raw.is_absolute() else [Path.cwd() / raw] + ([REPO_ROOT / raw] if IN_CHECKOUT else [])
    tried += [d / raw.name for d in data_dirs()]
    tried = list(dict.fromkeys(Path(os.path.normpath(p)) for p in tried))
    for p in tried:
        if p.is_file():
            return p.resolve()
    raise FileNotFoundError(f"data file {os.fspath(path)!r} not found (tried "
                            + ", ".join(str(p) for p in tried)
                            + f"); set {DATA_ENV} to the folder that holds {raw.name}")


#: the vocabulary of :func:`generated_bond_types` (one column)
GENERATED_BOND_VOCAB = (4,)


def generated_bond_types(src: Tensor, dst: Tensor) -> Tensor:
    """int64 [E, 1] bond types in [0, 4) for structures without edge
    features: a hash of the unordered pair of (global) node ids, so both
    directions of an edge get one type and a batch's types do not depend on
    how the collection is sliced."""
    a, b = torch.minimum(src, dst).long(), torch.maximum(src, dst).long()
    h = (a * 73856093) ^ (b * 19349663)
    return (h % 4).unsqueeze(1)
