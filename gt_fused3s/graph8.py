"""The 8-row window format (FlashSparse's swap-and-transpose, issue 13): the
builder half of the 8-row kernel variant (``csrc/kernels/rows8_params.h``;
a plan built with ``window_rows=8`` runs on it).

The BSB format (:mod:`gt_fused3s.graph`) puts a window's 16 rows on the mma's
m = 16 side, so a window whose rows have few common sources fills its 16 x 8
blocks sparsely. Computing the transposed products instead, S^T = K Q^T and
O^T = V^T P^T, puts the rows on the n = 8 side: windows of 8 rows, blocks of
8 rows x 16 columns, 40-48% fewer mma invocations on molecule batches
(``docs/reorder_stats_cpu_53d19b0.csv``, :func:`~gt_fused3s.graph.format_stats`).

Layout, for a graph of ``N`` nodes (the BSB's, with 8 rows and 16 columns)::

    R = ceil(N / 8) row windows; window r holds rows 8r .. 8r+7; its columns
    are the pairs (source j, copy c) some row has more than c edges from,
    ascending, cut into blocks (TCB) of 16 columns. T = number of TCBs.

    rw_offset     int32 [R + 1]   window r owns TCBs rw_offset[r] .. rw_offset[r+1]-1;
                                  TCB rw_offset[r] + i holds columns 16i .. 16i+15
    cols          int32 [T * 16]  global source id of each column, -1 = padding
    bitmap        int64 [T, 2]    for column c (0..15) and row rr = row - 8r (0..7)
                                  the edge bit is bit (c % 8) * 8 + rr of word c // 8
    window_order  int32 [R]       windows by decreasing TCB count (stable)
    edge_index    int64 [2, E]    every edge, duplicates included, sorted by
                                  (window, source, row)

The bitmap is the transpose of a BSB block's: the swapped mma's accumulator
S^T [16 columns, 8 rows] gives lane ``L`` columns ``L // 4`` and ``L // 4 + 8``
and rows ``2 (L % 4)``, ``+1``: bits ``2L``, ``2L + 1`` of words 0 and 1, as
in the BSB, so the kernels' bitmap decoding serves both formats.
Built on the input's device with vectorised ops (one sort and scatters), in
exact mode (T read back once) or in static mode (no host synchronisation,
cols / bitmap at a capacity from the edge and node counts); no CUDA builder.

The kernels run a window's blocks in one warp (no split of long windows, as
the 16-row format's schedule does): :meth:`BSBGraph8.max_window_blocks`
tells how long the longest window is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .graph import (WindowFormat, _check_edge_index, _check_range, _num_nodes_of, block_bits, nnz_slots,
                    pack_blocks, window_ranks)

ROWS_PER_WINDOW = 8
COLS_PER_TCB = 16


def block_capacity8(num_edges: int, num_nodes: int) -> int:
    """Blocks a static 8-row build allocates: at least the blocks of any
    graph of these counts (a window of e edges has at most e columns, so at
    most e / 16 + 1 blocks, and only windows with edges have blocks)."""
    windows = (num_nodes + ROWS_PER_WINDOW - 1) // ROWS_PER_WINDOW
    return num_edges // COLS_PER_TCB + min(windows, num_edges) + 1


@dataclass(eq=False)
class BSBGraph8(WindowFormat):
    """A graph in the 8-row layout of this module's docstring
    (:meth:`from_edge_index`)."""

    #: built without host synchronisation, cols / bitmap at capacity (:func:`block_capacity8`)
    static: bool = False
    format_name = "8-row format"

    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int | None = None, *,
                        static: bool = False) -> "BSBGraph8":
        """Build from ``edge_index`` [2, E] (row 0 sources, row 1
        destinations); ``num_nodes`` defaults to ``edge_index.max() + 1``.
        ``static``: no host synchronisation (``num_nodes`` required; the
        indices checked on the device, an out-of-range one stops the process
        with a device-side assertion), ``cols`` and ``bitmap`` at
        :func:`block_capacity8` blocks, so that the build can be captured in
        a CUDA graph; the kernels read only the blocks the windows list."""
        edge_index = _check_edge_index(edge_index)
        N = _num_nodes_of(edge_index, num_nodes, static)
        if not static:
            _check_range("edge_index", edge_index, 0, N)
        elif edge_index.numel():
            torch._assert_async(((edge_index >= 0) & (edge_index < N)).all(),
                                "gt_fused3s: edge_index has an index outside [0, num_nodes)")
        _, win, src, row_in, rank, cols_per_win = window_ranks(
            edge_index[0].long(), edge_index[1].long(), N, ROWS_PER_WINDOW)
        # column c, row rr of a block: bit (c % 8) * 8 + rr of word c // 8
        rw_offset, cols, bitmap, window_order, _ = pack_blocks(
            win, src, rank, cols_per_win, COLS_PER_TCB, lambda c: (c >> 3, ((c & 7) << 3) | row_in),
            capacity=block_capacity8(edge_index.size(1), N) if static else None)
        return cls(num_nodes=N, rw_offset=rw_offset, cols=cols, bitmap=bitmap, window_order=window_order,
                   edge_index=torch.stack([src, win * ROWS_PER_WINDOW + row_in]), static=static)

    @property
    def num_tcbs(self) -> int:
        """Blocks in use (static mode: read back from the device, a host synchronisation)."""
        return int(self.rw_offset[-1]) if self.static else self.bitmap.size(0)

    def _used_bitmap(self) -> Tensor:
        return self.bitmap[:self.num_tcbs] if self.static else self.bitmap

    def window_items(self) -> Tensor:
        """int32 [R, 4]: per window, heaviest first (``window_order``),
        (window, its first block, one past its last block, 0): what the
        8-row kernels read per warp, in one 16-byte load. Built once."""
        if getattr(self, "_window_items", None) is None:
            wo = self.window_order.long()
            rw = self.rw_offset
            self._window_items = torch.stack([wo.int(), rw[wo], rw[wo + 1], torch.zeros_like(rw[wo])], 1).int()
        return self._window_items

    def max_window_blocks(self) -> int:
        """The most blocks of one window (a host synchronisation, once): the
        length of the longest warp's walk in the 8-row kernels."""
        if getattr(self, "_max_blocks", None) is None:
            self._max_blocks = int((self.rw_offset[1:] - self.rw_offset[:-1]).max()) if self.num_windows else 0
        return self._max_blocks

    def to(self, device: torch.device | str) -> "BSBGraph8":
        """A copy on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return BSBGraph8(self.num_nodes, self.rw_offset.to(device), self.cols.to(device), self.bitmap.to(device),
                         self.window_order.to(device), self.edge_index.to(device), self.static)

    def stats(self, head_dim: int = 128) -> dict:
        """Blocks and the work of one forward per head of dimension D, read
        from the built arrays (the counts :func:`~gt_fused3s.graph.format_stats`
        predicts for ``"8x16"`` from the edges): ``num_windows``,
        ``num_tcbs``, ``nnz_per_tcb_mean``, ``kv_rows`` (K and V rows
        gathered) and ``mma_fwd`` = T * D / 8 (SDDMM S^T = K Q^T and SpMM
        O^T = V^T P^T, D / 16 m16n8k16 each per block)."""
        T = self.num_tcbs
        return {
            "num_windows": self.num_windows,
            "num_tcbs": T,
            "nnz_per_tcb_mean": self.num_edges / T if T else 0.0,
            "kv_rows": int((self.cols >= 0).sum()),
            "mma_fwd": T * (head_dim // 8),
        }

    def edge_slots(self, edge_index: Tensor) -> tuple[Tensor, Tensor]:
        """Where the edges of ``edge_index`` (the graph this format was built
        from, in any order) sit in its non-zero order (blocks in order, word
        0 then word 1, bits ascending): ``nnz_offset`` int32 [T + 1] and
        ``slot_edge`` int32 [E], the caller's edge id of each non-zero, as
        :func:`~gt_fused3s.graph.edge_slots` gives them for the BSB (what the
        kernels' per-edge terms read). Copies of one edge take its columns in
        the order they are listed."""
        edge_index = _check_edge_index(edge_index)
        if edge_index.size(1) != self.num_edges:
            raise ValueError(f"edge_index has {edge_index.size(1)} edges but the format was built "
                             f"from {self.num_edges}")
        order, win, _, row_in, rank, _ = window_ranks(
            edge_index[0].long(), edge_index[1].long(), self.num_nodes, ROWS_PER_WINDOW)
        tcb = self.rw_offset.long()[win] + torch.div(rank, COLS_PER_TCB, rounding_mode="floor")
        col_in = rank % COLS_PER_TCB
        return nnz_slots(self._used_bitmap(), tcb, col_in >> 3, ((col_in & 7) << 3) | row_in, order)[:2]

    def decode_edges(self) -> Tensor:
        """Edges [2, E] (source, destination), duplicates included, read back
        from ``cols`` and ``bitmap`` alone, sorted by (destination, source):
        the inverse of the builder, for tests."""
        win, t, word, b = block_bits(self.rw_offset, self._used_bitmap())
        col_in = word * 8 + (b >> 3)
        rows = win * ROWS_PER_WINDOW + (b & 7)
        srcs = self.cols.long()[t * COLS_PER_TCB + col_in]
        order = torch.argsort(rows * max(self.num_nodes, 1) + srcs, stable=True)
        return torch.stack([srcs[order], rows[order]])

    def __repr__(self) -> str:
        return (f"BSBGraph8(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"num_windows={self.num_windows}, num_tcbs={self.num_tcbs}, device={self.bitmap.device})")
