"""Dataset loaders with one output structure, :class:`GraphDataset`: a
sequence of batches, each a PyG ``Data`` (x, edge_index, num_nodes, and for
collections batch / ptr), collections batched as block-diagonal graphs.

Kinds (the ``kind`` of a config's dataset entry, see :func:`load_dataset`):

=============  ==============================================  =============
kind           source                                          needs network
=============  ==============================================  =============
molecules      :func:`synthetic.molecules_dataset`             no
random_graphs  :func:`synthetic.random_graphs_dataset`         no
powerlaw       :func:`synthetic.power_law_dataset`             no
npz            :func:`npz.load_npz` (layout of shared/data)    no
ogb            :func:`online.load_ogb` (ogbn-*, ogbg-*)        first use
lrgb           :func:`online.load_lrgb` (LRGBDataset)          first use
pyg            :func:`online.load_pyg` (torch_geometric.datasets class)  first use
=============  ==============================================  =============

Parameters of ``ogb`` and ``lrgb`` entries: ``dataset`` (the upstream name,
default the entry's name), ``split``, ``root``, ``batch_size``,
``max_graphs``; of ``pyg`` entries: ``cls`` (the class name) and the class's
own arguments (``name: Cora``).

An entry may carry a ``fallback``: another entry (``kind``, ``params``,
``quick``) loaded under the same name when its own loader cannot (offline,
not downloaded, ``ogb`` not installed, file missing), or at once with
``offline=True``: a local npz structure file or a synthetic stand-in, so
that one config runs online at a user's and offline on a GPU machine.

Structures without labels get a generated, learnable training task from
:func:`targets.structural_task` (features and targets from node degrees).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .base import (DatasetUnavailableError, GraphDataset, data_dirs, make_data,
                   random_features, resolve_path)
from .npz import load_npz
from .online import from_pyg, load_lrgb, load_ogb, load_pyg
from .synthetic import (molecule_batch, molecules_dataset, power_law_dataset, power_law_graph,
                        random_graph_batch, random_graphs_dataset, symmetric_coalesce)
from .targets import structural_task


def _upstream(fn: Callable, first: str) -> Callable:
    """Loader whose first argument (the upstream dataset name) comes from
    ``params[first]``, defaulting to the entry's name."""
    def load(name: str, params: dict) -> GraphDataset:
        params = dict(params)
        return fn(params.pop(first, name), **params)
    return load


LOADERS: dict[str, Callable[[str, dict], GraphDataset]] = {
    "molecules": lambda name, p: molecules_dataset(name, **p),
    "random_graphs": lambda name, p: random_graphs_dataset(name, **p),
    "powerlaw": lambda name, p: power_law_dataset(name, **p),
    "npz": lambda name, p: load_npz(name=name, **p),
    "ogb": _upstream(load_ogb, "dataset"),
    "lrgb": _upstream(load_lrgb, "dataset"),
    "pyg": lambda name, p: load_pyg(label=name, **p),
}


#: keys of a dataset entry and of its ``fallback``
ENTRY_KEYS = {"name", "kind", "params", "quick", "fallback"}
FALLBACK_KEYS = {"kind", "params", "quick"}
#: what makes a loader fall back: not downloaded and offline, package or file missing
_UNAVAILABLE = (DatasetUnavailableError, ImportError, FileNotFoundError)


def check_entry(spec: Any, extra_keys: set[str] = frozenset()) -> None:
    """Raise ValueError unless ``spec`` is a dataset entry (its ``fallback`` too)."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a dataset entry needs at least 'kind' (got {spec!r})")
    name = spec.get("name", spec["kind"])
    if spec["kind"] not in LOADERS:
        raise ValueError(f"dataset {name!r}: kind {spec['kind']!r} is unknown; choose one of "
                         f"{sorted(LOADERS)}")
    unknown = set(spec) - ENTRY_KEYS - set(extra_keys)
    if unknown:
        raise ValueError(f"dataset {name!r}: unknown keys {sorted(unknown)}; known: "
                         f"{sorted(ENTRY_KEYS | set(extra_keys))}")
    fallback = spec.get("fallback")
    if fallback is not None:
        if not isinstance(fallback, dict) or set(fallback) - FALLBACK_KEYS:
            raise ValueError(f"dataset {name!r}: fallback must be a mapping of "
                             f"{sorted(FALLBACK_KEYS)} (got {fallback!r})")
        check_entry({**fallback, "name": name})


def load_dataset(spec: dict[str, Any], *, device: torch.device | str = "cpu", seed: int = 0,
                 quick: bool = False, offline: bool = False) -> GraphDataset:
    """Load one dataset entry of a config::

        {name: str, kind: one of LOADERS, params: {...}, quick: {...},
         fallback: {kind, params, quick}}

    ``params`` go to the kind's loader (``device`` and ``seed`` are added
    unless given); with ``quick`` the entry's ``quick`` mapping overrides
    ``params`` (a smaller setting of the same dataset, for smoke tests).
    ``fallback`` is loaded instead when the entry's loader finds the data
    unavailable, or at once if ``offline``; the dataset's ``info`` then has
    ``fallback_reason``. If the fallback is unavailable too, the
    :class:`DatasetUnavailableError` is one line with both reasons (the
    download's own error first) and what to do.
    """
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ValueError(f"a dataset entry needs at least 'kind' (got {spec!r})")
    name = spec.get("name", spec["kind"])
    fallback = spec.get("fallback")
    if offline and fallback is not None:
        reason = "offline run"
    else:
        try:
            return _load(spec, name, device, seed, quick)
        except _UNAVAILABLE as err:
            if fallback is None:
                raise
            reason = f"{type(err).__name__}: {getattr(err, 'reason', err)}".splitlines()[0]
    try:
        ds = _load(fallback, name, device, seed, quick)
    except _UNAVAILABLE as err:
        hint = getattr(err, "hint", "")
        if offline:
            hint = (hint + "; or r" if hint else "R") + "un without --offline (offline=False) to download it"
        raise DatasetUnavailableError(
            f"{name}: {reason}; the fallback ({fallback['kind']}) failed too: "
            f"{type(err).__name__}: {getattr(err, 'reason', err)}".splitlines()[0], hint) from err
    ds.info["fallback_reason"] = reason
    return ds


def _load(spec: dict, name: str, device, seed: int, quick: bool) -> GraphDataset:
    if spec["kind"] not in LOADERS:
        raise ValueError(f"dataset kind {spec['kind']!r} is unknown; choose one of "
                         f"{sorted(LOADERS)}")
    params = dict(spec.get("params") or {})
    if quick:
        params.update(spec.get("quick") or {})
    params.setdefault("seed", seed)
    params["device"] = device
    return LOADERS[spec["kind"]](name, params)


__all__ = ["GraphDataset", "DatasetUnavailableError", "LOADERS", "load_dataset", "check_entry",
           "load_npz", "load_ogb", "load_lrgb", "load_pyg", "from_pyg", "molecules_dataset",
           "random_graphs_dataset", "power_law_dataset", "molecule_batch", "random_graph_batch",
           "power_law_graph", "symmetric_coalesce", "make_data", "random_features",
           "resolve_path", "data_dirs", "structural_task"]
