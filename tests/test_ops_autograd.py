"""The kernel path's autograd plumbing, on the CPU, with stand-in ops.

``torch.ops.gt_fused3s.fwd`` / ``bwd`` need a GPU; here they get CPU
stand-ins (tests/stand_in_kernels.py) with the same contract: fp16/bf16
operands padded to a compiled head dim, lse output, gradients in the operand
dtype or fp32, the graph decoded from the arrays they are given. What is
tested is everything around them: the torch.library custom op and its
autograd registration, casts and head-dim padding in both directions, the
plan's transposed BSB, which gradients are returned, the saved output, and
the double-backward error. The kernels themselves are tested on the GPU
(tests/test_backward_cuda.py).
"""
from __future__ import annotations

import pytest
import torch

import gt_fused3s.ops as ops_mod
from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.reference import attention_reference


def _graph(n=70, e=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    ei = torch.cat([ei, torch.stack([torch.arange(n), torch.full((n,), 3)]), ei[:, :9]], 1)   # heavy row, duplicates
    return GraphPlan.from_edge_index(ei, n)


def _inputs(n, h, d, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, h, d, generator=g).to(dtype) for _ in range(4)]


def _reference_grads(q, k, v, do, plan, scale=None):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, plan.edge_index, scale)
    return torch.autograd.grad(out, leaves, do.float())


@pytest.mark.parametrize("dtype,d", [(torch.float32, 24), (torch.float16, 32), (torch.bfloat16, 8)])
def test_gradients_through_the_custom_op(stand_in_kernels, dtype, d):
    bsb = _graph()
    fake = stand_in_kernels
    q, k, v, do = _inputs(bsb.num_nodes, 2, d, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused3s_attention(*leaves, bsb)
    assert out.dtype == dtype and out.shape == q.shape
    out.backward(do)
    # the transpose and its schedule: at the first grad
    assert fake.calls == ["bsb_build", "work_schedule", "bsb_build", "work_schedule", "fwd", "bwd"]
    # the stand-in is exact on the operands the kernel gets (fp32 rounded to
    # fp16); only the gradients' final rounding to a low-precision dtype remains
    rounded = [t.to(torch.float16) if dtype == torch.float32 else t for t in (q, k, v, do)]
    for leaf, ref in zip(leaves, _reference_grads(*rounded, bsb)):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == q.shape
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(leaf.grad.float(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=0)
    assert bsb.transposed is not None      # built once, kept in the plan


def test_fp32_inputs_get_fp32_gradients_from_the_kernel(stand_in_kernels):
    bsb = _graph()
    q, k, v, do = _inputs(bsb.num_nodes, 1, 16, torch.float32)
    q.requires_grad_()
    (dq,) = torch.autograd.grad(fused3s_attention(q, k, v, bsb, compute_dtype=torch.bfloat16), q, do)
    assert dq.dtype == torch.float32
    ref = _reference_grads(q, k, v, do, bsb)[0]
    assert (dq - ref).abs().max() < 5e-2 * ref.abs().max()


def test_only_requested_gradients_and_no_backward_without_grad(stand_in_kernels):
    bsb = _graph()
    fake = stand_in_kernels
    q, k, v, do = _inputs(bsb.num_nodes, 2, 16, torch.float16)
    with torch.no_grad():
        fused3s_attention(q.requires_grad_(), k, v, bsb)
    # inference: no transpose
    assert fake.calls == ["bsb_build", "work_schedule", "fwd"] and bsb.transposed is None
    q.requires_grad_(False)
    vg = v.clone().requires_grad_()
    out = fused3s_attention(q, k, vg, bsb)
    (dv,) = torch.autograd.grad(out, vg, do)
    assert dv.shape == v.shape and q.grad is None


def test_double_backward_raises_clearly(stand_in_kernels):
    bsb = _graph()
    q, k, v, do = _inputs(bsb.num_nodes, 1, 16, torch.float16)
    q.requires_grad_()
    out = fused3s_attention(q, k, v, bsb)
    with pytest.raises(RuntimeError, match="double backward through fused3s_attention is not supported"):
        torch.autograd.grad(out, q, do, create_graph=True)


def test_gradients_through_the_torch_library_op(stand_in_kernels):
    """The custom op (the path under torch.compile) has the eager path's gradients."""
    bsb = _graph()
    q, k, v, do = _inputs(bsb.num_nodes, 2, 24, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    args = (list(bsb.forward_args(2, 32)), list(bsb.backward_args(2, 32)), 0.3, torch.float32, None, None, [], None, 0.0, 0, None)
    out, lse, probs = torch.ops.gt_fused3s.attention(*leaves, *args)
    assert probs.numel() == 0              # no weights asked for
    assert not lse.requires_grad
    grads = torch.autograd.grad(out, leaves, do)
    eager = torch.autograd.grad(fused3s_attention(*leaves, bsb, 0.3), leaves, do)
    for a, b in zip(grads, eager):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(torch.ops.gt_fused3s.attention(*leaves, *args)[0], leaves, do, create_graph=True)


def test_custom_op_is_registered_with_a_schema():
    schema = str(torch.ops.gt_fused3s.attention.default._schema)
    assert "Tensor[] fwd_graph" in schema and "-> (Tensor, Tensor, Tensor)" in schema
    assert isinstance(ops_mod._attention_op, torch._library.custom_ops.CustomOpDef)


@pytest.mark.parametrize("bias", [False, True])
def test_destinations_as_the_first_rows(stand_in_kernels, bias):
    """A plan whose destinations are its first num_rows nodes (a rank's rows
    of a partitioned graph plus its halo columns): q and the output have
    num_rows rows, k and v all nodes; equal to the square graph's rows, and
    its gradients, through the kernel path and the reference path."""
    g = torch.Generator().manual_seed(3)
    n, rows = 90, 37
    ei = torch.stack([torch.randint(0, n, (500,), generator=g), torch.randint(0, rows, (500,), generator=g)])
    plan = GraphPlan.from_edge_index(ei, n, num_rows=rows)
    square = GraphPlan.from_edge_index(ei, n)
    assert plan.num_rows == rows and "num_rows=37" in repr(plan)
    q, k, v, do = _inputs(n, 2, 16, torch.float16)
    b = torch.randn(ei.size(1), 2, generator=g) if bias else None
    grads = []
    for graph, nq in ((plan, rows), (square, n)):
        leaves = [t.clone().requires_grad_() for t in (q[:nq], k, v)]
        eb = b.clone().requires_grad_() if bias else None
        out = fused3s_attention(*leaves, graph, edge_bias=eb)
        assert out.shape == (nq, 2, 16)
        out.backward(do[:nq])
        grads.append([out[:rows], *(t.grad for t in leaves), *([eb.grad] if bias else [])])
    for a, s in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, s[:a.size(0)])
    ref = attention_reference(q[:rows], k, v, ei, edge_bias=b)          # the reference path too
    torch.testing.assert_close(ref.to(torch.float16), grads[0][0], atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="q has 90 rows but the plan's destinations are its first num_rows=37"):
        fused3s_attention(q, k, v, plan)
    with pytest.raises(ValueError, match=r"pass a GraphPlan built with num_rows=37"):
        fused3s_attention(q[:rows], k, v, ei)
    with pytest.raises(ValueError, match=r"edge_index\[1\] \(destinations\) has index"):
        GraphPlan.from_edge_index(ei, n, num_rows=20)
