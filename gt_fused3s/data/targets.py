"""Generated, learnable training tasks on any graph structure: the structure
files of ``shared/data`` and the synthetic generators have no labels, so the
training harness makes a task from the structure itself.

* Node features: a fixed random vector per *degree bucket* (in-degree exact
  below 8, then one bucket per power of two: :func:`degree_bucket`), the
  same table for every batch, so the degree is all a node knows of itself.
* Graph target (collections, pooled readout): per graph, mean degree / 4 +
  the fraction of degree-1 nodes. Both terms are means over a graph's nodes
  of a function of the node's own bucket, so a mean-pooled model can fit it.
* Node target (one large graph): the mean of ``log2(1 + degree)`` over a
  node's in-neighbours (0 for a node without any): exactly what an attention
  that spreads its weight evenly computes from the features, so the
  attention itself must learn it.

Targets are standardised over all batches of a run (mean 0, std 1), so an
MSE loss starts near 1 whatever the graphs; the statistics come from the
batches given, so a run's batches define its scale.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch_geometric.data import Data

from .base import make_data, random_features

#: buckets of :func:`degree_bucket`: 0..7 exact, then 8-15, 16-31, ... up to 2^13+
NUM_BUCKETS = 16
#: ``random_features`` stream of the bucket table (apart from every batch's stream)
_TABLE_STREAM = 2**31 - 1
#: the generated target of each level, in words (for logs and tables)
STRUCTURAL_TARGETS = {"graph": "mean degree / 4 + fraction of degree-1 nodes of each graph",
                      "node": "mean log2(1 + degree) of each node's in-neighbours"}


def in_degree(data: Data) -> Tensor:
    """int64 [N] number of edges into each node."""
    return torch.bincount(data.edge_index[1], minlength=data.num_nodes)


def degree_bucket(degree: Tensor) -> Tensor:
    """int64 bucket of each degree: the degree itself below 8, then
    ``5 + floor(log2(d))`` (8-15 -> 8, 16-31 -> 9, ...), clipped to
    ``NUM_BUCKETS - 1``. Small degrees (molecules) stay distinct; large ones
    (power-law hubs) share a bucket per octave."""
    d = degree.long()
    octave = 5 + torch.log2(d.clamp_min(1).double()).floor().long()
    return torch.where(d < 8, d, octave).clamp_max(NUM_BUCKETS - 1)


def bucket_table(num_features: int, seed: int = 0) -> Tensor:
    """float32 [NUM_BUCKETS, num_features]: the fixed feature vector of each
    degree bucket, drawn on the CPU so that every device sees the same one."""
    return random_features(NUM_BUCKETS, num_features, seed=seed, stream=_TABLE_STREAM)


def graph_target(data: Data, degree: Tensor) -> Tensor:
    """float32 [G]: mean degree / 4 + fraction of degree-1 nodes, per graph
    of the batch ``data`` (``ptr``, ``batch``)."""
    G = data.ptr.numel() - 1
    nodes = (data.ptr[1:] - data.ptr[:-1]).clamp_min(1).float()

    def per_graph(values: Tensor) -> Tensor:
        return torch.zeros(G, device=values.device).index_add_(0, data.batch, values.float())

    return (per_graph(degree) / 4 + per_graph(degree == 1)) / nodes


def node_target(data: Data, degree: Tensor) -> Tensor:
    """float32 [N]: mean of ``log2(1 + degree)`` over each node's in-neighbours."""
    src, dst = data.edge_index
    value = torch.log2(1 + degree.float())
    total = torch.zeros(data.num_nodes, device=value.device).index_add_(0, dst, value[src])
    return total / degree.clamp_min(1).float()


def structural_task(batches: list[Data], level: str, num_features: int,
                    seed: int = 0) -> list[Data]:
    """``batches`` with features and targets made from their structure (see
    the module docstring): ``x`` float32 [N, num_features] from the degree
    buckets, ``y`` float32 [G, 1] (``level="graph"``) or [N, 1] (``"node"``),
    standardised over all the batches."""
    if level not in ("graph", "node"):
        raise ValueError(f"level must be 'graph' or 'node' (got {level!r})")
    table = bucket_table(num_features, seed)
    out = []
    for b in batches:
        degree = in_degree(b)
        target = graph_target(b, degree) if level == "graph" else node_target(b, degree)
        x = table.to(degree.device)[degree_bucket(degree)]
        out.append(make_data(x, b.edge_index, b.num_nodes, ptr=b.get("ptr"),
                             y=target.unsqueeze(-1), edge_attr=b.get("edge_attr")))
    return standardise_targets(out)


def standardise_targets(batches: list[Data]) -> list[Data]:
    """Shift and scale every batch's ``y`` (in place) by the mean and std of
    all of them; a constant target is only centred."""
    y = torch.cat([b.y.float() for b in batches])
    mean, std = y.mean(), y.std() if y.numel() > 1 else torch.ones((), device=y.device)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    for b in batches:
        b.y = (b.y - mean) / std
    return batches
