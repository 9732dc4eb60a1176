"""The BSB format: exact arrays on hand-made graphs, round trips on random ones."""
import pytest
import torch

from gt_fused3s.graph import BSBGraph, _popcount64
from gt_fused3s.plan import GraphPlan, cached_plan


def _i64(bits):
    """uint64 with the given bits set, as the int64 the format stores."""
    x = sum(1 << b for b in bits)
    return x - (1 << 64) if x >= 1 << 63 else x


def _dedup_keys(edge_index, n):
    return torch.unique(edge_index[1].long() * n + edge_index[0].long())


def _keys(edge_index, n):
    """Every edge (duplicates included) as a sorted key destination * n + source."""
    return torch.sort(edge_index[1].long() * n + edge_index[0].long()).values


def _random_graph(n, e, seed, self_loops=True):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    if not self_loops:
        ei = ei[:, ei[0] != ei[1]]
    return ei


def test_four_node_graph_exact_arrays():
    # edges j -> i: 0->1, 1->2, 2->3, 3->0 (twice), 0->0
    ei = torch.tensor([[0, 1, 2, 3, 3, 0], [1, 2, 3, 0, 0, 0]])
    g = BSBGraph.from_edge_index(ei, 4)
    assert g.rw_offset.tolist() == [0, 1]
    # the second copy of 3 -> 0 is a column of its own (source 3 again)
    assert g.cols.tolist() == [0, 1, 2, 3, 3, -1, -1, -1]
    # row 0 <- {0, 3, 3}: bits 0, 3, 4; row 1 <- 0: bit 8; row 2 <- 1: bit 17; row 3 <- 2: bit 26
    assert g.bitmap.tolist() == [[_i64([0, 3, 4, 8, 17, 26]), 0]]
    assert g.window_order.tolist() == [0]
    assert g.num_duplicates == 1 and g.num_edges == 6
    assert g.edge_index.tolist() == [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 0, 0]]
    assert all(t.dtype == torch.int32 for t in (g.rw_offset, g.cols, g.window_order))


def test_twenty_node_graph_exact_arrays():
    edges = [(19, 0), (5, 0), (5, 3)]                          # (source, destination)
    edges += [(s, 15) for s in (0, 1, 2, 3, 4, 6, 7, 8, 9)]
    edges += [(17, 17), (0, 19), (0, 19)]                      # self loop, duplicate
    ei = torch.tensor(edges).t()
    g = BSBGraph.from_edge_index(ei, 20)
    # window 0 columns {0..9, 19} -> 2 TCBs; window 1 columns {0, 0 (copy), 17} -> 1 TCB
    assert g.rw_offset.tolist() == [0, 2, 3]
    assert g.cols.tolist() == [0, 1, 2, 3, 4, 5, 6, 7,
                               8, 9, 19, -1, -1, -1, -1, -1,
                               0, 0, 17, -1, -1, -1, -1, -1]
    assert g.bitmap.tolist() == [
        [_i64([5, 29]), _i64([56, 57, 58, 59, 60, 62, 63])],   # rows 0, 3 | row 15
        [_i64([2]), _i64([56, 57])],                            # row 0 <- 19 | row 15 <- 8, 9
        [_i64([10, 24, 25]), 0],                                # row 17 <- 17, row 19 <- 0 twice
    ]
    assert g.window_order.tolist() == [0, 1]
    assert g.num_duplicates == 1
    assert g.tcb_nnz().tolist() == [9, 3, 3]


@pytest.mark.parametrize("n,e,seed", [(1, 1, 0), (15, 40, 1), (16, 200, 2), (17, 60, 3),
                                      (1003, 8000, 4), (333, 50000, 5)])
def test_round_trip_random(n, e, seed):
    ei = _random_graph(n, e, seed)
    g = BSBGraph.from_edge_index(ei, n)
    dec = g.decode_edges()
    assert torch.equal(dec[1] * n + dec[0], _keys(ei, n))           # every copy, once each
    assert torch.equal(_keys(g.edge_index, n), _keys(ei, n))
    assert g.num_edges == e and g.num_duplicates == e - _dedup_keys(ei, n).numel()
    tcbs = g.rw_offset[1:] - g.rw_offset[:-1]
    assert torch.all(tcbs[g.window_order.long()][:-1] >= tcbs[g.window_order.long()][1:])
    # every window's columns are ascending (a source repeats once per extra
    # copy of its most repeated edge), padding only at the end
    for r in range(g.num_windows):
        c = g.cols[g.rw_offset[r] * 8: g.rw_offset[r + 1] * 8]
        real = c[c >= 0]
        assert torch.all(real[1:] >= real[:-1])
        assert torch.all(c[: real.numel()] >= 0) and real.numel() > len(c) - 8


def test_dense_mask_round_trip_with_empty_rows_self_loops_and_heavy_node():
    n = 6000
    heavy = torch.stack([torch.arange(1, 5001), torch.zeros(5000, dtype=torch.long)])
    loops = torch.arange(0, n, 7).repeat(2, 1)
    rest = _random_graph(n, 3000, 7)
    rest = rest[:, rest[1] % 3 != 0]                           # rows 3k (k>0) stay empty
    ei = torch.cat([heavy, loops, rest, rest[:, :100]], 1)     # + duplicates
    g = BSBGraph.from_edge_index(ei, n)
    counts = torch.zeros(n, n, dtype=torch.int32).index_put_((ei[1], ei[0]), torch.ones(ei.size(1), dtype=torch.int32),
                                                             accumulate=True)
    assert torch.equal(g.to_dense_counts(), counts) and counts.max() == 2
    assert torch.equal(g.to_dense_mask(), counts > 0)
    dec = g.decode_edges()
    assert torch.equal(dec[1] * n + dec[0], _keys(ei, n))
    assert g.stats()["tcb_per_rw_max"] >= 5000 // 8
    assert g.window_order[0].item() == 0                       # the heavy window first


def test_batched_graphs_are_block_diagonal():
    from torch_geometric.data import Batch, Data
    graphs = [Data(edge_index=_random_graph(m, 3 * m, m, self_loops=False), num_nodes=m)
              for m in (5, 23, 16, 1, 40)]
    batch = Batch.from_data_list(graphs)
    g = BSBGraph.from_graph(batch)
    assert g.num_nodes == 85
    dec = g.decode_edges()
    assert torch.equal(dec[1] * 85 + dec[0], _keys(batch.edge_index, 85))
    # no edge crosses graphs
    assert torch.equal(batch.batch[dec[0]], batch.batch[dec[1]])


def test_from_csr_equals_from_edge_index():
    n = 77
    ei = _random_graph(n, 500, 11)
    key = _keys(ei, n)                      # duplicates included
    dst, src = key // n, key % n
    indptr = torch.zeros(n + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
    a = BSBGraph.from_csr(indptr, src.int())
    b = BSBGraph.from_edge_index(ei, n)
    for name in ("rw_offset", "cols", "bitmap", "window_order"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_stats_match_definitions():
    g = BSBGraph.from_edge_index(_random_graph(100, 900, 3), 100)
    s = g.stats()
    per_rw = (g.rw_offset[1:] - g.rw_offset[:-1]).double()
    assert s["num_tcbs"] == g.num_tcbs == int(per_rw.sum())
    assert s["tcb_per_rw_mean"] == pytest.approx(per_rw.mean().item())
    assert s["tcb_per_rw_cv"] == pytest.approx((per_rw.std(unbiased=False) / per_rw.mean()).item())
    assert s["nnz_per_tcb_mean"] * s["num_tcbs"] == pytest.approx(s["num_edges"])


def test_popcount_matches_python():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-2**63, 2**63 - 1, (1000,), generator=gen, dtype=torch.long)
    expect = [bin(v & (2**64 - 1)).count("1") for v in x.tolist()]
    assert _popcount64(x).tolist() == expect


def test_empty_graph_and_single_node():
    g = BSBGraph.from_edge_index(torch.zeros(2, 0, dtype=torch.long), 5)
    assert g.num_tcbs == 0 and g.rw_offset.tolist() == [0, 0] and g.num_edges == 0
    g = BSBGraph.from_edge_index(torch.tensor([[0], [0]]), 1)
    assert g.cols.tolist()[:1] == [0] and g.bitmap.tolist() == [[1, 0]]
    g = BSBGraph.from_edge_index(torch.zeros(2, 0, dtype=torch.long), 0)
    assert g.num_windows == 0 and g.num_tcbs == 0


@pytest.mark.parametrize("edge_index,num_nodes,match", [
    (torch.tensor([[0, 5], [1, 2]]), 5, "index 5 out of range for num_nodes=5"),
    (torch.tensor([[0, -1], [1, 2]]), 5, "negative index -1"),
    (torch.tensor([[0.0, 1.0], [1.0, 2.0]]), 5, "edge_index must be int32 or int64"),
    (torch.tensor([[0, 1, 2]]), 5, r"shape \[2, E\]"),
    (torch.tensor([0, 1]), 5, "must be 2-D"),
    ([[0, 1], [1, 0]], 5, "must be a torch.Tensor"),
    (torch.tensor([[0, 1], [1, 0]]), -3, "num_nodes must be a non-negative int"),
    (torch.tensor([[0, 1], [1, 0]]), 2.5, "num_nodes must be a non-negative int"),
])
def test_bad_input_names_the_argument(edge_index, num_nodes, match):
    with pytest.raises(ValueError, match=match):
        BSBGraph.from_edge_index(edge_index, num_nodes)


def test_bad_csr():
    with pytest.raises(ValueError, match="indptr must start at 0 and end at len"):
        BSBGraph.from_csr(torch.tensor([0, 1, 3]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="indices has index 9 out of range"):
        BSBGraph.from_csr(torch.tensor([0, 1, 2]), torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="non-decreasing"):
        BSBGraph.from_csr(torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="graph must be a BSBGraph"):
        BSBGraph.from_graph(object())


def test_cached_plan_reuses_and_rebuilds_on_change():
    ei = _random_graph(50, 200, 0)
    a = cached_plan(ei, 50)
    assert isinstance(a, GraphPlan) and cached_plan(ei, 50) is a
    assert cached_plan(ei.clone(), 50) is not a       # another tensor: another entry
    ei[0, 0] = (ei[0, 0] + 1) % 50                    # in-place edit bumps the version
    assert cached_plan(ei, 50) is not a


def test_plan_transposed_is_the_reversed_graph_and_prepare_is_idempotent():
    ei = torch.cat([_random_graph(70, 400, 2), torch.tensor([[3, 3], [9, 9]])], 1)   # + a duplicate
    plan = GraphPlan.from_edge_index(ei, 70)
    assert plan.transposed is None
    assert plan.prepare(2, 32) is plan and plan.transposed is not None
    t = plan.transposed
    assert plan.prepare(2, 32).transposed is t
    dec = t.decode_edges()
    assert torch.equal(dec[1] * 70 + dec[0], _keys(ei.flip(0), 70))
    assert plan.prepare(1, 16, backward=False).transposed is t


def test_static_build_through_the_op_pads_to_capacity_and_asserts_on_bad_indices(stand_in_kernels):
    """The static mode's contract, through the registered builder op (a CPU
    stand-in here; the CUDA builder is compared on the GPU): arrays at
    capacity, counters on the device of the input, no ValueError for a bad
    index but an asynchronous assertion (raised at once on a CPU)."""
    from gt_fused3s.graph import tcb_capacity
    ei = _random_graph(50, 300, 4)
    exact = BSBGraph.from_edge_index(ei, 50)
    static = BSBGraph.from_edge_index(ei, 50, static=True)
    T = exact.num_tcbs
    assert static.static and static.tcb_capacity == tcb_capacity(300, 50) > T
    assert torch.equal(static.cols[:T * 8], exact.cols) and torch.equal(static.bitmap[:T], exact.bitmap)
    assert static.num_tcbs == T and static.num_duplicates == exact.num_duplicates
    bad = torch.cat([ei, torch.tensor([[50], [0]])], 1)
    with pytest.raises(ValueError, match="index 50 out of range for num_nodes=50"):
        BSBGraph.from_edge_index(bad, 50)
    with pytest.raises(RuntimeError, match="edge_index has an index outside"):
        BSBGraph.from_edge_index(bad, 50, static=True)
