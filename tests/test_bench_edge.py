"""bench_edge's edge orders (gt_fused3s/bench/edge.py: order_edges): the
same edges, duplicates included, in the order asked for."""
from __future__ import annotations

import pytest
import torch

from gt_fused3s.bench.edge import EDGE_ORDERS, order_edges


def _multiset(ei: torch.Tensor) -> list[tuple[int, int]]:
    return sorted(map(tuple, ei.t().tolist()))


def test_orders_keep_the_edges():
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, 30, (2, 200), generator=g)
    ei = torch.cat([ei, ei[:, :10]], 1)                  # duplicates
    for how in EDGE_ORDERS:
        out = order_edges(ei, 30, how, seed=3)
        assert out.shape == ei.shape and _multiset(out) == _multiset(ei)
    assert order_edges(ei, 30, "as-loaded") is ei
    src = order_edges(ei, 30, "source")
    key = src[0] * 30 + src[1]
    assert bool((key[1:] >= key[:-1]).all())             # sorted by (source, destination)
    assert torch.equal(order_edges(ei, 30, "random", seed=3), order_edges(ei, 30, "random", seed=3))
    assert not torch.equal(order_edges(ei, 30, "random", seed=3), ei)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="edge order must be one of"):
        order_edges(torch.zeros(2, 3, dtype=torch.long), 1, "destination")
