"""Static shapes for batches: pad a batch's node, edge and graph counts up to
one of a few sizes (buckets), so that a whole epoch runs on a handful of
captured CUDA graphs (or compiled shapes) instead of one per batch.

A padded batch is the same graph plus what changes nothing for the real
nodes:

* padding nodes (at least one) after the real ones, features 0, in a
  padding graph of their own (the last graph id of the bucket) or, for a
  single graph, simply flagged by ``node_mask``;
* padding edges between padding nodes only (edge ``i`` goes from padding
  node ``i // P`` to padding node ``i % P``, modulo the ``P`` padding
  nodes), so no real node receives or sends anything new;
* padding graphs (empty, except the one holding the padding nodes), so the
  graph count is fixed too;
* ``node_mask`` [N_b] and ``graph_mask`` [G_b] (bool) flag what is real, and
  the targets are padded (NaN for float targets, 0 for integer ones): readout,
  loss and metrics read the real entries only (the training harness masks
  its loss with them).

Attention, feed-forward layers, LayerNorm and a mean readout give the real
nodes and graphs exactly their unpadded results; batch statistics
(``BatchNorm`` in training mode) would see the padding nodes.

Use with PyG (``pad_batch`` on a ``Data``/``Batch`` from the DataLoader) or
with DGL (``pad_dgl``), or on raw tensors (``pad_arrays``)::

    buckets = Buckets.fit([(b.num_nodes, b.num_edges, b.num_graphs) for b in loader])
    for batch in loader:
        padded = buckets.pad_batch(batch)        # shapes from a few buckets only
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor
from torch_geometric.data import Data

from ..graph import _check_edge_index, _check_range


@dataclass(frozen=True, order=True)
class Bucket:
    """One static shape: node, edge and graph counts of a padded batch."""

    num_nodes: int
    num_edges: int
    num_graphs: int

    def fits(self, num_nodes: int, num_edges: int, num_graphs: int) -> bool:
        """Whether a batch of these counts pads into this bucket (a padding
        node is always added, and padding edges need one)."""
        return (self.num_nodes > num_nodes and self.num_edges >= num_edges
                and self.num_graphs >= num_graphs + (1 if num_graphs else 0))


class Buckets:
    """A few buckets and the padding of batches into them.

    Args:
        buckets: the static shapes, tried smallest first; a batch larger than
            all of them gets a bucket of the ``growth`` ladder (see
            :meth:`bucket_of`), so a stream of unknown batches still needs
            only logarithmically many shapes.
        growth: ratio between successive sizes of that ladder.
    """

    def __init__(self, buckets: Iterable[Bucket] = (), growth: float = 1.25):
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1 (got {growth})")
        self.buckets = sorted(buckets)
        self.growth = growth

    @classmethod
    def fit(cls, sizes: Sequence[tuple[int, int, int]], max_buckets: int = 4,
            growth: float = 1.25) -> "Buckets":
        """At most ``max_buckets`` buckets covering batches of the given
        (nodes, edges, graphs) counts: the batches sorted by node count are
        cut into equal groups, and each group's bucket is its largest counts
        (plus one padding node and graph), rounded up to multiples of 16
        nodes and 64 edges."""
        if not sizes:
            raise ValueError("no batch sizes to fit buckets to")
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1 (got {max_buckets})")
        order = sorted(sizes)
        groups = max(1, min(max_buckets, len(order)))
        buckets = set()
        for g in range(groups):
            part = order[g * len(order) // groups:(g + 1) * len(order) // groups]
            if part:
                n = max(s[0] for s in part) + 1
                e = max(s[1] for s in part)
                graphs = max(s[2] for s in part)
                buckets.add(Bucket(_round_up(n, 16), _round_up(e, 64), graphs + 1 if graphs else 0))
        # a bucket must also fit every smaller group: graphs and edges are per group maxima
        return cls(_monotone(sorted(buckets)), growth)

    def bucket_of(self, num_nodes: int, num_edges: int, num_graphs: int = 0) -> Bucket:
        """The smallest bucket a batch fits, or (past the largest) the next
        sizes of the ``growth`` ladder (powers of ``growth`` times 16 nodes
        and 64 edges)."""
        for b in self.buckets:
            if b.fits(num_nodes, num_edges, num_graphs):
                return b
        return Bucket(_ladder(num_nodes + 1, 16, self.growth), _ladder(num_edges, 64, self.growth),
                      _ladder(num_graphs + 1, 1, self.growth) if num_graphs else 0)

    def pad_batch(self, data: Data, bucket: Bucket | None = None) -> Data:
        """``data`` (a PyG ``Data``/``Batch``: ``x``, ``edge_index``, optional
        ``batch``/``ptr``, ``y`` and ``edge_attr``) padded to its bucket, as a
        new ``Data`` with ``node_mask``, ``graph_mask`` (collections) and
        ``bucket``."""
        graphs = data.ptr.numel() - 1 if "ptr" in data else 0
        bucket = bucket or self.bucket_of(data.num_nodes, data.edge_index.size(1), graphs)
        batch = data.batch if graphs else None
        y = getattr(data, "y", None)
        x, edge_index, batch, y, node_mask, graph_mask = pad_arrays(
            data.x, data.edge_index, bucket, batch=batch, num_graphs=graphs, y=y,
            y_per_graph=bool(graphs) and y is not None and y.size(0) == graphs)
        out = Data(x=x, edge_index=edge_index, num_nodes=bucket.num_nodes, node_mask=node_mask)
        edge_attr = getattr(data, "edge_attr", None)
        if edge_attr is not None:        # padding edges get type 0 (they join padding nodes only)
            pad = edge_attr.new_zeros((bucket.num_edges - edge_attr.size(0), *edge_attr.shape[1:]))
            out.edge_attr = torch.cat([edge_attr, pad])
        if graphs:
            out.batch = batch
            out.graph_mask = graph_mask
            out.ptr = _ptr_of(batch, bucket.num_graphs)
        if y is not None:
            out.y = y
        out.bucket = bucket
        return out

    def pad_dgl(self, graph, feat: Tensor, bucket: Bucket | None = None):
        """A DGL (batched) graph and its node features padded to a bucket:
        ``(padded_graph, padded_feat, node_mask)``. The padded graph is a new
        graph with the padding nodes and edges added (``dgl.add_nodes``,
        ``dgl.add_edges``); graph ids are not kept (a DGL batch's readout
        uses ``node_mask``)."""
        import dgl
        n, e = graph.num_nodes(), graph.num_edges()
        bucket = bucket or self.bucket_of(n, e, 0)
        src, dst = graph.edges()
        x, edge_index, _, _, node_mask, _ = pad_arrays(feat, torch.stack([src, dst]).to(feat.device),
                                                       bucket)
        g = dgl.graph((edge_index[0].to(graph.device), edge_index[1].to(graph.device)),
                      num_nodes=bucket.num_nodes)
        return g, x, node_mask

    def __repr__(self) -> str:
        return f"Buckets({self.buckets}, growth={self.growth})"


def pad_arrays(x: Tensor, edge_index: Tensor, bucket: Bucket, *, batch: Tensor | None = None,
               num_graphs: int = 0, y: Tensor | None = None, y_per_graph: bool = False):
    """The tensors of a batch padded to ``bucket``: ``(x, edge_index, batch,
    y, node_mask, graph_mask)`` (``batch``/``graph_mask`` None without
    graphs, ``y`` None without targets). The indices are checked here, on the
    batch's device before it moves (a captured build cannot raise)."""
    _check_edge_index(edge_index)
    N, E = x.size(0), edge_index.size(1)
    if not bucket.fits(N, E, num_graphs):
        raise ValueError(f"a batch of {N} nodes, {E} edges and {num_graphs} graphs does not fit "
                         f"{bucket} (it needs more nodes than the batch, at least as many edges "
                         f"and, for graphs, one more graph)")
    _check_range("edge_index", edge_index, 0, N)
    dev = x.device
    P = bucket.num_nodes - N                       # >= 1 padding nodes
    x_p = torch.cat([x, x.new_zeros((P,) + tuple(x.shape[1:]))])
    i = torch.arange(bucket.num_edges - E, device=dev)
    pad_edges = torch.stack([N + (i // P) % P, N + i % P])
    edge_p = torch.cat([edge_index.to(dev), pad_edges.to(edge_index.dtype)], 1)
    node_mask = torch.arange(bucket.num_nodes, device=dev) < N
    batch_p = graph_mask = None
    if num_graphs:
        if batch is None:
            raise ValueError("a collection needs its batch vector")
        batch_p = torch.cat([batch, batch.new_full((P,), bucket.num_graphs - 1)])
        graph_mask = torch.arange(bucket.num_graphs, device=dev) < num_graphs
    if y is not None:
        rows = (bucket.num_graphs if y_per_graph else bucket.num_nodes) - y.size(0)
        fill = float("nan") if y.is_floating_point() else 0
        y = torch.cat([y, y.new_full((rows,) + tuple(y.shape[1:]), fill)])
    return x_p, edge_p, batch_p, y, node_mask, graph_mask


def _ptr_of(batch: Tensor, num_graphs: int) -> Tensor:
    counts = torch.bincount(batch, minlength=num_graphs)
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _ladder(x: int, base: int, growth: float) -> int:
    """The smallest ``base * growth**k`` (rounded up to a multiple of ``base``)
    that is at least ``x``."""
    if x <= base:
        return base
    k = math.ceil(math.log(x / base) / math.log(growth) - 1e-9)
    return max(_round_up(math.ceil(base * growth ** k), base), _round_up(x, base))


def _monotone(buckets: list[Bucket]) -> list[Bucket]:
    """Buckets sorted by nodes whose edge and graph counts never decrease, so
    the first bucket with room for a batch's nodes has room for the rest."""
    out, e, g = [], 0, 0
    for b in buckets:
        e, g = max(e, b.num_edges), max(g, b.num_graphs)
        out.append(Bucket(b.num_nodes, e, g))
    return out
