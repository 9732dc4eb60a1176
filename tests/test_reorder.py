"""Locality reordering (gt_fused3s.reorder), on the CPU (issue 13)."""
import math

import pytest
import torch

from graph_cases import GRAPH_CASES
from gt_fused3s.graph import BSBGraph
from gt_fused3s.reference import attention_reference
from gt_fused3s.reorder import (METHODS, NodeOrder, connected_components, invert, reorder)

ORDERS = [m for m in METHODS if m != "identity"]


def _components_graph() -> tuple[torch.Tensor, int]:
    """Several components: a shuffled path, a triangle, two isolated nodes,
    a star with a duplicate edge and a self loop, labels interleaved."""
    n = 30
    g = torch.Generator().manual_seed(7)
    lab = torch.randperm(n, generator=g)
    path = lab[:12]
    tri = lab[12:15]
    star = lab[15:28]                       # lab[28], lab[29] isolated
    src = torch.cat([path[:-1], tri, star[1:], star[1:2], star[:1]])
    dst = torch.cat([path[1:], tri.roll(1), star[:1].expand(12), star[:1], star[:1]])
    return torch.stack([src, dst]), n


CASES = dict(GRAPH_CASES)
CASES["components"] = _components_graph
CASES["empty_graph"] = lambda: (torch.zeros(2, 0, dtype=torch.long), 0)


def _keys(ei: torch.Tensor, n: int) -> torch.Tensor:
    return torch.sort(ei[1].long() * max(n, 1) + ei[0].long()).values


# ------------------------------------------------------------ permutations
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_order_is_a_permutation_and_restores(case, method):
    ei, n = CASES[case]()
    o = reorder(ei, n, method)
    assert o.perm.dtype == o.inv.dtype == torch.long
    assert torch.equal(torch.sort(o.perm).values, torch.arange(n))
    assert torch.equal(o.inv[o.perm], torch.arange(n))
    assert torch.equal(o.perm[o.inv], torch.arange(n))
    # relabelled edges: same edges, same order, under the permutation
    e2 = o.relabel(ei)
    assert e2.dtype == ei.dtype and e2.shape == ei.shape
    assert torch.equal(o.perm[e2], ei)
    assert torch.equal(_keys(o.perm[e2], n), _keys(ei, n))          # the multiset
    # rows out and back: exactly the caller's rows
    x = torch.randn(n, 3, 5, dtype=torch.float64)
    assert torch.equal(o.unrows(o.rows(x)), x)
    assert torch.equal(o.rows(x)[o.inv], x)


def test_int32_edge_index_and_invert():
    ei, n = GRAPH_CASES["random_1003"]()
    o64 = reorder(ei, n, "cuthill_mckee")
    o32 = reorder(ei.int(), n, "cuthill_mckee")
    assert torch.equal(o32.perm, o64.perm)
    assert o32.relabel(ei.int()).dtype == torch.int32
    p = torch.randperm(50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(invert(p)[p], torch.arange(50))
    with pytest.raises(ValueError, match="method"):
        reorder(ei, n, "metis")
    with pytest.raises(ValueError, match="edge_index"):
        reorder(ei[0], n)


@pytest.mark.parametrize("method", ORDERS)
@pytest.mark.parametrize("case", ["random_1003", "duplicates", "components", "self_loops"])
def test_attention_in_the_callers_order(case, method):
    """Attention on the reordered graph, unpermuted, equals attention on the
    caller's graph (duplicates and self loops are their own terms)."""
    ei, n = CASES[case]()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    o = reorder(ei, n, method)
    want = attention_reference(q, k, v, ei, compute_dtype=torch.float64)
    got = o.unrows(attention_reference(o.rows(q), o.rows(k), o.rows(v), o.relabel(ei),
                                       compute_dtype=torch.float64))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_connected_components():
    ei, n = _components_graph()
    comp = connected_components(ei, n)
    lab = torch.randperm(n, generator=torch.Generator().manual_seed(7))
    for nodes in (lab[:12], lab[12:15], lab[15:28], lab[28:29], lab[29:30]):
        assert bool((comp[nodes] == nodes.min()).all())
    assert int((comp == torch.arange(n)).sum()) == 5


@pytest.mark.parametrize("method", ORDERS)
def test_components_stay_contiguous_in_order(method):
    """Batched graphs (block-diagonal) stay block-diagonal: the nodes of each
    component take a contiguous range, components in their first node's order."""
    ei, n = _components_graph()
    comp = connected_components(ei, n)
    o = reorder(ei, n, method)
    c = comp[o.perm]                                   # component of each new position
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = c[1:] != c[:-1]
    assert int(starts.sum()) == int(torch.unique(comp).numel())   # one run per component
    assert bool((c[1:] >= c[:-1]).all())                           # in order of their minimum


@pytest.mark.parametrize("method", ORDERS)
def test_molecule_batch_stays_block_diagonal(method):
    from graph_cases import molecule_batches
    d = molecule_batches(1, 64, 4)[0]
    n = int(d.num_nodes)
    o = reorder(d.edge_index, n, method)
    assert bool((d.batch[o.perm][1:] >= d.batch[o.perm][:-1]).all())
    assert torch.equal(torch.sort(o.perm).values, torch.arange(n))


def test_cuthill_mckee_finds_a_shuffled_path():
    """A path with shuffled labels: the BFS order from an end walks it, so
    every edge joins consecutive positions (bandwidth 1)."""
    n = 200
    lab = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    ei = torch.stack([lab[:-1], lab[1:]])
    e2 = reorder(ei, n, "cuthill_mckee").relabel(ei)
    assert int((e2[0] - e2[1]).abs().max()) == 1
    # and it packs the BSB: a full window sees 17 or 18 columns (3 TCBs),
    # the last one (rows 192..199) 9 columns (2 TCBs)
    before = BSBGraph.from_edge_index(torch.cat([ei, ei.flip(0)], 1), n).num_tcbs
    after = BSBGraph.from_edge_index(torch.cat([e2, e2.flip(0)], 1), n).num_tcbs
    assert after == (math.ceil(n / 16) - 1) * 3 + 2 < before


@pytest.mark.parametrize("case", ["random_1003", "components", "heavy_node", "duplicates"])
def test_cuthill_mckee_property(case):
    """The Cuthill-McKee rule: a node comes after every node whose earliest
    neighbour comes before its own earliest neighbour (the position of the
    earliest neighbour never decreases along the order, roots apart), ties
    by increasing degree (undirected, simple graph)."""
    ei, n = CASES[case]()
    e2 = reorder(ei, n, "cuthill_mckee").relabel(ei)
    a, b = torch.cat([e2[0], e2[1]]), torch.cat([e2[1], e2[0]])
    keep = a != b
    key = torch.unique(a[keep] * n + b[keep])
    u, w = key // n, key % n
    deg = torch.bincount(u, minlength=n)
    first = torch.full((n,), n).scatter_reduce(0, u, w, reduce="amin")
    child = first < torch.arange(n)                    # not a root, not isolated
    f, d = first[child], deg[child]
    assert bool((f[1:] >= f[:-1]).all())
    same = f[1:] == f[:-1]
    assert bool((d[1:][same] >= d[:-1][same]).all())


def test_label_propagation_finds_two_cliques():
    """Two cliques of 16 joined by one edge, labels interleaved: each clique
    ends up in (almost) one window."""
    n = 32
    lab = torch.randperm(n, generator=torch.Generator().manual_seed(2))
    a, b = lab[:16], lab[16:]
    ia, ja = torch.meshgrid(a, a, indexing="ij")
    ib, jb = torch.meshgrid(b, b, indexing="ij")
    ei = torch.cat([torch.stack([ia.reshape(-1), ja.reshape(-1)]),
                    torch.stack([ib.reshape(-1), jb.reshape(-1)]),
                    torch.stack([a[:1], b[:1]])], 1)
    o = reorder(ei, n, "label_propagation")
    pos_a = o.inv[a]
    assert int(pos_a.max() - pos_a.min()) <= 16
    before = BSBGraph.from_edge_index(ei, n).num_tcbs
    after = BSBGraph.from_edge_index(o.relabel(ei), n).num_tcbs
    assert before == 8 and after <= 5


@pytest.mark.parametrize("method", ORDERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_bsb_of_reordered_graph_decodes_to_the_same_edges(case, method):
    ei, n = CASES[case]()
    o = reorder(ei, n, method)
    g = BSBGraph.from_edge_index(o.relabel(ei), n)
    dec = g.decode_edges()
    assert torch.equal(_keys(o.perm[dec], n), _keys(ei, n))       # duplicates included


def test_node_order_helpers():
    perm = torch.tensor([2, 0, 1])
    o = NodeOrder(perm, invert(perm), "manual")
    assert o.num_nodes == 3
    x = torch.tensor([[10.], [11.], [12.]])
    assert o.rows(x).flatten().tolist() == [12., 10., 11.]
    assert o.relabel(torch.tensor([[2], [0]])).flatten().tolist() == [0, 1]
