"""The 8-row window format (gt_fused3s/graph8.py): it decodes back to the
edges it was built from (duplicates included) and to what the 16-row BSB
decodes to, its counts equal format_stats("8x16"), and its bitmap has the
transposed layout the swapped mma reads."""
import pytest
import torch

from graph_cases import GRAPH_CASES
from gt_fused3s.graph import BSBGraph, block_bits, format_stats
from gt_fused3s.graph8 import BSBGraph8


def _sorted_edges(ei: torch.Tensor, n: int) -> torch.Tensor:
    order = torch.argsort(ei[1] * max(n, 1) + ei[0], stable=True)
    return ei[:, order]


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_decodes_to_the_edges_and_to_the_16_row_format(case):
    ei, n = GRAPH_CASES[case]()
    g8 = BSBGraph8.from_edge_index(ei, n)
    want = _sorted_edges(ei, n)
    assert torch.equal(g8.decode_edges(), want)
    assert torch.equal(g8.decode_edges(), BSBGraph.from_edge_index(ei, n).decode_edges())
    assert torch.equal(_sorted_edges(g8.edge_index, n), want)
    assert int(g8.tcb_nnz().sum()) == ei.size(1)


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_counts_equal_format_stats(case):
    ei, n = GRAPH_CASES[case]()
    got = BSBGraph8.from_edge_index(ei, n).stats(64)
    want = format_stats(ei, n, "8x16", 64)
    assert (got["num_windows"], got["num_tcbs"], got["kv_rows"], got["mma_fwd"]) == \
        (want["num_windows"], want["num_blocks"], want["kv_rows"], want["mma_fwd"])


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_edge_slots_name_each_non_zero_s_edge(case):
    ei, n = GRAPH_CASES[case]()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(0))
    ei = ei[:, perm]                                # any caller order
    g = BSBGraph8.from_edge_index(ei, n)
    nnz_offset, slot_edge = g.edge_slots(ei)
    assert torch.equal(torch.sort(slot_edge.long()).values, torch.arange(ei.size(1)))
    assert torch.equal(nnz_offset[1:] - nnz_offset[:-1], g.tcb_nnz().int())
    # the non-zeros in the format's order (block, word, bit ascending), decoded
    win, t, word, b = block_bits(g.rw_offset, g.bitmap)
    rows = win * 8 + (b & 7)
    srcs = g.cols.long()[t * 16 + word * 8 + (b >> 3)]
    assert torch.equal(ei[:, slot_edge.long()], torch.stack([srcs, rows]))


def test_layout_by_hand():
    # window 0 (rows 0..7): sources 3 (row 0), 5 (rows 0, 7; 5 -> 7 twice: a
    # column of its own for the copy); window 1 (rows 8..15): sources 0..9 to
    # row 9, so column 9 lies in word 1
    src = [3, 5, 5, 5] + list(range(10))
    dst = [0, 0, 7, 7] + [9] * 10
    g = BSBGraph8.from_edge_index(torch.tensor([src, dst]), 16)
    assert g.rw_offset.tolist() == [0, 1, 2]
    assert g.cols[:16].tolist() == [3, 5, 5] + [-1] * 13
    assert g.cols[16:].tolist() == list(range(10)) + [-1] * 6
    bits = lambda *b: sum(1 << x for x in b)   # noqa: E731
    # bit (c % 8) * 8 + row of word c // 8
    assert g.bitmap[0].tolist() == [bits(0 * 8 + 0, 1 * 8 + 0, 1 * 8 + 7, 2 * 8 + 7), 0]
    row = 9 - 8
    assert g.bitmap[1, 0].item() == bits(*(c * 8 + row for c in range(8)))
    assert g.bitmap[1, 1].item() == bits(0 * 8 + row, 1 * 8 + row)
    assert g.window_order.tolist() == [0, 1]


def test_lane_bits_match_the_swapped_accumulator():
    # S^T [16 columns, 8 rows] of m16n8k16: lane L holds column L // 4 (and
    # L // 4 + 8) at rows 2 (L % 4), 2 (L % 4) + 1: bits 2L, 2L + 1 of words
    # 0 (and 1), the BSB's lane bits
    for lane in range(32):
        c, r = lane // 4, 2 * (lane % 4)
        assert (c % 8) * 8 + r == 2 * lane and (c % 8) * 8 + r + 1 == 2 * lane + 1


def test_window_order_and_bad_input():
    ei, n = GRAPH_CASES["heavy_node"]()
    g = BSBGraph8.from_edge_index(ei, n)
    counts = (g.rw_offset[1:] - g.rw_offset[:-1])[g.window_order.long()]
    assert bool((counts[:-1] >= counts[1:]).all())
    with pytest.raises(ValueError):
        BSBGraph8.from_edge_index(torch.tensor([[0, 5], [1, 2]]), 4)
    empty = BSBGraph8.from_edge_index(torch.zeros(2, 0, dtype=torch.long), 17)
    assert empty.num_windows == 3 and empty.num_tcbs == 0 and empty.decode_edges().shape == (2, 0)
