"""Dataset loaders with one output structure, :class:`GraphDataset`: a
sequence of batches, each a PyG ``Data`` (x, edge_index, num_nodes, and for
collections batch / ptr), collections batched as block-diagonal graphs.

Kinds (the ``kind`` of a config's dataset entry, see :func:`load_dataset`):

===========  ==============================================  =============
kind         source                                          needs network
===========  ==============================================  =============
molecules    :func:`synthetic.molecules_dataset`             no
powerlaw     :func:`synthetic.power_law_dataset`             no
npz          :func:`npz.load_npz` (layout of shared/data)    no
ogb          :func:`online.load_ogb` (ogbn-*, ogbg-*)        first use
lrgb         :func:`online.load_lrgb` (LRGBDataset)          first use
pyg          :func:`online.load_pyg` (torch_geometric.datasets class)  first use
===========  ==============================================  =============

Parameters of ``ogb`` and ``lrgb`` entries: ``dataset`` (the upstream name,
default the entry's name), ``split``, ``root``, ``batch_size``,
``max_graphs``; of ``pyg`` entries: ``cls`` (the class name) and the class's
own arguments (``name: Cora``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .base import (DatasetUnavailableError, GraphDataset, data_dirs, make_data,
                   random_features, resolve_path)
from .npz import load_npz
from .online import from_pyg, load_lrgb, load_ogb, load_pyg
from .synthetic import (molecule_batch, molecules_dataset, power_law_dataset, power_law_graph,
                        symmetric_coalesce)


def _upstream(fn: Callable, first: str) -> Callable:
    """Loader whose first argument (the upstream dataset name) comes from
    ``params[first]``, defaulting to the entry's name."""
    def load(name: str, params: dict) -> GraphDataset:
        params = dict(params)
        return fn(params.pop(first, name), **params)
    return load


LOADERS: dict[str, Callable[[str, dict], GraphDataset]] = {
    "molecules": lambda name, p: molecules_dataset(name, **p),
    "powerlaw": lambda name, p: power_law_dataset(name, **p),
    "npz": lambda name, p: load_npz(name=name, **p),
    "ogb": _upstream(load_ogb, "dataset"),
    "lrgb": _upstream(load_lrgb, "dataset"),
    "pyg": lambda name, p: load_pyg(label=name, **p),
}


def load_dataset(spec: dict[str, Any], *, device: torch.device | str = "cpu", seed: int = 0,
                 quick: bool = False) -> GraphDataset:
    """Load one dataset entry of a config::

        {name: str, kind: one of LOADERS, params: {...}, quick: {...}}

    ``params`` go to the kind's loader (``device`` and ``seed`` are added
    unless given); with ``quick`` the entry's ``quick`` mapping overrides
    ``params`` (a smaller setting of the same dataset, for smoke tests).
    """
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a dataset entry needs at least 'kind' (got {spec!r})")
    kind = spec["kind"]
    if kind not in LOADERS:
        raise ValueError(f"dataset kind {kind!r} is unknown; choose one of {sorted(LOADERS)}")
    name = spec.get("name", kind)
    params = dict(spec.get("params") or {})
    if quick:
        params.update(spec.get("quick") or {})
    params.setdefault("seed", seed)
    params["device"] = device
    return LOADERS[kind](name, params)


__all__ = ["GraphDataset", "DatasetUnavailableError", "LOADERS", "load_dataset", "load_npz",
           "load_ogb", "load_lrgb", "load_pyg", "from_pyg", "molecules_dataset",
           "power_law_dataset", "molecule_batch", "power_law_graph", "symmetric_coalesce",
           "make_data", "random_features", "resolve_path", "data_dirs"]
