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

from .graph import BSBGraph, _check_index_tensor, _check_num_nodes, _check_range
from .ops import fused3s_attention, kernel_accepts, padded_head_dim
from .schedule import work_schedule
from .reference import attention_dense, attention_reference


class AttentionGraph:
    """One graph (or block-diagonal batch) as the backends see it.

    Args:
        edge_index: [2, E] (source, destination); duplicates count once.
        num_nodes: N.
    """

    def __init__(self, edge_index: Tensor, num_nodes: int):
        _check_index_tensor("edge_index", edge_index, 2)
        if edge_index.size(0) != 2:
            raise ValueError(f"edge_index must have shape [2, E] (got {tuple(edge_index.shape)})")
        self.num_nodes = _check_num_nodes(num_nodes)
        # Index ranges are checked where each format is built (the BSB builder
        # checks them inside its one host sync), so no extra sync here.
        self.raw_edge_index = edge_index
        self._formats: dict[str, object] = {}

    @classmethod
    def from_bsb(cls, bsb: BSBGraph) -> "AttentionGraph":
        g = cls.__new__(cls)
        g.num_nodes, g.raw_edge_index = bsb.num_nodes, bsb.edge_index
        g._formats = {"bsb": bsb, "edge_index": bsb.edge_index}
        return g

    def prepare(self, backend: str, heads: int | None = None, head_dim: int | None = None) -> None:
        """Build what ``backend`` reads, so that it can be timed apart from the
        attention and so that, for ``fused3s`` on CUDA with ``heads`` and
        ``head_dim`` given, a later attention call makes no host
        synchronisation (the kernel's work schedule is built here too).
        A no-op for unknown backends and formats already built."""
        if backend in FORMAT_OF:
            fmt = getattr(self, FORMAT_OF[backend])
            if (backend == "fused3s" and fmt.device.type == "cuda" and heads is not None
                    and head_dim is not None and kernel_accepts(head_dim, torch.float16)):
                work_schedule(fmt, heads, padded_head_dim(head_dim))

    def _get(self, name: str, build: Callable[[], object]):
        if name not in self._formats:
            self._formats[name] = build()
        return self._formats[name]

    @property
    def device(self) -> torch.device:
        return self.raw_edge_index.device

    @property
    def bsb(self) -> BSBGraph:
        return self._get("bsb", lambda: BSBGraph.from_edge_index(self.raw_edge_index, self.num_nodes))

    @property
    def edge_index(self) -> Tensor:
        """Deduplicated [2, E] int64 (the binary mask of every backend)."""
        def dedup():
            _check_range("edge_index", self.raw_edge_index, 0, self.num_nodes)
            ei = self.raw_edge_index.long()
            key = torch.unique(ei[1] * self.num_nodes + ei[0])
            return torch.stack([key % max(self.num_nodes, 1), key // max(self.num_nodes, 1)])
        return self._get("edge_index", dedup)

    @property
    def dense_mask(self) -> Tensor:
        def build():
            ei = self.edge_index
            mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool, device=self.device)
            mask[ei[1], ei[0]] = True
            return mask
        return self._get("dense_mask", build)

    @property
    def flex_block_mask(self):
        """FlexAttention ``BlockMask`` of this graph (built from the dense mask:
        O(N^2) bytes while building, so for graphs that fit)."""
        def build():
            from torch.nn.attention.flex_attention import create_block_mask
            mask = self.dense_mask

            def mask_mod(b, h, q_idx, kv_idx):
                return mask[q_idx, kv_idx]
            return create_block_mask(mask_mod, B=None, H=None, Q_LEN=self.num_nodes,
                                     KV_LEN=self.num_nodes, device=self.device)
        return self._get("flex_block_mask", build)


def _fused3s(q, k, v, graph: AttentionGraph, scale):
    return fused3s_attention(q, k, v, graph.bsb, scale)


def _reference(q, k, v, graph: AttentionGraph, scale):
    return attention_reference(q, k, v, graph.edge_index, scale)


def _dense(q, k, v, graph: AttentionGraph, scale):
    return attention_dense(q, k, v, graph.dense_mask, scale)


_pyg_module = None


def _pyg(q, k, v, graph: AttentionGraph, scale):
    global _pyg_module
    if _pyg_module is None:
        _pyg_module = _make_pyg_attention()
    return _pyg_module(q, k, v, graph.edge_index, scale)


def _make_pyg_attention():
    """PyG's unfused message passing, the computation of TransformerConv."""
    from torch_geometric.nn import MessagePassing
    from torch_geometric.utils import softmax

    class PygAttention(MessagePassing):
        def __init__(self):
            super().__init__(aggr="add", node_dim=0)

        def forward(self, q, k, v, edge_index, scale):
            return self.propagate(edge_index, query=q, key=k, value=v, scale=scale,
                                  size=(q.size(0), q.size(0)))

        def message(self, query_i, key_j, value_j, index, ptr, size_i, scale):
            alpha = (query_i * key_j).sum(dim=-1) * scale
            alpha = softmax(alpha, index, ptr, size_i)
            return value_j * alpha.unsqueeze(-1)

    return PygAttention()


_flex_compiled = None


def _flex(q, k, v, graph: AttentionGraph, scale):
    global _flex_compiled
    if not q.is_cuda:
        raise RuntimeError("the flex backend runs on CUDA tensors only")
    if _flex_compiled is None:   # eager FlexAttention is a slow debugging path
        from torch.nn.attention.flex_attention import flex_attention
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    out = _flex_compiled(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                         v.transpose(0, 1).unsqueeze(0), block_mask=graph.flex_block_mask,
                         scale=scale)
    return out.squeeze(0).transpose(0, 1)


#: the AttentionGraph format (attribute) each backend reads
FORMAT_OF = {"fused3s": "bsb", "pyg": "edge_index", "reference": "edge_index",
             "dense": "dense_mask", "flex": "flex_block_mask"}

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
