"""The Binary Sparse Block (BSB) format: a graph laid out for tensor cores.

Built once per graph (or per batch of graphs) and reused by every layer and
head. Rows are destination nodes, columns are source nodes (PyG convention:
``edge_index[0]`` = source ``j``, ``edge_index[1]`` = destination ``i``, the
edge ``j -> i`` lets ``i`` attend to ``j``).

Layout, for a graph of ``N`` nodes::

    R = ceil(N / 16) row windows (RW); window r holds rows 16r .. 16r+15.
    Within window r, the distinct source ids of its edges, in ascending order,
    are its compacted columns; they are cut into tensor-core blocks (TCB) of
    16 rows x 8 compacted columns. T = total number of TCBs.

    rw_offset     int32 [R + 1]  window r owns TCBs rw_offset[r] .. rw_offset[r+1]-1;
                                 TCB rw_offset[r] + i holds compacted columns 8i .. 8i+7
    cols          int32 [T * 8]  cols[t*8 + c] = global source id of column c of TCB t,
                                 or -1 for padding (only in a window's last TCB)
    bitmap        int64 [T, 2]   uint64 bit patterns stored as int64: for row
                                 ``rr = row - 16 r`` (0..15) and column c (0..7) the
                                 edge bit is bit ``(rr % 8) * 8 + c`` of word ``rr // 8``.
                                 Padding columns never have a bit set.
    window_order  int32 [R]      windows sorted by decreasing TCB count (stable),
                                 the order in which the kernel schedules them
    edge_index    int64 [2, E]   the deduplicated edges (source, destination) sorted by
                                 (window, source, row): the same mask, kept for the
                                 unfused paths (reference, CPU, fallbacks)

The bit layout matches the m16n8k16 accumulator: lane ``L`` of a warp holds
the scores of row ``L // 4`` (bits ``2L``, ``2L + 1`` of word 0) and row
``L // 4 + 8`` (the same bits of word 1).

The mask is binary: duplicate edges count once (``num_duplicates`` says how
many were dropped). All arrays are built on the device of the input with
vectorised ops (one sort, scans, scatters) and never loops over nodes in
Python: on the GPU by the CUDA builder of ``csrc/kernels/bsb_build.cu`` (one
host synchronisation), elsewhere by :meth:`BSBGraph._build` in PyTorch, which
is the specification the GPU builder must equal exactly.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
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


def _check_range(name: str, t: Tensor, low: int, high: int) -> None:
    """Raise ValueError naming ``name`` if an entry of ``t`` lies outside [low, high)."""
    if t.numel() == 0:
        return
    lo, hi = torch.stack(list(torch.aminmax(t.reshape(-1)))).tolist()  # one host sync
    if lo < low:
        raise ValueError(f"{name} has negative index {lo}" if low == 0
                         else f"{name} has index {lo} < {low}")
    if hi >= high:
        raise ValueError(f"{name} has index {hi} out of range for num_nodes={high}"
                         if low == 0 else f"{name} has index {hi} >= {high}")


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


@dataclass(eq=False)
class BSBGraph:
    """A graph in the BSB layout of this module's docstring. Build it with
    :meth:`from_edge_index`, :meth:`from_csr` or :meth:`from_graph`."""

    num_nodes: int
    rw_offset: Tensor
    cols: Tensor
    bitmap: Tensor
    window_order: Tensor
    edge_index: Tensor
    num_duplicates: int = 0
    #: the largest TCB count of a row window (the kernel splits heavier windows)
    max_window_tcbs: int = 0
    #: per-graph derived device arrays (kernel schedules, masks of other
    #: backends), built lazily by their users and cached here by name
    extras: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ build
    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int | None = None) -> "BSBGraph":
        """Build from ``edge_index`` [2, E] (row 0 sources, row 1 destinations).

        ``num_nodes`` defaults to ``edge_index.max() + 1`` (pass it: isolated
        trailing nodes cannot be inferred). Duplicate edges are collapsed.
        """
        edge_index = _check_index_tensor("edge_index", edge_index, 2)
        if edge_index.size(0) != 2:
            raise ValueError(f"edge_index must have shape [2, E] (got {tuple(edge_index.shape)})")
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        num_nodes = _check_num_nodes(num_nodes)
        if edge_index.is_cuda and (gpu_build := _gpu_builder()) is not None:
            # validates the indices itself, in its single host synchronisation
            return cls(num_nodes, *gpu_build(edge_index, num_nodes))
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
        if indices.is_cuda and (gpu_build := _gpu_builder()) is not None:
            return cls(num_nodes, *gpu_build(torch.stack([indices.long(), dst]), num_nodes))
        return cls._build(indices.long(), dst, num_nodes)

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
    def _build(cls, src: Tensor, dst: Tensor, num_nodes: int) -> "BSBGraph":
        device = src.device
        n_in = src.numel()
        R = (num_nodes + ROWS_PER_WINDOW - 1) // ROWS_PER_WINDOW
        # One sort gives both the deduplication and the per-window column
        # compaction: key = ((window, source), row in window).
        win = dst >> 4
        key = torch.unique((win * num_nodes + src) * ROWS_PER_WINDOW + (dst & 15))
        pair = key >> 4                       # window * N + source
        row_in = key & 15                     # row within the window
        win = torch.div(pair, num_nodes, rounding_mode="floor") if num_nodes else pair
        src = pair - win * num_nodes
        E = key.numel()
        # A (window, source) pair is one compacted column; number them.
        new_pair = torch.ones(E, dtype=torch.bool, device=device)
        new_pair[1:] = pair[1:] != pair[:-1]
        pair_id = torch.cumsum(new_pair, 0) - 1
        pairs_per_win = torch.zeros(R, dtype=torch.long, device=device)
        pairs_per_win.scatter_add_(0, win, new_pair.long())
        first_pair = torch.cumsum(pairs_per_win, 0) - pairs_per_win
        rank = pair_id - first_pair[win]      # compacted column index in its window
        tcb_per_win = (pairs_per_win + COLS_PER_TCB - 1) // COLS_PER_TCB
        rw_offset = torch.zeros(R + 1, dtype=torch.long, device=device)
        torch.cumsum(tcb_per_win, 0, out=rw_offset[1:])
        T = int(rw_offset[-1]) if R else 0
        tcb = rw_offset[win] + (rank >> 3)
        col_in = rank & 7
        cols = torch.full((T * COLS_PER_TCB,), -1, dtype=torch.int32, device=device)
        cols[tcb * COLS_PER_TCB + col_in] = src.to(torch.int32)   # same value per pair
        # Distinct bits per TCB word, so a sum is a bitwise or.
        bits = torch.ones_like(key) << (((row_in & 7) << 3) | col_in)
        bitmap = torch.zeros(T * 2, dtype=torch.long, device=device)
        bitmap.index_add_(0, tcb * 2 + (row_in >> 3), bits)
        window_order = torch.sort(tcb_per_win, descending=True, stable=True).indices
        return cls(
            num_nodes=num_nodes,
            rw_offset=rw_offset.to(torch.int32),
            cols=cols,
            bitmap=bitmap.view(T, 2),
            window_order=window_order.to(torch.int32),
            edge_index=torch.stack([src, win * ROWS_PER_WINDOW + row_in]),
            num_duplicates=n_in - E,
            max_window_tcbs=int(tcb_per_win.max()) if R else 0,
        )

    # ------------------------------------------------------------ properties
    @property
    def num_windows(self) -> int:
        return self.rw_offset.numel() - 1

    @property
    def num_tcbs(self) -> int:
        return self.bitmap.size(0)

    @property
    def num_edges(self) -> int:
        """Number of distinct edges (the mask's nonzeros)."""
        return self.edge_index.size(1)

    @property
    def device(self) -> torch.device:
        return self.rw_offset.device

    def to(self, device: torch.device | str) -> "BSBGraph":
        """A copy on ``device`` (``self`` if already there); ``extras`` are not
        carried (they are rebuilt on first use)."""
        device = torch.device(device)
        if device == self.device:
            return self
        return BSBGraph(self.num_nodes, self.rw_offset.to(device), self.cols.to(device),
                        self.bitmap.to(device), self.window_order.to(device),
                        self.edge_index.to(device), self.num_duplicates, self.max_window_tcbs)

    def transposed(self) -> "BSBGraph":
        """The BSB of the reversed graph (every edge j -> i becomes i -> j),
        built once and cached in ``extras``: its row windows are the source
        nodes, which the backward pass needs to sum dK and dV per source."""
        t = self.extras.get("transposed")
        if t is None:
            t = BSBGraph.from_edge_index(self.edge_index.flip(0), self.num_nodes)
            self.extras["transposed"] = t
        return t

    # ------------------------------------------------------------ statistics
    def tcb_nnz(self) -> Tensor:
        """int64 [T]: number of edges in each TCB."""
        return _popcount64(self.bitmap).sum(1)

    def stats(self) -> dict:
        """The paper's fit-for-tensor-cores statistics.

        ``tcb_per_rw_*`` are over all R windows (empty ones count as 0);
        ``nnz_per_tcb_*`` over all T TCBs; ``density`` = E / (T * 128).
        """
        tcb_per_rw = (self.rw_offset[1:] - self.rw_offset[:-1]).long()
        nnz = self.tcb_nnz()
        T = self.num_tcbs
        return {
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "num_windows": self.num_windows,
            "num_tcbs": T,
            "tcb_per_rw_mean": float(tcb_per_rw.double().mean()) if self.num_windows else 0.0,
            "tcb_per_rw_cv": _cv(tcb_per_rw),
            "tcb_per_rw_max": self.max_window_tcbs,
            "nnz_per_tcb_mean": float(nnz.double().mean()) if T else 0.0,
            "nnz_per_tcb_cv": _cv(nnz),
            "density": self.num_edges / (T * 128) if T else 0.0,
        }

    # ---------------------------------------------------------- decode / check
    def decode_edges(self) -> Tensor:
        """Edges [2, E] (source, destination) read back from ``cols`` and
        ``bitmap`` alone, sorted by (destination, source). For tests and
        debugging: it is the inverse of the builder."""
        device = self.device
        T = self.num_tcbs
        tcb_win = torch.repeat_interleave(
            torch.arange(self.num_windows, device=device),
            (self.rw_offset[1:] - self.rw_offset[:-1]).long(), output_size=T)
        bit = torch.arange(64, device=device)
        on = ((self.bitmap.unsqueeze(-1) >> bit) & 1).bool()        # [T, 2, 64]
        t, word, b = on.nonzero(as_tuple=True)
        rows = tcb_win[t] * ROWS_PER_WINDOW + word * 8 + (b >> 3)
        srcs = self.cols.long()[t * COLS_PER_TCB + (b & 7)]
        order = torch.argsort(rows * max(self.num_nodes, 1) + srcs)
        return torch.stack([srcs[order], rows[order]])

    def to_dense_mask(self) -> Tensor:
        """bool [N, N]: mask[i, j] is True iff the edge j -> i exists."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool, device=self.device)
        mask[self.edge_index[1], self.edge_index[0]] = True
        return mask

    def check_nodes(self, num_nodes: int, what: str = "q") -> None:
        if num_nodes != self.num_nodes:
            raise ValueError(f"{what} has {num_nodes} nodes but the BSB graph was built for "
                             f"num_nodes={self.num_nodes}; build the format for this graph")

    def __repr__(self) -> str:
        return (f"BSBGraph(num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"num_windows={self.num_windows}, num_tcbs={self.num_tcbs}, device={self.device})")


def _gpu_builder():
    """The CUDA builder ``torch.ops.gt_fused3s.bsb_build`` (one sort, a few
    kernels, one host synchronisation; same arrays as :meth:`BSBGraph._build`),
    or None where the extension cannot run or ``GT_FUSED3S_DISABLE_KERNEL=1``."""
    if os.environ.get("GT_FUSED3S_DISABLE_KERNEL") == "1":
        return None
    from ._build import extension_available, load_extension
    return load_extension().bsb_build if extension_available() else None


def _check_num_nodes(num_nodes: Any) -> int:
    if isinstance(num_nodes, Tensor):
        num_nodes = int(num_nodes)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise ValueError(f"num_nodes must be a non-negative int (got {num_nodes!r})")
    if num_nodes > 2**31 - 1:
        raise ValueError(f"num_nodes={num_nodes} exceeds the int32 indices of the format")
    return num_nodes


# One BSB per edge_index tensor: layers called on the same graph (and every
# layer of a model) share it. Keyed by the tensor's identity and checked
# against its storage, version counter and shape, so an in-place edit or a
# new tensor rebuilds; entries die with their tensor.
_CACHE: dict[int, tuple] = {}


def cached_bsb(edge_index: Tensor, num_nodes: int | None = None) -> BSBGraph:
    """The BSB of ``edge_index``, built on first use and cached for as long
    as ``edge_index`` lives (and is not modified)."""
    if not isinstance(edge_index, Tensor):
        return BSBGraph.from_edge_index(edge_index, num_nodes)
    sig = (edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape),
           edge_index.device, num_nodes)
    key = id(edge_index)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is edge_index and hit[1] == sig:
        return hit[2]
    bsb = BSBGraph.from_edge_index(edge_index, num_nodes)
    _CACHE[key] = (weakref.ref(edge_index, lambda _, k=key: _CACHE.pop(k, None)), sig, bsb)
    return bsb
