"""PyTorch Geometric layer: :class:`Fused3SConv`, a drop-in for
:class:`torch_geometric.nn.TransformerConv` whose attention runs fused."""
from __future__ import annotations

import math
import warnings
import weakref
from typing import Optional, Tuple, Union

import torch
from torch import Tensor
from torch_geometric.nn import TransformerConv
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.typing import SparseTensor

from ..graph import BSBGraph, _check_index_tensor, _check_range, _in_capture_or_compile, check_int
from .. import ops
from ..edge_terms import edge_feature_attention
from .fallback import PlanRebuildWarning, UnfusedPathWarning, warn_unfused
from .projections import project
from ..ops import fused3s_attention, kernel_accepts
from ..plan import GraphPlan, as_plan, cached_plan

__all__ = ["Fused3SConv", "UnfusedPathWarning"]

# Hook tables of MessagePassing that only its own propagate() calls: when one
# is in use, the layer takes the unfused path so that the hooks still run.
_HOOK_TABLES = (
    "_propagate_forward_pre_hooks", "_propagate_forward_hooks",
    "_message_forward_pre_hooks", "_message_forward_hooks",
    "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
    "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
)


class Fused3SConv(TransformerConv):
    r"""The graph transformer operator of
    :class:`~torch_geometric.nn.conv.TransformerConv` with its attention
    fused into one kernel (SDDMM, softmax and SpMM over the BSB format of
    the graph, see :mod:`gt_fused3s.graph`).

    .. math::
        \mathbf{x}^{\prime}_i = \mathbf{W}_1 \mathbf{x}_i +
        \sum_{j \in \mathcal{N}(i)} \alpha_{i,j} \mathbf{W}_2 \mathbf{x}_{j},
        \qquad
        \alpha_{i,j} = \textrm{softmax}_j \left(
        \frac{(\mathbf{W}_3\mathbf{x}_i)^{\top} (\mathbf{W}_4\mathbf{x}_j)}
        {\sqrt{d}} \right)

    per head, followed by concatenation (or the mean) of the heads, the root
    weight :math:`\mathbf{W}_1 \mathbf{x}_i` and the optional :math:`\beta`
    gating, all exactly as in :class:`TransformerConv`. The class subclasses
    it: constructor, parameter names, :meth:`reset_parameters`, ``repr`` and
    ``state_dict`` are shared, so a :class:`TransformerConv` checkpoint loads
    with ``strict=True`` (and back).

    The graph's plan (its BSB format, transposed format and kernel
    schedules, :class:`~gt_fused3s.plan.GraphPlan`) is what the kernel
    reads. Build it once with :meth:`to_graph_format` (and
    :meth:`~gt_fused3s.plan.GraphPlan.prepare` it) and pass it as
    ``edge_index`` to every call and every layer on that graph: then a
    forward and backward make no host synchronisation and can be captured
    in a CUDA graph. Given an ``edge_index`` tensor (or a sparse
    adjacency), the layer builds the plan for the call, as PyG's layers
    take no cache unless asked: with ``cached=True`` it keeps the plan of
    each tensor for as long as the tensor lives unmodified through torch
    (for a fixed graph: a tensor refilled behind torch's back, e.g. through
    ``torch.from_numpy``, would reuse a stale plan). Under
    ``torch.compile`` a plan passed in is read as is (what it lacks is
    built outside the compiled graph, a graph break: prepare it); an
    ``edge_index`` is turned into a static plan inside the compiled region,
    once per call,
    unless ``cached=True``: the plan an earlier call cached for the same
    tensor is then read as is (found by identity: an in-place edit of the
    tensor is not seen there), and on a tensor no call cached yet the plan
    is built outside the compiled graph (a graph break on that call, which
    ``fullgraph=True`` refuses: call the layer once eagerly, or pass a plan).

    CUDA inputs take the fused kernel (fp32 features are computed with fp16
    tensor-core operands and fp32 accumulation); CPU inputs take the
    reference implementation of the same function.

    Edge features (``edge_dim``) are fused without an [E, H, C] tensor: the
    key term :math:`\mathbf{q}_i^{\top} \mathbf{W}_e \mathbf{a}_{ij}` is an
    attention bias :math:`(\mathbf{W}_e^{\top} \mathbf{q}_i)^{\top}
    \mathbf{a}_{ij}` of the fused kernel, and the value term
    :math:`\sum_j \alpha_{ij} \mathbf{W}_e \mathbf{a}_{ij} = \mathbf{W}_e
    \sum_j \alpha_{ij} \mathbf{a}_{ij}` is built from the attention
    weights the kernel returns (their gradient enters the fused backward);
    the products with the raw features are CUDA kernels of their own
    (:func:`gt_fused3s.edge_terms.edge_feature_attention`).
    ``return_attention_weights`` returns those weights (in the order of the
    given ``edge_index``).

    Attention dropout (``dropout > 0`` while training) runs in the kernel:
    its mask is a counter-based hash of a seed drawn per call, regenerated
    in the backward (:func:`gt_fused3s.ops.dropout_keep` computes it): from
    torch's CPU generator when the call runs eagerly, on the GPU inside
    ``torch.compile`` or a captured CUDA graph, whose every call or replay
    then draws a new mask (the kernels read the seed from device memory).
    It follows the same distribution as TransformerConv's ``F.dropout``,
    not its random stream.

    What the fused path does not do takes :class:`TransformerConv`'s own
    unfused path (``super().forward``), with its exact results, and says so
    with an :class:`UnfusedPathWarning` naming the reason (not inside
    ``torch.compile``, which cannot trace a warning):

    - ``edge_attr`` without ``edge_dim`` (TransformerConv adds it to the
      values as is), a sparse adjacency whose values are feature vectors,
      and edge features or attention weights with a ``SparseTensor``
      adjacency (with a ``torch.sparse`` COO or CSR adjacency both are
      fused, in the order of its non-zeros, as TransformerConv takes and
      returns them),
    - ``aggr`` other than ``"add"``, ``flow="target_to_source"``, explain
      mode and registered message-passing hooks,
    - on CUDA, a head size ``out_channels`` the kernel does not take (not a
      multiple of 8 or above 256) or fp64 features.

    A plan of 8-row windows (``GraphPlan.from_edge_index(...,
    window_rows=8)``, the README's "8-row windows") runs plain attention
    only: with it, ``edge_dim``, ``return_attention_weights`` and dropout
    while training raise a ``ValueError`` naming the 16-row format.

    Duplicate edges count as often as they appear, exactly as in
    :class:`TransformerConv`.

    Args:
        in_channels (int or tuple): Size of each input sample, or :obj:`-1`
            to derive the size from the first input(s) to the forward method.
            A tuple corresponds to the sizes of source and target
            dimensionalities.
        out_channels (int): Size of each output sample (the head size
            :math:`d`).
        heads (int, optional): Number of attention heads. (default: :obj:`1`)
        concat (bool, optional): If set to :obj:`False`, the heads are
            averaged instead of concatenated. (default: :obj:`True`)
        beta (bool, optional): If set, combines aggregation and skip
            information as in :class:`TransformerConv`. (default: :obj:`False`)
        dropout (float, optional): Dropout probability of the normalized
            attention coefficients (fused, while training).
            (default: :obj:`0.`)
        edge_dim (int, optional): Edge feature dimensionality.
            (default: :obj:`None`)
        bias (bool, optional): If set to :obj:`False`, the layer will not
            learn an additive bias. (default: :obj:`True`)
        root_weight (bool, optional): If set to :obj:`False`, the layer will
            not add the transformed root node features to the output and the
            option :attr:`beta` is set to :obj:`False`. (default: :obj:`True`)
        cached (bool, optional): If set to :obj:`True`, the plan of an
            ``edge_index`` tensor (or sparse adjacency) is built on first
            use and reused for as long as that tensor lives unmodified
            through torch, as PyG's ``cached=True`` for transductive
            learning on one fixed graph; under ``torch.compile`` too
            (below). (default: :obj:`False`: built for
            every call; pass a plan from :meth:`to_graph_format` to reuse
            one explicitly. A build costs more than the layer: a
            :class:`~gt_fused3s.nn.PlanRebuildWarning` says when a call
            builds the plan of the tensor, unchanged, of the last build)
        **kwargs (optional): Additional arguments of
            :class:`torch_geometric.nn.conv.MessagePassing`.

    Shapes:
        - **input:**
          node features :math:`(|\mathcal{V}|, F_{in})` or
          :math:`((|\mathcal{V_s}|, F_{s}), (|\mathcal{V_t}|, F_{t}))`
          if bipartite,
          edge indices :math:`(2, |\mathcal{E}|)` (int32 or int64, row 0 = source),
          a sparse adjacency :math:`(|\mathcal{V_t}|, |\mathcal{V_s}|)` or a
          :class:`~gt_fused3s.plan.GraphPlan` (or
          :class:`~gt_fused3s.graph.BSBGraph`),
          edge features :math:`(|\mathcal{E}|, D)` *(optional)*
        - **output:** node features :math:`(|\mathcal{V}_t|, H * F_{out})`
          (:math:`(|\mathcal{V}_t|, F_{out})` if :obj:`concat=False`), or
          :math:`((|\mathcal{V}_t|, H * F_{out}), ((2, |\mathcal{E}|),
          (|\mathcal{E}|, H)))` if :obj:`return_attention_weights` is a bool
    """

    def __init__(
        self,
        in_channels: Union[int, Tuple[int, int]],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.,
        edge_dim: Optional[int] = None,
        bias: bool = True,
        root_weight: bool = True,
        cached: bool = False,
        **kwargs,
    ):
        out_channels, heads = check_int("out_channels", out_channels), check_int("heads", heads)
        # numpy integers are ints here (-1: lazy, as in TransformerConv)
        in_channels = (tuple(check_int("in_channels", c, -1) for c in in_channels)
                       if isinstance(in_channels, (tuple, list)) else check_int("in_channels", in_channels, -1))
        super().__init__(in_channels, out_channels, heads=heads, concat=concat,
                         beta=beta, dropout=dropout, edge_dim=edge_dim, bias=bias,
                         root_weight=root_weight, **kwargs)
        self.cached = bool(cached)
        # cached=True: (edge_index, its plan) of the last call, which a call
        # under torch.compile finds by identity (_plan_of)
        self._cached_hit = None
        # PyG compiles propagate() per class on first construction and keeps
        # the class's previous one as _orig_propagate, which explain mode and
        # decomposed layers call. For this subclass, built after a
        # TransformerConv, that previous one is TransformerConv's compiled
        # propagate, which skips explain masks: point it at the original.
        cls = type(self)
        if "_orig_propagate" in cls.__dict__ and cls.__dict__["_orig_propagate"] is not MessagePassing.propagate:
            cls._orig_propagate = MessagePassing.propagate

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: fail at once, in one line
        raise RuntimeError("Fused3SConv cannot be compiled by TorchScript (its graph plans are Python "
                           "objects): use torch.compile, or torch.export for serving")

    @staticmethod
    def to_graph_format(edge_index: Tensor, num_nodes: Optional[int] = None) -> GraphPlan:
        r"""Converts a graph to the plan that :meth:`forward` takes as
        ``edge_index`` (its BSB format, see :mod:`gt_fused3s.graph` for the
        layout; :meth:`~gt_fused3s.plan.GraphPlan.prepare` it for the
        layer's ``heads`` and ``out_channels`` to build its kernel schedules
        ahead too).

        Build it once, on the device of the node features, and pass it to
        every call on this graph (a later edit of ``edge_index`` does not
        reach it).

        Args:
            edge_index (torch.Tensor): The edge indices :math:`(2, |\mathcal{E}|)`
                (row 0 = source, row 1 = destination), or a sparse adjacency
                :math:`(N, N)` (``adj_t``: entry ``[i, j]`` is the edge
                ``j -> i``).
            num_nodes (int, optional): The number of nodes. Pass it: isolated
                trailing nodes cannot be inferred. (default: :obj:`None`,
                ``edge_index.max() + 1``)
        """
        if isinstance(edge_index, (GraphPlan, BSBGraph)):
            return as_plan(edge_index)
        if _is_sparse(edge_index):
            return _sparse_plan(edge_index, cached=False)
        return as_plan(edge_index, num_nodes)

    def _plan_of(self, edge_index, num_nodes: int, per_edge: bool) -> GraphPlan:
        """The plan of a forward's ``edge_index``: built for the call, or
        cached per tensor with ``cached=True`` (under torch.compile too:
        found by identity, or looked up outside the graph,
        :func:`_cached_plan_eagerly`).
        per_edge: the call takes the kernels' per-edge arguments (edge
        features, attention weights or dropout)."""
        if self.cached and isinstance(edge_index, (Tensor, SparseTensor)):
            hit = self._cached_hit
            if torch.compiler.is_compiling():
                # traced: the plan of an earlier call on this tensor (an
                # identity test, no graph break), else one looked up outside
                # the graph, which a recompiled graph then finds here
                if hit is not None and hit[0] is edge_index:
                    return hit[1]
                return _cached_plan_eagerly(self, edge_index, num_nodes, per_edge)
            plan = _cached_plan(edge_index, num_nodes)
            if hit is None or hit[0] is not edge_index or hit[1] is not plan:
                self._cached_hit = (edge_index, plan)
            return plan
        if isinstance(edge_index, Tensor) and not _is_sparse(edge_index) and not _in_capture_or_compile():
            _note_build(edge_index)
        return self.to_graph_format(edge_index, num_nodes)

    def forward(  # noqa: D417
        self,
        x: Union[Tensor, Tuple[Tensor, Tensor]],
        edge_index: Union[Tensor, SparseTensor, GraphPlan, BSBGraph],
        edge_attr: Optional[Tensor] = None,
        return_attention_weights: Optional[bool] = None,
    ):
        r"""Runs the forward pass of the module.

        Args:
            x (torch.Tensor or (torch.Tensor, torch.Tensor)): The input node
                features.
            edge_index (torch.Tensor, SparseTensor or GraphPlan): The edge
                indices, a sparse adjacency, or the graph's plan from
                :meth:`to_graph_format`.
            edge_attr (torch.Tensor, optional): The edge features
                :math:`(|\mathcal{E}|, D)`, in the order of ``edge_index``
                (of :attr:`GraphPlan.edge_index` for a plan; not with a
                :class:`BSBGraph`, whose edges are reordered).
                (default: :obj:`None`)
            return_attention_weights (bool, optional): If set to a bool,
                additionally returns :obj:`(edge_index, attention_weights)`.
                (default: :obj:`None`)
        """
        x_src, x_dst = self._check_x(x)
        n_src, n_dst = x_src.size(0), x_dst.size(0)
        is_plan = isinstance(edge_index, (GraphPlan, BSBGraph))
        n = max(n_src, n_dst)      # a bipartite graph runs as a square one of n nodes
        if is_plan:
            if n != edge_index.num_nodes:
                raise ValueError(f"x has {n_src} source and {n_dst} destination nodes but the "
                                 f"{type(edge_index).__name__} passed as edge_index was built for "
                                 f"num_nodes={edge_index.num_nodes} (max(sources, destinations) "
                                 f"= {n} needed)")
            if edge_attr is not None and isinstance(edge_index, BSBGraph):
                raise ValueError("edge_attr cannot be used with a BSBGraph (its edges are reordered); "
                                 "pass the edge_index tensor or a GraphPlan built from it")
        self._check_edge_index(edge_index, n_src, n_dst, x_dst.device)

        reason = self._unfused_reason(x_dst, edge_index, edge_attr, return_attention_weights)
        if reason is not None:
            warn_unfused("Fused3SConv", reason, "TransformerConv's unfused message passing")
            if is_plan:
                edge_index = edge_index.edge_index
            elif isinstance(edge_index, Tensor) and not _is_sparse(edge_index):
                # propagate() does not check ranges: give the clear error here
                _check_range("edge_index[0]", edge_index[0], 0, n_src)
                _check_range("edge_index[1]", edge_index[1], 0, n_dst)
            return super().forward(x, edge_index, edge_attr, return_attention_weights)

        H, C = self.heads, self.out_channels
        if n_src != n_dst and isinstance(edge_index, Tensor) and not _is_sparse(edge_index) \
                and not torch.compiler.is_compiling():
            # the square graph of n nodes would accept a source >= n_src
            _check_range("edge_index[0]", edge_index[0], 0, n_src)
            _check_range("edge_index[1]", edge_index[1], 0, n_dst)
        # Without the kernel (a CPU) the fused path is the reference, which
        # reads the edges only: no format to build.
        want_weights = isinstance(return_attention_weights, bool)
        # the seed is drawn by the op (one for the kernel and the edge term)
        drop_p = self.dropout if self.training and self.dropout > 0 else 0.0
        graph = (edge_index if isinstance(edge_index, Tensor) and not _is_sparse(edge_index)
                 and not ops.kernel_available(x_dst.device)
                 else self._plan_of(edge_index, n, want_weights or drop_p > 0 or self.lin_edge is not None))
        # Bipartite: rows are destinations, columns sources; both padded with
        # zero rows to n (no edge reaches a padding row, whose output is cut).
        # the projections of one tensor as one GEMM (projections.py)
        skip = [self.lin_skip] if self.root_weight else []
        if x_src is x_dst:
            q_, k_, v_, *x_r = project(x_dst, [self.lin_query, self.lin_key, self.lin_value] + skip)
        else:
            q_, *x_r = project(x_dst, [self.lin_query] + skip)
            k_, v_ = project(x_src, [self.lin_key, self.lin_value])
        query = _pad_rows(q_, n).view(-1, H, C)
        key = _pad_rows(k_, n).view(-1, H, C)
        value = _pad_rows(v_, n).view(-1, H, C)
        scale = 1.0 / math.sqrt(C)
        # the edges in the order of edge_attr and of the returned weights
        # (a torch.sparse adjacency's: the order of its non-zeros, as in PyG)
        edges = (as_plan(edge_index).edge_index if is_plan
                 else graph.edge_index if _is_sparse(edge_index) else edge_index)
        if self.lin_edge is not None:
            self._check_edge_attr(edge_attr, edges.size(1), x_dst.device)
            if isinstance(graph, Tensor) and not torch.compiler.is_compiling():
                # the reference path checks later, after edge_dot has indexed with it
                _check_range("edge_index", edge_index, 0, n)
            w_e = self.lin_edge.weight.view(H, C, -1)      # e_ij = W_e a_ij, per head [C, edge_dim]
            out, alpha = edge_feature_attention(query, key, value, graph, edge_attr, w_e, scale,
                                                dropout_p=drop_p,
                                                return_weights=want_weights)
        else:
            out = fused3s_attention(query, key, value, graph, scale, return_weights=want_weights,
                                    dropout_p=drop_p)
            out, alpha = out if want_weights else (out, None)
        # the destinations' rows (no slice when they are all: its backward would copy)
        out = self._combine(out if out.size(0) == n_dst else out[:n_dst], x_r[0] if x_r else None)
        if isinstance(return_attention_weights, bool):
            # TransformerConv returns a torch.sparse adjacency itself, weights in its order
            return out, (edge_index if _is_sparse(edge_index) else edges, alpha.to(query.dtype))
        return out

    # ------------------------------------------------------------- internals
    def _combine(self, out: Tensor, x_r: Optional[Tensor]) -> Tensor:
        """Heads concat/mean, root weight (x_r = lin_skip(x_dst)) and beta
        gating, as TransformerConv."""
        if self.concat:
            out = out.reshape(-1, self.heads * self.out_channels)
        else:
            out = out.mean(dim=1)
        if self.root_weight:
            if self.lin_beta is not None:
                beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1))
                beta = beta.sigmoid()
                out = beta * x_r + (1 - beta) * out
            else:
                out = out + x_r
        return out

    def _unfused_reason(self, x_dst: Tensor, edge_index, edge_attr, return_attention_weights) -> Optional[str]:
        """Why this call takes TransformerConv's unfused path, or None (fused)."""
        if edge_attr is not None and self.lin_edge is None:
            return "edge_attr without edge_dim (TransformerConv adds it to the values as is)"
        if isinstance(edge_index, SparseTensor) and self.lin_edge is not None:
            return "edge features with a SparseTensor adjacency"
        if isinstance(edge_index, SparseTensor) and isinstance(return_attention_weights, bool):
            return "attention weights of a SparseTensor adjacency"
        if self.aggr != "add" or self.flow != "source_to_target":
            return f"aggr={self.aggr!r}, flow={self.flow!r} (the kernel sums, source to target)"
        if self.explain:
            return "explain mode"
        if any(getattr(self, name, None) for name in _HOOK_TABLES):
            return "message-passing hooks are registered"
        if _is_sparse(edge_index) and _sparse_has_features(edge_index):
            return "a sparse adjacency with feature vectors as values (TransformerConv reads them as edge_attr)"
        if x_dst.is_cuda:   # what the kernel takes; fp64 (without autocast) it does not
            dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x_dst.dtype
            if not kernel_accepts(self.out_channels, dtype):
                return (f"out_channels={self.out_channels} in {dtype} (the kernel takes head sizes that are "
                        f"multiples of 8 up to 256 in fp16, bf16 or fp32)")
        return None

    def _check_x(self, x) -> Tuple[Tensor, Tensor]:
        if isinstance(x, Tensor):
            pairs = (("x", x), ("x", x))
        elif isinstance(x, (tuple, list)) and len(x) == 2:
            pairs = (("x[0]", x[0]), ("x[1]", x[1]))
        else:
            raise ValueError(f"x must be a Tensor [num_nodes, in_channels] or a pair "
                             f"(x_src, x_dst) of them (got {type(x).__name__})")
        in_ch = self.in_channels
        in_ch = (in_ch, in_ch) if isinstance(in_ch, int) else tuple(in_ch)
        lins = (self.lin_key, self.lin_query)
        for (name, t), c, lin in zip(pairs, in_ch, lins):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
            if t.dim() != 2:
                raise ValueError(f"{name} must have shape [num_nodes, in_channels] "
                                 f"(got {tuple(t.shape)})")
            if c not in (-1, None) and t.size(1) != c:
                raise ValueError(f"{name} has {t.size(1)} features but the layer was built "
                                 f"with in_channels={self.in_channels}")
            w = lin.weight
            if (not isinstance(w, torch.nn.parameter.UninitializedParameter)
                    and w.dtype != t.dtype and not torch.is_autocast_enabled(t.device.type)):
                raise ValueError(f"{name} has dtype {t.dtype} but the layer's parameters are "
                                 f"{w.dtype}; cast one to the other (e.g. x.to({w.dtype}) "
                                 f"or conv.to({t.dtype}))")
        if pairs[0][1].device != pairs[1][1].device:
            raise ValueError(f"x[0] and x[1] must be on one device "
                             f"(got {pairs[0][1].device} and {pairs[1][1].device})")
        return pairs[0][1], pairs[1][1]

    def _check_edge_attr(self, edge_attr, num_edges: int, device: torch.device) -> None:
        if not isinstance(edge_attr, Tensor):
            raise ValueError(f"the layer has edge_dim={self.edge_dim}: edge_attr must be a "
                             f"tensor [E, {self.edge_dim}] (got {type(edge_attr).__name__})")
        if edge_attr.dim() != 2 or tuple(edge_attr.shape) != (num_edges, self.edge_dim):
            raise ValueError(f"edge_attr must have shape [E, edge_dim] = [{num_edges}, "
                             f"{self.edge_dim}] (got {tuple(edge_attr.shape)})")
        if not edge_attr.is_floating_point():
            raise ValueError(f"edge_attr must be a floating-point tensor (got {edge_attr.dtype})")
        if edge_attr.device != device:
            raise ValueError(f"edge_attr is on {edge_attr.device} but x is on {device}")

    @staticmethod
    def _check_edge_index(edge_index, n_src: int, n_dst: int, device: torch.device) -> None:
        if isinstance(edge_index, (GraphPlan, BSBGraph)):
            dev = edge_index.device
        elif _is_sparse(edge_index):
            torch_sparse = isinstance(edge_index, SparseTensor)
            shape = tuple(edge_index.sizes() if torch_sparse else edge_index.shape)
            if shape[:2] != (n_dst, n_src):
                raise ValueError(f"the sparse adjacency edge_index must have shape "
                                 f"[num_dst_nodes, num_src_nodes] = [{n_dst}, {n_src}] "
                                 f"(got {shape})")
            dev = edge_index.device() if torch_sparse else edge_index.device
        elif isinstance(edge_index, Tensor):
            if edge_index.is_floating_point() or edge_index.dtype == torch.bool:
                raise ValueError(f"edge_index must be an integer tensor [2, E] "
                                 f"(got {edge_index.dtype})")
            _check_index_tensor("edge_index", edge_index, 2)
            if edge_index.size(0) != 2:
                raise ValueError(f"edge_index must have shape [2, E] "
                                 f"(got {tuple(edge_index.shape)})")
            dev = edge_index.device
        else:
            raise ValueError(f"edge_index must be an integer tensor [2, E], a sparse adjacency "
                             f"or a GraphPlan (got {type(edge_index).__name__})")
        if dev != device:
            raise ValueError(f"edge_index is on {dev} but x is on {device}; move the graph "
                             f"to the device of the features once (edge_index.to(x.device))")


# --------------------------------------------------------------- helpers

def _pad_rows(t: Tensor, n: int) -> Tensor:
    """``t`` with zero rows appended up to ``n`` rows (``t`` itself if it has them)."""
    return t if t.size(0) == n else torch.nn.functional.pad(t, (0, 0, 0, n - t.size(0)))


def _is_sparse(adj) -> bool:
    return (isinstance(adj, SparseTensor)
            or (isinstance(adj, Tensor) and adj.layout != torch.strided))


def _sparse_has_features(adj) -> bool:
    if isinstance(adj, SparseTensor):
        return adj.storage.value() is not None
    values = adj._values() if adj.layout == torch.sparse_coo else adj.values()
    return values.dim() > 1


# The edge_index tensor (weakly) and its version of the last plan a layer
# with cached=False built for a tensor, in any Fused3SConv.
_LAST_BUILT: list = [None]


def _note_build(edge_index: Tensor) -> None:
    """Warn when a layer with ``cached=False`` builds the plan of the very
    tensor, unchanged, that the last such build was for: the next layer of a
    model on the same graph, or the next step on a fixed graph. In eager mode
    a build takes more than the layer's kernels (a 3-layer step with
    edge_dim=16 on github: 31.9 ms, against 6.4 ms with cached=True and
    14.2 ms with one plan passed to the layers, H100, git 2cb77bf, README)."""
    last = _LAST_BUILT[0]
    if last is not None and last[0]() is edge_index and last[1] == edge_index._version:
        warnings.warn("Fused3SConv(cached=False) builds the graph's plan in every call, and builds it again "
                      "for the edge_index of the last call (a model's next layer, or a fixed graph's next "
                      "step): build it once, with cached=True (one plan per edge_index tensor, rebuilt when "
                      "the tensor is changed through torch) or by passing plan = conv.to_graph_format("
                      "edge_index, num_nodes) to every layer", PlanRebuildWarning, stacklevel=3)
    _LAST_BUILT[0] = (weakref.ref(edge_index), edge_index._version)


def _cached_plan(edge_index, num_nodes: int) -> GraphPlan:
    """The cached plan of an ``edge_index`` tensor or a sparse adjacency."""
    if _is_sparse(edge_index):
        return _sparse_plan(edge_index, cached=True)
    return cached_plan(edge_index, num_nodes)


@torch.compiler.disable
def _cached_plan_eagerly(layer: "Fused3SConv", edge_index, num_nodes: int, per_edge: bool) -> GraphPlan:
    """``cached=True`` under torch.compile, on a tensor no earlier call
    cached: the cached plan, looked up (and built on first use) outside the
    compiled graph (a graph break), its kernel arrays prepared for the
    layer's call, and kept on the layer, where the recompiled graph finds it
    without a break. Traced, the lookup cannot run (the cache checks the
    tensor's storage pointer and version counter): the plan was built inside
    the graph in every call, and a step of ``Fused3SConv(64, 16, heads=4,
    edge_dim=16, cached=True)`` under ``mode="reduce-overhead"`` took up to
    1.8x the step on a plan passed in (README)."""
    plan = _cached_plan(edge_index, num_nodes).prepare(
        layer.heads, layer.out_channels, backward=torch.is_grad_enabled(), edge_bias=per_edge,
        edge_features=layer.lin_edge is not None)
    layer._cached_hit = (edge_index, plan)
    return plan


# The plans of sparse adjacencies for layers with cached=True, as
# plan.cached_plan caches those of edge_index tensors: keyed by identity,
# checked against version and shape.
_SPARSE_CACHE: dict = {}


def _sparse_plan(adj, cached: bool) -> GraphPlan:
    if isinstance(adj, SparseTensor):
        n_dst, n_src = adj.sizes()[:2]
        sig = (adj.nnz(), n_dst, n_src)
    else:
        n_dst, n_src = adj.shape[:2]
        sig = (adj._nnz(), adj._version, tuple(adj.shape), adj.device, adj.layout)
    key = id(adj)
    hit = _SPARSE_CACHE.get(key) if cached else None
    if hit is not None and hit[0]() is adj and hit[1] == sig:
        return hit[2]
    n = max(n_dst, n_src)        # bipartite: the square graph of n nodes
    if isinstance(adj, SparseTensor):
        rowptr, col, _ = adj.csr()
        bsb, edges = _csr_bsb(rowptr, col, n_dst, n)
    elif adj.layout == torch.sparse_csr:
        bsb, edges = _csr_bsb(adj.crow_indices(), adj.col_indices(), n_dst, n)
    elif adj.layout == torch.sparse_coo:
        dst, src = adj._indices()
        edges = torch.stack([src, dst])
        bsb = BSBGraph.from_edge_index(edges, n)
    else:
        raise ValueError(f"a sparse edge_index must have the COO or CSR layout "
                         f"(got {adj.layout})")
    # edge features and weights follow the adjacency's non-zeros (the BSB's
    # own edge list is sorted by window)
    plan = GraphPlan(bsb, edge_index=edges)
    if cached:
        _SPARSE_CACHE[key] = (weakref.ref(adj, lambda _, k=key: _SPARSE_CACHE.pop(k, None)), sig, plan)
    return plan


def _csr_bsb(rowptr: Tensor, col: Tensor, n_dst: int, n: int) -> Tuple[BSBGraph, Tensor]:
    """The BSB of a destination-major CSR of ``n_dst`` rows, as a graph of
    ``n`` nodes, and its edges [2, E] in the CSR's order."""
    rows = torch.repeat_interleave(torch.arange(n_dst, device=col.device), (rowptr[1:] - rowptr[:-1]).long(),
                                   output_size=col.numel())
    edges = torch.stack([col.long(), rows])
    # (BSBGraph.from_csr would expand the rows once more; a sparse format's
    # CSR is valid by construction, and from_edge_index checks the ranges)
    return BSBGraph.from_edge_index(edges, n), edges
