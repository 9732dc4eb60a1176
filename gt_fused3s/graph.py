"""The Binary Sparse Block (BSB) format: a graph laid out for tensor cores.

Built once per graph (or per batch of graphs) and reused by every layer and
head. Rows are destination nodes, columns are source nodes (PyG convention:
``edge_index[0]`` = source ``j``, ``edge_index[1]`` = destination ``i``, the
edge ``j -> i`` lets ``i`` attend to ``j``).

Every edge is its own term of the attention: an edge that appears ``m``
times counts ``m`` times, exactly as in PyG's and DGL's message passing. The
format keeps a duplicate in a column of its own (the same source id listed
again), so the kernels need no count per entry.

Layout, for a graph of ``N`` nodes::

    R = ceil(N / 16) row windows (RW); window r holds rows 16r .. 16r+15.
    Within window r, the columns are the pairs (source j, copy c) such that
    some row of the window has more than c edges from j, in ascending order
    of (j, c); they are cut into tensor-core blocks (TCB) of 16 rows x 8
    columns. T = total number of TCBs. Without duplicates, a window's
    columns are simply its distinct sources, ascending.

    rw_offset     int32 [R + 1]  window r owns TCBs rw_offset[r] .. rw_offset[r+1]-1;
                                 TCB rw_offset[r] + i holds columns 8i .. 8i+7
    cols          int32 [T * 8]  cols[t*8 + c] = global source id of column c of TCB t,
                                 or -1 for padding (only in a window's last TCB)
    bitmap        int64 [T, 2]   uint64 bit patterns stored as int64: for row
                                 ``rr = row - 16 r`` (0..15) and column c (0..7) the
                                 edge bit is bit ``(rr % 8) * 8 + c`` of word ``rr // 8``.
                                 Padding columns never have a bit set.
    window_order  int32 [R]      windows sorted by decreasing TCB count (stable),
                                 the order in which the kernel schedules them
    edge_index    int64 [2, E]   every edge (source, destination), duplicates included,
                                 sorted by (window, source, row): for the unfused paths
    counters      int64 [5]      T, distinct edges, smallest and largest index of the
                                 input, largest TCB count of a window

The bit layout matches the m16n8k16 accumulator: lane ``L`` of a warp holds
the scores of row ``L // 4`` (bits ``2L``, ``2L + 1`` of word 0) and row
``L // 4 + 8`` (the same bits of word 1).

**Static mode** (``static=True``, CUDA): the shapes of every array are
functions of ``N`` and ``E`` alone and the build makes no host
synchronisation, so it can run inside a captured CUDA graph or a
``torch.compile`` region: ``cols`` and ``bitmap`` have the capacity
``E // 8 + R + 1`` TCBs (``T`` never exceeds it; the unused tail is
padding: ``cols`` -1, ``bitmap`` 0), ``counters`` stay on the device, and an
out-of-range index stops the process with a device-side assertion instead
of raising ``ValueError``. The kernels read only what ``rw_offset`` points to,
so both modes give the same results.

All arrays are built on the device of the input with vectorised ops (one
sort, scans, scatters), never loops over nodes in Python: on the GPU by the
CUDA builder of ``csrc/kernels/bsb_build.cu``, elsewhere by
:meth:`BSBGraph._build` in PyTorch, which is the specification the GPU
builder must equal exactly.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ROWS_PER_WINDOW = 16
COLS_PER_TCB = 8


def _check_index_tensor(name: str, t: Any, dim: int) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64 (got {t.dtype})")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D (got shape {tuple(t.shape)})")
    return t


def _check_edge_index(edge_index: Any) -> Tensor:
    _check_index_tensor("edge_index", edge_index, 2)
    if edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {tuple(edge_index.shape)})")
    return edge_index


class EdgeIndexError(IndexError, ValueError):
    """An edge index outside [0, num_nodes): an ``IndexError`` as in PyG, and a
    ``ValueError`` as every other bad input of this package."""


def _range_error(name: str, lo: int, hi: int, low: int, high: int) -> EdgeIndexError | None:
    """The error for an index range [lo, hi] outside [low, high), or None."""
    if lo < low:
        return EdgeIndexError(f"{name} has negative index {lo}" if low == 0
                              else f"{name} has index {lo} < {low}")
    if hi >= high:
        return EdgeIndexError(f"{name} has index {hi} out of range for num_nodes={high}"
                              if low == 0 else f"{name} has index {hi} >= {high}")
    return None


def _check_range(name: str, t: Tensor, low: int, high: int) -> None:
    """Raise ValueError naming ``name`` if an entry of ``t`` lies outside [low, high)."""
    if t.numel() == 0:
        return
    lo, hi = torch.stack(list(torch.aminmax(t.reshape(-1)))).tolist()  # one host sync
    err = _range_error(name, lo, hi, low, high)
    if err is not None:
        raise err


def _num_nodes_of(edge_index: Tensor, num_nodes: int | None, static: bool) -> int:
    """``num_nodes`` checked, or ``edge_index.max() + 1`` (a host
    synchronisation, which a static build cannot make: it needs ``num_nodes``)."""
    if num_nodes is None:
        if static:
            raise ValueError("a static build needs num_nodes (edge_index.max() + 1 is a host sync)")
        num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
    return _check_num_nodes(num_nodes)


def _popcount64(x: Tensor) -> Tensor:
    """Bit count of each int64 (read as uint64), with wrap-around int64 arithmetic."""
    m1, m2, m4 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F
    x = x - ((x >> 1) & m1)
    x = (x & m2) + ((x >> 2) & m2)
    x = (x + (x >> 4)) & m4
    return (x * 0x0101010101010101) >> 56


def _cv(x: Tensor) -> float:
    x = x.double()
    if x.numel() == 0 or x.mean() == 0:
        return 0.0
    return float(x.std(unbiased=False) / x.mean())


def _in_capture_or_compile() -> bool:
    """True while a CUDA graph is being captured or torch.compile traces:
    no host synchronisation is allowed there."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def tcb_capacity(num_edges: int, num_nodes: int) -> int:
    """The number of TCBs a graph of ``num_edges`` edges and ``num_nodes``
    nodes can need at most: each window's last TCB is its only partial one,
    so T <= E // 8 + R."""
    return num_edges // COLS_PER_TCB + (num_nodes + ROWS_PER_WINDOW - 1) // ROWS_PER_WINDOW + 1


@dataclass(eq=False)
class WindowFormat:
    """The arrays every window format has (this BSB,
    :class:`~gt_fused3s.graph8.BSBGraph8`; their layouts in their modules'
    docstrings) and what they answer alike (with the format's ``num_tcbs``)."""

    num_nodes: int
    rw_offset: Tensor
    cols: Tensor
    bitmap: Tensor
    window_order: Tensor
    edge_index: Tensor

    @property
    def num_windows(self) -> int:
        return self.rw_offset.numel() - 1

    @property
    def num_edges(self) -> int:
        """Number of edges, duplicates included (each is a term of the attention)."""
        return self.edge_index.size(1)

    #: how errors name the format
    format_name = "window format"

    @property
    def device(self) -> torch.device:
        return self.rw_offset.device

    def tcb_nnz(self) -> Tensor:
        """int64 [T]: number of edges in each TCB (the capacity's padding
        TCBs of static mode are left out)."""
        return _popcount64(self.bitmap[:self.num_tcbs]).sum(1)

    def check_nodes(self, num_nodes: int, what: str = "q") -> None:
        if num_nodes != self.num_nodes:
            raise ValueError(f"{what} has {num_nodes} nodes but the {self.format_name} was built for "
                             f"num_nodes={self.num_nodes}; build the format for this graph")


@dataclass(eq=False)
class BSBGraph(WindowFormat):
    """A graph in the BSB layout of this module's docstring. Build it with
    :meth:`from_edge_index`, :meth:`from_csr` or :meth:`from_graph`. The
    kernels read it through a :class:`~gt_fused3s.plan.GraphPlan`."""

    #: int64 [5]: T, distinct edges, smallest and largest input index, largest
    #: window TCB count. On the host, except in static mode (on the device).
    counters: Tensor
    #: built without host synchronisation, cols / bitmap at capacity
    static: bool = False
    format_name = "BSB graph"

    # ------------------------------------------------------------------ build
    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int | None = None, *,
                        static: bool | None = None) -> "BSBGraph":
        """Build from ``edge_index`` [2, E] (row 0 sources, row 1 destinations).

        ``num_nodes`` defaults to ``edge_index.max() + 1`` (pass it: isolated
        trailing nodes cannot be inferred, and the default syncs the host).
        ``static`` (CUDA only): build in static mode (see the module
        docstring); default: static while a CUDA graph is captured or
        torch.compile traces, else exact.
        """
        edge_index = _check_edge_index(edge_index)
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        num_nodes = _check_num_nodes(num_nodes)
        if static is None:
            static = _in_capture_or_compile()
        if _op_build_available(edge_index.device):
            return cls._build_op(edge_index, num_nodes, static)
        _check_range("edge_index", edge_index, 0, num_nodes)
        return cls._build(edge_index[0].long(), edge_index[1].long(), num_nodes)

    @classmethod
    def from_csr(cls, indptr: Tensor, indices: Tensor, num_nodes: int | None = None) -> "BSBGraph":
        """Build from a CSR of the destination-major adjacency: row ``i`` lists
        the sources ``indices[indptr[i]:indptr[i+1]]`` of the edges ``j -> i``
        (PyG's ``adj_t``). ``num_nodes`` defaults to ``len(indptr) - 1``."""
        indptr = _check_index_tensor("indptr", indptr, 1)
        indices = _check_index_tensor("indices", indices, 1)
        if indptr.numel() == 0:
            raise ValueError("indptr must have at least one entry (got an empty tensor)")
        if indptr.device != indices.device:
            raise ValueError(f"indptr and indices must be on one device "
                             f"(got {indptr.device} and {indices.device})")
        rows = indptr.numel() - 1
        num_nodes = _check_num_nodes(rows if num_nodes is None else num_nodes)
        if rows != num_nodes:
            raise ValueError(f"indptr has {rows} rows but num_nodes={num_nodes}")
        first, last = indptr[[0, -1]].tolist()
        if first != 0 or last != indices.numel():
            raise ValueError(f"indptr must start at 0 and end at len(indices)={indices.numel()} "
                             f"(got {first} and {last})")
        counts = indptr[1:] - indptr[:-1]
        if rows and bool((counts < 0).any()):
            raise ValueError("indptr must be non-decreasing")
        _check_range("indices", indices, 0, num_nodes)
        dst = torch.repeat_interleave(torch.arange(rows, device=indices.device),
                                      counts.long(), output_size=indices.numel())
        return cls.from_edge_index(torch.stack([indices.long(), dst]), num_nodes, static=False)

    @classmethod
    def from_graph(cls, graph: Any) -> "BSBGraph":
        """Build from a PyG ``Data``/``Batch`` (``edge_index``, ``num_nodes``), a
        DGL graph or batched graph (``edges()``, ``num_nodes()``), or return a
        ``BSBGraph`` unchanged. A batch is a block-diagonal graph."""
        if isinstance(graph, BSBGraph):
            return graph
        if hasattr(graph, "edge_index") and hasattr(graph, "num_nodes"):
            return cls.from_edge_index(graph.edge_index, int(graph.num_nodes))
        if hasattr(graph, "edges") and callable(getattr(graph, "num_nodes", None)):
            src, dst = graph.edges()
            return cls.from_edge_index(torch.stack([src, dst]), int(graph.num_nodes()))
        raise ValueError(f"graph must be a BSBGraph, a PyG Data/Batch or a DGL graph "
                         f"(got {type(graph).__name__})")

    @classmethod
    def _build_op(cls, edge_index: Tensor, num_nodes: int, static: bool) -> "BSBGraph":
        """The CUDA builder (``torch.ops.gt_fused3s.bsb_build``: one sort, scans,
        a few kernels, no synchronisation). Exact mode copies its counters to
        the host once, to check the indices and cut the arrays to T TCBs."""
        from .ops import bsb_build   # the registered op (fake kernel for torch.compile)
        rw_offset, cols, bitmap, window_order, edges, counters = bsb_build(edge_index, num_nodes)
        if static:
            if edge_index.numel():
                torch._assert_async((counters[2] >= 0) & (counters[3] < num_nodes),
                                    "gt_fused3s: edge_index has an index outside [0, num_nodes)")
            return cls(num_nodes, rw_offset, cols, bitmap, window_order, edges, counters, True)
        counters = counters.cpu()                       # the one synchronisation
        if edge_index.numel():
            err = _range_error("edge_index", int(counters[2]), int(counters[3]), 0, num_nodes)
            if err is not None:
                raise err
        T = int(counters[0])
        return cls(num_nodes, rw_offset, cols[:T * COLS_PER_TCB], bitmap[:T], window_order,
                   edges, counters)

    @classmethod
    def _build(cls, src: Tensor, dst: Tensor, num_nodes: int) -> "BSBGraph":
        """The specification of the format, in PyTorch (exact mode)."""
        E = src.numel()
        N = num_nodes
        R = (N + ROWS_PER_WINDOW - 1) // ROWS_PER_WINDOW
        key = torch.sort(_edge_keys(src, dst, N)).values
        first, win, src, row_in, rank, cols_per_win = _window_columns(key, N)
        # row rr, column c of a TCB: bit (rr % 8) * 8 + c of word rr // 8
        rw_offset, cols, bitmap, window_order, tcb_per_win = pack_blocks(
            win, src, rank, cols_per_win, COLS_PER_TCB, lambda c: (row_in >> 3, ((row_in & 7) << 3) | c))
        T = bitmap.size(0)
        lo, hi = (int(x) for x in torch.aminmax(torch.stack([src, dst]))) if E else (0, 0)
        counters = torch.tensor([T, int(first.sum()), lo, hi, int(tcb_per_win.max()) if R else 0],
                                dtype=torch.long)
        return cls(
            num_nodes=N,
            rw_offset=rw_offset,
            cols=cols,
            bitmap=bitmap,
            window_order=window_order,
            edge_index=torch.stack([src, win * ROWS_PER_WINDOW + row_in]),
            counters=counters,
        )

    # ------------------------------------------------------------ properties
    @property
    def tcb_capacity(self) -> int:
        """Rows of ``bitmap``: T in exact mode, the capacity in static mode."""
        return self.bitmap.size(0)

    @property
    def num_tcbs(self) -> int:
        """T (in static mode read from the device: a host synchronisation)."""
        return int(self.counters[0]) if self.static else self.bitmap.size(0)

    @property
    def num_duplicates(self) -> int:
        """Edges that repeat an earlier one (static mode: a host synchronisation)."""
        return self.num_edges - int(self.counters[1])

    @property
    def max_window_tcbs(self) -> int:
        """The largest TCB count of a row window (static mode: a host synchronisation)."""
        return int(self.counters[4])

    def to(self, device: torch.device | str) -> "BSBGraph":
        """A copy on ``device`` (``self`` if already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return BSBGraph(self.num_nodes, self.rw_offset.to(device), self.cols.to(device),
                        self.bitmap.to(device), self.window_order.to(device),
                        self.edge_index.to(device),
                        self.counters.to(device) if self.static else self.counters, self.static)

    # ------------------------------------------------------------ statistics
    def stats(self, head_dim: int = 128, *, variants: bool = True) -> dict:
        """The paper's fit-for-tensor-cores statistics, and the work of one
        forward per head (issue 13: counts, not timings).

        ``tcb_per_rw_*`` are over all R windows (empty ones count as 0);
        ``nnz_per_tcb_*`` over all T TCBs; ``nnz_per_pair_mean`` / ``_max``
        over the pairs of TCBs the kernels walk (a window's TCBs 2p, 2p + 1:
        the per-edge terms move a pair's edges through a warp's lanes, at
        most 64 at a time, ``csrc/kernels/edge_bias.cuh``);
        ``density`` = E / (T * 128).

        Work per head of dimension ``head_dim`` = D (a multiple of 16), in
        ``mma.m16n8k16`` invocations and bytes (see :func:`format_stats`):

        - ``mma_fwd``: this 16 x 8 format's count, SDDMM D/16 per TCB plus
          SpMM D/8 per pair of TCBs of a window (the SpMM's k of 16 is two
          TCBs; an odd window's last TCB is a half-empty pair);
        - ``mma_fwd_kernel``: what the current kernel executes: it computes
          whole pairs, also the SDDMM of a missing second TCB (D/4 per pair);
        - ``kv_rows``: K and V rows gathered (the TCBs' valid columns), and
          ``kv_bytes_fwd`` = 2 * kv_rows * D * 2 bytes (K and V, fp16/bf16).

        With ``variants`` (one sort of the edges more), the same counts for
        8-row windows of 8 x 16 blocks (FlashSparse's swap-and-transpose:
        S^T = K Q^T, O^T = V^T P^T, the rows are the mma's n = 8 side), under
        the prefix ``w8_``: ``w8_num_windows``, ``w8_num_blocks``,
        ``w8_nnz_per_block_mean``/``_cv``, ``w8_kv_rows``, ``w8_kv_bytes_fwd``,
        ``w8_mma_fwd``. Reads the counters (a host synchronisation in static
        mode).
        """
        D = check_int("head_dim", head_dim)
        if D % 16:
            raise ValueError(f"head_dim must be a multiple of 16 (got {D})")
        tcb_per_rw = (self.rw_offset[1:] - self.rw_offset[:-1]).long()
        nnz = self.tcb_nnz()
        T = nnz.numel()
        kv_rows = int((self.cols[:T * COLS_PER_TCB] >= 0).sum())
        pairs_per_rw = (tcb_per_rw + 1) // 2
        pairs = int(pairs_per_rw.sum())
        # the kernels walk a window's TCBs in pairs (2p, 2p + 1): the edges of
        # a pair are the run the edge terms move through a warp's lanes
        win = torch.repeat_interleave(torch.arange(self.num_windows, device=nnz.device), tcb_per_rw,
                                      output_size=T)
        pair = (torch.cumsum(pairs_per_rw, 0) - pairs_per_rw)[win] + \
            torch.div(torch.arange(T, device=nnz.device) - self.rw_offset.long()[win], 2, rounding_mode="floor")
        pair_nnz = torch.zeros(pairs, dtype=torch.long, device=nnz.device).index_add_(0, pair, nnz)
        out = {
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "num_windows": self.num_windows,
            "num_tcbs": T,
            "tcb_per_rw_mean": float(tcb_per_rw.double().mean()) if self.num_windows else 0.0,
            "tcb_per_rw_cv": _cv(tcb_per_rw),
            "tcb_per_rw_max": self.max_window_tcbs,
            "nnz_per_tcb_mean": float(nnz.double().mean()) if T else 0.0,
            "nnz_per_tcb_cv": _cv(nnz),
            "nnz_per_pair_mean": self.num_edges / pairs if pairs else 0.0,
            "nnz_per_pair_max": int(pair_nnz.max()) if pairs else 0,
            "density": self.num_edges / (T * 128) if T else 0.0,
            "head_dim": D,
            "mma_fwd": T * (D // 16) + pairs * (D // 8),
            "mma_fwd_kernel": pairs * (D // 4),
            "kv_rows": kv_rows,
            "kv_bytes_fwd": 2 * kv_rows * D * 2,
        }
        if variants:
            w8 = format_stats(self.edge_index, self.num_nodes, "8x16", D)
            out.update({"w8_" + k: v for k, v in w8.items()
                        if k not in ("format", "num_nodes", "num_edges", "head_dim")})
        return out

    # ---------------------------------------------------------- decode / check
    def decode_edges(self) -> Tensor:
        """Edges [2, E] (source, destination), duplicates included, read back
        from ``cols`` and ``bitmap`` alone, sorted by (destination, source).
        For tests and debugging: it is the inverse of the builder."""
        win, t, word, b = block_bits(self.rw_offset, self.bitmap[:self.num_tcbs])
        rows = win * ROWS_PER_WINDOW + word * 8 + (b >> 3)
        srcs = self.cols.long()[t * COLS_PER_TCB + (b & 7)]
        order = torch.argsort(rows * max(self.num_nodes, 1) + srcs, stable=True)
        return torch.stack([srcs[order], rows[order]])

    def to_dense_counts(self) -> Tensor:
        """int32 [N, N]: entry [i, j] = number of edges j -> i."""
        counts = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.int32, device=self.device)
        ones = torch.ones(self.num_edges, dtype=torch.int32, device=self.device)
        return counts.index_put_((self.edge_index[1], self.edge_index[0]), ones, accumulate=True)

    def to_dense_mask(self) -> Tensor:
        """bool [N, N]: mask[i, j] is True iff the edge j -> i exists."""
        return self.to_dense_counts() > 0

    def __repr__(self) -> str:
        tcbs = f"tcb_capacity={self.tcb_capacity}, static=True" if self.static else f"num_tcbs={self.num_tcbs}"
        return (f"BSBGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"num_windows={self.num_windows}, {tcbs}, device={self.device})")



#: block formats :func:`format_stats` counts: name -> (rows per window, columns per block)
FORMATS = {"16x8": (16, 8), "8x16": (8, 16)}


def format_stats(edge_index: Tensor, num_nodes: int, fmt: str = "16x8",
                 head_dim: int = 128) -> dict:
    """Block counts of a window format, from the edges alone (no kernel).

    ``fmt`` ``"16x8"`` is this module's BSB format; ``"8x16"`` is 8-row
    windows cut into blocks of 8 rows x 16 columns (FlashSparse's
    swap-and-transpose, whose sparse operand is the mma's n = 8 side).
    Columns are formed as the builder forms them: per window, the distinct
    (source, copy) pairs, ascending (a duplicate edge takes a column of its
    own), cut into blocks of ``cols`` columns; every block has 128 entries.

    Returns ``format``, ``num_nodes``, ``num_edges`` (duplicates included),
    ``num_windows``, ``num_blocks``, ``blocks_per_window_mean``,
    ``nnz_per_block_mean``/``_cv``/``_max``, ``kv_rows`` (columns over all
    blocks = K and V rows gathered), ``kv_bytes_fwd`` (2 * kv_rows * D * 2),
    ``single_nnz_share`` (the share of the non-zeros alone in their column:
    what a CUDA-core residue would take off the tensor cores), ``head_dim``
    and ``mma_fwd``: m16n8k16 invocations of one forward per head
    of dimension D (a multiple of 16). Counted per block:

    - 16x8: SDDMM S[16, 8] = Q K^T takes D/16; the SpMM O[16, D] += P V has
      k = 16 columns, two TCBs: D/8 per pair of TCBs of a window (an odd
      window's last TCB is a pair of its own), so D/16 per TCB on average;
    - 8x16: SDDMM S^T[16, 8] = K Q^T takes D/16; SpMM O^T[D, 8] += V^T P^T
      takes D/16 (m = 16 of D, k = the block's 16 columns).

    Both are D/8 per block of 128 entries (but for the 16x8 odd windows), so
    the formats differ in how many blocks the graph needs. Vectorised (one
    sort of the edges); a few host synchronisations (the counts returned).
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FORMATS)} (got {fmt!r})")
    D = check_int("head_dim", head_dim)
    if D % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (got {D})")
    edge_index = _check_edge_index(edge_index)
    N = _check_num_nodes(num_nodes)
    rows, width = FORMATS[fmt]
    _check_range("edge_index", edge_index, 0, N)
    E = edge_index.size(1)
    R = (N + rows - 1) // rows
    _, win, _, _, rank, cols_per_win = window_ranks(edge_index[0].long(), edge_index[1].long(), N, rows)
    blocks_per_win = (cols_per_win + width - 1) // width
    block_off = torch.cumsum(blocks_per_win, 0) - blocks_per_win
    B = int(blocks_per_win.sum())
    nnz = torch.bincount(block_off[win] + torch.div(rank, width, rounding_mode="floor"),
                         minlength=B)
    kv_rows = int(cols_per_win.sum())
    # non-zeros per column: a column holding one is what a CUDA-core residue
    # would take off the tensor cores (issue 13, item 2; README)
    col_nnz = torch.bincount((torch.cumsum(cols_per_win, 0) - cols_per_win)[win] + rank, minlength=kv_rows)
    if fmt == "16x8":
        mma = B * (D // 16) + int(((blocks_per_win + 1) // 2).sum()) * (D // 8)
    else:
        mma = B * (D // 8)
    return {
        "format": fmt,
        "num_nodes": N,
        "num_edges": E,
        "num_windows": R,
        "num_blocks": B,
        "blocks_per_window_mean": B / R if R else 0.0,
        "nnz_per_block_mean": E / B if B else 0.0,
        "nnz_per_block_cv": _cv(nnz),
        "nnz_per_block_max": int(nnz.max()) if B else 0,
        "kv_rows": kv_rows,
        "kv_bytes_fwd": 2 * kv_rows * D * 2,
        "single_nnz_share": int((col_nnz == 1).sum()) / E if E else 0.0,
        "head_dim": D,
        "mma_fwd": mma,
    }


def pack_blocks(win: Tensor, src: Tensor, rank: Tensor, cols_per_win: Tensor, width: int,
                bit_of, capacity: int | None = None) -> tuple[Tensor, ...]:
    """A window format's arrays from its edges' columns (:func:`window_ranks`
    or the BSB builder's): blocks of ``width`` columns per window, ``cols``
    (source of each column, -1 padding) and the bitmap, where
    ``bit_of(column in block)`` gives each edge's (word, bit). Returns
    ``rw_offset`` int32 [R + 1], ``cols`` int32 [T * width], ``bitmap``
    int64 [T, 2], ``window_order`` int32 [R] (decreasing block count,
    stable) and the block count per window (int64). T is read back from
    the device (one host synchronisation), or, given a ``capacity`` (at
    least T), the arrays have that many blocks, the last unused (cols -1,
    bitmap 0), and nothing is read back."""
    device = src.device
    tcb_per_win = (cols_per_win + width - 1) // width
    R = tcb_per_win.numel()
    rw_offset = torch.zeros(R + 1, dtype=torch.long, device=device)
    torch.cumsum(tcb_per_win, 0, out=rw_offset[1:])
    T = capacity if capacity is not None else (int(rw_offset[-1]) if R else 0)
    tcb = rw_offset[win] + torch.div(rank, width, rounding_mode="floor")
    col_in = rank % width
    cols = torch.full((T * width,), -1, dtype=torch.int32, device=device)
    cols[tcb * width + col_in] = src.to(torch.int32)   # same value per column
    # Distinct bits per block word (one edge copy per (row, column)), so a sum is an or.
    word, bit = bit_of(col_in)
    bitmap = torch.zeros(T * 2, dtype=torch.long, device=device)
    bitmap.index_add_(0, tcb * 2 + word, torch.ones_like(src) << bit)
    window_order = torch.sort(tcb_per_win, descending=True, stable=True).indices
    return rw_offset.to(torch.int32), cols, bitmap.view(T, 2), window_order.to(torch.int32), tcb_per_win


def block_bits(rw_offset: Tensor, bitmap: Tensor) -> tuple[Tensor, ...]:
    """Every set bit of a window format's ``bitmap`` [T, 2]: its window,
    block, word and bit (for the decoders)."""
    T = bitmap.size(0)
    win = torch.repeat_interleave(torch.arange(rw_offset.numel() - 1, device=bitmap.device),
                                  (rw_offset[1:] - rw_offset[:-1]).long(), output_size=T)
    on = ((bitmap.unsqueeze(-1) >> torch.arange(64, device=bitmap.device)) & 1).bool()   # [T, 2, 64]
    t, word, b = on.nonzero(as_tuple=True)
    return win[t], t, word, b


def window_ranks(src: Tensor, dst: Tensor, num_nodes: int, rows: int) -> tuple[Tensor, ...]:
    """The columns of a window format with ``rows`` rows per window, as the
    builders form them: per window, the pairs (source, copy) some row of the
    window has, ascending (a duplicate edge takes a column of its own).

    Returns, per edge sorted by (window, source, row in window), ``order``
    (its index in ``src`` / ``dst``), ``win``, ``src``, ``row_in`` and
    ``rank`` (its column within the window), and per window ``cols_per_win``.
    Vectorised: one sort of the edges (stable: copies keep their order)."""
    device = src.device
    E, N = src.numel(), num_nodes
    R = (N + rows - 1) // rows
    win = torch.div(dst, rows, rounding_mode="floor")
    key, order = torch.sort((win * N + src) * rows + (dst - win * rows), stable=True)
    pair = torch.div(key, rows, rounding_mode="floor")          # window * N + source
    win = win[order]
    idx = torch.arange(E, device=device)
    first = torch.ones(E, dtype=torch.bool, device=device)
    first[1:] = key[1:] != key[:-1]
    copy = idx - torch.cummax(torch.where(first, idx, 0), 0).values   # copy number of the edge
    new_pair = torch.ones(E, dtype=torch.bool, device=device)
    new_pair[1:] = pair[1:] != pair[:-1]
    pair_id = torch.cumsum(new_pair.long(), 0) - 1
    pair_cols = torch.zeros(E, dtype=torch.long, device=device)
    pair_cols.scatter_reduce_(0, pair_id, copy + 1, reduce="amax")
    cols_per_win = torch.zeros(R, dtype=torch.long, device=device)
    # each pair's columns once, at its first edge (a masked sum: no boolean indexing, no host sync)
    cols_per_win.index_add_(0, win, torch.where(new_pair, pair_cols[pair_id], 0))
    col = torch.cumsum(pair_cols, 0) - pair_cols                  # first column of each pair
    col = col[pair_id] + copy                                     # global column of the edge
    first_col = torch.cumsum(cols_per_win, 0) - cols_per_win
    rank = col - first_col[win]                                   # column within its window
    return order, win, pair - win * N, key - pair * rows, rank, cols_per_win


def _op_build_available(device: torch.device) -> bool:
    """Whether the builder op runs on ``device``: a CUDA device where the
    extension builds and loads and ``GT_FUSED3S_DISABLE_KERNEL=1`` is not
    set (elsewhere :meth:`BSBGraph._build` builds the format in PyTorch)."""
    if device.type != "cuda" or os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1":
        return False
    from ._build import extension_available
    return extension_available()


def check_int(name: str, value: Any, low: int = 1) -> int:
    """``value`` as a Python int if it is an integer >= ``low`` (a Python or
    numpy integer, or a 0-d integer tensor; not a bool), else one-line
    ValueError naming ``name``."""
    if isinstance(value, bool) or isinstance(value, float):
        raise ValueError(f"{name} must be an int >= {low} (got {value!r})")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {low} (got {value!r})") from None
    if as_int < low:
        raise ValueError(f"{name} must be an int >= {low} (got {value!r})")
    return as_int


def _check_num_nodes(num_nodes: Any) -> int:
    if isinstance(num_nodes, Tensor):
        num_nodes = int(num_nodes)
    elif not isinstance(num_nodes, (int, float)) and hasattr(num_nodes, "__index__"):
        # numpy integers (an int, also a size torch.compile traces as
        # dynamic, skips the hasattr, which dynamo cannot trace on one)
        num_nodes = int(num_nodes.__index__())
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise ValueError(f"num_nodes must be a non-negative int (got {num_nodes!r})")
    if num_nodes > 2**31 - 1:
        raise ValueError(f"num_nodes={num_nodes} exceeds the int32 indices of the format")
    return num_nodes


def _edge_keys(src: Tensor, dst: Tensor, num_nodes: int) -> Tensor:
    """The builder's sort key of each edge: ((window, source), row in window).
    Equal keys are copies of one edge; equal ``key >> 4`` is one (window,
    source) pair."""
    return (dst >> 4) * num_nodes * ROWS_PER_WINDOW + src * ROWS_PER_WINDOW + (dst & 15)


def _max_key(num_nodes: int) -> int:
    """An upper bound of the keys :func:`_edge_keys` makes for ``num_nodes`` nodes."""
    return ((num_nodes - 1) >> 4) * num_nodes * ROWS_PER_WINDOW + num_nodes * ROWS_PER_WINDOW - 1


def _window_columns(key: Tensor, num_nodes: int) -> tuple[Tensor, ...]:
    """Where each edge of the sorted ``key`` goes: (first copy?, window,
    source, row in window, column within the window) per edge, and the
    column count of each window. Shapes depend only on E and N (no host
    synchronisation), so :func:`edge_slots` can run inside a capture."""
    device = key.device
    E = key.numel()
    N = num_nodes
    R = (N + ROWS_PER_WINDOW - 1) // ROWS_PER_WINDOW
    idx = torch.arange(E, device=device)
    first = torch.ones(E, dtype=torch.bool, device=device)
    first[1:] = key[1:] != key[:-1]
    # copy number: the distance to the first copy of its run (a scatter of
    # the runs' starts, not a cummax: that scan took 0.14 ms for 51k edges)
    run = torch.cumsum(first, 0) - 1
    run_start = torch.zeros(E + 1, dtype=torch.long, device=device)
    run_start.scatter_(0, torch.where(first, run, E), idx)     # later copies write to slot E
    copy = idx - run_start[run]
    pair = key >> 4                       # window * N + source
    row_in = key & 15
    win = torch.div(pair, N, rounding_mode="floor") if N else pair
    src = pair - win * N
    new_pair = torch.ones(E, dtype=torch.bool, device=device)
    new_pair[1:] = pair[1:] != pair[:-1]
    pair_id = torch.cumsum(new_pair, 0) - 1
    # A pair (window, source) has as many columns as its most repeated edge.
    pair_cols = torch.zeros(E, dtype=torch.long, device=device)
    pair_cols.scatter_reduce_(0, pair_id, copy + 1, reduce="amax")
    pair_base = torch.cumsum(pair_cols, 0) - pair_cols          # first column of each pair
    col_id = pair_base[pair_id] + copy                           # global column of the edge
    # columns per window from a running count and the windows' edge ranges
    # (the edges are sorted by window), not an index_add into int64, which
    # torch.compile runs as a sorting index_put (80 us per build)
    col_count = torch.zeros(E + 1, dtype=torch.long, device=device)
    torch.cumsum(torch.where(new_pair, pair_cols[pair_id], 0), 0, out=col_count[1:])
    bounds = torch.searchsorted(win, torch.arange(R + 1, device=device))
    cols_per_win = col_count[bounds[1:]] - col_count[bounds[:-1]]
    first_col = torch.cumsum(cols_per_win, 0) - cols_per_win
    rank = col_id - first_col[win]                               # column within its window
    return first, win, src, row_in, rank, cols_per_win


def edge_slots(bsb: BSBGraph, edge_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Where the edges of ``edge_index`` (the graph ``bsb`` was built from,
    in any order) sit in the format's non-zero order: TCBs in order, inside
    a TCB word 0 then word 1 of the bitmap, bits ascending.

    Returns ``nnz_offset`` int32 [T + 1] (first non-zero of each TCB, over
    the capacity in static mode), ``slot_edge`` int32 [E] (the index in
    ``edge_index`` of each non-zero) and ``slot_pos`` uint8 [E] (its place
    among the mma fragments of its pair of TCBs, ``128 x + 4 lane + i``: TCB
    x of the pair, lane ``4 (row % 8) + column // 2`` and element ``i = 2
    (row >= 8) + column % 2`` of the m16n8 accumulator, where the kernels
    put its bias and find its score: csrc/kernels/edge_bias.cuh). Copies of
    one edge take its columns in the order they are listed. Built once per
    graph with static shapes (no host synchronisation), on a GPU by one op
    (csrc/kernels/edge_slots.cu), elsewhere with vectorised ops (the op's
    specification), for the kernels' per-edge terms, which they read and write in the
    caller's edge order through ``slot_edge``.
    """
    _check_edge_index(edge_index)
    if edge_index.size(1) != bsb.num_edges:
        raise ValueError(f"edge_index has {edge_index.size(1)} edges but the BSB graph was built "
                         f"from {bsb.num_edges}")
    if _op_build_available(edge_index.device):
        # one op (ops.edge_slots_op: keys, sort, two kernels): the ops below
        # are one launch each, about 140 a format (github, H100: the eager
        # plan build with both formats' slots 7.0 ms, of which 1.7 ms on the GPU)
        from .ops import edge_slots_op
        return edge_slots_op(edge_index, bsb.rw_offset, bsb.cols, bsb.bitmap, bsb.num_nodes)
    src, dst = edge_index[0].long(), edge_index[1].long()
    key = _edge_keys(src, dst, bsb.num_nodes)
    if _max_key(bsb.num_nodes) < 2**31:      # half the radix passes (molecule batches)
        key = key.int()
    key, order = torch.sort(key, stable=True)
    return edge_slots_from_keys(key.long(), order, bsb.rw_offset, bsb.bitmap, bsb.num_nodes)[:3]


def edge_slots_from_keys(key: Tensor, order: Tensor, rw_offset: Tensor, bitmap: Tensor,
                         num_nodes: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`edge_slots` in PyTorch from the sorted keys (int64) and their
    edge ids: ``(nnz_offset, slot_edge, slot_pos, column)``, ``column`` the
    global TCB slot (``8 tcb + column % 8``) of each sorted edge, which
    holds its source in the BSB's ``cols`` (the CUDA op finds it there)."""
    _, win, _, row_in, rank, _ = _window_columns(key, num_nodes)
    tcb = rw_offset.long()[win] + (rank >> 3)
    word = row_in >> 3
    bit = ((row_in & 7) << 3) | (rank & 7)
    nnz_offset, slot_edge, nnz = nnz_slots(bitmap, tcb, word, bit, order)
    # bit 8 (row % 8) + column: lane bit // 2, element 2 word + bit % 2 of TCB
    # x = (rank // 8) % 2 of the window's pairs (work items start at even TCBs)
    pos = (((rank >> 3) & 1) << 7) | ((bit >> 1) << 2) | (word << 1) | (bit & 1)
    slot_pos = torch.empty_like(order, dtype=torch.uint8).scatter_(0, nnz, pos.to(torch.uint8))
    return nnz_offset, slot_edge, slot_pos, 8 * tcb + (rank & 7)


def nnz_slots(bitmap: Tensor, tcb: Tensor, word: Tensor, bit: Tensor, order: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    """``(nnz_offset, slot_edge)`` of a window format (:func:`edge_slots`)
    from each edge's block, word and bit and its index ``order`` in the
    caller's edge list, and each of those edges' non-zero index (int64, in
    ``order``'s order). The non-zero order: blocks in order, inside a block
    word 0 then word 1, bits ascending."""
    counts = _popcount64(bitmap)                                  # [T, 2]
    nnz_offset = torch.zeros(bitmap.size(0) + 1, dtype=torch.long, device=bitmap.device)
    torch.cumsum(counts.sum(1), 0, out=nnz_offset[1:])
    below = _popcount64(bitmap[tcb, word] & ((torch.ones_like(bit) << bit) - 1))
    nnz = nnz_offset[tcb] + below + torch.where(word == 1, counts[tcb, 0], 0)
    slot_edge = torch.empty_like(order, dtype=torch.int32).scatter_(0, nnz, order.int())
    return nnz_offset.int(), slot_edge, nnz


def node_csr(idx: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """The edges grouped by one of their nodes ``idx`` [E] (a destination, say):
    ``(rowptr [num_nodes + 1], order [E])``, int64, the edges of node ``n``
    being ``order[rowptr[n]:rowptr[n + 1]]`` (edge ids in the caller's order,
    ascending within a node). One stable sort and a search, on ``idx``'s
    device, with static shapes and no host synchronisation."""
    idx = idx.long()
    order = torch.sort(idx, stable=True).indices
    nodes = torch.arange(num_nodes + 1, device=idx.device, dtype=idx.dtype)
    return torch.searchsorted(idx[order], nodes), order
