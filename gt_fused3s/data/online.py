"""Loaders of published datasets: OGB (``ogb``), LRGB and the other PyG
datasets (``torch_geometric.datasets``). They read ``root`` and download
there on first use (default: ``.data/datasets`` of the checkout, or
``~/.cache/gt_fused3s/datasets`` for an installed package, see
:func:`~gt_fused3s.data.base.download_root`); offline and without the files they raise
:class:`DatasetUnavailableError` naming the dataset, the folder and the
offline alternative (an npz structure file).

Node features are the dataset's own, cast to float (integer atom/bond codes
included: the benchmark measures speed, a trained model would embed them);
datasets without node features get seeded random normal ones.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import torch

from .base import (GENERATED_BOND_VOCAB, DatasetUnavailableError, GraphDataset, download_root,
                   generated_bond_types, make_data, random_features)


def _answer_yes(question: str = "") -> str:
    """Stands in for ``input`` while a dataset loads: ogb asks on stdin
    whether to re-download a folder left by a failed download and whether to
    download a large file, and a run must never wait on a terminal. The
    config asked for the dataset, so the answer is yes, and the question is
    shown."""
    print(f"gt-fused3s: answered 'y' to: {question.strip()}", file=sys.stderr)
    return "y"


def _open(name: str, root: Path, make: Callable[[], Any]):
    """Run a dataset constructor (never reading stdin); turn a failed
    download into one clear error."""
    try:
        with mock.patch("builtins.input", _answer_yes):
            return make()
    # URLError and socket errors are OSErrors; ogb exits when a download fails
    except (OSError, EOFError, SystemExit) as err:
        own = " ".join(str(err).split()) or "(no message)"
        raise DatasetUnavailableError(
            f"dataset {name} is not in {root} and could not be downloaded (offline?): "
            f"{type(err).__name__}: {own}",
            f"Put the files there (or set its 'root'), or use the npz structure file option: "
            f"kind: npz, params: {{structure: path/to/{name}.npz}} (layout of "
            f"shared/data/README.md)") from err


def _node_features(data, num_features: int, seed: int, stream: int, device) -> torch.Tensor:
    x = getattr(data, "x", None)
    if x is None:
        return random_features(int(data.num_nodes), num_features, seed=seed, stream=stream,
                               device=device)
    x = x.to(device=device, dtype=torch.float32)
    return x.unsqueeze(-1) if x.dim() == 1 else x


def from_pyg(dataset, name: str, *, batch_size: int = 1024, max_graphs: int | None = None,
             num_features: int = 16, num_classes: int | None = None, seed: int = 0,
             device: torch.device | str = "cpu", info: dict | None = None) -> GraphDataset:
    """Wrap a PyG dataset (a sequence of ``Data``): one graph -> level
    ``"node"``; several -> level ``"graph"``, batched ``batch_size`` graphs at
    a time (PyG's ``Batch``, i.e. block-diagonal). ``num_features`` is used
    only when the data has no ``x``. Integer ``edge_attr`` (bond types: ZINC,
    OGB molecules, LRGB peptides) comes along as int64 [E, C] with its
    vocabulary; without one, generated bond types stand in."""
    from torch_geometric.data import Batch

    first = dataset[0]
    vocab = _edge_vocab(dataset, first)
    if getattr(first, "x", None) is not None:
        num_features = 1 if first.x.dim() == 1 else first.x.size(-1)
    info = {"source": type(dataset).__name__, **(info or {})}
    count = len(dataset) if max_graphs is None else min(int(max_graphs), len(dataset))

    if len(dataset) == 1:
        def make_single(i: int, device: torch.device):
            x = _node_features(first, num_features, seed, 0, device)
            return make_data(x, first.edge_index.to(device), int(first.num_nodes),
                             y=None if first.y is None else first.y.to(device),
                             edge_attr=_edge_types(first, vocab, device))
        return GraphDataset(name, "node", num_features, 1, make_single, num_classes,
                            info={**info, "num_graphs": 1, "num_nodes": int(first.num_nodes),
                                  "num_edges": int(first.edge_index.size(1))}, device=device,
                            edge_vocab=vocab)

    def make_batch(i: int, device: torch.device):
        graphs = [dataset[j] for j in range(i * batch_size, min((i + 1) * batch_size, count))]
        b = Batch.from_data_list(graphs)
        x = _node_features(b, num_features, seed, i, device)
        return make_data(x, b.edge_index.to(device), int(b.num_nodes), ptr=b.ptr.to(device),
                         y=None if getattr(b, "y", None) is None else b.y.to(device),
                         edge_attr=_edge_types(b, vocab, device))

    return GraphDataset(name, "graph", num_features, math.ceil(count / batch_size), make_batch,
                        num_classes, info={**info, "num_graphs": count, "batch_size": batch_size},
                        device=device, edge_vocab=vocab)


def _edge_vocab(dataset, first) -> tuple[int, ...]:
    """The sizes of the categorical edge feature columns: from the data's
    integer ``edge_attr`` (max + 1 per column over the dataset), else those of
    the generated bond types."""
    ea = getattr(first, "edge_attr", None)
    if ea is None or ea.is_floating_point():
        return GENERATED_BOND_VOCAB
    stored = getattr(dataset, "_data", None)      # an InMemoryDataset's collated tensors
    every = getattr(stored, "edge_attr", None) if stored is not None else None
    if every is None:
        every = torch.cat([d.edge_attr.reshape(d.edge_attr.size(0), -1) for d in dataset])
    every = every.reshape(every.size(0), -1)
    return tuple(int(m) + 1 for m in every.max(0).values) if every.numel() else (1,) * every.size(1)


def _edge_types(data, vocab, device) -> torch.Tensor:
    """int64 [E, C] edge types of ``data`` on ``device``."""
    ea = getattr(data, "edge_attr", None)
    if ea is None or ea.is_floating_point():
        return generated_bond_types(data.edge_index[0], data.edge_index[1]).to(device)
    return ea.reshape(ea.size(0), -1).long().to(device)


@contextlib.contextmanager
def _needs_ogb(name: str):
    """Turns a missing ``ogb`` into an ImportError that says how to install it."""
    try:
        yield
    except ImportError as err:
        raise ImportError(f'dataset {name} needs the ogb package ({err}): pip install "gt-fused3s[ogb]"') from err


def load_ogb(name: str, *, root: str | Path | None = None, split: str | None = None,
             **kwargs) -> GraphDataset:
    """An OGB node (``ogbn-*``) or graph (``ogbg-*``) property dataset.

    ``split`` (graph datasets): ``"train"``, ``"valid"`` or ``"test"`` of
    ``get_idx_split()``; default all graphs. Other keyword arguments go to
    :func:`from_pyg`.
    """
    root = Path(root) if root else download_root() / "ogb"
    os.environ.setdefault("DGLBACKEND", "pytorch")    # ogb imports DGL where it is installed
    if name.startswith("ogbn-"):
        with _needs_ogb(name):
            from ogb.nodeproppred import PygNodePropPredDataset
        ds = _open(name, root, lambda: PygNodePropPredDataset(name=name, root=str(root)))
        classes = int(ds.num_classes)
    elif name.startswith("ogbg-"):
        with _needs_ogb(name):
            from ogb.graphproppred import PygGraphPropPredDataset
        ds = _open(name, root, lambda: PygGraphPropPredDataset(name=name, root=str(root)))
        classes = int(ds.num_tasks)
        if split is not None:
            ds = ds[ds.get_idx_split()[split]]
    else:
        raise ValueError(f"OGB dataset names start with 'ogbn-' or 'ogbg-' (got {name!r})")
    return from_pyg(ds, name, num_classes=classes, info={"source": "ogb", "split": split},
                    **kwargs)


def load_lrgb(name: str, *, root: str | Path | None = None, split: str = "test",
              **kwargs) -> GraphDataset:
    """An LRGB dataset (``Peptides-func``, ``Peptides-struct``, ``PascalVOC-SP``,
    ``COCO-SP``, ``PCQM-Contact``) through ``torch_geometric.datasets.LRGBDataset``,
    one ``split`` (``"train"``, ``"val"``, ``"test"``)."""
    from torch_geometric.datasets import LRGBDataset

    root = Path(root) if root else download_root() / "lrgb"
    ds = _open(name, root, lambda: LRGBDataset(str(root), name, split=split))
    return from_pyg(ds, name, num_classes=int(ds.num_classes),
                    info={"source": "lrgb", "split": split}, **kwargs)


_FROM_PYG_KEYS = ("batch_size", "max_graphs", "num_features", "seed", "device")


def load_pyg(cls: str, *, label: str | None = None, root: str | Path | None = None,
             **kwargs) -> GraphDataset:
    """Any ``torch_geometric.datasets`` class by name, e.g. ``load_pyg("Planetoid",
    name="Cora")``. The keyword arguments that :func:`from_pyg` does not take
    go to the class, and so does ``root`` (default ``.data/datasets/pyg/<cls>``)
    if the class takes one. ``label`` names the dataset in tables."""
    import torch_geometric.datasets as pyg_datasets

    if not hasattr(pyg_datasets, cls):
        raise ValueError(f"torch_geometric.datasets has no dataset class {cls!r}")
    wrap = {k: kwargs.pop(k) for k in _FROM_PYG_KEYS if k in kwargs}
    dataset_cls = getattr(pyg_datasets, cls)
    root = Path(root) if root else download_root() / "pyg" / cls
    if "root" in inspect.signature(dataset_cls).parameters:   # not e.g. FakeDataset
        kwargs["root"] = str(root)
    label = label or (f"{cls}-{kwargs['name']}" if "name" in kwargs else cls)
    ds = _open(label, root, lambda: dataset_cls(**kwargs))
    try:
        classes = int(ds.num_classes)
    except Exception:   # regression targets, no y
        classes = None
    return from_pyg(ds, label, num_classes=classes, info={"source": f"pyg {cls}"}, **wrap)
