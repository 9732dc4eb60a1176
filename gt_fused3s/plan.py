"""The per-graph plan: everything the fused kernels read that depends only on
the graph, built once when the graph is prepared.

A :class:`GraphPlan` holds the graph's BSB format (rows = destinations), the
BSB of the reversed graph for the backward's dK/dV pass, and the work
schedule of each (heads, head dim) in use, with the kernels' graph
arguments flattened once. :func:`~gt_fused3s.ops.fused3s_attention` reads
it; nothing else writes into it. Prepared for a (heads, head dim) and, for
training, with its transpose, a call on the plan only launches kernels: no
host synchronisation, no allocation a CUDA graph could not replay.

Built in static mode (``static=True``, or automatically while a CUDA graph
is captured or torch.compile traces), a plan's shapes depend only on the
graph's node and edge counts and its build makes no host synchronisation,
so a new batch's plan can itself be part of a captured graph.

Built with ``window_rows=8`` (issue 13: FlashSparse's swap-and-transpose,
:mod:`~gt_fused3s.graph8`), the plan holds the 8-row format and its
transpose instead, and the op runs the 8-row kernels (plain attention:
no per-edge terms).

Built with ``reorder`` (issue 13: a locality order of the nodes,
:mod:`~gt_fused3s.reorder`), the plan's formats are those of the relabelled
graph and :func:`~gt_fused3s.ops.fused3s_attention` permutes q, k, v into
that order and the output back (four gathers), so callers see their own
node order and their own edge order throughout.
"""
from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .graph import (BSBGraph, _check_edge_index, _check_num_nodes, _check_range, _in_capture_or_compile,
                    _num_nodes_of, edge_slots, node_csr)
from .cost_model import choose_window_rows, format_features
from .graph8 import BSBGraph8
from .reorder import METHODS as REORDER_METHODS
from .reorder import NodeOrder
from .reorder import reorder as _compute_order
from .schedule import work_schedule

# orders computed without a host synchronisation (so a static build may ask for them by name)
_SYNC_FREE_METHODS = ("identity",)

_SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernel runs for ``head_dim`` (zero-padded up to it)."""
    for d in _SUPPORTED_HEAD_DIMS:
        if d >= head_dim:
            return d
    raise ValueError(f"head dim {head_dim} is above the kernel's largest ({_SUPPORTED_HEAD_DIMS[-1]})")


#: Edges from which a plan groups per-edge arrays by destination
#: (:meth:`GraphPlan.edge_grouping`): below, the gathers in and out cost more
#: than the grouped reads save (github, 578k edges: +1-8% per forward +
#: backward; the 200k power-law graph, 6.9M: -7 to -12%; H100, README).
#: ``GT_FUSED3S_EDGE_GROUPING_MIN_EDGES`` sets it (0: every plan, for tests).
EDGE_GROUPING_MIN_EDGES = int(os.environ.get("GT_FUSED3S_EDGE_GROUPING_MIN_EDGES", 1 << 20))

#: Window heights a plan's format can have: 16 (the BSB, every option) or 8
#: (:class:`~gt_fused3s.graph8.BSBGraph8`, plain attention, head dims <= 128),
#: or ``"auto"``: the cost model's choice (:meth:`GraphPlan.from_edge_index`).
WINDOW_ROWS = (16, 8, "auto")
#: Blocks of one window from which an 8-row plan warns: the 8-row kernels run
#: a window in one warp (the 16-row schedule splits long windows), so a hub's
#: window sets the kernel's length (github's, about 600 blocks: 13x slower
#: than the 16-row forward, H100, README "8-row windows").
ROWS8_WARN_BLOCKS = 64


class EdgeGrouping(NamedTuple):
    """The plan's edges grouped by destination (:meth:`GraphPlan.edge_grouping`):
    the order in which the kernels read and write per-edge arrays (bias,
    weights, dS, edge features) where the caller's order scatters them."""
    perm: Tensor                # int64 [E]: grouped position -> the caller's edge id
    inv: Tensor                 # int64 [E]: the caller's edge id -> grouped position
    slots: tuple[Tensor, ...]   # bias_args() with the grouped positions as edge ids
    dst: Tensor                 # int64 [E]: each grouped edge's row (kernel node ids)
    csr: tuple[Tensor, Tensor]  # (rowptr, arange(E)): the grouped edges by destination


class GraphPlan:
    """One graph (or block-diagonal batch) prepared for the fused kernels.

    Args:
        bsb: the graph's BSB format.
        transposed: the BSB of the reversed graph (built by :meth:`prepare`
            with ``backward=True`` if not given).
        edge_index: the edges [2, E] ``bsb`` was built from, in the order
            an ``edge_bias`` [E, H] follows (default: ``bsb.edge_index``).
        num_rows: the destinations are the first ``num_rows`` nodes (default
            all): q and the output then have ``num_rows`` rows, k and v
            ``num_nodes`` (one rank's rows of a partitioned graph, whose
            columns add the halo). No edge may point past them.
        order: a node order (:class:`~gt_fused3s.reorder.NodeOrder`) the
            BSB was built in: ``bsb`` (and ``transposed``) are the formats of
            ``order.relabel(edge_index)``, while ``edge_index`` stays the
            caller's (caller's node ids, caller's edge order). The op
            permutes q, k, v into the order and the output back. Not with
            ``num_rows``.

    Build it with :meth:`from_edge_index` (or from a BSB: ``GraphPlan(bsb)``)
    and :meth:`prepare` it for the heads and head dims of the model::

        plan = GraphPlan.from_edge_index(edge_index, num_nodes).prepare(heads=4, head_dim=32)
        out = fused3s_attention(q, k, v, plan)      # no host sync, forward and backward
    """

    def __init__(self, bsb: BSBGraph | BSBGraph8, transposed: BSBGraph | BSBGraph8 | None = None,
                 edge_index: Tensor | None = None, *, num_rows: int | None = None,
                 order: NodeOrder | None = None):
        if not isinstance(bsb, (BSBGraph, BSBGraph8)):
            raise ValueError(f"bsb must be a BSBGraph or a BSBGraph8 (got {type(bsb).__name__})")
        if transposed is not None and type(transposed) is not type(bsb):
            raise ValueError(f"transposed must be a {type(bsb).__name__}, as bsb (got {type(transposed).__name__})")
        if isinstance(bsb, BSBGraph8) and num_rows is not None and num_rows != bsb.num_nodes:
            raise ValueError("an 8-row plan needs every node as a destination (num_rows): build a "
                             "rectangular plan with the 16-row format")
        num_rows = bsb.num_nodes if num_rows is None else _check_num_nodes(num_rows)
        if num_rows > bsb.num_nodes:
            raise ValueError(f"num_rows={num_rows} is more than the graph's {bsb.num_nodes} nodes")
        if transposed is not None and (transposed.num_nodes != bsb.num_nodes
                                       or transposed.device != bsb.device):
            raise ValueError("transposed must be the BSB of the same graph reversed, on its device")
        if edge_index is not None:
            _check_edge_index(edge_index)
            if edge_index.size(1) != bsb.num_edges or edge_index.device != bsb.device:
                raise ValueError(f"edge_index must be the {bsb.num_edges} edges the BSB was built "
                                 f"from, on {bsb.device} (got {tuple(edge_index.shape)} on "
                                 f"{edge_index.device})")
        if order is not None:
            _check_order(order, bsb.num_nodes, bsb.device)
            if num_rows != bsb.num_nodes:
                raise ValueError(_RECT_REORDER.format(num_rows=num_rows, num_nodes=bsb.num_nodes))
        self.bsb = bsb
        self.transposed = transposed
        self.num_rows = num_rows    #: rows of q and of the output (destinations: the first nodes)
        #: the node order the formats are built in (None: the caller's)
        self.order: NodeOrder | None = order
        if order is None:
            self._edges = edge_index if edge_index is not None else bsb.edge_index
            self._kernel_edges = self._edges
        elif edge_index is not None:
            self._edges, self._kernel_edges = edge_index, _relabel(order, edge_index)
        else:   # the BSB's edges, in its order, back in the caller's node ids
            self._edges, self._kernel_edges = order.perm[bsb.edge_index.long()].to(bsb.edge_index.dtype), \
                bsb.edge_index
        # bias_args(): where each edge sits in the BSB and its transpose (per-edge terms)
        self._bias_args: tuple[Tensor, ...] | None = None
        # destination_csr(): the edges grouped by destination (edge-feature terms)
        self._csr: tuple[Tensor, Tensor] | None = None
        # edge_grouping(): False until decided, then an EdgeGrouping or None
        self._grouping: EdgeGrouping | None | bool = False
        # (heads, padded head dim) -> (forward arguments, backward arguments)
        self._fwd_args: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        self._bwd_args: dict[tuple[int, int], tuple[Tensor, ...]] = {}
        # built inside a region torch.compile traces: its arrays are the
        # graph's own (see _outside_graph)
        self._in_graph = torch.compiler.is_compiling()

    # ------------------------------------------------------------------ build
    @classmethod
    def from_edge_index(cls, edge_index: Tensor, num_nodes: int | None = None, *,
                        static: bool | None = None, num_rows: int | None = None,
                        reorder: str | NodeOrder | None = None, window_rows: int | str = 16) -> "GraphPlan":
        """The plan of ``edge_index`` [2, E] (row 0 sources, row 1
        destinations; duplicates count with their multiplicity), built on
        its device. ``static``: see :meth:`BSBGraph.from_edge_index`. An
        ``edge_bias`` follows the order of ``edge_index``. ``num_rows``:
        the destinations are the first ``num_rows`` nodes (checked here,
        unless static).

        ``reorder``: build the formats in a locality order of the nodes
        (issue 13; fewer tensor-core blocks where neighbours get close ids):
        ``"cuthill_mckee"`` or ``"label_propagation"`` (computed here, on
        the graph's device, see :mod:`~gt_fused3s.reorder`), ``"identity"``
        (the caller's order through the same path: the permutations' cost
        alone), or a :class:`~gt_fused3s.reorder.NodeOrder` computed ahead.
        Callers see their own order: :func:`~gt_fused3s.ops.fused3s_attention`
        gathers q, k, v into the plan's order and the output (and the
        gradients) back; edge-ordered tensors (``edge_bias``, returned
        weights, dropout mask, edge features) stay in the order of
        ``edge_index``. The orders by name make host synchronisations
        (Cuthill-McKee per BFS level, both per connected-components round),
        so a static build (``static=True``, or inside a CUDA graph capture or
        torch.compile) refuses them: build eagerly, or pass a ``NodeOrder``
        computed eagerly, which a static build applies with gathers only.
        Not with ``num_rows`` (a rectangular plan keeps the caller's order).

        ``window_rows``: 16 (the BSB: every option of the op) or 8 (the
        8-row format of :mod:`~gt_fused3s.graph8`, FlashSparse's
        swap-and-transpose: half the mma invocations on sparse graphs, which
        pays where windows are short, README "8-row windows"; plain attention
        only (no edge bias, returned weights or dropout), head dims up to
        128, every node a destination (no ``num_rows``); static builds as
        for 16 rows; an exact build warns where a window holds more than
        :data:`ROWS8_WARN_BLOCKS` blocks, since its kernels do not split one).
        ``"auto"`` (for plain attention, head dims up to 128): the 8-row
        format where the cost model fitted on the GPU predicts it faster,
        forward + backward, from both formats' counts in every (heads, head
        dim) setting of its fit, else the 16-row one
        (:mod:`~gt_fused3s.cost_model`, README "Choosing the window rows";
        :func:`~gt_fused3s.cost_model.choose_window_rows` chooses for your
        heads and head dim); the 16-row format for a static build (the
        counts need a host read-back) or with ``num_rows``.
        :attr:`window_rows` tells which was built.
        """
        if window_rows not in WINDOW_ROWS:
            raise ValueError(f"window_rows must be 16, 8 or 'auto' (got {window_rows!r})")
        chosen = window_rows == "auto"
        if chosen:
            is_static = _in_capture_or_compile() if static is None else bool(static)
            window_rows = 16
            if not is_static and num_rows is None:
                edge_index = _check_edge_index(edge_index)
                num_nodes = _num_nodes_of(edge_index, num_nodes, False)
                if reorder is not None:                          # the order computed once, counted in it
                    reorder = _node_order(edge_index, num_nodes, reorder, False)
                counted = edge_index if reorder is None else _relabel(reorder, edge_index)
                window_rows = choose_window_rows(format_features(counted, num_nodes))
        if window_rows == 8:       # the model weighed the long windows the warning is about
            return cls._from_edge_index8(edge_index, num_nodes, static, num_rows, reorder, warn=not chosen)
        if reorder is None:
            bsb = BSBGraph.from_edge_index(edge_index, num_nodes, static=static)
            if num_rows is not None and num_rows < bsb.num_nodes and not bsb.static and edge_index.numel():
                _check_range("edge_index[1] (destinations)", edge_index[1], 0, num_rows)
            return cls(bsb, edge_index=edge_index, num_rows=num_rows)
        edge_index = _check_edge_index(edge_index)
        num_nodes = _num_nodes_of(edge_index, num_nodes, False)
        if num_rows is not None and _check_num_nodes(num_rows) != num_nodes:
            raise ValueError(_RECT_REORDER.format(num_rows=num_rows, num_nodes=num_nodes))
        is_static = _in_capture_or_compile() if static is None else bool(static)
        order = _node_order(edge_index, num_nodes, reorder, is_static)
        bsb = BSBGraph.from_edge_index(_relabel(order, edge_index), num_nodes, static=static)
        return cls(bsb, edge_index=edge_index, order=order)

    @classmethod
    def _from_edge_index8(cls, edge_index, num_nodes, static, num_rows, reorder, warn: bool = True) -> "GraphPlan":
        """:meth:`from_edge_index` with ``window_rows=8`` (``warn``: about a
        long window, which a static build cannot see without a host sync)."""
        is_static = _in_capture_or_compile() if static is None else bool(static)
        edge_index = _check_edge_index(edge_index)
        num_nodes = _num_nodes_of(edge_index, num_nodes, is_static)
        if num_rows is not None and _check_num_nodes(num_rows) != num_nodes:
            raise ValueError("an 8-row plan needs every node as a destination (num_rows): build a "
                             "rectangular plan with the 16-row format")
        order = None if reorder is None else _node_order(edge_index, num_nodes, reorder, is_static)
        fmt = BSBGraph8.from_edge_index(edge_index if order is None else _relabel(order, edge_index), num_nodes,
                                        static=is_static)
        longest = fmt.max_window_blocks() if warn and not is_static else 0
        if longest > ROWS8_WARN_BLOCKS:
            warnings.warn(f"gt_fused3s: a window of this graph's 8-row format holds {longest} blocks (more than "
                          f"{ROWS8_WARN_BLOCKS}), which one warp walks alone: the 8-row kernels will be slow "
                          f"here (hubs); the default 16-row format splits long windows", RuntimeWarning,
                          stacklevel=3)
        return cls(fmt, edge_index=edge_index, order=order)

    @property
    def window_rows(self) -> int:
        """Rows of the format's windows: 16 (the BSB) or 8 (BSBGraph8)."""
        return 8 if isinstance(self.bsb, BSBGraph8) else 16

    def prepare(self, heads: int, head_dim: int, *, backward: bool = True,
                edge_bias: bool = False, edge_features: bool = False) -> "GraphPlan":
        """Build the kernels' schedules for ``heads`` heads of ``head_dim``
        (and, with ``backward``, the transposed BSB and its schedule; with
        ``edge_bias``, where each edge sits in both formats; with
        ``edge_features``, that and the edges grouped by destination), so
        that a call of :func:`~gt_fused3s.ops.fused3s_attention` (or
        :func:`~gt_fused3s.edge_terms.edge_feature_attention`) on this plan
        builds nothing. Idempotent; returns ``self``. Under torch.compile,
        what a plan passed in lacks is built outside the compiled graph (a
        graph break, which ``fullgraph=True`` refuses): prepare it ahead."""
        self.forward_args(heads, padded_head_dim(head_dim))
        if backward:
            self.backward_args(heads, padded_head_dim(head_dim))
        if edge_bias or edge_features:
            self.bias_args()
            self.edge_grouping()
        if edge_features:
            self.destination_csr()
        return self

    def _outside_graph(self) -> bool:
        """Whether an array missing from this plan must be built outside the
        graph torch.compile traces: a plan passed into a compiled region
        outlives the call, and arrays the graph built and stored on it would
        be the graph's outputs, which CUDA graphs (``mode="reduce-overhead"``)
        overwrite at the next replay: a compiled Fused3SConv step on an
        unprepared plan failed at its second step with "accessing tensor
        output of CUDAGraphs that has been overwritten" (H200, torch 2.11).
        Built eagerly instead (:func:`_build_eagerly`: one graph break, on
        the call that finds the plan unprepared, which ``fullgraph=True``
        refuses; the recompiled graph then reads the arrays as inputs; five
        steps then equal eager). A plan built inside the region lives in it."""
        return torch.compiler.is_compiling() and not self._in_graph

    def forward_args(self, heads: int, head_dim: int) -> tuple[Tensor, ...]:
        """The forward kernel's graph arguments (rw_offset, cols, bitmap,
        window_order, items, slots) for a padded ``head_dim``; built on
        first use (a plan prepared for them builds nothing here)."""
        args = self._fwd_args.get((heads, head_dim))
        if args is None and self._outside_graph():
            return _build_eagerly(self.forward_args, heads, head_dim)
        if args is None and self.window_rows == 8:
            # the 8-row kernels' four arrays: one warp a window, no schedule
            args = self._fwd_args[heads, head_dim] = _rows8_args(self.bsb, head_dim)
        if args is None:
            b = self.bsb
            items, slots = work_schedule(b, heads, head_dim)
            args = self._fwd_args[heads, head_dim] = (b.rw_offset, b.cols, b.bitmap, b.window_order,
                                                      items, slots)
        return args

    def backward_args(self, heads: int, head_dim: int) -> tuple[Tensor, ...]:
        """The dK/dV pass's graph arguments (transposed cols, bitmap, items,
        slots); the dQ pass reuses :meth:`forward_args`."""
        args = self._bwd_args.get((heads, head_dim))
        if args is None and self._outside_graph():
            return _build_eagerly(self.backward_args, heads, head_dim)
        if args is None and self.window_rows == 8:
            args = self._bwd_args[heads, head_dim] = _rows8_args(self._transposed(), head_dim)
        if args is None:
            t = self._transposed()
            items, slots = work_schedule(t, heads, head_dim)
            args = self._bwd_args[heads, head_dim] = (t.cols, t.bitmap, items, slots)
        return args

    def bias_args(self) -> tuple[Tensor, ...]:
        """The kernels' per-edge arguments (:func:`~gt_fused3s.graph.edge_slots`),
        for an ``edge_bias`` or weights in the order of :attr:`edge_index`:
        ``nnz_offset``, ``slot_edge`` and ``slot_pos`` of the BSB, then those
        of the transposed BSB."""
        if self.window_rows == 8:
            raise ValueError(ROWS8_NO_EDGE_TERMS)
        if self._bias_args is None and self._outside_graph():
            return _build_eagerly(self.bias_args)
        if self._bias_args is None:
            # the edges in the formats' node ids, in the caller's edge order:
            # slot_edge holds the caller's edge ids
            e = self._kernel_edges
            self._bias_args = (*edge_slots(self.bsb, e), *edge_slots(self._transposed(), e.flip(0)))
        return self._bias_args

    def destination_csr(self) -> tuple[Tensor, Tensor]:
        """The edges of :attr:`edge_index` grouped by destination,
        ``(rowptr, order)`` (:func:`~gt_fused3s.graph.node_csr`): what the
        edge-feature sums over a node's in-edges read, one group per
        destination row (:attr:`num_rows`). Built on first use."""
        if self._csr is None and self._outside_graph():
            return _build_eagerly(self.destination_csr)
        if self._csr is None:
            self._csr = node_csr(self._edges[1], self.num_rows)
        return self._csr

    def edge_grouping(self) -> EdgeGrouping | None:
        """The edges grouped by destination, for the kernels' per-edge arrays,
        where the caller's order is not so already: None for a plan whose
        edges come grouped (the npz graphs, a CSR's edges, DGL's), of fewer
        than :data:`EDGE_GROUPING_MIN_EDGES` edges, for a static plan and
        inside a capture or a compiled region (deciding
        takes a host synchronisation, made once per plan: by :meth:`prepare`
        with ``edge_bias`` or ``edge_features``, else by the first eager
        call). PyG's coalesced order is by source: through it, the kernels'
        per-edge reads and writes scatter over memory (200k power-law graph,
        H100: the attention with a bias 1.49x -> 1.77x the plain one, with
        16 edge features 2.84x -> 3.69x, README); the op gathers the per-edge
        arrays into this order once per call and the outputs back."""
        if self._grouping is not False:
            return self._grouping
        if self.num_edges < max(EDGE_GROUPING_MIN_EDGES, 1):
            self._grouping = None
            return None
        if self.static or _in_capture_or_compile():
            return None                # decided on a later eager call, if any
        dst = self._kernel_edges[1].long()
        if bool((dst[1:] >= dst[:-1]).all()):        # already grouped (the one host sync)
            self._grouping = None
            return None
        # the kernels' rows are the caller's nodes unless the plan is reordered
        if self.order is None:
            rowptr, perm = self.destination_csr()
            grouped = dst[perm]
        else:
            perm = torch.sort(dst, stable=True).indices
            grouped = dst[perm]
            rowptr = torch.searchsorted(grouped, torch.arange(self.num_rows + 1, device=dst.device))
        positions = torch.arange(perm.numel(), device=perm.device)
        inv = torch.empty_like(perm)
        inv[perm] = positions
        nnz, slot_edge, pos, t_nnz, t_slot_edge, t_pos = self.bias_args()
        slots = (nnz, inv[slot_edge.long()].int(), pos, t_nnz, inv[t_slot_edge.long()].int(), t_pos)
        self._grouping = EdgeGrouping(perm, inv, slots, grouped, (rowptr, positions))
        return self._grouping

    def _transposed(self) -> BSBGraph | BSBGraph8:
        if self.transposed is None:
            b = self.bsb
            self.transposed = (BSBGraph8.from_edge_index(b.edge_index.flip(0), b.num_nodes, static=b.static)
                               if isinstance(b, BSBGraph8) else
                               BSBGraph.from_edge_index(b.edge_index.flip(0), b.num_nodes, static=b.static))
        return self.transposed

    # ------------------------------------------------------------- properties
    @property
    def num_nodes(self) -> int:
        return self.bsb.num_nodes

    @property
    def device(self) -> torch.device:
        return self.bsb.device

    @property
    def static(self) -> bool:
        return self.bsb.static

    @property
    def edge_index(self) -> Tensor:
        """The graph's edges [2, E] (duplicates included), in the order an
        ``edge_bias`` follows: as given to :meth:`from_edge_index`."""
        return self._edges

    @property
    def kernel_edge_index(self) -> Tensor:
        """The edges as the kernels see them: :attr:`edge_index` in the
        plan's node order (itself without a reorder), same edge order."""
        return self._kernel_edges

    @property
    def num_edges(self) -> int:
        return self.bsb.num_edges

    def to(self, device: torch.device | str) -> "GraphPlan":
        """A copy on ``device`` (``self`` if already there), to be prepared there."""
        device = torch.device(device)
        if device == self.device:
            return self
        order = self.order
        if order is not None:
            order = NodeOrder(order.perm.to(device), order.inv.to(device), order.method)
        return GraphPlan(self.bsb.to(device),
                         self.transposed.to(device) if self.transposed is not None else None,
                         self._edges.to(device), num_rows=self.num_rows, order=order)

    def __repr__(self) -> str:
        prepared = sorted(self._fwd_args)
        rows = f", num_rows={self.num_rows}" if self.num_rows != self.num_nodes else ""
        if self.order is not None:
            rows += f", reorder={self.order.method!r}"
        return (f"GraphPlan({self.bsb!r}{rows}, backward={self.transposed is not None}, "
                f"prepared (heads, head_dim)={prepared})")


ROWS8_NO_EDGE_TERMS = ("an 8-row plan (window_rows=8) runs plain attention: an edge_bias, returned weights, "
                       "dropout or edge features need the 16-row format (GraphPlan.from_edge_index(..., "
                       "window_rows=16), the default)")


def _node_order(edge_index: Tensor, num_nodes: int, reorder: str | NodeOrder, is_static: bool) -> NodeOrder:
    """The node order ``reorder`` asks for (a method's name, computed here,
    or a ``NodeOrder``, checked), after the edges' range check (on the device
    in a static build, which takes only sync-free methods)."""
    if is_static:
        # no host check: an index out of range fails on the device, as in the static builder
        if edge_index.numel():
            torch._assert_async(((edge_index >= 0) & (edge_index < num_nodes)).all(),
                                "gt_fused3s: edge_index has an index outside [0, num_nodes)")
    else:
        _check_range("edge_index", edge_index, 0, num_nodes)   # before an order reads it
    if isinstance(reorder, str):
        if reorder not in REORDER_METHODS:
            raise ValueError(f"reorder must be None, one of {REORDER_METHODS} or a NodeOrder "
                             f"(got {reorder!r})")
        if is_static and reorder not in _SYNC_FREE_METHODS:
            raise ValueError(
                f"reorder={reorder!r} computes its order with host synchronisations, which a "
                f"static build (static=True, a CUDA graph capture, torch.compile) cannot make: "
                f"build the plan eagerly, or compute the order ahead (order = "
                f"gt_fused3s.reorder.reorder(edge_index, num_nodes, {reorder!r})) and pass "
                f"reorder=order")
        return _compute_order(edge_index, num_nodes, reorder)
    if isinstance(reorder, NodeOrder):
        _check_order(reorder, num_nodes, edge_index.device, exact=not is_static)
        return reorder
    raise ValueError(f"reorder must be None, one of {REORDER_METHODS} or a NodeOrder "
                     f"(got {type(reorder).__name__})")


def _rows8_args(fmt: BSBGraph8, head_dim: int) -> tuple[Tensor, ...]:
    """The 8-row kernels' arguments of one format: rw_offset, cols, bitmap
    and its windows heaviest first (:meth:`BSBGraph8.window_items`)."""
    if head_dim > 128:
        raise ValueError(f"an 8-row plan (window_rows=8) takes head dims up to 128 (got {head_dim}); "
                         f"use the 16-row format")
    return fmt.rw_offset, fmt.cols, fmt.bitmap, fmt.window_items()


_RECT_REORDER = ("a reordered plan needs every node as a destination (num_rows={num_rows} of "
                 "{num_nodes} nodes): a rectangular plan, such as a partitioned rank's, keeps the "
                 "caller's order (build it without reorder)")


@torch.compiler.disable
def _build_eagerly(build, *args):
    """``build(*args)`` (a plan's array builder) run eagerly, also when
    torch.compile traces the caller (GraphPlan._outside_graph)."""
    return build(*args)


def _relabel(order: NodeOrder, edge_index: Tensor) -> Tensor:
    """``edge_index`` in ``order``'s node ids (edge order kept), clamped into
    range first, so that a static build never gathers out of bounds (its
    indices are checked on the device)."""
    n = order.num_nodes
    return order.inv[edge_index.long().clamp(0, max(n - 1, 0))].to(edge_index.dtype)


def _check_order(order: NodeOrder, num_nodes: int, device: torch.device, *, exact: bool = False) -> None:
    """``order`` is a NodeOrder of ``num_nodes`` nodes on ``device``; with
    ``exact`` (a host synchronisation) also that perm and inv are inverse
    permutations."""
    if not isinstance(order, NodeOrder):
        raise ValueError(f"order must be a gt_fused3s.reorder.NodeOrder (got {type(order).__name__})")
    for name in ("perm", "inv"):
        t = getattr(order, name)
        if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"order.{name} must be a 1-D int32/int64 tensor")
        if t.numel() != num_nodes or t.device != device:
            raise ValueError(f"order.{name} has {t.numel()} entries on {t.device} but the graph has "
                             f"{num_nodes} nodes on {device}")
    if exact and num_nodes:
        perm, inv = order.perm.long(), order.inv.long()
        in_range = bool(((perm >= 0) & (perm < num_nodes) & (inv >= 0) & (inv < num_nodes)).all())
        if not (in_range and torch.equal(inv[perm], torch.arange(num_nodes, device=device))):
            raise ValueError("order.perm must be a permutation of the nodes and order.inv its inverse")


def as_plan(graph: Any, num_nodes: int | None = None) -> GraphPlan:
    """``graph`` as a plan: a :class:`GraphPlan` as is, the plan of a
    :class:`BSBGraph` (one per BSB object, kept for as long as it lives), or
    a plan built now for an ``edge_index`` tensor. Nothing is cached for a
    tensor: its memory can change without torch noticing (an array refilled
    through ``torch.from_numpy``, an edit through ``.data``), and a reused
    plan would then be silently stale. Build a plan once and pass it, or ask
    for :func:`cached_plan`, to reuse one."""
    if isinstance(graph, GraphPlan):
        return graph
    if isinstance(graph, BSBGraph):
        plan = _BSB_PLANS.get(graph)
        if plan is None:
            plan = _BSB_PLANS[graph] = GraphPlan(graph)
            plan._in_graph = False      # kept: it outlives a compiled call that made it
        return plan
    if isinstance(graph, Tensor):
        return GraphPlan.from_edge_index(graph, num_nodes)   # static while captured or compiled
    raise ValueError(f"graph must be a GraphPlan, a BSBGraph or an edge_index tensor "
                     f"(got {type(graph).__name__})")


_BSB_PLANS: "weakref.WeakKeyDictionary[BSBGraph, GraphPlan]" = weakref.WeakKeyDictionary()

# One plan per edge_index tensor, for callers that ask for caching
# (Fused3SConv(cached=True)). Keyed by the tensor's identity and checked
# against its storage, version counter and shape, so an in-place edit
# through torch or a new tensor rebuilds; entries die with their tensor.
_CACHE: dict[int, tuple] = {}


def cached_plan(edge_index: Tensor, num_nodes: int | None = None) -> GraphPlan:
    """The plan of ``edge_index``, built on first use and cached for as long
    as ``edge_index`` lives (and is not modified through torch: the cache
    sees the tensor's version counter, not writes that bypass it, such as a
    numpy array behind ``torch.from_numpy`` refilled in place; use it only
    for a graph that stays fixed, as with PyG's ``cached=True``). While a CUDA graph is
    captured or torch.compile traces, a static plan is built on every call
    instead (no cache can be checked there): pass a plan built ahead to
    share one build between layers."""
    _check_edge_index(edge_index)
    if num_nodes is not None:
        num_nodes = _check_num_nodes(num_nodes)
    if _in_capture_or_compile():
        return GraphPlan.from_edge_index(edge_index, num_nodes, static=True)
    sig = (edge_index.data_ptr(), edge_index._version, tuple(edge_index.shape),
           edge_index.device, num_nodes)
    key = id(edge_index)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is edge_index and hit[1] == sig:
        return hit[2]
    # The plan keeps a view of the edges (their order is the edge bias's),
    # not the tensor itself, whose death clears the entry.
    plan = GraphPlan.from_edge_index(edge_index.detach()[:], num_nodes)
    _CACHE[key] = (weakref.ref(edge_index, lambda _, k=key: _CACHE.pop(k, None)), sig, plan)
    return plan
