"""gt_fused3s.nn.Fused3SConv against torch_geometric.nn.TransformerConv:
same weights, same outputs and gradients, fused path where it applies and
TransformerConv's own path where it does not."""
from __future__ import annotations

import importlib
import itertools
import sys
import warnings

import pytest
import torch
from torch_geometric import EdgeIndex
from torch_geometric.data import Batch, Data
from torch_geometric.nn import TransformerConv
from torch_geometric.utils import coalesce

import gt_fused3s.edge_terms as edge_terms
import gt_fused3s.nn.pyg as pyg_mod
from gt_fused3s import BSBGraph, GraphPlan, cached_plan
from gt_fused3s.nn import Fused3SConv, PlanRebuildWarning, UnfusedPathWarning

try:
    from graph_cases import GRAPH_CASES
except ImportError:  # tests/ collected as a package
    from tests.graph_cases import GRAPH_CASES

ATOL, RTOL = 1e-5, 1e-5
F_IN, D = 19, 24          # odd sizes on purpose


@pytest.fixture
def fused_calls(count_calls):
    """Calls of the fused attention from the layer, with or without edge
    features (0 = the layer took TransformerConv's unfused path)."""
    calls = count_calls(pyg_mod, "fused3s_attention")
    count_calls(edge_terms._EdgeFeatureTerms, "apply", calls)   # eager on the kernel path
    return count_calls(edge_terms, "fused3s_attention", calls)


@pytest.fixture
def bsb_builds(count_calls):
    return count_calls(BSBGraph, "_build")


def make_pair(in_channels=F_IN, out_channels=D, seed=0, **kwargs):
    """A TransformerConv and a Fused3SConv holding its weights (strict load)."""
    torch.manual_seed(seed)
    ref = TransformerConv(in_channels, out_channels, **kwargs)
    ours = Fused3SConv(in_channels, out_channels, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def random_x(n, f=F_IN, seed=1):
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed))


def assert_close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------ equivalence

@pytest.mark.parametrize("heads,concat,root_weight,beta,bias",
                         list(itertools.product([1, 4], [True, False], [True, False],
                                                [True, False], [True, False])))
def test_matches_transformer_conv(heads, concat, root_weight, beta, bias, fused_calls):
    edge_index, n = GRAPH_CASES["random_1003"]()
    ref, ours = make_pair(heads=heads, concat=concat, root_weight=root_weight, beta=beta,
                          bias=bias)
    x = random_x(n)
    assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(fused_calls) == 1


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_matches_on_graph_cases(case, fused_calls):
    edge_index, n = GRAPH_CASES[case]()
    ref, ours = make_pair(heads=4, beta=True)
    x = random_x(n)
    assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(fused_calls) == 1


def test_matches_on_pyg_batch(fused_calls):
    g = torch.Generator().manual_seed(7)
    graphs = []
    for i, n in enumerate([5, 17, 1, 33, 12, 40, 9]):
        e = int(torch.randint(0, 3 * n + 1, (1,), generator=g))
        ei = coalesce(torch.randint(0, n, (2, e), generator=g), num_nodes=n)
        if i % 2:   # self loops on half the graphs
            ei = coalesce(torch.cat([ei, torch.arange(n).repeat(2, 1)], 1), num_nodes=n)
        graphs.append(Data(x=torch.randn(n, F_IN, generator=g), edge_index=ei, num_nodes=n))
    batch = Batch.from_data_list(graphs)
    ref, ours = make_pair(heads=4, concat=False, beta=True)
    assert_close(ours(batch.x, batch.edge_index), ref(batch.x, batch.edge_index))
    assert len(fused_calls) == 1


@pytest.mark.parametrize("concat,beta", [(True, True), (False, False)])
def test_gradients_match(concat, beta, fused_calls):
    edge_index, n = GRAPH_CASES["random_1003"]()
    ref, ours = make_pair(heads=4, concat=concat, beta=beta)
    grads = []
    for conv in (ref, ours):
        x = random_x(n).requires_grad_()
        out = conv(x, edge_index)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({"x": x.grad, **{k: p.grad for k, p in conv.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    assert len(fused_calls) == 1


def test_bipartite_pair_with_equal_counts(fused_calls):
    edge_index, n = GRAPH_CASES["random_1003"]()
    ref, ours = make_pair(in_channels=(F_IN, 11), heads=4, beta=True)
    x = (random_x(n, F_IN, seed=1), random_x(n, 11, seed=2))
    assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(fused_calls) == 1


def test_output_invariant_to_edge_order():
    edge_index, n = GRAPH_CASES["random_1003"]()
    _, ours = make_pair(heads=4)
    x = random_x(n)
    perm = torch.randperm(edge_index.size(1), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(x, edge_index[:, perm]), ours(x, edge_index),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["coo", "csr", "edge_index_class"])
def test_other_adjacency_formats(fmt, fused_calls):
    edge_index, n = GRAPH_CASES["empty_rows"]()
    ref, ours = make_pair(heads=4)
    x = random_x(n)
    if fmt == "edge_index_class":
        adj = EdgeIndex(edge_index, sparse_size=(n, n))
    else:   # adj_t: entry [dst, src]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch's sparse invariant-check notice
            adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1)),
                                          (n, n)).coalesce()
            adj = adj.to_sparse_csr() if fmt == "csr" else adj
    assert_close(ours(x, adj), ref(x, edge_index))
    assert len(fused_calls) == 1


@pytest.mark.parametrize("fmt", ["coo", "csr"])
@pytest.mark.parametrize("bipartite", [False, True])
@pytest.mark.parametrize("kernel_path", [False, True])
def test_sparse_adjacency_with_edge_features_and_weights_is_fused(fmt, bipartite, kernel_path, fused_calls,
                                                                  request):
    """A torch.sparse adjacency (entry [dst, src]) with edge features in the
    order of its non-zeros, the weights returned in that order with the
    adjacency itself, as TransformerConv does; gradients equal too; on the
    reference path and on the kernel path (CPU stand-ins of the ops)."""
    if kernel_path:
        stand_ins = request.getfixturevalue("stand_in_kernels")
    n_src, n_dst = (13, 9) if bipartite else (40, 40)
    g = torch.Generator().manual_seed(8)
    edge_index = torch.stack([torch.randint(0, n_src, (120,), generator=g),
                              torch.randint(0, n_dst, (120,), generator=g)]).unique(dim=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch's sparse invariant-check notice
        adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1)),
                                      (n_dst, n_src)).coalesce()
        if fmt == "csr":
            adj = adj.to_sparse_csr()
    in_ch = (F_IN, 7) if bipartite else F_IN
    ref, ours = make_pair(in_channels=in_ch, heads=2, beta=True, edge_dim=3)
    x = ((torch.randn(n_src, F_IN, generator=g), torch.randn(n_dst, 7, generator=g)) if bipartite
         else torch.randn(n_src, F_IN, generator=g))
    ea = torch.randn(edge_index.size(1), 3, generator=g)
    got = []
    for conv in (ref, ours):
        xs = tuple(t.clone().requires_grad_() for t in (x if bipartite else (x,)))
        a = ea.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error", UnfusedPathWarning)
            out, (adj_out, alpha) = conv(xs if bipartite else xs[0], adj, a, return_attention_weights=True)
        assert adj_out is adj
        (out.square().sum() + alpha.sum()).backward()
        got.append((out, alpha, a.grad, *(t.grad for t in xs)))
    for i, (mine, theirs) in enumerate(zip(got[1], got[0])):
        tol = (1e-5 if not kernel_path else 3e-3 if i < 2 else 3e-2)     # fp16 operands on the kernel path
        torch.testing.assert_close(mine, theirs, atol=tol, rtol=max(tol, 1e-4))
    assert len(fused_calls) == 1
    if kernel_path:
        assert {"fwd_scores", "bwd", "edge_dot", "edge_scatter"} <= set(stand_ins.calls)


@pytest.mark.parametrize("edge_dim", [None, 16])
def test_layer_step_runs_no_more_ops_than_transformer_conv(edge_dim, monkeypatch):
    """Eager host time is per op: a forward + backward of the fused layer
    (the fused ops as their fake kernels, on the kernel path) dispatches no
    more non-view aten ops than TransformerConv's, with and without edge
    features, and at most 3/4 of them (counted when written: 45 vs 70 with
    edge_dim 16, 21 vs 64 without, since the projections of x run as one
    GEMM and W_e's block-diagonal matrix is one block_diag; 60 and 32
    before those, 68 with edge_dim before the cuts of the session of git
    9ef07c7; 47 with edge_dim 16 since the edge features go in grouped by
    destination and their gradient comes back, two gathers)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from gt_fused3s import ops
    fakes = {"fwd": ops._fwd_fake, "fwd_scores": ops._fwd_scores_fake, "bwd": ops._bwd_fake,
             "edge_dot": ops._edge_dot_fake, "edge_rows": ops._edge_rows_fake,
             "edge_scatter": ops._edge_scatter_fake, "edge_probs": ops._edge_probs_fake,
             "gather_rows": ops._gather_rows_fake}
    monkeypatch.setattr(ops, "_op", fakes.__getitem__)
    monkeypatch.setattr(ops, "kernel_available", lambda device: True)
    monkeypatch.setattr(ops, "_use_kernel", lambda t: True)
    views = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select",
             "slice", "as_strided", "alias", "detach", "reshape", "diagonal", "unbind", "split",
             "_reshape_alias", "promote_types"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name().split("::")[-1].split(".")[0] not in views:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    n = 200
    edge_index = torch.randint(0, n, (2, 400), generator=g)
    ref, ours = make_pair(in_channels=64, out_channels=16, heads=4, edge_dim=edge_dim)
    ours.cached = True
    x = torch.randn(n, 64, generator=g, requires_grad=True)
    attr = torch.randn(400, 16, generator=g, requires_grad=True) if edge_dim else None
    counts = []
    for conv in (ours, ref):
        leaves = [x] + ([attr] if attr is not None else []) + list(conv.parameters())
        torch.autograd.grad(conv(x, edge_index, attr).sum(), leaves)      # the plan, cached
        Count.n = 0
        with Count():
            torch.autograd.grad(conv(x, edge_index, attr).sum(), leaves)
        counts.append(Count.n)
    assert counts[0] <= 0.75 * counts[1], f"fused layer step: {counts[0]} ops, TransformerConv's: {counts[1]}"


def test_projections_run_as_one_gemm_unless_a_module_is_hooked():
    """project(): plain Linear modules of one input give their own outputs
    from one GEMM (one addmm dispatched for three); a module with a forward
    hook, or of another type, keeps its own call (the hook's effect shows)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from gt_fused3s.nn.projections import project
    torch.manual_seed(0)
    lins = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 8), torch.nn.Linear(16, 4)]
    x = torch.randn(10, 16)

    class Gemms(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Gemms.n += func.name().split("::")[-1].split(".")[0] in ("addmm", "mm")
            return func(*args, **(kwargs or {}))

    with Gemms():
        got = project(x, lins)
    assert Gemms.n == 1
    for g, lin in zip(got, lins):
        torch.testing.assert_close(g, lin(x))
    handle = lins[1].register_forward_hook(lambda mod, inp, out: out * 2)
    got = project(x, lins)
    torch.testing.assert_close(got[1], 2 * (x @ lins[1].weight.t() + lins[1].bias))
    handle.remove()
    lins[2] = torch.nn.Sequential(torch.nn.Linear(16, 4))     # another module type: its own call
    torch.testing.assert_close(project(x, lins)[2], lins[2](x))


def test_hooked_projection_is_honoured_like_transformer_conv():
    """A forward hook on lin_query (an adapter, say) changes the fused layer
    as it changes TransformerConv: the projections are not stacked then."""
    ref, ours = make_pair(in_channels=16, out_channels=8, heads=2, beta=True)
    for conv in (ref, ours):
        conv.lin_query.register_forward_hook(lambda mod, inp, out: out * 3)
    g = torch.Generator().manual_seed(5)
    x, ei = torch.randn(30, 16, generator=g), torch.randint(0, 30, (2, 90), generator=g)
    torch.testing.assert_close(ours(x, ei), ref(x, ei), atol=1e-5, rtol=1e-4)


def test_lazy_in_channels():
    edge_index, n = GRAPH_CASES["self_loops"]()
    x = random_x(n)
    ref, ours = make_pair(in_channels=-1, heads=2)
    ref(x, edge_index)                    # materialises the lazy weights
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert_close(ours(x, edge_index), ref(x, edge_index))


# ------------------------------------------------------------ graph format

def test_plan_reuse_is_explicit(stand_in_kernels):
    """The kernel path (CPU stand-ins): a plan from to_graph_format is built
    once and read by every call and layer; an edge_index tensor gets a plan
    per call (no implicit cache: a PlanRebuildWarning says how to keep one),
    or one per tensor with cached=True."""
    pyg_mod._LAST_BUILT[0] = None
    edge_index, n = GRAPH_CASES["random_1003"]()
    _, conv1 = make_pair(heads=4, seed=0)
    _, conv2 = make_pair(in_channels=4 * D, heads=2, seed=1)
    x = random_x(n)
    builds = lambda: stand_in_kernels.calls.count("bsb_build")      # noqa: E731
    with torch.no_grad():          # forward only: one BSB per plan (no transposed one)
        with pytest.warns(PlanRebuildWarning, match=r"cached=True.*to_graph_format"):
            for _ in range(2):
                conv2(conv1(x, edge_index), edge_index)
        assert builds() == 4
        plan = Fused3SConv.to_graph_format(edge_index, n)
        assert builds() == 5 and plan is not Fused3SConv.to_graph_format(edge_index, n)
        before = builds()
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanRebuildWarning)
            for _ in range(2):
                conv2(conv1(x, plan), plan)
            assert builds() == before
            conv1.cached = conv2.cached = True
            for _ in range(2):
                conv2(conv1(x, edge_index), edge_index)
        assert builds() == before + 1
        assert cached_plan(edge_index, n) is cached_plan(edge_index, n)


def test_plan_rebuild_warning_only_for_the_same_unchanged_tensor(stand_in_kernels):
    """No PlanRebuildWarning for a new tensor each call (a new batch) or one
    changed through torch in between (its plan must be rebuilt); one for
    the same tensor unchanged."""
    pyg_mod._LAST_BUILT[0] = None
    edge_index, n = GRAPH_CASES["random_1003"]()
    _, conv = make_pair(heads=2)
    x = random_x(n)
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", PlanRebuildWarning)
            conv(x, edge_index)
            conv(x, edge_index.clone())
            ei = edge_index.clone()
            conv(x, ei)
            ei[0, 0] = ei[0, 1]
            conv(x, ei)
        with pytest.warns(PlanRebuildWarning):
            conv(x, ei)


def test_an_edge_index_refilled_behind_torchs_back_is_not_stale(stand_in_kernels):
    """A tensor over a numpy array refilled in place with the next graph
    (same shape, same storage, same torch version counter): the layer builds
    each call's plan, so it computes the new graph, as TransformerConv does
    (the PlanRebuildWarning, which cannot tell, names cached=True's terms)."""
    import numpy as np
    pyg_mod._LAST_BUILT[0] = None
    first, n = GRAPH_CASES["random_1003"]()
    second = torch.randint(0, n, first.shape, generator=torch.Generator().manual_seed(9))
    buf = first.numpy().copy()
    edge_index = torch.from_numpy(buf)
    ref, ours = make_pair(heads=2)
    x = random_x(n)
    close = dict(atol=3e-3, rtol=0)       # the kernel path's fp16 operands
    out_first = ours(x, edge_index)
    torch.testing.assert_close(out_first, ref(x, first), **close)
    np.copyto(buf, second.numpy())
    with pytest.warns(PlanRebuildWarning, match="changed through torch"):
        out_second = ours(x, edge_index)
    torch.testing.assert_close(out_second, ref(x, second), **close)
    assert (out_second - out_first).abs().max() > 0.1      # a stale plan would repeat the first


def test_an_edge_index_edited_through_data_is_not_stale(stand_in_kernels):
    """An edit through ``.data`` leaves the tensor's version counter as it
    was; the layer and the functional op still compute the edited graph."""
    from gt_fused3s import fused3s_attention
    from gt_fused3s.reference import attention_reference
    pyg_mod._LAST_BUILT[0] = None
    edge_index, n = GRAPH_CASES["random_1003"]()
    edge_index = edge_index.clone()
    second = torch.randint(0, n, edge_index.shape, generator=torch.Generator().manual_seed(7))
    ref, ours = make_pair(heads=2)
    x = random_x(n)
    close = dict(atol=3e-3, rtol=0)       # the kernel path's fp16 operands
    torch.testing.assert_close(ours(x, edge_index), ref(x, edge_index), **close)
    q = torch.randn(n, 2, 8)
    fused3s_attention(q, q, q, edge_index)
    version = edge_index._version
    edge_index.data.copy_(second)
    assert edge_index._version == version             # torch cannot see the edit
    with pytest.warns(PlanRebuildWarning):            # (nor the warning: the plan is built all the same)
        torch.testing.assert_close(ours(x, edge_index), ref(x, second), **close)
    torch.testing.assert_close(fused3s_attention(q, q, q, edge_index), attention_reference(q, q, q, second), **close)



def test_prebuilt_plan(bsb_builds, fused_calls):
    edge_index, n = GRAPH_CASES["isolated_nodes"]()
    ref, ours = make_pair(heads=4, beta=True)
    x = random_x(n)
    plan = Fused3SConv.to_graph_format(edge_index, n)
    assert isinstance(plan, GraphPlan) and plan.num_nodes == n
    assert len(bsb_builds) == 1
    assert_close(ours(x, plan), ref(x, edge_index))
    assert_close(ours(x, plan.bsb), ref(x, edge_index))       # a BSBGraph is taken too
    assert len(bsb_builds) == 1 and len(fused_calls) == 2
    # a fallback with a plan runs TransformerConv on its edges
    out, (ei, alpha) = ours(x, plan, return_attention_weights=True)
    assert ei is plan.edge_index and alpha.shape == (plan.bsb.num_edges, 4)
    assert_close(out, ref(x, edge_index))


def test_duplicate_edges_count_as_in_transformer_conv():
    edge_index, n = GRAPH_CASES["duplicates"]()
    ref, ours = make_pair(heads=4)
    x = random_x(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # no warning: nothing differs
        out = ours(x, edge_index)
        out_plan = ours(x, Fused3SConv.to_graph_format(edge_index, n))
    assert_close(out, ref(x, edge_index))
    assert_close(out_plan, ref(x, edge_index))
    assert not torch.allclose(out, ref(x, coalesce(edge_index, num_nodes=n)), atol=1e-3)


# ------------------------------------------------------------ fallbacks

def _edge_case_graph():
    """N = 40: duplicates (with their own edge features), self loops,
    isolated nodes 35..39, edges in no particular order."""
    g = torch.Generator().manual_seed(9)
    src, dst = torch.randint(0, 35, (2, 150), generator=g)
    i = torch.arange(0, 35, 3)
    ei = torch.stack([torch.cat([src, src[:20], i]), torch.cat([dst, dst[:20], i])])
    return ei[:, torch.randperm(ei.size(1), generator=g)], 40


def _loss_grads(conv, x, edge_index, edge_attr, **kw):
    x = x.clone().requires_grad_()
    ea = edge_attr.clone().requires_grad_() if edge_attr is not None else None
    out = conv(x, edge_index, ea, **kw)
    alpha = None
    if isinstance(out, tuple):
        out, (_, alpha) = out
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    if alpha is not None:
        loss = loss + (alpha * torch.linspace(1, 2, alpha.numel(), dtype=alpha.dtype).view_as(alpha)).sum()
    loss.backward()
    grads = {"x": x.grad, **{k: p.grad for k, p in conv.named_parameters()}}
    if ea is not None:
        grads["edge_attr"] = ea.grad
    return out, alpha, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,concat,beta,root_weight,bias",
                         [(1, True, False, True, True), (4, True, True, True, False),
                          (4, False, False, False, True), (2, False, True, True, True),
                          (3, True, False, False, False)])
def test_edge_features_fused_outputs_and_gradients(heads, concat, beta, root_weight, bias, dtype, fused_calls):
    """edge_dim on the fused path equals TransformerConv: outputs and the
    gradients of x, edge_attr and every parameter, float32 and float64, on a
    graph with duplicate edges (different features), self loops and
    isolated nodes."""
    edge_index, n = _edge_case_graph()
    ref, ours = make_pair(heads=heads, concat=concat, beta=beta, root_weight=root_weight, bias=bias,
                          edge_dim=6)
    ref, ours = ref.to(dtype), ours.to(dtype)
    x = random_x(n).to(dtype)
    edge_attr = torch.randn(edge_index.size(1), 6, generator=torch.Generator().manual_seed(2)).to(dtype)
    out_ref, _, g_ref = _loss_grads(ref, x, edge_index, edge_attr)
    out, _, g = _loss_grads(ours, x, edge_index, edge_attr)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(out, out_ref, **tol)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], **tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    assert len(fused_calls) == 1


@pytest.mark.parametrize("edge_dim", [None, 5])
@pytest.mark.parametrize("graph_kind", ["edge_index", "plan"])
def test_return_attention_weights_fused(edge_dim, graph_kind, fused_calls):
    """The weights, in the given edge order (a plan keeps it), and their
    gradient, as TransformerConv's."""
    edge_index, n = _edge_case_graph()
    ref, ours = make_pair(heads=4, beta=True, edge_dim=edge_dim)
    x = random_x(n)
    edge_attr = (torch.randn(edge_index.size(1), edge_dim, generator=torch.Generator().manual_seed(3))
                 if edge_dim else None)
    graph = GraphPlan.from_edge_index(edge_index, n) if graph_kind == "plan" else edge_index
    out_ref, alpha_ref, g_ref = _loss_grads(ref, x, edge_index, edge_attr, return_attention_weights=True)
    out, alpha, g = _loss_grads(ours, x, graph, edge_attr, return_attention_weights=True)
    assert_close(out, out_ref)
    assert_close(alpha, alpha_ref)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], atol=1e-5, rtol=1e-4)
    returned = ours(x, graph, edge_attr, return_attention_weights=False)[1][0]
    assert torch.equal(returned, edge_index)
    assert len(fused_calls) == 2


def test_edge_features_and_weights_on_the_kernel_path(stand_in_kernels, fused_calls):
    """The same through the kernel path (the registered ops, with CPU stand-ins
    in fp16): edge bias, weights and the weights' gradient in the backward."""
    edge_index, n = _edge_case_graph()
    ref, ours = make_pair(out_channels=16, heads=2, edge_dim=4)
    x = random_x(n)
    edge_attr = torch.randn(edge_index.size(1), 4, generator=torch.Generator().manual_seed(4))
    out_ref, alpha_ref, g_ref = _loss_grads(ref, x, edge_index, edge_attr, return_attention_weights=True)
    out, alpha, g = _loss_grads(ours, x, edge_index, edge_attr, return_attention_weights=True)
    assert {"fwd_scores", "bwd"} <= set(stand_in_kernels.calls)
    torch.testing.assert_close(out, out_ref, atol=3e-3, rtol=3e-3)       # fp16 operands
    torch.testing.assert_close(alpha, alpha_ref, atol=3e-3, rtol=3e-3)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], atol=3e-2, rtol=3e-2)


def test_fallback_edge_attr_without_edge_dim_and_sparse_weights(fused_calls):
    """TransformerConv adds a raw edge_attr to the values when edge_dim is
    None, and returns a SparseTensor of weights for a SparseTensor input:
    both stay on its own path."""
    from torch_geometric.typing import SparseTensor
    edge_index, n = GRAPH_CASES["random_1003"]()
    ref, ours = make_pair(heads=2)
    x = random_x(n)
    raw = torch.randn(edge_index.size(1), 2, D, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UnfusedPathWarning, match="edge_attr without edge_dim"):
        assert_close(ours(x, edge_index, raw), ref(x, edge_index, raw))
    assert len(fused_calls) == 0
    if SparseTensor is not None and hasattr(SparseTensor, "from_edge_index"):
        try:
            adj = SparseTensor.from_edge_index(edge_index, sparse_sizes=(n, n)).t()
        except Exception:   # torch_sparse not installed: nothing to check
            return
        with pytest.warns(UnfusedPathWarning, match="attention weights of a SparseTensor adjacency"):
            out, adj_w = ours(x, adj, return_attention_weights=True)
        out_ref, adj_ref = ref(x, adj, return_attention_weights=True)
        assert_close(out, out_ref)
        assert len(fused_calls) == 0


def _with_kernel_mask(monkeypatch, seed_of_call):
    """TransformerConv's F.dropout replaced by the fused kernel's mask for the
    seed the layer draws (``torch.manual_seed`` before each call), so both
    layers drop the same edges."""
    import torch_geometric.nn.conv.transformer_conv as tc
    from gt_fused3s.ops import dropout_keep

    def kernel_dropout(alpha, p=0.5, training=True):
        if not training or p == 0:
            return alpha
        return alpha * dropout_keep(seed_of_call(), p, *alpha.shape)
    monkeypatch.setattr(tc.F, "dropout", kernel_dropout)


@pytest.mark.parametrize("edge_dim", [None, 4])
def test_dropout_fused_in_training(monkeypatch, edge_dim, fused_calls):
    """dropout > 0 while training takes the kernel's dropout: with the same
    mask, outputs, weights and gradients equal TransformerConv's; in eval
    mode nothing is dropped."""
    from gt_fused3s.ops import draw_dropout_seed
    edge_index, n = _edge_case_graph()
    ref, ours = make_pair(heads=4, dropout=0.3, edge_dim=edge_dim)
    x = random_x(n)
    ea = torch.randn(edge_index.size(1), 4, generator=torch.Generator().manual_seed(2)) if edge_dim else None

    def seed_of_call():
        torch.manual_seed(11)
        return draw_dropout_seed()
    _with_kernel_mask(monkeypatch, seed_of_call)
    for conv in (ref, ours):
        conv.train()
    torch.manual_seed(11)
    out, alpha, g = _loss_grads(ours, x, edge_index, ea, return_attention_weights=True)
    out_ref, alpha_ref, g_ref = _loss_grads(ref, x, edge_index, ea, return_attention_weights=True)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(alpha, alpha_ref, atol=1e-5, rtol=1e-4)     # before dropout, as PyG
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], atol=1e-5, rtol=1e-4)
    assert len(fused_calls) == 1
    ref.eval()
    ours.eval()                           # no dropout
    assert_close(ours(x, edge_index, ea), ref(x, edge_index, ea))
    assert len(fused_calls) == 2


def test_dropout_mask_distribution_and_seeds():
    from gt_fused3s.ops import dropout_keep
    m = dropout_keep(5, 0.3, 20000, 4)
    assert set(m.unique().tolist()) <= {0.0, torch.tensor(1 / 0.7).item()}
    kept = (m > 0).float().mean(0)
    assert torch.all((kept - 0.7).abs() < 0.015), kept            # per head, ~ Binomial(20000, 0.7)
    assert torch.equal(m, dropout_keep(5, 0.3, 20000, 4))         # counter-based: repeatable
    other = dropout_keep(6, 0.3, 20000, 4)
    assert (m != other).float().mean() > 0.3                      # another seed, another mask
    assert ((m[:, 0] > 0) != (m[:, 1] > 0)).float().mean() > 0.3  # heads independent
    assert torch.all(dropout_keep(5, 0.0, 10, 2) == 1)


@pytest.mark.parametrize("n_src,n_dst", [(30, 21), (21, 30)])
@pytest.mark.parametrize("edge_dim", [None, 3])
def test_bipartite_fused(n_src, n_dst, edge_dim, fused_calls):
    """x = (x_src, x_dst) of different sizes (rows = destinations, columns =
    sources): fused, outputs and gradients equal TransformerConv's, for an
    edge_index, a sparse adjacency [n_dst, n_src] and a plan of max(n_src, n_dst)
    nodes."""
    g = torch.Generator().manual_seed(6)
    edge_index = torch.stack([torch.randint(0, n_src, (90,), generator=g),
                              torch.randint(0, n_dst, (90,), generator=g)])
    edge_index = torch.cat([edge_index, edge_index[:, :7]], 1)           # duplicates
    ref, ours = make_pair(in_channels=(F_IN, 7), heads=4, beta=True, edge_dim=edge_dim)
    x = (torch.randn(n_src, F_IN, generator=g), torch.randn(n_dst, 7, generator=g))
    ea = torch.randn(edge_index.size(1), 3, generator=g) if edge_dim else None
    grads = []
    for conv, graph in ((ref, edge_index), (ours, edge_index),
                        (ours, GraphPlan.from_edge_index(edge_index, max(n_src, n_dst)))):
        xs = tuple(t.clone().requires_grad_() for t in x)
        out = conv(xs, graph, ea)
        assert out.shape == (n_dst, 4 * D)
        out.square().sum().backward()
        grads.append((out.detach(), xs[0].grad, xs[1].grad))
    for got in grads[1:]:
        for a, b in zip(got, grads[0]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert len(fused_calls) == 2
    if edge_dim is None:
        adj = torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1)), (n_dst, n_src))
        assert_close(ours(x, adj.coalesce()), ref(x, edge_index.unique(dim=1)))
        assert len(fused_calls) == 3
    bad = edge_index.clone()
    bad[0, 0] = n_src                      # a source the square graph would accept
    with pytest.raises(ValueError, match=rf"edge_index\[0\] has index {n_src} out of range"):
        ours(x, bad, ea)


def test_fallback_other_aggregation(fused_calls):
    edge_index, n = GRAPH_CASES["self_loops"]()
    ref, ours = make_pair(heads=2, aggr="mean")
    x = random_x(n)
    with pytest.warns(UnfusedPathWarning, match="aggr='mean'"):
        assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(fused_calls) == 0


# ------------------------------------------------------------ state dict

def test_state_dict_round_trip_both_ways():
    edge_index, n = GRAPH_CASES["random_1003"]()
    x = random_x(n)
    for kwargs in ({"heads": 4, "beta": True}, {"heads": 1, "concat": False, "edge_dim": 3,
                                                "bias": False}):
        torch.manual_seed(0)
        ref = TransformerConv(F_IN, D, **kwargs)
        torch.manual_seed(0)
        ours = Fused3SConv(F_IN, D, **kwargs)   # same init: shared reset_parameters
        for (k1, v1), (k2, v2) in zip(ref.state_dict().items(), ours.state_dict().items()):
            assert k1 == k2 and torch.equal(v1, v2)
        torch.manual_seed(1)
        ours.reset_parameters()
        ref.load_state_dict(ours.state_dict(), strict=True)      # ours -> TransformerConv
        ours2 = Fused3SConv(F_IN, D, **kwargs)
        ours2.load_state_dict(ref.state_dict(), strict=True)     # TransformerConv -> ours
        edge_attr = (torch.randn(edge_index.size(1), 3) if "edge_dim" in kwargs else None)
        assert_close(ours2(x, edge_index, edge_attr), ref(x, edge_index, edge_attr))
    assert repr(Fused3SConv(F_IN, D, heads=4)) == f"Fused3SConv({F_IN}, {D}, heads=4)"
    assert isinstance(ours, TransformerConv)


# ------------------------------------------------------------ bad input

@pytest.mark.parametrize("make,match", [
    (lambda x, ei: (x.long(), ei), r"x must be a floating-point tensor"),
    (lambda x, ei: (x.unsqueeze(0), ei), r"x must have shape \[num_nodes, in_channels\]"),
    (lambda x, ei: (x[:, :5], ei), r"x has 5 features .* in_channels=19"),
    (lambda x, ei: (x.double(), ei), r"x has dtype torch.float64 .* torch.float32"),
    (lambda x, ei: ((x, None), ei), r"x\[1\] must be a torch.Tensor"),
    (lambda x, ei: ("x", ei), r"x must be a Tensor"),
    (lambda x, ei: (x, ei.float()), r"edge_index must be an integer tensor"),
    (lambda x, ei: (x, ei.short()), r"edge_index must be int32 or int64"),
    (lambda x, ei: (x, ei[0]), r"edge_index must be 2-D"),
    (lambda x, ei: (x, torch.cat([ei, ei[:1]])), r"edge_index must have shape \[2, E\]"),
    (lambda x, ei: (x, ei.tolist()), r"edge_index must be an integer tensor \[2, E\]"),
    (lambda x, ei: (x, torch.cat([ei, torch.tensor([[3], [33]])], 1)),
     r"edge_index has index 33 out of range for num_nodes=33"),
    (lambda x, ei: (x, torch.cat([ei, torch.tensor([[-1], [3]])], 1)),
     r"edge_index has negative index -1"),
    (lambda x, ei: (x[:20], BSBGraph.from_edge_index(ei, 33)), r"BSBGraph .* num_nodes=33"),
])
def test_bad_input_raises_value_error(make, match):
    edge_index, n = GRAPH_CASES["self_loops"]()
    _, ours = make_pair(heads=2)
    x, ei = make(random_x(n), edge_index)
    with pytest.raises(ValueError, match=match):
        ours(x, ei)


def test_bad_input_with_edge_features():
    edge_index, n = GRAPH_CASES["self_loops"]()
    _, ours = make_pair(heads=2, edge_dim=3)
    x = random_x(n)
    bad = torch.cat([edge_index, torch.tensor([[40], [3]])], 1)
    with pytest.raises(ValueError, match=r"edge_index has index 40 out of range"):
        ours(x, bad, torch.randn(bad.size(1), 3))
    bsb = BSBGraph.from_edge_index(edge_index, n)
    with pytest.raises(ValueError, match=r"edge_attr cannot be used with a BSBGraph"):
        ours(x, bsb, torch.randn(bsb.num_edges, 3))
    E = edge_index.size(1)
    for attr, match in ((None, r"edge_dim=3: edge_attr must be a tensor"),
                        (torch.randn(E, 4), r"edge_attr must have shape \[E, edge_dim\] = \[66, 3\]"),
                        (torch.randn(E - 1, 3), r"edge_attr must have shape"),
                        (torch.ones(E, 3, dtype=torch.long), r"edge_attr must be a floating-point")):
        with pytest.raises(ValueError, match=match):
            ours(x, edge_index, attr)


def test_bad_input_on_unfused_path():
    edge_index, n = GRAPH_CASES["self_loops"]()
    _, ours = make_pair(heads=2, aggr="mean")     # TransformerConv's path
    bad = torch.cat([edge_index, torch.tensor([[40], [3]])], 1)
    with pytest.warns(UnfusedPathWarning), \
            pytest.raises(ValueError, match=r"edge_index\[0\] has index 40 out of range"):
        ours(random_x(n), bad)


def test_fallback_hooks_and_explain_mode_warn_and_equal_transformer_conv(fused_calls):
    """Message-passing hooks and PyG's explain mode need propagate(): the
    unfused path runs them, and the warning names the reason."""
    edge_index, n = GRAPH_CASES["duplicates"]()
    ref, ours = make_pair(heads=2)
    x = random_x(n)
    seen = []
    for conv in (ref, ours):
        conv.register_message_forward_hook(lambda module, inputs, out: seen.append(out.shape))
    with pytest.warns(UnfusedPathWarning, match="message-passing hooks are registered"):
        assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(seen) == 2 and seen[0] == seen[1] and len(fused_calls) == 0
    ref, ours = make_pair(heads=2)
    mask = torch.rand(edge_index.size(1), generator=torch.Generator().manual_seed(5))
    for conv in (ref, ours):
        conv.explain, conv._edge_mask, conv._apply_sigmoid = True, mask, True
    with pytest.warns(UnfusedPathWarning, match="explain mode"):
        assert_close(ours(x, edge_index), ref(x, edge_index))
    assert len(fused_calls) == 0


# ------------------------------------------------------------ packaging

def test_nn_package_needs_no_dgl(monkeypatch):
    import gt_fused3s
    monkeypatch.setattr(gt_fused3s, "nn", gt_fused3s.nn)  # restored with sys.modules
    monkeypatch.setitem(sys.modules, "dgl", None)         # `import dgl` now fails
    for name in [m for m in sys.modules if m.startswith("gt_fused3s.nn")]:
        monkeypatch.delitem(sys.modules, name)
    nn_pkg = importlib.import_module("gt_fused3s.nn")
    assert nn_pkg.Fused3SConv.__name__ == "Fused3SConv"
    with pytest.raises(ImportError, match=r'pip install "gt-fused3s\[dgl\]"'):
        importlib.import_module("gt_fused3s.nn.dgl")


@pytest.mark.parametrize("edge_dim", [None, 4])
@pytest.mark.parametrize("kernel_path", [False, True])
def test_dropout_under_compile_is_fused_with_a_new_mask_each_call(monkeypatch, request, count_calls, fused_calls,
                                                                  kernel_path, edge_dim):
    """Training with attention dropout under torch.compile takes the fused
    path (it took TransformerConv's before: an int seed would be frozen into
    the graph): the region draws its seed as a tensor each call, so two
    calls drop different edges, and a call equals the eager layer whose seed
    is that tensor's value (the kernels' path through the stand-ins: the ops
    get the seed tensor), gradients included."""
    from gt_fused3s import ops
    if kernel_path:
        request.getfixturevalue("stand_in_kernels")
    count_calls(pyg_mod, "edge_feature_attention", fused_calls)     # (compiled: one op, counted here)
    edge_index, n = GRAPH_CASES["self_loops"]()
    _, ours = make_pair(heads=2, dropout=0.5, edge_dim=edge_dim)
    ours.train()
    ea = torch.randn(edge_index.size(1), 4, generator=torch.Generator().manual_seed(2)) if edge_dim else None
    torch._dynamo.reset()
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)

    def run(layer, seed):
        x = random_x(n).requires_grad_()
        torch.manual_seed(seed)         # the region's draw repeats; the eager one is patched below
        out = layer(x, edge_index, ea)
        out.square().sum().backward()
        return out.detach(), x.grad
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnfusedPathWarning)
        out1, g1 = run(compiled, 5)
        out2, _ = run(compiled, 6)
    assert len(fused_calls) > 0                     # traced the fused path
    assert not torch.allclose(out1, out2)           # a new mask each call
    torch.manual_seed(5)
    drawn = ops.draw_dropout_seed_tensor("cpu")     # what the region drew
    monkeypatch.setattr(ops, "draw_dropout_seed", lambda: int(drawn))
    out_e, g_e = run(ours, 5)
    torch.testing.assert_close(out1, out_e, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g1, g_e, atol=1e-5, rtol=1e-4)


def test_dropout_seed_forms():
    """An int seed and a one-element int64 tensor of the same value draw the
    same mask; inside a compiled region an int seed raises (it would be
    frozen) and None draws a tensor; bad seed tensors are ValueErrors."""
    from gt_fused3s import fused3s_attention
    from gt_fused3s.ops import _dropout, dropout_keep
    assert torch.equal(dropout_keep(2**40 + 7, 0.3, 500, 3), dropout_keep(torch.tensor([2**40 + 7]), 0.3, 500, 3))
    assert _dropout(0.0, torch.tensor([1])) == (0.0, 0, None)
    p, s, t = _dropout(0.2, torch.tensor([9]))
    assert (p, s) == (0.2, 0) and int(t) == 9
    assert _dropout(0.2, -1) == (0.2, 2**63 - 1, None)
    for bad in (torch.tensor([1, 2]), torch.tensor([1.0]), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(ValueError, match="one int64"):
            _dropout(0.2, bad)

    def region(q, seed):
        return _dropout(0.2, seed, q.device)[2] + 0
    drawn = torch.compile(region, backend="eager", fullgraph=True)(torch.zeros(1), None)
    assert drawn.dtype == torch.int64 and drawn.shape == (1,) and 0 <= int(drawn) < 2**62
    torch._dynamo.reset()
    with pytest.raises(Exception, match="an int dropout_seed inside"):
        torch.compile(region, backend="eager", fullgraph=True)(torch.zeros(1), 3)
    ei, n = GRAPH_CASES["self_loops"]()
    q = torch.randn(n, 2, 8)
    out_t = fused3s_attention(q, q, q, ei, dropout_p=0.4, dropout_seed=torch.tensor([77]))
    torch.testing.assert_close(out_t, fused3s_attention(q, q, q, ei, dropout_p=0.4, dropout_seed=77))


def test_clear_errors_for_scripting_sizes_and_edge_indices():
    """TorchScript fails at once pointing to torch.compile; zero sizes and
    a bad out_dtype are one-line ValueErrors; an out-of-range edge index is
    an IndexError as in PyG (and still a ValueError)."""
    from gt_fused3s import EdgeIndexError, fused3s_attention
    _, ours = make_pair(heads=2)
    with pytest.raises(RuntimeError, match="cannot be compiled by TorchScript.*torch.compile"):
        torch.jit.script(ours)
    for kwargs in ({"out_channels": 0}, {"heads": 0}, {"heads": 2.0}):
        with pytest.raises(ValueError, match=r"must be an int >= 1"):
            Fused3SConv(F_IN, **{"out_channels": D, **kwargs})
    import numpy as np                  # numpy integers are ints, as everywhere in PyG
    conv = Fused3SConv(np.int64(F_IN), np.int64(D), heads=np.int32(2))
    assert conv.out_channels == D and type(conv.heads) is int
    q = torch.randn(5, 2, 0)
    with pytest.raises(ValueError, match="head dim >= 1"):
        fused3s_attention(q, q, q, torch.zeros(2, 1, dtype=torch.long))
    q = torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match="out_dtype must be a floating-point"):
        fused3s_attention(q, q, q, torch.zeros(2, 1, dtype=torch.long), out_dtype=torch.int32)
    edge_index, n = GRAPH_CASES["self_loops"]()
    bad = torch.cat([edge_index, torch.tensor([[3], [n]])], 1)
    for kind in (IndexError, ValueError, EdgeIndexError):
        with pytest.raises(kind, match=f"index {n} out of range"):
            ours(random_x(n), bad)
