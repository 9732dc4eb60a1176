"""DGL layer: :class:`Fused3SConv`, dot-product graph attention whose
attention runs fused over the BSB format of the graph.

Importing this module needs DGL (``pip install "gt-fused3s[dgl]"``). DGL on
PyPI is CPU-only: a DGL graph is a source of structure here, the features
may live on the GPU.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Optional

import torch
from torch import Tensor, nn

os.environ.setdefault("DGLBACKEND", "pytorch")
try:
    import dgl  # noqa: F401  (the top-level package, not this module)
    from dgl.base import DGLError
    from dgl.utils import expand_as_pair
except ImportError as e:  # ModuleNotFoundError, or DGL's own import failures
    raise ImportError('gt_fused3s.nn.dgl needs DGL, which could not be imported '
                      f'({e}); install it with: pip install "gt-fused3s[dgl]"') from e

from ..graph import check_int
from ..ops import fused3s_attention, kernel_accepts
from .fallback import warn_unfused
from .projections import project
from ..plan import GraphPlan
from ..reference import attention_reference

__all__ = ["Fused3SConv"]

_ZERO_IN_DEGREE_MSG = (
    "There are 0-in-degree nodes in the graph, "
    "output for those nodes will be invalid. "
    "This is harmful for some applications, "
    "causing silent performance regression. "
    "Adding self-loop on the input graph by "
    "calling `g = dgl.add_self_loop(g)` will resolve "
    "the issue. Setting ``allow_zero_in_degree`` "
    "to be `True` when constructing this module will "
    "suppress the check and let the code run."
)


class Fused3SConv(nn.Module):
    r"""Multi-head dot-product graph attention, fused (SDDMM, softmax and
    SpMM in one kernel over the graph's BSB format, see
    :mod:`gt_fused3s.graph`).

    .. math::
        h_i^{(l+1)} = \sum_{j\in \mathcal{N}(i)} \alpha_{i, j} W_v h_j^{(l)},
        \qquad
        \alpha_{i, j} = \mathrm{softmax}_j\left(
        \frac{(W_q h_i^{(l)})^T W_k h_j^{(l)}}{\sqrt{d}}\right)

    per head, with :math:`d` = ``out_feats``. It equals DGL's unfused
    computation with the same projections::

        graph.apply_edges(fn.u_dot_v('k', 'q', 'e'))
        graph.edata['a'] = edge_softmax(graph, graph.edata['e'] / out_feats ** 0.5)
        graph.update_all(fn.u_mul_e('v', 'a', 'm'), fn.sum('m', 'h'))

    The graph's format is built once per graph object and device (the first
    call on a graph builds it on the device of the features; later calls
    and other layers reuse it). The cache is checked against the graph's
    structure object, which DGL replaces on every in-place edit
    (``add_edges``, ``remove_edges``, ...), and its node and edge counts: an
    edited graph is rebuilt, even when the counts stay the same.

    Graphs whose source and destination node counts differ (bipartite
    graphs, the blocks of ``dgl.to_block`` from neighbour sampling) are
    fused too: rows are destinations, columns sources, both padded to
    ``max(N_src, N_dst)`` rows. ``get_attention=True`` returns the
    attention the fused kernel computes (one extra score pass). A graph with
    several edge types or an extra node type is refused with a DGLError, as
    DGL's DotGatConv refuses it: pass one relation, ``g[etype]``.

    Duplicate edges (a multigraph) count as often as they appear, as in
    DGL's edge softmax. On CUDA, a head size the kernel does not take (not
    a multiple of 8, or above 256) or fp64 features run the unfused fp32
    reference instead, with an :class:`~gt_fused3s.nn.UnfusedPathWarning`.

    Parameters
    ----------
    in_feats : int, or pair of ints
        Input feature size. A pair gives the source and destination feature
        sizes (keys and values are projected from source features, queries
        from destination features).
    out_feats : int
        Output feature size per head (the head dimension :math:`d`).
    num_heads : int
        Number of attention heads.
    bias : bool, optional
        If True, the query, key and value projections learn a bias.
        Default: ``True``.
    allow_zero_in_degree : bool, optional
        If False (default), raise a DGLError on graphs with 0-in-degree
        nodes, like DGL's convolutions. If True, those nodes output 0.

    Shapes
    ------
    - **feat**: :math:`(N, D_{in})`, or a pair :math:`(N_{src}, D_{in_{src}})`,
      :math:`(N_{dst}, D_{in_{dst}})`.
    - **output**: :math:`(N_{dst}, H, D_{out})` with :math:`H` = ``num_heads``,
      :math:`D_{out}` = ``out_feats``.
    """

    def __init__(self, in_feats, out_feats: int, num_heads: int, bias: bool = True,
                 allow_zero_in_degree: bool = False):
        super().__init__()
        out_feats, num_heads = check_int("out_feats", out_feats), check_int("num_heads", num_heads)
        self._in_src_feats, self._in_dst_feats = expand_as_pair(in_feats)
        self._out_feats = out_feats
        self._num_heads = num_heads
        self._allow_zero_in_degree = allow_zero_in_degree
        self.q_proj = nn.Linear(self._in_dst_feats, out_feats * num_heads, bias=bias)
        self.k_proj = nn.Linear(self._in_src_feats, out_feats * num_heads, bias=bias)
        self.v_proj = nn.Linear(self._in_src_feats, out_feats * num_heads, bias=bias)
        self.reset_parameters()

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: fail at once, in one line
        raise RuntimeError("Fused3SConv cannot be compiled by TorchScript (it reads DGL graphs and "
                           "its graph plans are Python objects): use torch.compile, or torch.export "
                           "for serving")

    def reset_parameters(self):
        """Reinitialise the projections (as DGL's BiasedMHA: Xavier uniform
        with gain :math:`2^{-1/2}`, zero bias)."""
        for lin in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(lin.weight, gain=2 ** -0.5)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def set_allow_zero_in_degree(self, set_value: bool):
        """Set the ``allow_zero_in_degree`` flag."""
        self._allow_zero_in_degree = set_value

    def extra_repr(self) -> str:
        in_feats = (self._in_src_feats if self._in_src_feats == self._in_dst_feats
                    else (self._in_src_feats, self._in_dst_feats))
        return (f"in_feats={in_feats}, "
                f"out_feats={self._out_feats}, num_heads={self._num_heads}")

    @staticmethod
    def to_graph_format(graph, device=None) -> GraphPlan:
        """The plan (BSB format and kernel schedules) of ``graph`` on
        ``device`` (default: the graph's), built on first use and cached for
        as long as the graph lives."""
        device = torch.device(device) if device is not None else graph.device
        return _graph_plan(graph, device)

    def forward(self, graph, feat, get_attention: bool = False, edge_bias: Optional[Tensor] = None):
        r"""Compute the attention.

        Parameters
        ----------
        graph : DGLGraph
            The graph (homogeneous, bipartite or a block: one edge type and
            one node type on each side).
        feat : torch.Tensor or pair of torch.Tensor
            :math:`(N, D_{in})` features, or a pair of source and destination
            features.
        get_attention : bool, optional
            Also return the attention values :math:`(E, H, 1)`, in the
            graph's edge order. Default: ``False``.
        edge_bias : torch.Tensor, optional
            :math:`(E, H)` (or :math:`(E, H, 1)`), in the graph's edge order:
            added to each edge's scaled score before the edge softmax (an
            attention bias, as Graphormer's spatial and edge encodings);
            differentiable. Fused like the rest. Default: ``None``.

        Returns
        -------
        torch.Tensor
            :math:`(N_{dst}, H, D_{out})`; and the attention values if
            ``get_attention``.

        Raises
        ------
        DGLError
            If there are 0-in-degree nodes in the graph and
            ``allow_zero_in_degree`` is False, the features do not match
            the graph's node counts, or the graph has several edge types or
            an extra node type (take one relation: ``g[etype]``).
        """
        if len(graph.canonical_etypes) != 1 or len(graph.srctypes) != 1 or len(graph.dsttypes) != 1:
            # as DotGatConv, which refuses them too: the edges' node ids are per node type
            raise DGLError(f"Fused3SConv takes a graph with one edge type and one node type on each "
                           f"side (homogeneous, bipartite, or a block); got node types "
                           f"{graph.ntypes} and edge types {graph.canonical_etypes}: take one "
                           f"relation, g[etype]")
        if not self._allow_zero_in_degree and _has_zero_in_degree(graph):
            raise DGLError(_ZERO_IN_DEGREE_MSG)

        n_src, n_dst = graph.num_src_nodes(), graph.num_dst_nodes()
        if isinstance(feat, (tuple, list)):
            if len(feat) != 2:
                raise DGLError(f"feat must be a tensor or a pair (feat_src, feat_dst) "
                               f"(got {len(feat)} tensors)")
            h_src, h_dst = feat
        else:
            h_src = feat
            h_dst = feat[:n_dst] if graph.is_block and isinstance(feat, Tensor) else feat
        for name, h, n, f in (("feat_src", h_src, n_src, self._in_src_feats),
                              ("feat_dst", h_dst, n_dst, self._in_dst_feats)):
            if not isinstance(h, Tensor) or not h.is_floating_point() or h.dim() != 2:
                raise DGLError(f"{name} must be a floating-point tensor [num_nodes, {f}] (got "
                               f"{h.dtype if isinstance(h, Tensor) else type(h).__name__} "
                               f"{tuple(h.shape) if isinstance(h, Tensor) else ''})")
            if h.size(0) != n or h.size(1) != f:
                raise DGLError(f"{name} has shape {tuple(h.shape)} but the graph has {n} such "
                               f"nodes and the layer expects {f} features")

        H, D = self._num_heads, self._out_feats
        if edge_bias is not None:
            if not isinstance(edge_bias, Tensor) or not edge_bias.is_floating_point():
                raise DGLError(f"edge_bias must be a floating-point tensor [num_edges, {H}] (got "
                               f"{type(edge_bias).__name__})")
            if edge_bias.dim() == 3 and edge_bias.size(-1) == 1:
                edge_bias = edge_bias.squeeze(-1)
            if tuple(edge_bias.shape) != (graph.num_edges(), H):
                raise DGLError(f"edge_bias has shape {tuple(edge_bias.shape)} but the graph has "
                               f"{graph.num_edges()} edges and the layer {H} heads: [num_edges, num_heads]")
        # the projections of one tensor as one GEMM (projections.py)
        if h_src is h_dst:
            q, k, v = project(h_dst, [self.q_proj, self.k_proj, self.v_proj])
        else:
            q, (k, v) = self.q_proj(h_dst), project(h_src, [self.k_proj, self.v_proj])
        q, k, v = (t.view(-1, H, D) for t in (q, k, v))
        scale = 1.0 / math.sqrt(D)

        # bipartite graphs and blocks: the square graph of n nodes, zero rows
        # appended to q (destinations) or k, v (sources); no edge reaches them
        n = max(n_src, n_dst)
        q, k, v = (_pad_rows(t, n) for t in (q, k, v))
        plan = _graph_plan(graph, q.device)
        if q.is_cuda and not kernel_accepts(D, q.dtype):
            warn_unfused("Fused3SConv", f"out_feats={D} in {q.dtype} (the kernel takes head sizes that are "
                         f"multiples of 8 up to 256 in fp16, bf16 or fp32)", "the unfused fp32 reference")
            out = attention_reference(q, k, v, plan.edge_index, scale, edge_bias=edge_bias,
                                      return_weights=get_attention)
        else:
            out = fused3s_attention(q, k, v, plan, scale, edge_bias=edge_bias, return_weights=get_attention)
        out, alpha = out if get_attention else (out, None)
        out = out if out.size(0) == n_dst else out[:n_dst]    # no slice (a copy in its backward) if all rows
        return (out, alpha.to(q.dtype).unsqueeze(-1)) if get_attention else out


# One entry per DGLGraph object: its plan per device and its 0-in-degree
# flag. Checked against the graph's structure index (DGL makes a new one on
# every in-place edit: an identity test, holding the old one so that its id
# cannot be reused) and the node and edge counts; entries die with their graph.
_GRAPH_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _graph_entry(graph) -> dict:
    sig = (graph.num_src_nodes(), graph.num_dst_nodes(), graph.num_edges())
    index = getattr(graph, "_graph", None)
    entry = _GRAPH_CACHE.get(graph)
    if entry is None or entry["sig"] != sig or entry["index"] is not index:
        entry = {"sig": sig, "index": index, "plan": {}, "zero_in": None}
        _GRAPH_CACHE[graph] = entry
    return entry


# The two lookups below run eagerly also under torch.compile (DGL's graph
# objects are not traced anyway): a plan the compiled graph built and the
# cache kept would hold the graph's outputs, which CUDA graphs
# (mode="reduce-overhead") overwrite at the next replay.
@torch.compiler.disable
def _has_zero_in_degree(graph) -> bool:
    entry = _graph_entry(graph)
    if entry["zero_in"] is None:
        entry["zero_in"] = bool((graph.in_degrees() == 0).any())
    return entry["zero_in"]


@torch.compiler.disable
def _graph_plan(graph, device: torch.device) -> GraphPlan:
    entry = _graph_entry(graph)
    plan = entry["plan"].get(device)
    if plan is None:
        if len(graph.canonical_etypes) != 1:
            raise DGLError("the fused attention needs a graph with one edge type")
        src, dst = graph.edges()          # in edge id order: the order of get_attention
        edge_index = torch.stack([src, dst]).to(device=device, dtype=torch.int64)
        n = max(graph.num_src_nodes(), graph.num_dst_nodes())
        plan = entry["plan"][device] = GraphPlan.from_edge_index(edge_index, n)
    return plan


def _pad_rows(t: Tensor, n: int) -> Tensor:
    """``t`` with zero rows appended up to ``n`` rows (``t`` itself if it has them)."""
    return t if t.size(0) == n else torch.nn.functional.pad(t, (0, 0, 0, 0, 0, n - t.size(0)))
