"""A plan built with a locality reordering (``GraphPlan.from_edge_index(...,
reorder=...)``, issue 13): its formats are those of the relabelled graph,
while callers see their own node and edge order. On the CPU, through the
registered ops with their CPU stand-ins (which decode the graph from the
arrays they are given, so a format in the wrong order, an edge slot under
the wrong id or an output left in the plan's order gives a wrong result):
outputs, returned weights and the gradients of q, k, v and the edge bias
equal those of the plan without a reordering and the reference, on every
graph case and with every order."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.edge_terms import edge_feature_attention
from gt_fused3s.reference import attention_reference
from gt_fused3s.reorder import NodeOrder, invert, reorder
from graph_cases import GRAPH_CASES

H, D = 2, 32
ORDERS = ("cuthill_mckee", "label_propagation", "identity", "random")


def _order(ei, n, method):
    """reorder= for ``method``: a name, or a seeded random NodeOrder (which
    moves almost every node, so an order left undone shows)."""
    if method == "random":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(n))
        return NodeOrder(perm, invert(perm), "random")
    return method


def _shuffled(name, seed=0):
    ei, n = GRAPH_CASES[name]()
    return ei[:, torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(seed))], n


def _inputs(n, E, seed=1):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(n, H, D, generator=g).half() for _ in range(4))
    bias = torch.randn(E, H, generator=g)
    dw = torch.randn(E, H, generator=g)            # a gradient for the returned weights
    return q, k, v, do, bias, dw


def _grouped(plan) -> bool:
    dst = plan.kernel_edge_index[1]
    return bool((dst[1:] >= dst[:-1]).all())


def _run(plan_or_ei, q, k, v, do, bias, dw, **kw):
    """out, weights and the gradients of q, k, v, bias (one backward through
    both outputs)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, w = fused3s_attention(*leaves[:3], plan_or_ei, 0.3, edge_bias=leaves[3], return_weights=True, **kw)
    torch.autograd.backward([out.float(), w], [do.float(), dw])
    return out, w, [t.grad for t in leaves]


@pytest.mark.parametrize("method", ORDERS)
@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_reordered_plan_equals_plain_plan_and_reference(stand_in_kernels, name, method):
    ei, n = _shuffled(name)
    E = ei.size(1)
    q, k, v, do, bias, dw = _inputs(n, E)
    plain = GraphPlan.from_edge_index(ei, n).prepare(H, D, edge_bias=True)
    plan = GraphPlan.from_edge_index(ei, n, reorder=_order(ei, n, method)).prepare(H, D, edge_bias=True)
    assert plan.order is not None and plan.order.method == (method if method != "random" else "random")
    assert plan.edge_index is ei                                  # the caller's edges, kept
    assert torch.equal(plan.kernel_edge_index, plan.order.inv[ei])
    assert plan.bsb.num_edges == E
    stand_in_kernels.calls.clear()
    out, w, grads = _run(plan, q, k, v, do, bias, dw)
    calls = stand_in_kernels.calls
    assert [c for c in calls if c != "gather_rows"] == ["fwd_scores", "edge_probs", "bwd"]   # the kernel path
    # q, k, v in, out back; dO in, dq, dk, dv back; the shuffled edges' bias
    # in and weights back grouped by destination, their gradients the other way
    assert plan.edge_grouping() is not None or E == 0 or _grouped(plan)
    assert calls.count("gather_rows") == 8 + (4 if plan.edge_grouping() is not None else 0)
    out0, w0, grads0 = _run(plain, q, k, v, do, bias, dw)
    torch.testing.assert_close(out, out0, atol=1e-3, rtol=0)
    torch.testing.assert_close(w, w0, atol=1e-5, rtol=0)
    for g, g0 in zip(grads, grads0):
        assert g.dtype == g0.dtype
        torch.testing.assert_close(g.float(), g0.float(), atol=2e-3, rtol=0)
    # and the reference in fp32 (the caller's graph, nothing reordered)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    ref, ref_w = attention_reference(*ref_leaves[:3], ei, 0.3, edge_bias=ref_leaves[3], return_weights=True)
    torch.autograd.backward([ref, ref_w], [do.float(), dw])
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(w, ref_w, atol=1e-3, rtol=0)
    for g, r in zip(grads, ref_leaves):
        torch.testing.assert_close(g.float(), r.grad, atol=1e-2, rtol=0)


def test_a_random_order_really_moves_the_format(stand_in_kernels):
    """The reordered plan's BSB is that of the relabelled graph (so the tests
    above compare two different formats), and its decoded edges, mapped back,
    are the caller's."""
    ei, n = GRAPH_CASES["random_1003"]()
    plan = GraphPlan.from_edge_index(ei, n, reorder=_order(ei, n, "random"))
    plain = GraphPlan.from_edge_index(ei, n)
    assert not torch.equal(plan.bsb.cols, plain.bsb.cols)
    back = plan.order.perm[plan.bsb.decode_edges()]
    key = lambda e: torch.sort(e[1] * n + e[0]).values       # noqa: E731
    assert torch.equal(key(back), key(ei))


@pytest.mark.parametrize("method", ["cuthill_mckee", "random"])
def test_dropout_mask_follows_the_callers_edges(stand_in_kernels, method):
    """Dropout is keyed by the caller's edge id: one seed gives the same
    result with and without a reordering."""
    ei, n = _shuffled("duplicates", seed=2)
    q, k, v, do, bias, dw = _inputs(n, ei.size(1), seed=3)
    plain = GraphPlan.from_edge_index(ei, n)
    plan = GraphPlan.from_edge_index(ei, n, reorder=_order(ei, n, method))
    out, w, grads = _run(plan, q, k, v, do, bias, dw, dropout_p=0.3, dropout_seed=11)
    out0, w0, grads0 = _run(plain, q, k, v, do, bias, dw, dropout_p=0.3, dropout_seed=11)
    torch.testing.assert_close(out, out0, atol=1e-3, rtol=0)
    torch.testing.assert_close(w, w0, atol=1e-5, rtol=0)
    for g, g0 in zip(grads, grads0):
        torch.testing.assert_close(g.float(), g0.float(), atol=2e-3, rtol=0)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True])
def test_fast_path(stand_in_kernels, count_calls, grad):
    """A prepared plan without a reordering runs exactly the ops it ran
    before (no gather); a reordered one adds the four gathers (eight with a
    backward: dO in, dq, dk, dv out) and equals it."""
    import gt_fused3s.ops as ops_mod
    ei, n = _shuffled("random_1003", seed=4)
    q, k, v, do, _, _ = _inputs(n, ei.size(1), seed=5)
    plain = GraphPlan.from_edge_index(ei, n).prepare(H, D)
    plan = GraphPlan.from_edge_index(ei, n, reorder="cuthill_mckee").prepare(H, D)
    general = count_calls(ops_mod, "_check_qkv")                  # the general path's first step
    results, logs = [], []
    for p in (plain, plan):
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        with _OpLog() as log:
            out = fused3s_attention(*leaves, p)
            if grad:
                out.backward(do)
        results.append([out, *(t.grad for t in leaves if grad)])
        logs.append(log.ops)
    assert not general, "took the general path"
    assert "gather_rows" not in logs[0]
    assert logs[1].count("gather_rows") == (8 if grad else 4)
    assert [o for o in logs[1] if o != "gather_rows"] == logs[0]
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=0)


def test_edge_feature_attention_on_a_reordered_plan(stand_in_kernels):
    """edge_feature_attention (edge bias from the edge features, value term
    summed by destination through the plan's destination_csr) on a reordered
    plan equals the plain plan: output, weights, gradients of q, k, v, the
    edge features and W_e."""
    ei, n = _shuffled("isolated_nodes", seed=6)
    E, C, F = ei.size(1), 16, 5
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, H, C, generator=g) for _ in range(3))
    a = torch.randn(E, F, generator=g)
    w_e = torch.randn(H, C, F, generator=g) * 0.3
    plain = GraphPlan.from_edge_index(ei, n).prepare(H, C, edge_features=True)
    plan = GraphPlan.from_edge_index(ei, n, reorder=_order(ei, n, "random")).prepare(H, C, edge_features=True)
    for i in range(2):     # the caller's destinations, in both
        assert torch.equal(plan.destination_csr()[i], plain.destination_csr()[i])

    def run(p):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, a, w_e)]
        out, alpha = edge_feature_attention(*leaves[:3], p, leaves[3], leaves[4], 0.25)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().add(
            (alpha * torch.linspace(1, 2, alpha.numel()).view_as(alpha)).sum()).backward()
        return [out, alpha, *(t.grad for t in leaves)]

    stand_in_kernels.calls.clear()
    got = run(plan)
    assert {"fwd_scores", "bwd", "edge_dot", "edge_scatter"} <= set(stand_in_kernels.calls)
    for x, y in zip(got, run(plain)):
        torch.testing.assert_close(x, y, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("edge_dim", [None, 4])
def test_fused3sconv_with_a_reordered_plan_equals_transformer_conv(stand_in_kernels, edge_dim):
    from torch_geometric.nn import TransformerConv

    from gt_fused3s.nn import Fused3SConv
    g = torch.Generator().manual_seed(9)
    src, dst = torch.randint(0, 35, (2, 150), generator=g)
    i = torch.arange(0, 35, 3)     # duplicates, self loops, isolated nodes 35..39
    ei = torch.stack([torch.cat([src, src[:20], i]), torch.cat([dst, dst[:20], i])])
    ei, n = ei[:, torch.randperm(ei.size(1), generator=g)], 40
    torch.manual_seed(0)
    ref = TransformerConv(19, 16, heads=2, beta=True, edge_dim=edge_dim)
    ours = Fused3SConv(19, 16, heads=2, beta=True, edge_dim=edge_dim)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(n, 19, generator=g)
    ea = torch.randn(ei.size(1), edge_dim, generator=g) if edge_dim else None
    plan = GraphPlan.from_edge_index(ei, n, reorder="cuthill_mckee")

    def run(conv, graph):
        xx = x.clone().requires_grad_()
        eaa = ea.clone().requires_grad_() if ea is not None else None
        out, (edges, alpha) = conv(xx, graph, eaa, return_attention_weights=True)
        ((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
         + (alpha * torch.linspace(1, 2, alpha.numel()).view_as(alpha)).sum()).backward()
        grads = [xx.grad, *(p.grad for p in conv.parameters())] + ([eaa.grad] if eaa is not None else [])
        return out, edges, alpha, grads

    stand_in_kernels.calls.clear()
    out, edges, alpha, grads = run(ours, plan)
    assert {"fwd_scores", "bwd"} <= set(stand_in_kernels.calls)
    out_ref, edges_ref, alpha_ref, grads_ref = run(ref, ei)
    assert torch.equal(edges, ei)
    torch.testing.assert_close(out, out_ref, atol=3e-3, rtol=3e-3)       # fp16 operands
    torch.testing.assert_close(alpha, alpha_ref, atol=3e-3, rtol=3e-3)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_static_build(stand_in_kernels):
    """A static plan takes a NodeOrder computed ahead (gathers only) and the
    sync-free identity; the orders by name, which synchronise, are refused
    with the way out in the message."""
    ei, n = _shuffled("duplicates", seed=8)
    order = reorder(ei, n, "cuthill_mckee")
    q, k, v, do, bias, dw = _inputs(n, ei.size(1), seed=9)
    plain = GraphPlan.from_edge_index(ei, n)
    for r in (order, "identity"):
        plan = GraphPlan.from_edge_index(ei, n, static=True, reorder=r)
        assert plan.static and plan.order is not None
        stand_in_kernels.calls.clear()
        got = _run(plan, q, k, v, do, bias, dw)
        assert stand_in_kernels.calls[0] in ("bsb_build", "edge_slots", "work_schedule")   # the plan's builders
        want = _run(plain, q, k, v, do, bias, dw)
        torch.testing.assert_close(got[0], want[0], atol=1e-3, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        for g, g0 in zip(got[2], want[2]):
            torch.testing.assert_close(g.float(), g0.float(), atol=2e-3, rtol=0)
    for method in ("cuthill_mckee", "label_propagation"):
        with pytest.raises(ValueError, match="build the plan eagerly"):
            GraphPlan.from_edge_index(ei, n, static=True, reorder=method)


def test_constructor_and_errors():
    ei, n = _shuffled("isolated_nodes")
    order = reorder(ei, n, "cuthill_mckee")
    plan = GraphPlan.from_edge_index(ei, n, reorder=order)
    assert "reorder='cuthill_mckee'" in repr(plan)
    # from a BSB built in the order: the same plan (edges in the BSB's order)
    from gt_fused3s.graph import BSBGraph
    direct = GraphPlan(BSBGraph.from_edge_index(order.relabel(ei), n), order=order)
    key = lambda e: torch.sort(e[1] * n + e[0]).values       # noqa: E731
    assert torch.equal(key(direct.edge_index), key(ei))
    assert torch.equal(direct.kernel_edge_index, order.inv[direct.edge_index])
    assert plan.to("cpu") is plan
    # a plan without a reordering is as before
    plain = GraphPlan.from_edge_index(ei, n)
    assert plain.order is None and plain.kernel_edge_index is plain.edge_index
    with pytest.raises(ValueError, match="rectangular plan"):
        GraphPlan.from_edge_index(ei, n, num_rows=40, reorder="cuthill_mckee")
    with pytest.raises(ValueError, match="rectangular plan"):
        GraphPlan(BSBGraph.from_edge_index(ei, n), num_rows=40, order=reorder(ei, n, "identity"))
    with pytest.raises(ValueError, match="reorder must be"):
        GraphPlan.from_edge_index(ei, n, reorder="metis")
    with pytest.raises(ValueError, match="reorder must be"):
        GraphPlan.from_edge_index(ei, n, reorder=torch.arange(n))
    with pytest.raises(ValueError, match="entries"):
        GraphPlan.from_edge_index(ei, n, reorder=reorder(ei, n + 1, "identity"))
    bad = NodeOrder(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    with pytest.raises(ValueError, match="permutation"):
        GraphPlan.from_edge_index(ei, n, reorder=bad)
    with pytest.raises(ValueError, match="out of range"):
        GraphPlan.from_edge_index(ei, 30, reorder="cuthill_mckee")


def test_compiled_call_on_a_reordered_plan(stand_in_kernels):
    """torch.compile (fullgraph) traces the gathers around the op: output and
    gradients equal the eager call's."""
    ei, n = _shuffled("empty_rows", seed=10)
    q, k, v, do, bias, dw = _inputs(n, ei.size(1), seed=11)
    plan = GraphPlan.from_edge_index(ei, n, reorder="cuthill_mckee").prepare(H, D, edge_bias=True)

    def f(q, k, v, b):
        return fused3s_attention(q, k, v, plan, 0.3, edge_bias=b, return_weights=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, w = fn(*leaves)
        torch.autograd.backward([out.float(), w], [do.float(), dw])
        results.append([out, w, *(t.grad for t in leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
