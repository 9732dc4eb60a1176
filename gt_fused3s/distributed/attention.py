"""Full-graph attention over a partitioned graph: each rank computes the rows
it owns, after receiving the K and V rows of its halo from their owners.

Per layer the ranks exchange, with ``all_to_all_single``, the rows each
needs of the others (the send lists of :class:`~.partition.LocalGraph`); the
backward returns the halo's dK and dV to the owners by the reverse exchange,
where they are added to the local gradients. With the fused kernel the
exchange is pipelined over head chunks (``LocalGraph.head_chunks``): the
attention of the chunks received overlaps the transfer of the next. The local attention runs on the
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

from .. import ops as _ops
from ..plan import GraphPlan, padded_head_dim
from ..reference import attention_reference, default_scale
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
    backward: on CUDA by events on the current stream around its wait for
    the exchange, so the time is what the exchanges add to the step (the
    transfer not hidden behind the attention of earlier head chunks, and any
    wait for a slower rank)."""
    global _TIMER
    _TIMER = timer = ExchangeTimer()
    try:
        yield timer
    finally:
        _TIMER = None


def _all_to_all(x: Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    """Rows of ``x`` split ``in_splits`` over the ranks, received ``out_splits``
    from them into a new [out_rows, ...] tensor, waited for."""
    out = x.new_empty((out_rows, *x.shape[1:]))
    _exchange(x, out, out_splits, in_splits, group).wait()
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


class _Pending:
    """An exchange in flight (``async_op``): :meth:`wait` makes the current
    stream wait for it, and the timer counts that wait, the part of the
    exchange the compute did not hide."""

    def __init__(self, work, x: Tensor):
        self.work, self.x = work, x

    def wait(self) -> None:
        timer = _TIMER
        start = timer._record(self.x) if timer is not None else None
        if self.work is not None:
            self.work.wait()
        if timer is not None:
            timer._spans.append((start, timer._record(self.x)))


def _exchange(x: Tensor, out: Tensor, out_splits: list[int], in_splits: list[int], group) -> _Pending:
    """Start sending the rows of ``x`` (split ``in_splits`` over the ranks)
    and receiving ``out_splits`` from them into ``out`` (contiguous rows)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:   # a collective: every rank calls
        return _Pending(None, x)
    if len(in_splits) != dist.get_world_size(group):
        raise ValueError(f"the local graph was built for {len(in_splits)} parts but the process group "
                         f"has {dist.get_world_size(group)} ranks: pass parts=world_size to local_graph")
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                  input_split_sizes=in_splits, group=group, async_op=True)
    if _TIMER is not None:
        _TIMER.count += 1
        _TIMER.bytes += x.numel() * x.element_size()
    return _Pending(work, x)


def _send_rows(x: Tensor, lg: LocalGraph) -> Tensor:
    """The rows of ``x`` [n_local, ...] this rank sends, grouped by
    destination: ``x`` itself where one rank gets them all, in order."""
    return x if lg.sends_all_rows else x.index_select(0, lg.send_index.to(x.device))


def _add_received(pairs: list[tuple[Tensor, Tensor]], lg: LocalGraph) -> None:
    """``local[send rows] += received`` for each (local [n_local, ...],
    received [n_send, ...]) pair: the halo gradients coming back. A block
    of all rows is one addition; a row appears at most once per other
    block, so no atomics are needed."""
    index = lg.send_index.to(pairs[0][0].device)
    start = 0
    for count, full in zip(lg.send_counts, lg.send_full or [False] * len(lg.send_counts)):
        for local, got in pairs:
            part = got[start:start + count]
            if count and full:
                local.add_(part)
            elif count:
                rows = index[start:start + count]
                local.index_copy_(0, rows, local.index_select(0, rows) + part)
        start += count


class _HaloKeysValues(torch.autograd.Function):
    """(k, v) [n_local, H, D] -> (k_all, v_all) [n_local + n_halo, H, D]: two
    views of one buffer [n_columns, H, 2D] that holds this rank's rows and,
    received by one exchange straight into its tail, the halo's. The
    backward sends the halo rows' dK and dV back to their owners and adds
    them to the local rows'. (The path of other backends and of CPUs; the
    fused kernel takes :class:`_PipelinedFusedAttention`.)"""

    @staticmethod
    def forward(ctx, k, v, lg: LocalGraph, group):
        n, H, D = k.shape
        kv = k.new_empty((lg.num_columns, H, 2 * D))
        kv[:n, :, :D] = k
        kv[:n, :, D:] = v
        _exchange(_send_rows(kv[:n], lg), kv[n:], lg.halo_counts, lg.send_counts, group).wait()
        ctx.lg, ctx.group, ctx.n, ctx.D = lg, group, n, D
        return kv[..., :D], kv[..., D:]

    @staticmethod
    def backward(ctx, dk_all, dv_all):
        lg, n, D = ctx.lg, ctx.n, ctx.D
        halo = torch.cat([dk_all[n:], dv_all[n:]], -1)
        back = halo.new_empty((lg.send_index.numel(), *halo.shape[1:]))
        _exchange(halo, back, lg.send_counts, lg.halo_counts, ctx.group).wait()
        # written in place: dk_all, dv_all are the attention's fresh gradients, read by nothing else
        dk, dv = dk_all[:n], dv_all[:n]
        _add_received([(dk, back[..., :D]), (dv, back[..., D:])], lg)
        return dk, dv, None, None


def _head_chunks(heads: int, chunks: int) -> list[tuple[int, int]]:
    chunks = max(1, min(chunks, heads))
    bounds = [heads * i // chunks for i in range(chunks + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class _PipelinedFusedAttention(torch.autograd.Function):
    """The fused attention of this rank's rows with the halo exchange
    pipelined over head chunks. Forward: every chunk's K|V halo exchange is
    started at once, each into its own buffer [n_columns, heads of the
    chunk, 2D]; the attention of a chunk runs as soon as its halo is in,
    while the next chunks' are still on the wire. Backward: each chunk's
    fused backward, then its halo dK and dV start back to their owners while
    the next chunk's backward runs; the received gradients are added last.
    The kernels read q, K, V and dO as strided views: no padded rows, no
    concatenation of the halo."""

    @staticmethod
    def forward(ctx, q, k, v, bias, lg: LocalGraph, plan: GraphPlan, scale: float, group):
        n, H, D = q.shape
        heads = _head_chunks(H, lg.head_chunks)
        buffers, pending = [], []
        for h0, h1 in heads:
            kv = k.new_empty((lg.num_columns, h1 - h0, 2 * D))
            kv[:n, :, :D] = k[:, h0:h1]
            kv[:n, :, D:] = v[:, h0:h1]
            buffers.append(kv)
            pending.append(_exchange(_send_rows(kv[:n], lg), kv[n:], lg.halo_counts, lg.send_counts, group))
        slots = plan.bias_args() if bias is not None else ()
        outs, lses = [], []
        for (h0, h1), kv, wait in zip(heads, buffers, pending):
            wait.wait()
            b = bias[:, h0:h1].contiguous() if bias is not None else None
            out, lse, _ = _ops._kernel_forward(q[:, h0:h1], kv[..., :D], kv[..., D:],
                                               plan.forward_args(h1 - h0, padded_head_dim(D)), scale,
                                               q.dtype, None, b, slots)
            outs.append(out)
            lses.append(lse)
        out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
        ctx.save_for_backward(q, out, bias, *buffers, *lses)
        ctx.lg, ctx.plan, ctx.scale, ctx.group, ctx.heads = lg, plan, scale, group, heads
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, bias, *rest = ctx.saved_tensors
        heads, lg, plan, n = ctx.heads, ctx.lg, ctx.plan, q.size(0)
        buffers, lses = rest[:len(heads)], rest[len(heads):]
        D = q.size(-1)
        slots = plan.bias_args() if bias is not None else ()
        dqs, dbs, local, pending = [], [], [], []
        for (h0, h1), kv, lse in zip(heads, buffers, lses):
            hc, Dp = h1 - h0, padded_head_dim(D)
            b = bias[:, h0:h1].contiguous() if bias is not None else None
            edge = (b, *slots, None, None, 0.0, 0) if bias is not None else ()
            dq, dk, dv, db = _ops._kernel_backward(grad_out[:, h0:h1], q[:, h0:h1], kv[..., :D], kv[..., D:],
                                                   out[:, h0:h1], lse, plan.forward_args(hc, Dp),
                                                   plan.backward_args(hc, Dp), ctx.scale, None, edge)
            dqs.append(dq)
            dbs.append(db)
            back = dk.new_empty((2, lg.send_index.numel(), hc, D))     # the halo rows' dK, dV, sent back
            pending.append([_exchange(g[n:], back[i], lg.send_counts, lg.halo_counts, ctx.group)
                            for i, g in enumerate((dk, dv))])
            local.append((dk[:n], dv[:n], back))
        for (dk, dv, back), waits in zip(local, pending):
            for w in waits:
                w.wait()
            _add_received([(dk, back[0]), (dv, back[1])], lg)
        cat = (lambda ts: torch.cat(ts, 1)) if len(heads) > 1 else (lambda ts: ts[0])   # noqa: E731
        dk, dv = cat([t[0] for t in local]), cat([t[1] for t in local])
        return (cat(dqs), dk, dv, cat(dbs) if bias is not None and ctx.needs_input_grad[3] else None,
                None, None, None, None)


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
    every rank of ``group`` calls it, once per layer. K and V travel
    together, in ``lg.head_chunks`` exchanges on the fused path (fp16 /
    bf16: run it under autocast), one otherwise. The default attention is the fused one on the local graph
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
    fused = attention is None and _ops.kernel_available(q.device)
    if fused and q.dtype in (torch.float16, torch.bfloat16) and _ops.kernel_accepts(q.size(-1), q.dtype):
        if edge_bias is not None and edge_bias.shape != (lg.edge_ids.numel(), q.size(1)):
            raise ValueError(f"edge_bias must be [E_local, H] = [{lg.edge_ids.numel()}, {q.size(1)}] "
                             f"(got {tuple(edge_bias.shape)})")
        scale = default_scale(q.size(-1)) if scale is None else float(scale)
        bias = edge_bias.float() if edge_bias is not None else None
        return _PipelinedFusedAttention.apply(q, k.to(q.dtype), v.to(q.dtype), bias, lg,
                                              _local_plan(lg, q.device), scale, group)
    k_all, v_all = _HaloKeysValues.apply(k, v, lg, group)
    if attention is not None:
        q_all = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, lg.halo.numel()))   # no edge reaches a halo row
        return attention(q_all, k_all, v_all, _attention_graph(lg, q.device), scale, edge_bias)[:n]
    if fused:                     # fp32 (cast for the kernel), or the rest fused3s_attention accepts
        return _ops.fused3s_attention(q, k_all, v_all, _local_plan(lg, q.device), scale, edge_bias=edge_bias)
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
