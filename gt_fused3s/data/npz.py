"""Graph structures stored as ``.npz`` in the layout of ``shared/data``
(see its README), with generated features.

- single graph: ``indptr`` int32 [N+1], ``indices`` int32 [nnz], ``num_nodes``;
  row ``i`` of the CSR lists the sources of the edges ``j -> i`` (the files are
  symmetric, so either reading gives the same graph).
- collection: ``graph_ptr`` int64 [G+1], ``edge_ptr`` int64 [G+1], ``src``,
  ``dst`` int32 [E] with global ids; any contiguous slice of graphs is a
  block-diagonal graph once shifted by its first node id.

The files hold no edge features: batches carry generated bond types
(``base.generated_bond_types``) as ``edge_attr``.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from .base import GENERATED_BOND_VOCAB, GraphDataset, generated_bond_types, make_data, random_features, resolve_path


def load_npz(structure: str | os.PathLike, *, name: str | None = None, num_features: int = 16,
             batch_size: int = 1024, start: int = 0, max_graphs: int | None = None,
             seed: int = 0, device: torch.device | str = "cpu") -> GraphDataset:
    """A dataset from a structure file (path resolved by :func:`resolve_path`).

    Args:
        structure: the ``.npz`` path.
        name: name in tables, default the file's stem.
        num_features: width of the random normal features (seeded per batch).
        batch_size: graphs per batch (collections).
        start, max_graphs: use graphs ``start .. start + max_graphs - 1`` of a
            collection (default: from ``start`` to the end).
        seed: feature seed.
        device: where batches are made by default (:class:`GraphDataset`).

    A single graph is one batch of level ``"node"``; a collection is batched
    in contiguous slices of ``batch_size`` graphs, level ``"graph"``.
    """
    path = resolve_path(structure)
    name = name or path.stem
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if "indptr" in arrays:
        indptr = torch.from_numpy(arrays["indptr"].astype(np.int64))
        indices = torch.from_numpy(arrays["indices"].astype(np.int64))
        n = int(arrays["num_nodes"]) if "num_nodes" in arrays else indptr.numel() - 1
        if indptr.numel() != n + 1 or int(indptr[-1]) != indices.numel():
            raise ValueError(f"{path}: indptr has {indptr.numel()} entries and ends at "
                             f"{int(indptr[-1])}, expected {n + 1} entries ending at "
                             f"len(indices)={indices.numel()}")

        def make_single(i: int, device: torch.device):
            dst = torch.repeat_interleave(torch.arange(n), indptr[1:] - indptr[:-1],
                                          output_size=indices.numel())
            ei = torch.stack([indices, dst]).to(device)
            return make_data(random_features(n, num_features, seed=seed, device=device), ei, n,
                             edge_attr=generated_bond_types(ei[0], ei[1]))

        return GraphDataset(name, "node", num_features, 1, make_single,
                            info={"source": str(path), "num_graphs": 1, "num_nodes": n,
                                  "num_edges": indices.numel()}, device=device,
                            edge_vocab=GENERATED_BOND_VOCAB)

    missing = {"graph_ptr", "edge_ptr", "src", "dst"} - arrays.keys()
    if missing:
        raise ValueError(f"{path}: neither a single graph (indptr, indices, num_nodes) nor a "
                         f"collection (graph_ptr, edge_ptr, src, dst); missing {sorted(missing)}")
    gp = torch.from_numpy(arrays["graph_ptr"].astype(np.int64))
    ep = torch.from_numpy(arrays["edge_ptr"].astype(np.int64))
    src = torch.from_numpy(arrays["src"])
    dst = torch.from_numpy(arrays["dst"])
    total = gp.numel() - 1
    if not 0 <= start < total:
        raise ValueError(f"{path}: start={start} outside [0, {total})")
    count = total - start if max_graphs is None else min(int(max_graphs), total - start)
    num_batches = math.ceil(count / batch_size)

    def make_batch(i: int, device: torch.device):
        a = start + i * batch_size
        b = min(a + batch_size, start + count)
        n0, e0, e1 = int(gp[a]), int(ep[a]), int(ep[b])
        ei = torch.stack([src[e0:e1], dst[e0:e1]]).long()
        bonds = generated_bond_types(ei[0], ei[1]).to(device)      # of the global ids
        ei = ei.sub_(n0).to(device)
        ptr = (gp[a:b + 1] - n0).to(device)
        n = int(gp[b]) - n0
        return make_data(random_features(n, num_features, seed=seed, stream=i, device=device),
                         ei, n, ptr=ptr, edge_attr=bonds)

    return GraphDataset(name, "graph", num_features, num_batches, make_batch,
                        info={"source": str(path), "num_graphs": count, "batch_size": batch_size,
                              "num_nodes": int(gp[start + count] - gp[start]),
                              "num_edges": int(ep[start + count] - ep[start])}, device=device,
                        edge_vocab=GENERATED_BOND_VOCAB)
