"""NaN and Inf in q, k, v propagate as in PyG's message passing, never come
back as 0: a row whose scores hold a NaN (or an Inf that makes its softmax
undefined) is NaN, and so is a row that attends to a NaN value. CPU
(reference path) against PyG's softmax and scatter; on a GPU the fused
kernels, where a NaN value also reaches the rows of its 16-row window that
share its TCB column (0 x NaN in the tensor-core product), a superset."""
from __future__ import annotations

import pytest
import torch
from torch_geometric.utils import scatter, softmax

from gt_fused3s import GraphPlan, fused3s_attention


def _pyg_attention(q, k, v, ei):
    src, dst = ei
    score = (q[dst] * k[src]).sum(-1) / q.size(-1) ** 0.5
    alpha = softmax(score, dst, num_nodes=q.size(0))
    return scatter(alpha.unsqueeze(-1) * v[src], dst, dim=0, dim_size=q.size(0), reduce="sum")


def _cases(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, 4 * n), generator=g)
    q, k, v = (torch.randn(n, 2, 16, generator=g) for _ in range(3))
    for name, t, value in (("nan q", q, float("nan")), ("inf k", k, float("inf")),
                           ("nan k", k, float("nan")), ("nan v", v, float("nan"))):
        bad = [x.clone() for x in (q, k, v)]
        which = {"q": 0, "k": 1, "v": 2}[name[-1]]
        node = int(ei[0, 3]) if which else int(ei[1, 3])     # a node with an edge
        bad[which][node, 1, 5] = value
        yield name, ei, bad


@pytest.mark.parametrize("case", range(4))
def test_nonfinite_inputs_propagate_as_in_message_passing(case):
    name, ei, (q, k, v) = list(_cases())[case]
    expect = _pyg_attention(q, k, v, ei).isnan()
    assert expect.any(), name
    got = fused3s_attention(q, k, v, ei)
    assert torch.equal(got.isnan(), expect), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(4))
def test_nonfinite_inputs_propagate_in_the_kernels(case):
    name, ei, (q, k, v) = list(_cases())[case]
    expect = _pyg_attention(q, k, v, ei).isnan()
    plan = GraphPlan.from_edge_index(ei.cuda(), q.size(0))
    got = fused3s_attention(*(t.cuda().half() for t in (q, k, v)), plan).float().cpu()
    if name == "nan v":     # 0 x NaN in the rows sharing the value's TCB column
        assert (got.isnan() | ~expect).all(), name
    else:
        assert torch.equal(got.isnan(), expect), name
