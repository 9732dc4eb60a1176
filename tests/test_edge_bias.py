"""The additive edge bias of ``fused3s_attention(..., edge_bias=[E, H])``,
on the CPU: the format's edge slots, the reference against a loop written
out per node, the kernel path (CPU stand-ins of the ops, which find each
edge's bias through the slots as the kernels do), gradients, gradcheck in
float64 and clear errors. The CUDA kernels are tested in
tests/test_edge_bias_cuda.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.graph import BSBGraph, edge_slots
from gt_fused3s.reference import attention_reference
from graph_cases import GRAPH_CASES
from stand_in_kernels import decode


def _shuffled(name: str, seed: int = 0):
    """A graph case with its edges in a random order (the caller's order is
    what the bias follows, not the format's)."""
    ei, n = GRAPH_CASES[name]()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(seed))
    return ei[:, perm], n


def _loop_reference(q, k, v, ei, bias, scale):
    """out[i] = sum over the edges e = j -> i of softmax_e(s q_i.k_j + b_e) v_j, per node."""
    out = torch.zeros_like(v)
    for i in range(q.size(0)):
        es = (ei[1] == i).nonzero().flatten()
        if es.numel() == 0:
            continue
        s = (q[i] * k[ei[0, es]]).sum(-1) * scale + bias[es]          # [deg, H]
        out[i] = (torch.softmax(s, 0).unsqueeze(-1) * v[ei[0, es]]).sum(0)
    return out


def _check_slots(bsb: BSBGraph, ei: torch.Tensor, nnz_offset, slot_edge, slot_pos) -> None:
    items = torch.stack([torch.arange(bsb.num_windows), bsb.rw_offset[:-1], bsb.rw_offset[1:],
                         torch.full((bsb.num_windows,), -1)], 1).int()
    # (decode also checks each non-zero's place in its pair's mma fragments)
    decoded, ids = decode(items, bsb.cols, bsb.bitmap, nnz_offset, slot_edge, slot_pos)
    assert torch.equal(torch.sort(ids).values, torch.arange(ei.size(1)))   # a bijection
    assert torch.equal(ei[:, ids], decoded)                                 # each slot holds its edge


@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_edge_slots_find_every_edge_once(name):
    ei, n = _shuffled(name)
    bsb = BSBGraph.from_edge_index(ei, n)
    nnz_offset, slot_edge, slot_pos = edge_slots(bsb, ei)
    assert nnz_offset.dtype == slot_edge.dtype == torch.int32 and slot_pos.dtype == torch.uint8
    assert nnz_offset.numel() == bsb.num_tcbs + 1 and int(nnz_offset[-1]) == ei.size(1)
    _check_slots(bsb, ei, nnz_offset, slot_edge, slot_pos)
    # the transposed format, for the backward's dK/dV pass, with the same ids
    t = BSBGraph.from_edge_index(ei.flip(0), n)
    _check_slots(t, ei.flip(0), *edge_slots(t, ei.flip(0)))


def test_edge_slots_of_a_static_build(stand_in_kernels):
    ei, n = _shuffled("duplicates")
    plan = GraphPlan.from_edge_index(ei, n, static=True).prepare(1, 16, edge_bias=True)
    nnz_offset, slot_edge, slot_pos, t_nnz_offset, t_slot_edge, t_slot_pos = plan.bias_args()
    assert nnz_offset.numel() == plan.bsb.tcb_capacity + 1      # over the capacity
    _check_slots(plan.bsb, ei, nnz_offset, slot_edge, slot_pos)
    _check_slots(plan.transposed, ei.flip(0), t_nnz_offset, t_slot_edge, t_slot_pos)


@pytest.mark.parametrize("name", ["duplicates", "self_loops", "empty_rows"])
def test_edge_grouping_is_the_destination_order(stand_in_kernels, name):
    """plan.edge_grouping(): for edges in a shuffled order, the stable
    destination order and its inverse, the slots naming grouped positions of
    the same edges, each grouped edge's row and the grouped CSR; None for
    edges already grouped and for a static plan."""
    ei, n = _shuffled(name, seed=5)
    plan = GraphPlan.from_edge_index(ei, n)
    gr = plan.edge_grouping()
    assert gr is not None and plan.edge_grouping() is gr            # decided once
    E = ei.size(1)
    assert torch.equal(gr.perm, torch.sort(ei[1], stable=True).indices)
    assert torch.equal(gr.perm[gr.inv], torch.arange(E)) and torch.equal(gr.inv[gr.perm], torch.arange(E))
    assert torch.equal(gr.dst, ei[1][gr.perm]) and bool((gr.dst[1:] >= gr.dst[:-1]).all())
    caller = plan.bias_args()
    for i in (1, 4):        # slot_edge of the BSB and of its transpose
        assert gr.slots[i].dtype == torch.int32
        assert torch.equal(gr.perm[gr.slots[i].long()], caller[i].long())
    for i in (0, 2, 3, 5):
        assert gr.slots[i] is caller[i]
    rowptr, order = gr.csr
    assert torch.equal(order, torch.arange(E))
    assert torch.equal(rowptr, torch.searchsorted(gr.dst, torch.arange(n + 1)))
    grouped = ei[:, gr.perm]
    assert GraphPlan.from_edge_index(grouped, n).edge_grouping() is None
    static = GraphPlan.from_edge_index(ei, n, static=True)
    assert static.static and static.edge_grouping() is None


def test_edge_grouping_only_from_a_million_edges(monkeypatch):
    """The default threshold (the tests lower it to 0, conftest.py): a plan
    of fewer edges keeps the caller's order."""
    import gt_fused3s.plan as plan_mod
    monkeypatch.setattr(plan_mod, "EDGE_GROUPING_MIN_EDGES", 1 << 20)
    ei, n = _shuffled("duplicates", seed=5)
    assert GraphPlan.from_edge_index(ei, n).edge_grouping() is None
    monkeypatch.setattr(plan_mod, "EDGE_GROUPING_MIN_EDGES", ei.size(1))
    assert GraphPlan.from_edge_index(ei, n).edge_grouping() is not None


def test_edge_slots_refuse_another_graph():
    ei, n = _shuffled("duplicates")
    with pytest.raises(ValueError, match="edges but the BSB graph was built from"):
        edge_slots(BSBGraph.from_edge_index(ei, n), ei[:, 1:])


@pytest.mark.parametrize("name", ["duplicates", "self_loops", "empty_rows"])
def test_reference_bias_equals_a_loop_per_node(name):
    ei, n = _shuffled(name)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(ei.size(1), 2, generator=g, dtype=torch.float64)   # duplicates differ
    out = attention_reference(q, k, v, ei, 0.4, edge_bias=bias, compute_dtype=torch.float64)
    torch.testing.assert_close(out, _loop_reference(q, k, v, ei, bias, 0.4))


@pytest.mark.parametrize("graph_kind", ["plan", "edge_index", "static_plan"])
def test_kernel_path_bias_output_and_gradients(stand_in_kernels, graph_kind):
    ei, n = _shuffled("duplicates", seed=3)
    H, D = 2, 32
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(n, H, D, generator=g).half() for _ in range(4))
    bias = torch.randn(ei.size(1), H, generator=g)
    graph = {"plan": lambda: GraphPlan.from_edge_index(ei, n).prepare(H, D, edge_bias=True),
             "edge_index": lambda: ei,
             "static_plan": lambda: GraphPlan.from_edge_index(ei, n, static=True)}[graph_kind]()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = fused3s_attention(*leaves[:3], graph, 0.3, edge_bias=leaves[3])
    out.backward(do)
    assert [c for c in stand_in_kernels.calls if c in ("fwd", "bwd")][-2:] == ["fwd", "bwd"]
    # the shuffled edges' bias goes in grouped by destination and its
    # gradient comes back (plan.edge_grouping), except on a static plan
    assert ("gather_rows" in stand_in_kernels.calls) == (graph_kind != "static_plan")
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    ref = attention_reference(*ref_leaves[:3], ei, 0.3, edge_bias=ref_leaves[3])
    ref.backward(do.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
    for leaf, r in zip(leaves, ref_leaves):
        assert leaf.grad.dtype == leaf.dtype
        torch.testing.assert_close(leaf.grad.float(), r.grad, atol=1e-2, rtol=0)


def test_bias_gradient_alone_and_bf16_bias(stand_in_kernels):
    """Only the bias needs a gradient (an attention-bias encoder over fixed
    features); a bf16 bias gets a bf16 gradient."""
    ei, n = _shuffled("random_1003", seed=5)
    g = torch.Generator().manual_seed(6)
    q, k, v, do = (torch.randn(n, 1, 16, generator=g).half() for _ in range(4))
    bias = torch.randn(ei.size(1), 1, generator=g).bfloat16().requires_grad_()
    plan = GraphPlan.from_edge_index(ei, n)
    fused3s_attention(q, k, v, plan, edge_bias=bias).backward(do)
    ref_bias = bias.detach().float().requires_grad_()
    attention_reference(q.float(), k.float(), v.float(), ei, edge_bias=ref_bias).backward(do.float())
    assert bias.grad.dtype == torch.bfloat16
    torch.testing.assert_close(bias.grad.float(), ref_bias.grad, atol=1e-2, rtol=1e-2)


def test_zero_bias_changes_nothing_and_log_counts_are_multiplicity(stand_in_kernels):
    """A zero bias gives the plain attention; a bias of log(m) on one copy of
    an edge equals listing it m times."""
    ei, n = _shuffled("self_loops")
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, 2, 16, generator=g).half() for _ in range(3))
    plan = GraphPlan.from_edge_index(ei, n)
    plain = fused3s_attention(q, k, v, plan)
    torch.testing.assert_close(fused3s_attention(q, k, v, plan, edge_bias=torch.zeros(ei.size(1), 2)), plain)
    tripled = torch.cat([ei, ei[:, :1], ei[:, :1]], 1)
    bias = torch.zeros(ei.size(1), 2)
    bias[0] = math.log(3.0)
    torch.testing.assert_close(fused3s_attention(q, k, v, plan, edge_bias=bias),
                               fused3s_attention(q, k, v, tripled), atol=2e-3, rtol=0)


def test_gradcheck_float64_with_edge_bias():
    ei, n = _shuffled("duplicates", seed=8)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(ei.size(1), 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, b: fused3s_attention(q, k, v, ei, edge_bias=b),
                                    (q, k, v, bias))


@pytest.mark.parametrize("bad,match", [
    (lambda E, H: torch.zeros(E, H + 1), r"edge_bias must have shape \[E, H\]"),
    (lambda E, H: torch.zeros(E - 1, H), r"edge_bias must have shape \[E, H\]"),
    (lambda E, H: torch.zeros(E, H, dtype=torch.long), "edge_bias must be a floating-point tensor"),
])
@pytest.mark.parametrize("kernel_path", [False, True])
def test_bad_edge_bias_raises_clearly(request, bad, match, kernel_path):
    if kernel_path:
        request.getfixturevalue("stand_in_kernels")
    ei, n = _shuffled("duplicates")
    q = torch.randn(n, 2, 16).half()
    with pytest.raises(ValueError, match=match):
        fused3s_attention(q, q, q, GraphPlan.from_edge_index(ei, n), edge_bias=bad(ei.size(1), 2))


# ------------------------------------------------------------ attention weights
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("graph_kind", ["plan", "edge_index"])
def test_weights_and_their_gradient_on_the_kernel_path(stand_in_kernels, with_bias, graph_kind):
    """return_weights: P [E, H] in the caller's edge order from the forward's
    lse (the probs op), and a loss on both outputs gets the reference's
    gradients (the weights' gradient enters the fused backward as dp_bias)."""
    ei, n = _shuffled("duplicates", seed=10)
    H, D = 2, 16
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(n, H, D, generator=g).half() for _ in range(4))
    bias = torch.randn(ei.size(1), H, generator=g) if with_bias else None
    dw = torch.randn(ei.size(1), H, generator=g)
    graph = GraphPlan.from_edge_index(ei, n) if graph_kind == "plan" else ei
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([bias.clone().requires_grad_()] if with_bias else [])
    out, w = fused3s_attention(*leaves[:3], graph, 0.3, edge_bias=leaves[3] if with_bias else None,
                               return_weights=True)
    assert "fwd_scores" in stand_in_kernels.calls and w.shape == (ei.size(1), H) and w.dtype == torch.float32
    ((out.float() * do.float()).sum() + (w * dw).sum()).backward()
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref_out, ref_w = attention_reference(*ref_leaves[:3], ei, 0.3, return_weights=True,
                                         edge_bias=ref_leaves[3] if with_bias else None)
    ((ref_out * do.float()).sum() + (ref_w * dw).sum()).backward()
    torch.testing.assert_close(w, ref_w, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-3, rtol=0)
    for leaf, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.float(), r.grad, atol=1e-2, rtol=0)


def test_weights_alone_carry_the_gradient(stand_in_kernels):
    """Only the weights enter the loss: the output's gradient is zero, the
    weights' is still exact."""
    ei, n = _shuffled("random_1003", seed=12)
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(n, 1, 32, generator=g).half() for _ in range(3))
    dw = torch.randn(ei.size(1), 1, generator=g)
    qq = q.clone().requires_grad_()
    _, w = fused3s_attention(qq, k, v, GraphPlan.from_edge_index(ei, n), return_weights=True)
    (w * dw).sum().backward()
    rq = q.float().requires_grad_()
    (attention_reference(rq, k.float(), v.float(), ei, return_weights=True)[1] * dw).sum().backward()
    torch.testing.assert_close(qq.grad.float(), rq.grad, atol=1e-2, rtol=0)


def test_weights_sum_to_one_per_row_and_gradcheck_float64():
    ei, n = _shuffled("empty_rows", seed=14)
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = torch.randn(ei.size(1), 2, generator=g, dtype=torch.float64, requires_grad=True)
    _, w = fused3s_attention(q, k, v, ei, edge_bias=bias, return_weights=True)
    sums = torch.zeros(n, 2, dtype=torch.float64).index_add(0, ei[1], w)
    has = torch.zeros(n, dtype=torch.bool)
    has[ei[1]] = True
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: fused3s_attention(q, k, v, ei, edge_bias=b, return_weights=True)[1], (q, k, v, bias))


# ------------------------------------------------------------ attention dropout
@pytest.mark.parametrize("with_bias,weights", [(False, False), (True, True)])
def test_dropout_on_the_kernel_path_equals_the_reference_with_its_mask(stand_in_kernels, with_bias, weights):
    """The ops receive (p, seed) and draw the mask of dropout_keep by the
    caller's edge ids (the stand-ins as the kernels): output and gradients
    equal the reference given that mask."""
    from gt_fused3s.ops import dropout_keep
    ei, n = _shuffled("duplicates", seed=16)
    H, D = 2, 16
    g = torch.Generator().manual_seed(17)
    q, k, v, do = (torch.randn(n, H, D, generator=g).half() for _ in range(4))
    bias = torch.randn(ei.size(1), H, generator=g) if with_bias else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([bias.clone().requires_grad_()] if with_bias else [])
    res = fused3s_attention(*leaves[:3], GraphPlan.from_edge_index(ei, n), 0.3, dropout_p=0.4, dropout_seed=99,
                            edge_bias=leaves[3] if with_bias else None, return_weights=weights)
    out, w = res if weights else (res, None)
    loss = (out.float() * do.float()).sum() + (w.sum() if weights else 0)
    loss.backward()
    mask = dropout_keep(99, 0.4, ei.size(1), H)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    ref = attention_reference(*ref_leaves[:3], ei, 0.3, dropout_mask=mask, return_weights=weights,
                              edge_bias=ref_leaves[3] if with_bias else None)
    ref_out, ref_w = ref if weights else (ref, None)
    ((ref_out * do.float()).sum() + (ref_w.sum() if weights else 0)).backward()
    torch.testing.assert_close(out.float(), ref_out, atol=2e-3, rtol=0)
    for leaf, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(leaf.grad.float(), r.grad, atol=1e-2, rtol=0)
    assert not torch.allclose(out.float(), attention_reference(q.float(), k.float(), v.float(), ei, 0.3,
                                                               edge_bias=bias), atol=1e-2)   # it dropped


def test_dropout_reference_path_and_bad_p():
    ei, n = _shuffled("self_loops")
    q = torch.randn(n, 2, 8, dtype=torch.float64)
    a = fused3s_attention(q, q, q, ei, dropout_p=0.5, dropout_seed=3)
    torch.manual_seed(0)
    b = fused3s_attention(q, q, q, ei, dropout_p=0.5)          # a seed from torch's generator
    torch.manual_seed(0)
    assert torch.equal(b, fused3s_attention(q, q, q, ei, dropout_p=0.5))
    assert not torch.equal(a, b)
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            fused3s_attention(q, q, q, ei, dropout_p=p)


def _compiled_bias_matches_eager(ei, n, device="cpu", dtype=torch.float32, tol=1e-5):
    """fused3s_attention with an edge bias and returned weights, compiled
    (fullgraph) on a plan prepared for a bias, against the same call eager:
    outputs, weights and the gradients of q, k, v and the bias."""
    H, D = 2, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, H, D, generator=g).to(device, dtype) for _ in range(3))
    bias = torch.randn(ei.size(1), H, generator=g).to(device)
    plan = GraphPlan.from_edge_index(ei.to(device), n).prepare(H, D, edge_bias=True)
    grouping, plan.traced_groupings = plan.edge_grouping(), []
    # what the compiled call reads: the grouping prepare() decided
    plan.edge_grouping = lambda: plan.traced_groupings.append(torch.compiler.is_compiling()) or grouping

    def fn(q, k, v, b):
        out, w = fused3s_attention(q, k, v, plan, 0.3, edge_bias=b, return_weights=True)
        return out.float().square().sum() + (w * torch.linspace(0, 1, w.numel(), device=w.device).view_as(w)).sum()

    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        loss = f(*leaves)
        results.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    (l_e, g_e), (l_c, g_c) = results
    torch.testing.assert_close(l_c, l_e, atol=tol, rtol=tol)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    return plan


def test_compiled_bias_reads_the_plans_grouping(stand_in_kernels):
    """Under torch.compile the op reads the edge grouping the plan decided
    (prepare) and gives eager's results (conftest groups every plan whose
    edges are not grouped already)."""
    ei, n = _shuffled("random_1003")
    torch._dynamo.reset()
    plan = _compiled_bias_matches_eager(ei, n)
    assert plan.edge_grouping() is not None and True in plan.traced_groupings
