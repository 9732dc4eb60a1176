"""CPU stand-ins for the CUDA ops ``gt_fused3s::fwd``, ``bwd`` and
``bsb_build``, with their contracts, so that the CPU suite runs everything
around the kernels: the plan, the registered ops and their fakes
(``opcheck``), autograd, torch.compile tracing, casts and padding.

``fwd`` and ``bwd`` decode the graph from the arrays they are given (the
items' windows, ``cols`` and ``bitmap``; unused items of a schedule at
capacity skipped, as the kernels do) and compute with the reference in fp32,
so a wrong array, schedule or transposed format shows up as a wrong result.
``bsb_build`` is the specification builder padded to capacity. The CUDA
kernels themselves are tested on the GPU (the ``cuda`` tests)."""
from __future__ import annotations

import torch

from gt_fused3s.graph import BSBGraph, tcb_capacity
from gt_fused3s.reference import attention_reference

KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def decode(items: torch.Tensor, cols: torch.Tensor, bitmap: torch.Tensor) -> torch.Tensor:
    """Edges [2, E] (source, destination) of a BSB as the kernels read it:
    the TCBs the items cover, in their windows."""
    it = items[items[:, 0] >= 0].long()
    T = bitmap.size(0)
    tcb_win = torch.full((T,), -1, dtype=torch.long)
    for w, b, e, _ in it.tolist():
        tcb_win[b:e] = w
    bit = torch.arange(64)
    on = ((bitmap.unsqueeze(-1) >> bit) & 1).bool()            # [T, 2, 64]
    t, word, b = on.nonzero(as_tuple=True)
    assert torch.all(tcb_win[t] >= 0), "an edge bit lies in a TCB no item covers"
    rows = tcb_win[t] * 16 + word * 8 + (b >> 3)
    srcs = cols.long()[t * 8 + (b & 7)]
    assert torch.all(srcs >= 0), "an edge bit in a padding column"
    return torch.stack([srcs, rows])


def _lse(q, k, edge_index, scale):
    src, dst = edge_index
    s = (q.float()[dst] * k.float()[src]).sum(-1) * scale
    mx = torch.full(q.shape[:2], float("-inf")).scatter_reduce(0, dst[:, None].expand_as(s), s, "amax")
    se = torch.zeros(q.shape[:2]).index_add(0, dst, torch.exp(s - mx[dst]))
    return mx + torch.log(se)


def _reference_backward(q, k, v, do, edge_index, scale):
    """dq, dk, dv of the attention over ``edge_index`` in fp32, written out
    (P = softmax, dS = P (dO.v - rowsum(dO * O)), dq = s dS k, dk = s dS^T q,
    dv = P^T dO), without autograd, so it also runs under dispatch modes."""
    q, k, v, do = (t.float() for t in (q, k, v, do))
    src, dst = edge_index
    N, H, _ = q.shape
    s = (q[dst] * k[src]).sum(-1) * scale                                   # [E, H]
    p = torch.exp(s - _lse(q, k, edge_index, scale)[dst])
    o = torch.zeros_like(v).index_add(0, dst, p.unsqueeze(-1) * v[src])
    delta = (do * o).sum(-1)                                                # [N, H]
    ds = p * ((do[dst] * v[src]).sum(-1) - delta[dst])
    dq = torch.zeros_like(q).index_add(0, dst, ds.unsqueeze(-1) * k[src]) * scale
    dk = torch.zeros_like(k).index_add(0, src, ds.unsqueeze(-1) * q[dst]) * scale
    dv = torch.zeros_like(v).index_add(0, src, p.unsqueeze(-1) * do[dst])
    return dq, dk, dv


def _check_operands(*ts):
    q = ts[0]
    assert q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) in KERNEL_HEAD_DIMS
    for t in ts:
        assert t.dtype == q.dtype and t.shape == q.shape


def _sorted(ei):
    return torch.sort(ei[1] * (2 ** 31) + ei[0]).values


class StandIns:
    """The stand-in implementations; ``calls`` lists the ops run."""

    def __init__(self):
        self.calls: list[str] = []

    def fwd(self, q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32):
        _check_operands(q, k, v)
        assert items.size(0) >= rw_offset.numel() - 1
        self.calls.append("fwd")
        ei = decode(items, cols, bitmap)
        out = attention_reference(q, k, v, ei, scale, out_dtype=torch.float32)
        return (out if out_fp32 else out.to(q.dtype)), _lse(q, k, ei, scale)

    def bwd(self, do, q, k, v, out, lse, cols, bitmap, items, slots, t_cols, t_bitmap, t_items, t_slots,
            scale, grad_fp32):
        _check_operands(q, k, v, do)
        ei = decode(items, cols, bitmap)
        # the transposed format holds exactly the reversed edges
        assert torch.equal(_sorted(decode(t_items, t_cols, t_bitmap).flip(0)), _sorted(ei))
        # the saved forward output and lse come back unchanged
        expect = attention_reference(q, k, v, ei, scale, out_dtype=torch.float32)
        torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, _lse(q, k, ei, scale))
        self.calls.append("bwd")
        grads = _reference_backward(q, k, v, do, ei, scale)
        return tuple(g if grad_fp32 else g.to(q.dtype) for g in grads)

    def bsb_build(self, edge_index, num_nodes):
        self.calls.append("bsb_build")
        E = edge_index.size(1)
        ok = bool(((edge_index >= 0) & (edge_index < num_nodes)).all()) if E else True
        valid = edge_index if ok else edge_index.clamp(0, max(num_nodes - 1, 0))
        g = BSBGraph._build(valid[0].long(), valid[1].long(), num_nodes)
        cap = tcb_capacity(E, num_nodes)
        pad = cap - g.num_tcbs
        cols = torch.cat([g.cols, torch.full((pad * 8,), -1, dtype=torch.int32)])
        bitmap = torch.cat([g.bitmap, torch.zeros(pad, 2, dtype=torch.long)])
        counters = g.counters.clone()
        if E:
            lo, hi = torch.aminmax(edge_index.long())
            counters[2], counters[3] = lo, hi
        return g.rw_offset, cols, bitmap, g.window_order, g.edge_index, counters


def install(monkeypatch) -> StandIns:
    """Register the stand-ins as the ops' CPU kernels (removed when the test
    ends) and route CPU tensors through the kernel path."""
    import gt_fused3s._build as build_mod
    import gt_fused3s.graph as graph_mod
    import gt_fused3s.ops as ops_mod
    import gt_fused3s.schedule as schedule_mod

    stand_ins = StandIns()
    lib = torch.library.Library("gt_fused3s", "IMPL")
    for name in ("fwd", "bwd", "bsb_build"):
        lib.impl(name, getattr(stand_ins, name), "CPU")
    monkeypatch.setattr(ops_mod, "kernel_available", lambda device: True)
    monkeypatch.setattr(ops_mod, "_use_kernel", lambda q: True)
    monkeypatch.setattr(graph_mod, "_op_build_available", lambda device: True)
    monkeypatch.setattr(build_mod, "load_extension", lambda: torch.ops.gt_fused3s)
    monkeypatch.setattr(schedule_mod, "_num_sms", lambda device: 132)
    stand_ins.lib = lib
    return stand_ins
