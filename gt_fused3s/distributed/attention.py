"""Full-graph attention over a partitioned graph: each rank computes the rows
it owns, after receiving the K and V rows of its halo from their owners.

Per layer the ranks exchange, with one ``all_to_all_single``, the rows each
needs of the others (the send lists of :class:`~.partition.LocalGraph`); the
backward returns the halo's dK and dV to the owners by the reverse exchange,
where they are added to the local gradients. The local attention runs on the
local graph (rows: this rank's nodes; columns: its nodes, then the halo)
through :func:`gt_fused3s.fused3s_attention` (the fused kernel on CUDA, the
reference on a CPU): the plan's destinations are its first rows, so q and
the output keep this rank's rows, and K and V are read as two views of the
one buffer the halo is received into.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from ..ops import fused3s_attention, kernel_available
from ..plan import GraphPlan
from ..reference import attention_reference
from .partition import LocalGraph


class ExchangeTimer:
    """The time the halo exchanges of a span took, as the compute stream saw
    it (see :func:`exchange_timer`)."""

    def __init__(self):
        self._spans: list = []     # (start, end): CUDA events, or perf_counter seconds
        self.count = 0             #: exchanges (forward and backward)
        self.bytes = 0             #: bytes this rank sent

    def _record(self, x: Tensor):
        if x.is_cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self) -> float:
        """Milliseconds of the exchanges so far (synchronises the device)."""
        total = 0.0
        for s, e in self._spans:
            if isinstance(s, float):
                total += (e - s) * 1e3
            else:
                e.synchronize()
                total += s.elapsed_time(e)
        return total


_TIMER: ExchangeTimer | None = None


@contextlib.contextmanager
def exchange_timer() -> Iterator[ExchangeTimer]:
    """Time every halo exchange run inside the ``with`` block, forward and
    backward. On CUDA an exchange is timed by events on the current stream
    around the collective, which that stream waits for: the time is what the
    exchange adds to the step (the transfer and any wait for a slower rank);
    the exchange does not overlap the attention, which needs its rows."""
    global _TIMER
    _TIMER = timer = ExchangeTimer()
    try:
        yield timer
    finally:
        _TIMER = None


def _all_to_all(x: Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group,
                out: Tensor | None = None) -> Tensor:
    """Rows of ``x`` split ``in_splits`` over the ranks, received ``out_splits``
    from them into ``out`` (a contiguous [out_rows, ...] block; default new)."""
    if out is None:
        out = x.new_empty((out_rows, *x.shape[1:]))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return out             # one rank: no halo, nothing to exchange
    if len(in_splits) != dist.get_world_size(group):
        raise ValueError(f"the local graph was built for {len(in_splits)} parts but the process group "
                         f"has {dist.get_world_size(group)} ranks: pass parts=world_size to local_graph")
    timer = _TIMER
    start = timer._record(x) if timer is not None else None
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    if timer is not None:
        timer._spans.append((start, timer._record(x)))
        timer.count += 1
        timer.bytes += x.numel() * x.element_size()
    return out


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lg: LocalGraph, group):
        ctx.lg, ctx.group, ctx.rows = lg, group, x.size(0)
        send = x.index_select(0, lg.send_index.to(x.device))
        return _all_to_all(send, lg.halo.numel(), lg.halo_counts, lg.send_counts, group)

    @staticmethod
    def backward(ctx, grad):
        lg = ctx.lg
        back = _all_to_all(grad, lg.send_index.numel(), lg.send_counts, lg.halo_counts, ctx.group)
        dx = grad.new_zeros((ctx.rows, *grad.shape[1:])).index_add_(0, lg.send_index.to(grad.device), back)
        return dx, None, None


def exchange_halo(x: Tensor, lg: LocalGraph, group=None) -> Tensor:
    """The halo rows [n_halo, ...] of a per-node tensor whose local rows are
    ``x`` [n_local, ...] on every rank (a collective: every rank of ``group``
    calls it). Differentiable: the backward sends the halo's gradients back
    to the owners and adds them to ``x``'s."""
    if x.size(0) != lg.num_local:
        raise ValueError(f"x has {x.size(0)} rows but rank {lg.rank} owns {lg.num_local} nodes")
    return _HaloExchange.apply(x, lg, group)


class _HaloKeysValues(torch.autograd.Function):
    """(k, v) [n_local, H, D] -> (k_all, v_all) [n_local + n_halo, H, D]: two
    views of one buffer [n_columns, H, 2D] that holds this rank's rows and,
    received by one exchange straight into its tail, the halo's. No
    concatenation, no padding: the kernels read the views by their strides.
    The backward sends the halo rows' dK and dV back to their owners, in one
    exchange, and adds them to the local rows'."""

    @staticmethod
    def forward(ctx, k, v, lg: LocalGraph, group):
        n, H, D = k.shape
        kv = k.new_empty((lg.num_columns, H, 2 * D))
        kv[:n, :, :D] = k
        kv[:n, :, D:] = v
        send = kv[:n].index_select(0, lg.send_index.to(k.device))
        _all_to_all(send, lg.halo.numel(), lg.halo_counts, lg.send_counts, group, out=kv[n:])
        ctx.lg, ctx.group, ctx.n, ctx.D = lg, group, n, D
        return kv[..., :D], kv[..., D:]

    @staticmethod
    def backward(ctx, dk_all, dv_all):
        lg, n, D = ctx.lg, ctx.n, ctx.D
        halo = torch.cat([dk_all[n:], dv_all[n:]], -1)
        back = _all_to_all(halo, lg.send_index.numel(), lg.send_counts, lg.halo_counts, ctx.group)
        # the local rows' gradients, written in place: dk_all, dv_all are the
        # attention's own fresh gradients, read by nothing else
        dk, dv = dk_all[:n], dv_all[:n]
        index = lg.send_index.to(dk.device)
        start = 0
        for count in lg.send_counts:      # a row is sent at most once to each rank: no atomics
            if count:
                rows, part = index[start:start + count], back[start:start + count]
                dk.index_copy_(0, rows, dk.index_select(0, rows) + part[..., :D])
                dv.index_copy_(0, rows, dv.index_select(0, rows) + part[..., D:])
            start += count
        return dk, dv, None, None


def _local_plan(lg: LocalGraph, device: torch.device) -> GraphPlan:
    """The local attention graph's plan (rows: this rank's nodes; columns:
    its nodes, then the halo), built once per device."""
    plans = lg.__dict__.setdefault("_plans", {})
    if device not in plans:
        plans[device] = GraphPlan.from_edge_index(lg.edge_index.to(device), lg.num_columns,
                                                  num_rows=lg.num_local)
    return plans[device]


def partitioned_attention(q: Tensor, k: Tensor, v: Tensor, lg: LocalGraph, scale: float | None = None,
                          group=None, *, edge_bias: Tensor | None = None, attention=None) -> Tensor:
    """This rank's rows [n_local, H, D] of the attention over the whole graph.

    ``q``, ``k``, ``v``: [n_local, H, D], the rows of the nodes this rank owns
    (``lg.nodes``). ``edge_bias``: optional [E_local, H] in the order of
    ``lg.edge_index`` (the global bias rows ``lg.edge_ids``). A collective:
    every rank of ``group`` calls it, once per layer. K and V travel in one
    exchange. The default attention is the fused one on the local graph
    (q's rows only: the plan's destinations are its first rows), or the
    reference where the kernel is unavailable. ``attention``: another local
    attention, ``(q, k, v, graph, scale, edge_bias)`` with ``graph`` the
    local graph as an :class:`~gt_fused3s.backends.AttentionGraph` (a
    backend of :data:`gt_fused3s.backends.BACKENDS`), given q padded to the
    columns.
    """
    n = lg.num_local
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.size(0) != n:
            raise ValueError(f"{name} must be [n_local, H, D] = [{n}, H, D] on rank {lg.rank} "
                             f"(got {tuple(t.shape)})")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape (got {tuple(k.shape)} and {tuple(v.shape)})")
    k_all, v_all = _HaloKeysValues.apply(k, v, lg, group)
    if attention is not None:
        q_all = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, lg.halo.numel()))   # no edge reaches a halo row
        return attention(q_all, k_all, v_all, _attention_graph(lg, q.device), scale, edge_bias)[:n]
    if kernel_available(q.device):
        return fused3s_attention(q, k_all, v_all, _local_plan(lg, q.device), scale, edge_bias=edge_bias)
    exact = torch.float64 if q.dtype == torch.float64 else torch.float32
    return attention_reference(q, k_all, v_all, lg.edge_index.to(q.device), scale, edge_bias=edge_bias,
                               compute_dtype=exact, out_dtype=q.dtype)


def _attention_graph(lg: LocalGraph, device: torch.device):
    """The local graph as an AttentionGraph on ``device`` (for the backends), built once."""
    from ..backends import AttentionGraph
    graphs = lg.__dict__.setdefault("_attention_graphs", {})
    if device not in graphs:
        graphs[device] = AttentionGraph(lg.edge_index.to(device), lg.num_columns)
    return graphs[device]
