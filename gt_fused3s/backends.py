"""Attention backends that compute the same function, for the model and the
benchmarks: ``fused3s`` (ours), ``pyg`` (PyG's unfused message passing, as in
``TransformerConv``), ``reference`` (ours, unfused), ``dense`` (masked dense
softmax, small graphs) and ``flex`` (PyTorch FlexAttention with a block mask).

Every backend is a function ``fn(q, k, v, graph, scale) -> out`` over
[N, H, D] tensors and an :class:`AttentionGraph`, which builds each
backend's format of one graph (or batch) on first use and keeps it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .graph import BSBGraph, _check_edge_index, _check_num_nodes
from . import ops
from .ops import fused3s_attention, kernel_accepts
from .plan import GraphPlan, as_plan
from .reference import attention_dense, attention_reference


class AttentionGraph:
    """One graph (or block-diagonal batch) as the backends see it.

    Args:
        edge_index: [2, E] (source, destination); every edge is a term of
            the attention (a duplicate counts twice), in every backend.
        num_nodes: N.
        static: how ``fused3s`` builds its plan on CUDA (see
            :meth:`BSBGraph.from_edge_index`): ``None`` (default) static
            while a CUDA graph is captured or torch.compile traces, else
            exact (one host synchronisation, which checks the indices).
    """

    def __init__(self, edge_index: Tensor, num_nodes: int, *, static: bool | None = None):
        self.edge_index = _check_edge_index(edge_index)
        self.num_nodes = _check_num_nodes(num_nodes)
        self.static = static
        self._formats: dict[str, object] = {}

    @classmethod
    def from_plan(cls, plan: GraphPlan | BSBGraph) -> "AttentionGraph":
        """The graph of a prebuilt plan (or BSB), which ``fused3s`` reads as is."""
        plan = as_plan(plan)
        g = cls(plan.edge_index, plan.num_nodes, static=plan.static)
        g._formats["plan"] = plan
        return g

    def prepare(self, backend: str, heads: int | None = None, head_dim: int | None = None, *,
                backward: bool = False) -> None:
        """Build what ``backend`` reads, so that it can be timed apart from the
        attention and so that, for ``fused3s`` on CUDA with ``heads`` and
        ``head_dim`` given, a later attention call makes no host
        synchronisation (the plan's schedules, and with ``backward`` the
        transposed format, are built here too). A no-op for unknown
        backends and formats already built."""
        if backend not in FORMAT_OF:
            return
        fmt = getattr(self, FORMAT_OF[backend])
        if (backend == "fused3s" and isinstance(fmt, GraphPlan) and heads is not None
                and head_dim is not None and kernel_accepts(head_dim, torch.float16)):
            fmt.prepare(heads, head_dim, backward=backward)

    def _get(self, name: str, build: Callable[[], object]):
        fmt = self._formats.get(name)
        if fmt is None:
            fmt = self._formats[name] = build()
        return fmt

    @property
    def device(self) -> torch.device:
        return self.edge_index.device

    @property
    def plan(self) -> GraphPlan:
        """The fused kernel's plan (built on the graph's device)."""
        return self._get("plan", lambda: GraphPlan.from_edge_index(self.edge_index, self.num_nodes,
                                                                    static=self.static))

    @property
    def fused3s_format(self) -> GraphPlan | Tensor:
        """What ``fused3s`` reads: the plan where the kernel runs; elsewhere
        (a CPU), where it runs the reference, the edges themselves (nothing
        to build)."""
        return self.plan if ops.kernel_available(self.device) else self.edge_index

    @property
    def dense_counts(self) -> Tensor:
        """int32 [N, N]: entry [i, j] = number of edges j -> i."""
        def build():
            counts = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.int32, device=self.device)
            ones = torch.ones(self.edge_index.size(1), dtype=torch.int32, device=self.device)
            return counts.index_put_((self.edge_index[1].long(), self.edge_index[0].long()), ones,
                                     accumulate=True)
        return self._get("dense_counts", build)

    @property
    def flex_block_mask(self):
        """FlexAttention ``(BlockMask, score_mod)`` of this graph, built from
        the dense counts (O(N^2) bytes while building, so for graphs that
        fit); ``score_mod`` adds log(count) where an edge repeats, else None."""
        def build():
            from torch.nn.attention.flex_attention import create_block_mask
            counts = self.dense_counts

            def mask_mod(b, h, q_idx, kv_idx):
                return counts[q_idx, kv_idx] > 0
            block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=self.num_nodes,
                                           KV_LEN=self.num_nodes, device=self.device)
            if not (self.num_nodes and bool(counts.max() > 1)):
                return block_mask, None
            log_counts = counts.float().log()     # duplicates weigh m times: + log m

            def add_log_counts(score, b, h, q_idx, kv_idx):
                return score + log_counts[q_idx, kv_idx]
            return block_mask, add_log_counts
        return self._get("flex_block_mask", build)


def _fused3s(q, k, v, graph: AttentionGraph, scale, edge_bias=None):
    return fused3s_attention(q, k, v, graph.fused3s_format, scale, edge_bias=edge_bias)


def _reference(q, k, v, graph: AttentionGraph, scale, edge_bias=None):
    return attention_reference(q, k, v, graph.edge_index, scale, edge_bias=edge_bias)


def _no_bias(name: str, edge_bias) -> None:
    if edge_bias is not None:
        raise ValueError(f"the {name} backend takes no per-edge bias (edge features): use fused3s, "
                         f"pyg or reference")


def _dense(q, k, v, graph: AttentionGraph, scale, edge_bias=None):
    _no_bias("dense", edge_bias)
    return attention_dense(q, k, v, graph.dense_counts, scale)


_pyg_module = None


def _pyg(q, k, v, graph: AttentionGraph, scale, edge_bias=None):
    global _pyg_module
    if _pyg_module is None:
        _pyg_module = _make_pyg_attention()
    return _pyg_module(q, k, v, graph.edge_index.long(), scale, edge_bias)   # PyG's scatters take int64


def _make_pyg_attention():
    """PyG's unfused message passing, the computation of TransformerConv."""
    from torch_geometric.nn import MessagePassing
    from torch_geometric.utils import softmax

    class PygAttention(MessagePassing):
        def __init__(self):
            super().__init__(aggr="add", node_dim=0)

        def forward(self, q, k, v, edge_index, scale, edge_bias=None):
            return self.propagate(edge_index, query=q, key=k, value=v, scale=scale, edge_bias=edge_bias,
                                  size=(q.size(0), q.size(0)))

        def message(self, query_i, key_j, value_j, index, ptr, size_i, scale, edge_bias):
            alpha = (query_i * key_j).sum(dim=-1) * scale
            if edge_bias is not None:
                alpha = alpha + edge_bias
            alpha = softmax(alpha, index, ptr, size_i)
            return value_j * alpha.unsqueeze(-1)

    return PygAttention()


_flex_compiled = None


def _flex(q, k, v, graph: AttentionGraph, scale, edge_bias=None):
    global _flex_compiled
    _no_bias("flex", edge_bias)
    if not q.is_cuda:
        raise RuntimeError("the flex backend runs on CUDA tensors only")
    if _flex_compiled is None:   # eager FlexAttention is a slow debugging path
        from torch.nn.attention.flex_attention import flex_attention
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    block_mask, score_mod = graph.flex_block_mask
    out = _flex_compiled(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0), score_mod=score_mod, block_mask=block_mask,
                         scale=scale)
    return out.squeeze(0).transpose(0, 1)


#: the AttentionGraph format (attribute) each backend reads
FORMAT_OF = {"fused3s": "fused3s_format", "pyg": "edge_index", "reference": "edge_index",
             "dense": "dense_counts", "flex": "flex_block_mask"}

BACKENDS: dict[str, Callable] = {
    "fused3s": _fused3s,
    "pyg": _pyg,
    "reference": _reference,
    "dense": _dense,
    "flex": _flex,
}


def get_backend(name: str) -> Callable:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[name]
