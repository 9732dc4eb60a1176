"""Full-graph attention over a partitioned graph: each rank computes the rows
it owns, after receiving the K and V rows of its halo from their owners.

Per layer the ranks exchange the rows each needs of the others (the send
lists of :class:`~.partition.LocalGraph`), as one batch of point-to-point
sends and receives: rows a rank reads all of go as the local rows
themselves, one tensor for every such rank, with no gather. The backward
returns the halo's dK and dV to the owners by the reverse exchange, where
they are added to the local gradients. With the fused kernel the
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
import weakref
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


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lg: LocalGraph, group):
        ctx.lg, ctx.group, ctx.rows = lg, group, x.size(0)
        out = x.new_empty((lg.halo.numel(), *x.shape[1:]))
        _exchange(_send_blocks(x, lg), _halo_blocks(out, lg), lg, group).wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        pending, back = _start_return([grad], ctx.lg, ctx.group)
        pending.wait()
        dx = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        _add_returned(dx, *back[0], ctx.lg)
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
    """An exchange in flight: :meth:`wait` makes the current stream wait
    for it, and the timer counts that wait, the part of the exchange the
    compute did not hide. Holds the tensors sent until then."""

    def __init__(self, works: list, ref: Tensor | None, tensors: list[Tensor]):
        self.works, self.ref, self.tensors = works, ref, tensors

    def wait(self) -> None:
        timer = _TIMER
        start = timer._record(self.ref) if timer is not None and self.works else None
        for work in self.works:
            work.wait()
        if start is not None:
            timer._spans.append((start, timer._record(self.ref)))
        self.tensors = []


Blocks = list[tuple[int, Tensor]]     # (group rank of the peer, rows sent to it / received from it)


def _exchange(sends: Blocks, recvs: Blocks, lg: LocalGraph, group) -> _Pending:
    """Start sending and receiving row blocks, one batch of point-to-point
    operations (one NCCL group): a block sent whole to several ranks is one
    tensor, not a copy per rank (an ``all_to_all_single`` needs them laid
    out one after another). Blocks of one peer and direction travel in
    list order, so both sides list them alike. Receive buffers must be
    contiguous."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:   # a collective: every rank calls
        return _Pending([], None, [])
    if lg.parts != dist.get_world_size(group):
        raise ValueError(f"the local graph was built for {lg.parts} parts but the process group "
                         f"has {dist.get_world_size(group)} ranks: pass parts=world_size to local_graph")
    _connect(group)
    sends = [(r, t.contiguous()) for r, t in sends]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=r) for r, t in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=r) for r, t in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    if _TIMER is not None:
        _TIMER.count += 1
        _TIMER.bytes += sum(t.numel() * t.element_size() for _, t in sends)
    ref = (sends or recvs)[0][1] if ops else None
    return _Pending([w for w in works if w is not None], ref, [t for _, t in sends])


_CONNECTED: weakref.WeakSet = weakref.WeakSet()   # process groups past their first exchange


def _connect(group) -> None:
    """One barrier per process group before its first exchange: a rank with
    nothing to send or receive (an empty part) issues no point-to-point
    operation, but NCCL sets a communicator up only when every rank takes
    part in its first call."""
    pg = group if group is not None else dist.group.WORLD
    if pg not in _CONNECTED:
        dist.barrier(group)
        _CONNECTED.add(pg)


def _send_blocks(x: Tensor, lg: LocalGraph) -> Blocks:
    """The rows of ``x`` [n_local, ...] each rank reads: ``x`` itself for a
    rank that gets all of them (one tensor for every such rank: no gather),
    a gather of its rows for the others."""
    blocks, start, index = [], 0, None
    for r, (count, full) in enumerate(zip(lg.send_counts, _flags(lg.send_full, lg.parts))):
        if count and full:
            blocks.append((r, x))
        elif count:   # (the index moved to x's device only where a block is gathered)
            index = lg.send_index.to(x.device) if index is None else index
            blocks.append((r, _ops.gather_rows(x, index[start:start + count])))
        start += count
    return blocks


def _halo_blocks(halo: Tensor, lg: LocalGraph) -> Blocks:
    """``halo`` [n_halo, ...] (contiguous) as the owners' blocks: views."""
    return [(r, b) for r, b in enumerate(torch.split(halo, lg.halo_counts)) if lg.halo_counts[r]]


def _flags(flags: list[bool], parts: int) -> list[bool]:
    return flags or [False] * parts


def _start_return(halo_grads: list[Tensor], lg: LocalGraph, group) -> tuple[_Pending, list[tuple[Tensor, Tensor]]]:
    """Start sending each gradient's halo rows [n_halo, ...] back to their
    owners, and receiving the gradients of this rank's rows from the ranks
    that read them: per gradient (full [F, n_local, ...]: one slot per rank
    that read every row; part [rows, ...]: the other ranks' blocks, in
    rank order), to be added by :func:`_add_returned` after the wait."""
    n, sends, recvs, bufs = lg.num_local, [], [], []
    flags = _flags(lg.send_full, lg.parts)
    n_full = sum(1 for c, f in zip(lg.send_counts, flags) if c and f)
    n_part = sum(c for c, f in zip(lg.send_counts, flags) if c and not f)
    for g in halo_grads:
        full = g.new_empty((n_full, n, *g.shape[1:]))
        part = g.new_empty((n_part, *g.shape[1:]))
        bufs.append((full, part))
        sends += _halo_blocks(g, lg)
        i = start = 0
        for r, (count, is_full) in enumerate(zip(lg.send_counts, flags)):
            if count and is_full:
                recvs.append((r, full[i]))
                i += 1
            elif count:
                recvs.append((r, part[start:start + count]))
                start += count
    return _exchange(sends, recvs, lg, group), bufs


def _add_returned(local: Tensor, full: Tensor, part: Tensor, lg: LocalGraph) -> None:
    """``local`` [n_local, ...] += the gradients :func:`_start_return`
    received: the full blocks summed first (one reduction, in fp32 inside),
    the other blocks added to their rows (a row appears at most once per
    block, so no atomics are needed)."""
    if full.size(0):
        local.add_(full.sum(0) if full.size(0) > 1 else full[0])
    if not part.numel():
        return
    index = lg.send_index.to(local.device)
    start = got = 0
    for count, is_full in zip(lg.send_counts, _flags(lg.send_full, lg.parts)):
        if count and not is_full:
            rows = index[start:start + count]
            local.index_copy_(0, rows, _ops.gather_rows(local, rows) + part[got:got + count])
            got += count
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
        _exchange(_send_blocks(kv[:n], lg), _halo_blocks(kv[n:], lg), lg, group).wait()
        ctx.lg, ctx.group, ctx.n = lg, group, n
        return kv[..., :D], kv[..., D:]

    @staticmethod
    def backward(ctx, dk_all, dv_all):
        lg, n = ctx.lg, ctx.n
        pending, back = _start_return([dk_all[n:], dv_all[n:]], lg, ctx.group)
        pending.wait()
        # written in place: dk_all, dv_all are the attention's fresh gradients, read by nothing else
        dk, dv = dk_all[:n], dv_all[:n]
        _add_returned(dk, *back[0], lg)
        _add_returned(dv, *back[1], lg)
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
            pending.append(_exchange(_send_blocks(kv[:n], lg), _halo_blocks(kv[n:], lg), lg, group))
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
            # the halo rows' dK and dV go back to their owners while the next chunk's backward runs
            pending.append(_start_return([dk[n:], dv[n:]], lg, ctx.group))
            local.append((dk[:n], dv[:n]))
        for (dk, dv), (wait, back) in zip(local, pending):
            wait.wait()
            _add_returned(dk, *back[0], lg)
            _add_returned(dv, *back[1], lg)
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
