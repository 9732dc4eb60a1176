"""Synthetic graphs that need no download: molecule-like batches, batches of
random graphs and power-law graphs. Vectorised torch on the requested
device, seeded; the stand-ins of datasets whose structure is not at hand.

Both return symmetric, deduplicated edge sets with no self loops, sorted by
(destination, source).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import (GENERATED_BOND_VOCAB, GraphDataset, generated_bond_types, make_data, random_features,
                   seeded_generator)


def symmetric_coalesce(src: Tensor, dst: Tensor, num_nodes: int, *,
                       self_loops: bool = False) -> Tensor:
    """Both directions of every pair, duplicates once, self loops dropped
    unless ``self_loops``; int64 [2, E] sorted by (destination, source)."""
    s, d = torch.cat([src, dst]).long(), torch.cat([dst, src]).long()
    if not self_loops:
        keep = s != d
        s, d = s[keep], d[keep]
    key = torch.unique(d * num_nodes + s)
    return torch.stack([key % max(num_nodes, 1), key // max(num_nodes, 1)])


def molecule_batch(num_graphs: int, *, min_nodes: int = 10, max_nodes: int = 40,
                   max_rings: int = 3, isolated_prob: float = 0.1, seed: int = 0,
                   stream: int = 0, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """``num_graphs`` molecule-like graphs as one block-diagonal graph.

    Graph ``g`` has ``n_g`` atoms, uniform in [min_nodes, max_nodes]. Its
    skeleton is a tree: atom ``l`` bonds to atom ``l - 1`` (a chain) or, one
    time in five, to ``l - 2`` or ``l - 3`` (a branch). Up to ``max_rings``
    ring closures bond atoms ``a`` and ``a + 5``. With probability
    ``isolated_prob`` a graph's last one or two atoms have no bond (a
    counter-ion: an isolated node, an empty attention row). Every bond is two
    directed edges.

    Returns:
        edge_index int64 [2, E] with global ids, ptr int64 [num_graphs + 1].
    """
    if num_graphs < 1 or not 2 <= min_nodes <= max_nodes:
        raise ValueError(f"need num_graphs >= 1 and 2 <= min_nodes <= max_nodes "
                         f"(got {num_graphs}, {min_nodes}, {max_nodes})")
    device = torch.device(device)
    g = seeded_generator(seed, device, stream)
    G = num_graphs
    sizes = torch.randint(min_nodes, max_nodes + 1, (G,), generator=g, device=device)
    n_iso = (torch.rand(G, generator=g, device=device) < isolated_prob).long() \
        * torch.randint(1, 3, (G,), generator=g, device=device)
    n_core = torch.maximum(sizes - n_iso, torch.full_like(sizes, 2))  # bonded atoms
    ptr, N, graph = _batch_layout(sizes)

    # Tree bonds: every non-first bonded atom to an earlier one.
    node = torch.arange(N, device=device)
    local = node - ptr[graph]
    child = (local >= 1) & (local < n_core[graph])
    back = torch.where(torch.rand(N, generator=g, device=device) < 0.8, 1,
                       torch.randint(2, 4, (N,), generator=g, device=device))
    parent = node - torch.minimum(back, local)
    # Ring closures a -- a + 5 in graphs with at least 6 bonded atoms.
    rings = torch.randint(0, max_rings + 1, (G,), generator=g, device=device) * (n_core >= 6)
    R = int(rings.sum())
    ring_graph = torch.repeat_interleave(torch.arange(G, device=device), rings, output_size=R)
    a = (torch.rand(R, generator=g, device=device) * (n_core[ring_graph] - 5)).long() \
        + ptr[ring_graph]
    src = torch.cat([node[child], a])
    dst = torch.cat([parent[child], a + 5])
    return symmetric_coalesce(src, dst, N), ptr


def _batch_layout(sizes: Tensor) -> tuple[Tensor, int, Tensor]:
    """Node offsets ``ptr`` [G + 1], the node count N and the graph of each
    node [N] of a batch of graphs with ``sizes`` nodes."""
    ptr = torch.zeros(sizes.numel() + 1, dtype=torch.long, device=sizes.device)
    torch.cumsum(sizes, 0, out=ptr[1:])
    N = int(ptr[-1])
    graph = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes,
                                    output_size=N)
    return ptr, N, graph


def random_graph_batch(num_graphs: int, *, min_nodes: int = 100, max_nodes: int = 500,
                       avg_degree: float = 6.0, seed: int = 0, stream: int = 0,
                       device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """``num_graphs`` random graphs as one block-diagonal graph.

    Graph ``g`` has ``n_g`` nodes, uniform in [min_nodes, max_nodes]; every
    node draws ``avg_degree / 2`` partners (rounded up or down at random, so
    the mean is exact) uniformly from its own graph; both directions of
    every pair are kept, duplicates and self draws dropped, so the mean
    degree is ``avg_degree`` less a little. No locality inside a graph: a
    stand-in for collections whose structure is not shipped (superpixel and
    protein-association graphs), not a model of them.

    Returns:
        edge_index int64 [2, E] with global ids, ptr int64 [num_graphs + 1].
    """
    if num_graphs < 1 or not 2 <= min_nodes <= max_nodes or avg_degree < 0:
        raise ValueError(f"need num_graphs >= 1, 2 <= min_nodes <= max_nodes and avg_degree >= 0 "
                         f"(got {num_graphs}, {min_nodes}, {max_nodes}, {avg_degree})")
    device = torch.device(device)
    g = seeded_generator(seed, device, stream)
    G = num_graphs
    sizes = torch.randint(min_nodes, max_nodes + 1, (G,), generator=g, device=device)
    ptr, N, graph_of_node = _batch_layout(sizes)
    half = avg_degree / 2
    draws = math.floor(half) + (torch.rand(N, generator=g, device=device) < half % 1).long()
    M = int(draws.sum())
    src = torch.repeat_interleave(torch.arange(N, device=device), draws, output_size=M)
    graph = graph_of_node[src]
    dst = ptr[graph] + (torch.rand(M, generator=g, device=device) * sizes[graph]).long()
    return symmetric_coalesce(src, dst, N), ptr


def zipf_weights(num_nodes: int, alpha: float, max_degree: int, *, generator: torch.Generator,
                 device: torch.device | str = "cpu") -> Tensor:
    """float64 [num_nodes] samples of a power law ``P(w >= k) ~ k^-(alpha - 1)``
    (a continuous Zipf / Pareto, by inverse transform), clipped to [1, max_degree]."""
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1 (got {alpha})")
    u = torch.rand(num_nodes, generator=generator, device=device, dtype=torch.float64)
    w = torch.floor(u.clamp_min(1e-300) ** (-1.0 / (alpha - 1.0)))
    return w.clamp(1, max_degree)


def power_law_graph(num_nodes: int, *, avg_degree: float | None = None, alpha: float = 2.2,
                    max_degree: int | None = None, self_loops: bool = False, seed: int = 0,
                    device: torch.device | str = "cpu") -> Tensor:
    """A symmetric graph whose degrees follow a clipped power law.

    Every node gets a target degree ``w`` from :func:`zipf_weights` (if
    ``avg_degree`` is given, the weights are rescaled to that mean and clipped
    again). Node ``i`` then draws ``ceil(w_i / 2)`` partners, each chosen with
    probability proportional to ``w`` (a Chung-Lu graph); both directions of
    every pair are kept, duplicates once. So every node has degree >= 1 and
    degrees are about ``w``: at most ``max_degree`` plus sampling noise, mean
    about ``avg_degree`` (duplicates make it a little lower on dense graphs).
    A draw that hits its own node moves to the next node (no self loops)
    unless ``self_loops``.

    Args:
        num_nodes: N (>= 2).
        avg_degree: target mean degree (directed nnz / N); default: the power
            law's own mean.
        alpha: power-law exponent of the degree distribution (> 1; 2 to 3 for
            social and web graphs).
        max_degree: degree clip, default ``N - 1``.
        self_loops: keep draws of a node's own id as self loops.
        seed: the same seed on the same device gives the same graph.
        device: where the graph is generated.

    Returns:
        int64 [2, E] (source, destination), sorted by (destination, source).
    """
    if num_nodes < 2:
        raise ValueError(f"num_nodes must be >= 2 (got {num_nodes})")
    device = torch.device(device)
    max_degree = num_nodes - 1 if max_degree is None else int(max_degree)
    if max_degree < 1:
        raise ValueError(f"max_degree must be >= 1 (got {max_degree})")
    g = seeded_generator(seed, device)
    w = zipf_weights(num_nodes, alpha, max_degree, generator=g, device=device)
    if avg_degree is not None:
        w = (w * (float(avg_degree) / float(w.mean()))).clamp(1, max_degree)
    stubs = torch.ceil(w / 2).long()
    M = int(stubs.sum())
    src = torch.repeat_interleave(torch.arange(num_nodes, device=device), stubs, output_size=M)
    cdf = torch.cumsum(w, 0)
    draw = torch.rand(M, generator=g, device=device, dtype=torch.float64) * cdf[-1]
    dst = torch.searchsorted(cdf, draw).clamp_max(num_nodes - 1)
    if not self_loops:
        dst = torch.where(dst == src, (dst + 1) % num_nodes, dst)
    return symmetric_coalesce(src, dst, num_nodes, self_loops=self_loops)


# ------------------------------------------------------------------ datasets
def molecules_dataset(name: str = "molecules", *, num_graphs: int = 1024, batch_size: int = 1024,
                      num_features: int = 16, min_nodes: int = 10, max_nodes: int = 40,
                      max_rings: int = 3, isolated_prob: float = 0.1, seed: int = 0,
                      device: torch.device | str = "cpu") -> GraphDataset:
    """``num_graphs`` molecule-like graphs (:func:`molecule_batch`) in batches
    of ``batch_size``, random normal features. Batch ``i`` is generated from
    ``(seed, i)`` when asked for."""
    def batch(count, stream, device):
        return molecule_batch(count, min_nodes=min_nodes, max_nodes=max_nodes,
                              max_rings=max_rings, isolated_prob=isolated_prob, seed=seed,
                              stream=stream, device=device)

    return _collection(name, "synthetic molecules", batch, num_graphs, batch_size, num_features,
                       seed, device)


def random_graphs_dataset(name: str = "random_graphs", *, num_graphs: int = 1024,
                          batch_size: int = 1024, num_features: int = 16, min_nodes: int = 100,
                          max_nodes: int = 500, avg_degree: float = 6.0, seed: int = 0,
                          device: torch.device | str = "cpu") -> GraphDataset:
    """``num_graphs`` :func:`random_graph_batch` graphs in batches of
    ``batch_size``, random normal features."""
    def batch(count, stream, device):
        return random_graph_batch(count, min_nodes=min_nodes, max_nodes=max_nodes,
                                  avg_degree=avg_degree, seed=seed, stream=stream, device=device)

    return _collection(name, "synthetic random graphs", batch, num_graphs, batch_size,
                       num_features, seed, device)


def _collection(name, source, batch, num_graphs, batch_size, num_features, seed, device):
    """A collection whose batch ``i`` is ``batch(count, i, device)`` -> (edge_index,
    ptr), generated from ``(seed, i)`` when asked for."""
    def make(i: int, device: torch.device):
        ei, ptr = batch(min(batch_size, num_graphs - i * batch_size), i, device)
        n = int(ptr[-1])
        x = random_features(n, num_features, seed=seed, stream=i, device=device)
        return make_data(x, ei, n, ptr=ptr, edge_attr=generated_bond_types(ei[0], ei[1]))

    return GraphDataset(name, "graph", num_features, math.ceil(num_graphs / batch_size), make,
                        info={"source": source, "synthetic": True, "num_graphs": num_graphs,
                              "batch_size": batch_size}, device=device, edge_vocab=GENERATED_BOND_VOCAB)


def power_law_dataset(name: str = "powerlaw", *, num_nodes: int = 10_000,
                      avg_degree: float | None = None, alpha: float = 2.2,
                      max_degree: int | None = None, num_features: int = 16,
                      self_loops: bool = False, seed: int = 0,
                      device: torch.device | str = "cpu") -> GraphDataset:
    """One :func:`power_law_graph` with random normal features."""
    def make(i: int, device: torch.device):
        ei = power_law_graph(num_nodes, avg_degree=avg_degree, alpha=alpha,
                             max_degree=max_degree, self_loops=self_loops, seed=seed,
                             device=device)
        return make_data(random_features(num_nodes, num_features, seed=seed, device=device),
                         ei, num_nodes, edge_attr=generated_bond_types(ei[0], ei[1]))

    return GraphDataset(name, "node", num_features, 1, make,
                        info={"source": "synthetic power law", "synthetic": True, "num_graphs": 1,
                              "num_nodes": num_nodes, "alpha": alpha, "max_degree": max_degree},
                        device=device, edge_vocab=GENERATED_BOND_VOCAB)
