"""Reordered plans (GraphPlan.from_edge_index(..., reorder=...), issue 13)
on the GPU: the fused kernels on the relabelled formats, with the gathers
around them, against the fp32 reference in the caller's order (output,
returned weights, gradients of q, k, v and the edge bias; the tolerance of
tests/test_edge_bias_cuda.py), on every graph case with every order, exact
and static builds, and the fast path against the plain plan's."""
from __future__ import annotations

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.reorder import NodeOrder, invert, reorder

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES

pytestmark = GPU_TESTS

DEV = "cuda"


def _order(ei, n, method):
    if method == "random":
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(n)).to(DEV)
        return NodeOrder(perm, invert(perm), "random")
    return method


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("method", ["cuthill_mckee", "label_propagation", "random"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases_reordered(name, method, dtype):
    from test_edge_bias_cuda import _check, _shuffled
    ei, n = GRAPH_CASES[name]()
    ei = _shuffled(ei, seed=1)
    plan = GraphPlan.from_edge_index(ei, n, reorder=_order(ei, n, method))
    assert plan.order is not None
    for h, d in ((1, 64), (4, 32), (1, 128)):
        _check(plan, ei, h, d, LOW[dtype], seed=h + d, label=f"{name} {method} H={h} D={d}", weights=h != 4)


@pytest.mark.parametrize("name", ["random_1003", "duplicates", "heavy_node"])
def test_static_plan_with_an_order_computed_ahead(name):
    from test_edge_bias_cuda import _check, _shuffled
    ei, n = GRAPH_CASES[name]()
    ei = _shuffled(ei, seed=2)
    plan = GraphPlan.from_edge_index(ei, n, static=True, reorder=reorder(ei, n, "cuthill_mckee"))
    assert plan.static
    _check(plan, ei, 2, 64, torch.float16, seed=5, label=f"{name} static")


@pytest.mark.parametrize("grad", [False, True])
def test_fast_path_equals_the_plain_plan(grad):
    ei, n = GRAPH_CASES["random_1003"]()
    ei = ei.to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v, do = (torch.randn(n, 4, 64, generator=g, device=DEV).half() for _ in range(4))
    res = []
    for plan in (GraphPlan.from_edge_index(ei, n), GraphPlan.from_edge_index(ei, n, reorder="cuthill_mckee")):
        plan.prepare(4, 64)
        leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
        out = fused3s_attention(*leaves, plan)
        if grad:
            out.backward(do)
        res.append([out.float(), *(t.grad.float() for t in leaves if grad)])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=5e-3, rtol=5e-3)
