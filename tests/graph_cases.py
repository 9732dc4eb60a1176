"""Named small graphs reused across tests.

``GRAPH_CASES[name]()`` returns ``(edge_index, num_nodes)``: an int64
``[2, E]`` tensor (row 0 = source, row 1 = destination) on the CPU and the
node count. Every case is deterministic. Only ``"duplicates"`` has repeated
edges; every other case is coalesced (sorted by destination, then source).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _coalesce(src: Tensor, dst: Tensor, num_nodes: int) -> Tensor:
    key = torch.unique(dst.long() * max(num_nodes, 1) + src.long())
    return torch.stack([key % max(num_nodes, 1), key // max(num_nodes, 1)])


def _random(num_nodes: int, num_edges: int, seed: int, *, num_targets: int | None = None,
            num_sources: int | None = None) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_sources or num_nodes, (num_edges,), generator=g)
    dst = torch.randint(0, num_targets or num_nodes, (num_edges,), generator=g)
    return src, dst


def random_1003() -> tuple[Tensor, int]:
    """N = 1003 (not a multiple of 16), ~4 in-edges a node, a few self loops."""
    n = 1003
    src, dst = _random(n, 4 * n, seed=1)
    return _coalesce(src, dst, n), n


def empty_rows() -> tuple[Tensor, int]:
    """N = 37: only even nodes receive edges, odd rows are empty."""
    n = 37
    src, dst = _random(n, 120, seed=2)
    return _coalesce(src, dst - dst % 2, n), n


def isolated_nodes() -> tuple[Tensor, int]:
    """N = 50: nodes 40..49 have no edge at all (trailing isolated nodes)."""
    n = 50
    src, dst = _random(n, 200, seed=3, num_targets=40, num_sources=40)
    return _coalesce(src, dst, n), n


def self_loops() -> tuple[Tensor, int]:
    """N = 33: a directed ring plus a self loop on every node."""
    n = 33
    i = torch.arange(n)
    return _coalesce(torch.cat([i, i]), torch.cat([(i + 1) % n, i]), n), n


def duplicates() -> tuple[Tensor, int]:
    """N = 20: random edges, several of them repeated (not coalesced)."""
    n = 20
    src, dst = _random(n, 60, seed=4)
    src = torch.cat([src, src[:15], src[:5]])
    dst = torch.cat([dst, dst[:15], dst[:5]])
    return torch.stack([src, dst]), n


def heavy_node() -> tuple[Tensor, int]:
    """N = 2500: node 5 receives an edge from every node; the rest is sparse."""
    n = 2500
    src, dst = _random(n, 2 * n, seed=5)
    src = torch.cat([src, torch.arange(n)])
    dst = torch.cat([dst, torch.full((n,), 5)])
    return _coalesce(src, dst, n), n


def dense_pairs() -> tuple[Tensor, int]:
    """N = 72: nodes 0..31 all connected (self loops too: TCB pairs of 256
    edges), each of 32..47 receives from 3 of 0..15 (pairs of 48), the rest
    sparse: every width of a pair's run of edges (edge_bias.cuh)."""
    n = 72
    full = torch.arange(32)
    src = [full.repeat(32)]
    dst = [full.repeat_interleave(32)]
    rows = torch.arange(32, 48)
    for shift in (0, 5, 11):
        src.append((rows + shift) % 16)
        dst.append(rows)
    s, d = _random(n, 60, seed=6)
    src.append(s)
    dst.append(d.clamp(min=48))
    return _coalesce(torch.cat(src), torch.cat(dst), n), n


def single_node() -> tuple[Tensor, int]:
    """N = 1 with a self loop."""
    return torch.zeros(2, 1, dtype=torch.long), 1


def no_edges() -> tuple[Tensor, int]:
    """N = 17, E = 0: every row is empty."""
    return torch.zeros(2, 0, dtype=torch.long), 17


def split_hubs() -> tuple[Tensor, int]:
    """N = 1003: a node of 600 + 50 in-edges (its window split over chunks in
    the forward and the dQ pass), one of 600 out-edges (split in the dK/dV
    pass), duplicates into the first; random edges around them. Not in
    GRAPH_CASES (the tests of split windows take it by name)."""
    n = 1003
    g = torch.Generator().manual_seed(11)
    a, b = torch.randperm(n, generator=g)[:600], torch.randperm(n, generator=g)[:600]
    src = torch.cat([torch.randint(0, n, (3 * n,), generator=g), a, torch.full_like(b, 29), a[:50]])
    dst = torch.cat([torch.randint(0, n, (3 * n,), generator=g), torch.full_like(a, 17), b, torch.full((50,), 17)])
    return torch.stack([src, dst]), n


GRAPH_CASES: dict[str, Callable[[], tuple[Tensor, int]]] = {
    "random_1003": random_1003,
    "empty_rows": empty_rows,
    "isolated_nodes": isolated_nodes,
    "self_loops": self_loops,
    "duplicates": duplicates,
    "heavy_node": heavy_node,
    "dense_pairs": dense_pairs,
    "single_node": single_node,
    "no_edges": no_edges,
}


def molecule_batches(count: int, batch_size: int, num_features: int, seed: int = 0) -> list:
    """``count`` batches of generated molecules (PyG ``Data`` with ``batch``
    and ``ptr``), each with a seeded random target per graph in ``y``."""
    from gt_fused3s.data import molecules_dataset
    ds = molecules_dataset(num_graphs=count * batch_size, batch_size=batch_size,
                           num_features=num_features, seed=seed)
    out = []
    for i in range(len(ds)):
        d = ds[i]
        d.y = torch.randn(d.ptr.numel() - 1, generator=torch.Generator().manual_seed(i))
        out.append(d)
    return out
