"""The kernel path's autograd plumbing, on the CPU, with stand-in ops.

``torch.ops.gt_fused3s.fwd`` / ``bwd`` need a GPU; here they are replaced by
reference implementations with the same contract (fp16/bf16 operands padded
to a compiled head dim, lse output, gradients in the operand dtype or fp32).
What is tested is everything around them: the torch.library custom op and
its autograd registration, casts and head-dim padding in both directions,
the transposed BSB, which gradients are returned, the saved output, and the
double-backward error. The kernels themselves are tested on the GPU
(tests/test_backward_cuda.py).
"""
from __future__ import annotations

import pytest
import torch

import gt_fused3s.ops as ops_mod
import gt_fused3s.schedule as schedule_mod
from gt_fused3s import BSBGraph, fused3s_attention
from gt_fused3s.reference import attention_reference


def _lse(q, k, edge_index, scale):
    src, dst = edge_index
    s = (q.float()[dst] * k.float()[src]).sum(-1) * scale
    mx = torch.full(q.shape[:2], float("-inf")).scatter_reduce(0, dst[:, None].expand_as(s), s, "amax")
    se = torch.zeros(q.shape[:2]).index_add(0, dst, torch.exp(s - mx[dst]))
    return mx + torch.log(se)


class FakeOps:
    """Reference-backed fwd / bwd with the compiled ops' signatures."""

    def __init__(self, bsb: BSBGraph):
        self.bsb = bsb
        self.calls = []

    def fwd(self, q, k, v, rw_offset, cols, bitmap, window_order, items, slots, scale, out_fp32):
        assert q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) in (16, 32, 64, 128, 256)
        assert torch.equal(cols, self.bsb.cols)
        self.calls.append("fwd")
        out = attention_reference(q, k, v, self.bsb.edge_index, scale, out_dtype=torch.float32)
        return out if out_fp32 else out.to(q.dtype), _lse(q, k, self.bsb.edge_index, scale)

    def bwd(self, do, q, k, v, out, lse, cols, bitmap, items, slots, t_cols, t_bitmap, t_items, t_slots,
            scale, grad_fp32):
        t = self.bsb.transposed()
        assert torch.equal(cols, self.bsb.cols) and torch.equal(t_cols, t.cols) and torch.equal(t_bitmap, t.bitmap)
        assert do.dtype == q.dtype and do.shape == q.shape == out.shape
        # the saved forward output and lse come back unchanged (padded)
        expect = attention_reference(q, k, v, self.bsb.edge_index, scale, out_dtype=torch.float32)
        torch.testing.assert_close(out.float(), expect, atol=1e-2, rtol=0)
        torch.testing.assert_close(lse, _lse(q, k, self.bsb.edge_index, scale))
        self.calls.append("bwd")
        leaves = [x.float().requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            o = attention_reference(*leaves, self.bsb.edge_index, scale)
            grads = torch.autograd.grad(o, leaves, do.float())
        return tuple(g if grad_fp32 else g.to(q.dtype) for g in grads)


@pytest.fixture
def fake_kernel(monkeypatch):
    """Route CPU tensors through the kernel path with FakeOps."""
    def install(bsb):
        fake = FakeOps(bsb)
        monkeypatch.setattr(ops_mod, "_use_kernel", lambda q: True)
        monkeypatch.setattr(schedule_mod, "_num_sms", lambda device: 132)
        import gt_fused3s._build as build_mod
        monkeypatch.setattr(build_mod, "load_extension", lambda: fake)
        return fake
    return install


def _graph(n=70, e=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei = torch.cat([ei, torch.stack([torch.arange(n), torch.full((n,), 3)])], 1)   # node 3: heavy row
    return BSBGraph.from_edge_index(ei, n)


def _inputs(n, h, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(dtype) for _ in range(4)]


def _reference_grads(q, k, v, do, bsb, scale=None):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, bsb.edge_index, scale)
    return torch.autograd.grad(out, leaves, do.float())


@pytest.mark.parametrize("dtype,d", [(torch.float32, 24), (torch.float16, 32), (torch.bfloat16, 8)])
def test_gradients_through_the_custom_op(fake_kernel, dtype, d):
    bsb = _graph()
    fake = fake_kernel(bsb)
    q, k, v, do = _inputs(bsb.num_nodes, 2, d, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused3s_attention(*leaves, bsb)
    assert out.dtype == dtype and out.shape == q.shape
    out.backward(do)
    assert fake.calls == ["fwd", "bwd"]
    # the stand-in is exact on the operands the kernel gets (fp32 rounded to
    # fp16); only the gradients' final rounding to a low-precision dtype remains
    rounded = [t.to(torch.float16) if dtype == torch.float32 else t for t in (q, k, v, do)]
    for leaf, ref in zip(leaves, _reference_grads(*rounded, bsb)):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(leaf.grad.float(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=0)
    assert "transposed" in bsb.extras      # built once, cached with the graph


def test_fp32_inputs_get_fp32_gradients_from_the_kernel(fake_kernel):
    bsb = _graph()
    fake_kernel(bsb)
    q, k, v, do = _inputs(bsb.num_nodes, 1, 16, torch.float32)
    q.requires_grad_()
    (dq,) = torch.autograd.grad(fused3s_attention(q, k, v, bsb, compute_dtype=torch.bfloat16), q, do)
    assert dq.dtype == torch.float32
    ref = _reference_grads(q, k, v, do, bsb)[0]
    assert (dq - ref).abs().max() < 5e-2 * ref.abs().max()


def test_only_requested_gradients_and_no_backward_without_grad(fake_kernel):
    bsb = _graph()
    fake = fake_kernel(bsb)
    q, k, v, do = _inputs(bsb.num_nodes, 2, 16, torch.float16)
    with torch.no_grad():
        fused3s_attention(q.requires_grad_(), k, v, bsb)
    assert fake.calls == ["fwd"] and "transposed" not in bsb.extras   # inference builds no transpose
    q.requires_grad_(False)
    vg = v.clone().requires_grad_()
    out = fused3s_attention(q, k, vg, bsb)
    (dv,) = torch.autograd.grad(out, vg, do)
    assert dv.shape == v.shape and q.grad is None


def test_double_backward_raises_clearly(fake_kernel):
    bsb = _graph()
    fake_kernel(bsb)
    q, k, v, do = _inputs(bsb.num_nodes, 1, 16, torch.float16)
    q.requires_grad_()
    out = fused3s_attention(q, k, v, bsb)
    with pytest.raises(RuntimeError, match="double backward through fused3s_attention is not supported"):
        torch.autograd.grad(out, q, do, create_graph=True)


def test_transposed_bsb_is_the_reversed_graph():
    bsb = _graph()
    t = bsb.transposed()
    assert t is bsb.transposed()
    expect = BSBGraph.from_edge_index(bsb.edge_index.flip(0), bsb.num_nodes)
    for name in ("rw_offset", "cols", "bitmap", "window_order", "edge_index"):
        assert torch.equal(getattr(t, name), getattr(expect, name))
    # the decoded edges are exactly the reversed ones
    fwd = {tuple(e) for e in bsb.decode_edges().t().tolist()}
    rev = {(b, a) for a, b in (tuple(e) for e in t.decode_edges().t().tolist())}
    assert fwd == rev


def test_gradients_through_the_torch_library_op(fake_kernel):
    """The custom op (the path under torch.compile) has the eager path's gradients."""
    bsb = _graph()
    fake_kernel(bsb)
    q, k, v, do = _inputs(bsb.num_nodes, 2, 24, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    args = (ops_mod._forward_arrays(bsb, q), ops_mod._backward_arrays(bsb, q), 0.3, torch.float32, None)
    out, lse = torch.ops.gt_fused3s.attention(*leaves, *args)
    assert not lse.requires_grad
    grads = torch.autograd.grad(out, leaves, do)
    eager = torch.autograd.grad(fused3s_attention(*leaves, bsb, 0.3), leaves, do)
    for a, b in zip(grads, eager):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(torch.ops.gt_fused3s.attention(*leaves, *args)[0], leaves, do, create_graph=True)


def test_custom_op_is_registered_with_a_schema():
    schema = str(torch.ops.gt_fused3s.attention.default._schema)
    assert "Tensor[] fwd_graph" in schema and "-> (Tensor, Tensor)" in schema
    assert isinstance(ops_mod._attention_op, torch._library.custom_ops.CustomOpDef)
