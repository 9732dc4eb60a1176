r"""The Graph Transformer of the Fused3S end-to-end study: an input
embedding, ``L`` blocks of sparse graph attention + FFN, and a node- or
graph-level readout, with the attention backend switchable at run time.

One block (post-norm, as in Dwivedi & Bresson's Graph Transformer)::

    h = norm1(x + W_o · attention(W_q x, W_k x, W_v x; graph, b))
    x = norm2(h + FFN(h)),     FFN = Linear(C, 2C) -> ReLU -> Linear(2C, C)

With edge features (``edge_vocab``: categorical columns such as bond types),
each block adds a learned attention bias per edge and head, ``b_e =
sum_c Embedding_c(edge_attr[e, c])`` [E, H], to the scaled scores (the edge
encoding of Graphormer; the fused kernel takes it as ``edge_bias``).

where ``attention`` is the 3S attention of DESIGN.md over the graph's edges
(node ``i`` attends to its in-neighbours ``j``), computed by one of
:data:`gt_fused3s.backends.BACKENDS`. Every backend computes the same
function, so one set of weights gives the same outputs under any backend.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from typing import Iterator

import torch
from torch import Tensor, nn

from ..backends import AttentionGraph, get_backend
from ..distributed import LocalGraph, partitioned_attention
from ..graph import BSBGraph, check_int
from ..plan import GraphPlan


class AttentionTimer:
    """Time spent in the model's attention calls and graph-format builds.

    Made by :meth:`GraphTransformer.attention_timer`; while it is active, every
    span (``"attention"``: one backend call, ``"format"``: building the
    backend's graph format, once per forward) is timed: with CUDA events on a
    GPU (read by :meth:`ms`, after one synchronisation) and ``perf_counter``
    on a CPU. Spans add a little overhead, so time a run without the timer
    and use this one for the split.
    """

    def __init__(self):
        self._ms: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def span(self, kind: str, device: torch.device) -> Iterator[None]:
        self._count[kind] += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._ms[kind] += (time.perf_counter() - t0) * 1e3

    def _collect(self) -> None:
        if self._events:
            torch.cuda.synchronize()
            for kind, start, end in self._events:
                self._ms[kind] += start.elapsed_time(end)
            self._events.clear()

    def ms(self, kind: str = "attention") -> float:
        """Total milliseconds spent in spans of ``kind``."""
        self._collect()
        return self._ms[kind]

    def count(self, kind: str = "attention") -> int:
        return self._count[kind]


def _make_norm(norm: str, channels: int) -> nn.Module:
    if norm == "layer":
        return nn.LayerNorm(channels)
    if norm == "batch":
        return nn.BatchNorm1d(channels)
    raise ValueError(f"norm must be 'layer' or 'batch' (got {norm!r})")


class EdgeEncoder(nn.Module):
    """An attention bias [E, heads] from categorical edge features [E, C]:
    the sum of one embedding per column (vocabulary ``vocab[c]``).

    Computed as a multi-hot matrix [E, sum(vocab)] times the stacked
    embedding tables, not as lookups: a lookup's backward adds every edge's
    gradient into one of a handful of rows (a molecule has 4 bond types),
    and those atomic adds serialise (0.44 ms of a 5 ms training step on ZINC
    batches of 1024 graphs, H100), where the GEMM ``hot^T @ grad`` takes a
    few microseconds. The product runs in the tables' dtype (fp32) outside
    autocast, so the bias keeps the embeddings' precision. A code outside
    its column's vocabulary fails on the device (as an embedding lookup
    does), without a host synchronisation."""

    def __init__(self, vocab: tuple[int, ...], heads: int):
        super().__init__()
        self.vocab = tuple(int(v) for v in vocab)
        self.embeddings = nn.ModuleList(nn.Embedding(v, heads) for v in self.vocab)

    def forward(self, edge_attr: Tensor) -> Tensor:
        edge_attr = edge_attr.reshape(edge_attr.size(0), len(self.vocab))   # E may be 0 (an empty rank)
        hot = torch.cat([edge_attr[:, c:c + 1] == torch.arange(v, device=edge_attr.device)
                         for c, v in enumerate(self.vocab)], dim=1)          # [E, sum(vocab)]
        torch._assert_async((hot.sum(1) == len(self.vocab)).all(),
                            "gt_fused3s: edge_attr has a code outside its column's vocabulary")
        table = torch.cat([e.weight for e in self.embeddings])              # [sum(vocab), heads]
        with torch.autocast(edge_attr.device.type, enabled=False):
            return hot.to(table.dtype) @ table


class GraphTransformerBlock(nn.Module):
    """Q/K/V projections (one GEMM), sparse attention, output projection, residual +
    norm, FFN, residual + norm. The attention itself is passed in by the
    model (one backend for all blocks); with ``edge_vocab``, its bias per
    edge comes from this block's :class:`EdgeEncoder`."""

    def __init__(self, channels: int, heads: int = 1, norm: str = "layer", dropout: float = 0.0,
                 edge_vocab: tuple[int, ...] | None = None):
        super().__init__()
        if channels < heads:
            raise ValueError(f"hidden_channels={channels} must be >= heads={heads}")
        self.heads = heads
        self.head_dim = channels // heads
        inner = heads * self.head_dim
        self.qkv = nn.Linear(channels, 3 * inner)   # one GEMM for the three projections
        self.o = nn.Linear(inner, channels)
        self.norm1 = _make_norm(norm, channels)
        self.ffn = nn.Sequential(nn.Linear(channels, 2 * channels), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(2 * channels, channels))
        self.norm2 = _make_norm(norm, channels)
        self.dropout = nn.Dropout(dropout)
        self.edge_encoder = EdgeEncoder(edge_vocab, heads) if edge_vocab else None

    def forward(self, x: Tensor, attend, edge_attr: Tensor | None = None) -> Tensor:
        N = x.size(0)
        # [N, 3, H, D] -> three strided [N, H, D] views (the kernel takes row strides)
        q, k, v = self.qkv(x).view(N, 3, self.heads, self.head_dim).unbind(1)
        bias = self.edge_encoder(edge_attr) if self.edge_encoder is not None else None
        # the width named: N may be 0 (a rank of a partitioned graph that owns no node)
        a = attend(q, k, v, 1.0 / math.sqrt(self.head_dim), bias).reshape(N, self.heads * self.head_dim)
        x = self.norm1(x + self.dropout(self.o(a)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class GraphTransformer(nn.Module):
    r"""Graph Transformer with a switchable sparse-attention backend.

    Args:
        in_channels: input feature width F.
        hidden_channels: width C of every block (projections go to
            ``heads * (C // heads)``).
        out_channels: width of the readout.
        num_layers: number of blocks L (default 10, as in the paper's study).
        heads: attention heads H.
        backend: name in :data:`gt_fused3s.backends.BACKENDS` (``"fused3s"``,
            ``"pyg"``, ``"reference"``, ``"dense"``, ``"flex"``); settable
            later (``model.backend = "pyg"``) without touching the weights.
        norm: ``"layer"`` (LayerNorm, default) or ``"batch"`` (BatchNorm1d
            over nodes).
        readout: ``"node"`` (a linear head per node) or ``"graph"`` (mean
            pool per graph of ``batch``, then a linear head).
        dropout: dropout after the output projection and inside the FFN
            (training only).
        self_loops: let every node attend to itself as well (adds the
            missing self loops to the graph the model builds).
        edge_vocab: the vocabulary of each categorical edge feature column
            (a dataset's ``edge_vocab``): the blocks learn an attention bias
            from ``edge_attr`` [E, C] (None: no edge features).

    Shapes:
        - input: x [N, F], edge_index [2, E] (source, destination),
          batch [N] (graph readout; None = one graph), edge_attr int64
          [E, C] (with ``edge_vocab``)
        - output: [N, out_channels] (node) or [G, out_channels] (graph)
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int,
                 num_layers: int = 10, heads: int = 1, backend: str = "fused3s",
                 norm: str = "layer", readout: str = "node", dropout: float = 0.0,
                 self_loops: bool = False, edge_vocab: tuple[int, ...] | None = None):
        super().__init__()
        in_channels, hidden_channels, out_channels, num_layers, heads = (
            check_int(name, value) for name, value in (
                ("in_channels", in_channels), ("hidden_channels", hidden_channels),
                ("out_channels", out_channels), ("num_layers", num_layers), ("heads", heads)))
        if edge_vocab and self_loops:
            raise ValueError("self_loops adds edges without edge features: add typed self loops "
                             "to the data instead, or leave edge_vocab unset")
        if readout not in ("node", "graph"):
            raise ValueError(f"readout must be 'node' or 'graph' (got {readout!r})")
        self.readout = readout
        self.self_loops = self_loops
        self.embed = nn.Linear(in_channels, hidden_channels)
        self.edge_vocab = tuple(edge_vocab) if edge_vocab else None
        self.blocks = nn.ModuleList(GraphTransformerBlock(hidden_channels, heads, norm, dropout, self.edge_vocab)
                                    for _ in range(num_layers))
        self.head = nn.Linear(hidden_channels, out_channels)
        self.backend = backend
        self._timer: AttentionTimer | None = None

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: fail at once, in one line
        raise RuntimeError("GraphTransformer cannot be compiled by TorchScript (its attention "
                           "backends and graph plans are Python objects): use torch.compile, or "
                           "torch.export for serving (forward on a prepared GraphPlan)")

    def _check_edge_attr(self, edge_attr, num_edges: int) -> None:
        _check_edge_attr_for(self, edge_attr, num_edges)

    def _forward_partitioned(self, x, lg, batch, num_graphs, edge_attr) -> Tensor:
        return _forward_partitioned_impl(self, x, lg, batch, num_graphs, edge_attr)

    # ----------------------------------------------------------------- backend
    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._attention_fn = get_backend(name)    # raises on an unknown name
        self._backend = name

    @contextlib.contextmanager
    def attention_timer(self) -> Iterator[AttentionTimer]:
        """Time the attention calls and format builds of the forwards run
        inside the ``with`` block (see :class:`AttentionTimer`)::

            with model.attention_timer() as t:
                model(x, edge_index)
            t.ms("attention"), t.ms("format"), t.count("attention")
        """
        self._timer = timer = AttentionTimer()
        try:
            yield timer
        finally:
            self._timer = None

    def _span(self, kind: str, device: torch.device):
        if self._timer is not None:
            return self._timer.span(kind, device)
        if torch.compiler.is_compiling():        # nothing to time inside a compiled region
            return contextlib.nullcontext()
        if torch.autograd._profiler_enabled():   # named ranges for torch.profiler
            return torch.profiler.record_function(f"gt_fused3s::{kind}")
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ graph
    def make_graph(self, edge_index: Tensor, num_nodes: int, *,
                   static: bool | None = None) -> AttentionGraph:
        """The :class:`AttentionGraph` a forward builds (self loops added if
        the model has ``self_loops``); build it once yourself and pass it as
        ``graph=`` to reuse it across forwards on one graph. ``static``: see
        :class:`AttentionGraph` (default: static while a CUDA graph is
        captured or torch.compile traces)."""
        if self.self_loops:
            edge_index = _add_self_loops(edge_index, num_nodes)
        return AttentionGraph(edge_index, num_nodes, static=static)

    def prepare_graph(self, graph: AttentionGraph, *, backward: bool | None = None) -> AttentionGraph:
        """Build what the current backend reads of ``graph`` (for ``fused3s``
        on CUDA, the plan: the BSB, the kernel's schedule for this model's
        heads and, for training, the transposed format), so that a forward
        and backward on it make no host synchronisation. A forward does this
        itself; call it ahead (e.g. on a side stream while the previous batch
        computes) to take it off the critical path. ``backward`` defaults to
        ``self.training``."""
        graph.prepare(self._backend, self.blocks[0].heads, self.blocks[0].head_dim,
                      backward=self.training if backward is None else backward)
        return graph

    # ---------------------------------------------------------------- forward
    def forward(self, x: Tensor, edge_index: Tensor | None, batch: Tensor | None = None,
                graph: AttentionGraph | GraphPlan | BSBGraph | None = None,
                num_graphs: int | None = None, edge_attr: Tensor | None = None) -> Tensor:
        """Args:
            x: [N, F] node features.
            edge_index: [2, E]; ignored when ``graph`` is given.
            batch: [N] graph id of each node, for ``readout="graph"``.
            graph: a prebuilt :class:`AttentionGraph` (or a
                :class:`GraphPlan` / :class:`BSBGraph`) of this graph.
                Default: built here, once per forward, and shared by all
                blocks (a batch is a new graph). A
                :class:`~gt_fused3s.distributed.LocalGraph`: this rank's
                share of a graph partitioned over a process group; ``x``
                (and ``edge_attr``) are then this rank's rows, the output
                its nodes' rows (node readout; every rank calls it).
            num_graphs: the number of graphs in ``batch`` (graph readout);
                given, the readout needs no host synchronisation.
            edge_attr: int64 [E, C] categorical edge features, in the order
                of the graph's edges (models with ``edge_vocab`` only).
        """
        N = x.size(0)
        if isinstance(graph, LocalGraph):
            return self._forward_partitioned(x, graph, batch, num_graphs, edge_attr)
        if graph is None:
            if edge_index is None:
                raise ValueError("pass edge_index or graph")
            graph = self.make_graph(edge_index, N)
        elif isinstance(graph, (GraphPlan, BSBGraph)):
            graph = AttentionGraph.from_plan(graph)
        if graph.num_nodes != N:
            raise ValueError(f"graph has {graph.num_nodes} nodes but x has {N} rows")
        if graph.device != x.device:
            raise ValueError(f"graph is on {graph.device} but x is on {x.device}")

        self._check_edge_attr(edge_attr, graph.edge_index.size(1))

        fn, device = self._attention_fn, x.device
        with self._span("format", device):      # the backend's format, timed apart
            self.prepare_graph(graph)

        def attend(q, k, v, scale, bias):
            with self._span("attention", device):
                return fn(q, k, v, graph, scale, bias)

        h = self.embed(x)
        for block in self.blocks:
            h = block(h, attend, edge_attr)
        if self.readout == "graph":
            from torch_geometric.nn import global_mean_pool
            h = global_mean_pool(h, batch, size=num_graphs)
        return self.head(h)


def _forward_partitioned_impl(model: "GraphTransformer", x: Tensor, lg, batch, num_graphs, edge_attr) -> Tensor:
    """The forward of this rank's rows of a graph partitioned over a process
    group (``x``: the rows of ``lg.nodes``; ``edge_attr``: the rows
    ``lg.edge_ids`` of the graph's). Every block's attention exchanges the K
    and V halo (:func:`~gt_fused3s.distributed.partitioned_attention`) and
    runs the model's backend on the local graph; the rest of a block is per
    node. A collective: every rank calls it."""
    if x.size(0) != lg.num_local:
        raise ValueError(f"x has {x.size(0)} rows but rank {lg.rank} owns {lg.num_local} nodes")
    if model.readout != "node":
        raise ValueError("a partitioned graph is one large graph: readout must be 'node'")
    if model.self_loops:
        raise ValueError("self_loops: add the loops to the graph before partitioning it")
    model._check_edge_attr(edge_attr, lg.edge_ids.numel())

    def attend(q, k, v, scale, bias):
        with model._span("attention", x.device):
            # fused3s: partitioned_attention's own (no padded rows); others through their backend
            other = None if model.backend == "fused3s" else model._attention_fn
            return partitioned_attention(q, k, v, lg, scale, edge_bias=bias, attention=other)

    h = model.embed(x)
    for block in model.blocks:
        h = block(h, attend, edge_attr)
    return model.head(h)


def _check_edge_attr_for(model: "GraphTransformer", edge_attr, num_edges: int) -> None:
    if model.edge_vocab is None:
        if edge_attr is not None:
            raise ValueError("edge_attr given to a model without edge features (edge_vocab=None)")
        return
    C = len(model.edge_vocab)
    if not isinstance(edge_attr, Tensor):
        raise ValueError(f"the model has edge_vocab={model.edge_vocab}: pass edge_attr, an int64 "
                         f"[E, {C}] tensor")
    if edge_attr.is_floating_point() or edge_attr.size(0) != num_edges or (
            math.prod(edge_attr.shape[1:]) != C):
        raise ValueError(f"edge_attr must be an integer [E, {C}] = [{num_edges}, {C}] tensor of edge "
                         f"types (got {edge_attr.dtype} {tuple(edge_attr.shape)})")


def _add_self_loops(edge_index: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` plus a self loop on every node that has none (PyG's
    ``add_remaining_self_loops``). Its edge count depends on the data, so it
    cannot run inside a captured CUDA graph or a compiled region: there, add
    the loops to the batches beforehand."""
    if torch.compiler.is_compiling() or (edge_index.is_cuda and torch.cuda.is_current_stream_capturing()):
        raise NotImplementedError("self_loops=True makes the edge count data-dependent; add the self "
                                  "loops to the batches before a captured or compiled forward")
    from torch_geometric.utils import add_remaining_self_loops
    return add_remaining_self_loops(edge_index, num_nodes=num_nodes)[0]
