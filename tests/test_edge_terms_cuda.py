"""The edge-feature kernels (csrc/kernels/edge_terms.cu) on the GPU machine:
each product and its gradients against the PyTorch path in float64 on the
CPU, with duplicates, a node of thousands of edges, isolated nodes, feature
counts that take the vector and the scalar loads, no edges; an index out of
range gives NaN; and the composed attention with edge features against
TransformerConv's materialised form."""
from __future__ import annotations

import pytest
import torch

from gt_fused3s import GraphPlan
from gt_fused3s.edge_terms import edge_dot, edge_feature_attention, edge_scatter
from gt_fused3s.graph import node_csr
from gt_fused3s.reference import edge_feature_reference

from cuda_marks import GPU_TESTS
from graph_cases import GRAPH_CASES

pytestmark = GPU_TESTS


def _operands(E, N, H, F, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, N, (E,), generator=g)
    if E >= 4500:           # high-degree nodes: edge_scatter's hub blocks take those of over 256 edges
        fixed = (N // 2, 3, N - 1, 5)
        for node in fixed:                      # the random edges avoid them
            idx[idx == node] = 6
        idx[:3000] = N // 2
        idx[3000:3600] = 3
        idx[3600:3857] = N - 1                  # 257 edges: the smallest hub
        idx[3857:4113] = 5                      # 256 (kHubDegree): not a hub
    return (idx, torch.randn(N, H, F, generator=g, dtype=torch.float64),
            torch.randn(E, F, generator=g, dtype=torch.float64),
            torch.randn(E, H, generator=g, dtype=torch.float64))


def _grads(fn, *leaves, grad_dtype=torch.float32):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    g = torch.Generator().manual_seed(9)
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(grad_dtype).to(out))
    return out.detach().double().cpu(), [t.grad.double().cpu() for t in leaves]


def _close(got, want, what, dtype):
    # fp32 arithmetic; results (and gradients) in the operands' dtype
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not want.numel():
        return
    scale = max(want.abs().max().item(), 1.0)
    err = (got - want).abs().max().item()
    tol = 2e-5 if dtype == torch.float32 else 1e-3
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} (scale {scale:.3g})"


# (5000, 2000) and (1500, 600): fewer than 4 edges a node (edge_scatter's
# two lanes a node), the first with hubs
@pytest.mark.parametrize("E,N,H,F", [(5000, 400, 4, 16), (1000, 97, 1, 16), (3000, 211, 8, 5),
                                     (700, 50, 3, 1), (0, 10, 2, 4), (6000, 700, 8, 5), (4500, 900, 3, 12),
                                     (5000, 2000, 4, 16), (1500, 600, 3, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_products_and_gradients(E, N, H, F, dtype):
    idx, X, a, w = _operands(E, N, H, F, seed=E + F)
    idx_d = idx.cuda()
    csr = node_csr(idx_d, N)
    for name, fn, fn_d, leaves in (
            ("edge_dot", lambda X, a: edge_dot(X, a, idx), lambda X, a: edge_dot(X, a, idx_d, csr), (X, a)),
            ("edge_scatter", lambda w, a: edge_scatter(w, a, idx, N),
             lambda w, a: edge_scatter(w, a, idx_d, N, csr), (w, a))):
        # the reference on operands rounded as the GPU's are
        rounded = [t.to(dtype).double() for t in leaves]
        want, want_grads = _grads(fn, *rounded, grad_dtype=dtype)
        got, got_grads = _grads(fn_d, *(t.to(dtype).cuda() for t in rounded), grad_dtype=dtype)
        _close(got, want, name, dtype)
        for i, (g, gw) in enumerate(zip(got_grads, want_grads)):
            _close(g, gw, f"{name} grad {i}", dtype)


@pytest.mark.parametrize("H", [4, 5])
def test_edge_scatter_hubs_every_run_the_same(H):
    """Hubs of 257 to 5,000 edges, many in one hub block's scan; four heads
    and five (two head groups): every run gives the same bits, within fp32
    rounding of the float64 sums."""
    g = torch.Generator().manual_seed(11)
    N, F = 600, 16
    degrees = torch.randint(0, 6, (N,), generator=g)
    hubs = torch.arange(0, N, 7)
    degrees[hubs] = torch.randint(257, 5000, (hubs.numel(),), generator=g)
    idx = torch.repeat_interleave(torch.arange(N), degrees)
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    w = torch.randn(idx.numel(), H, generator=g, dtype=torch.float64)
    a = torch.randn(idx.numel(), F, generator=g, dtype=torch.float64)
    want = torch.zeros(N, H, F, dtype=torch.float64).index_add_(0, idx, w.unsqueeze(-1) * a.unsqueeze(1))
    rowptr, order = node_csr(idx.cuda(), N)
    runs = [torch.ops.gt_fused3s.edge_scatter(w.float().cuda(), a.float().cuda(), rowptr, order)
            for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    _close(runs[0].double().cpu(), want, "edge_scatter hubs", torch.float32)


@pytest.mark.parametrize("H,F", [(4, 16), (5, 16), (3, 5)])
def test_edge_dot_heads_a_thread(H, F):
    """From 2^19 edges edge_dot gives a thread up to four heads (one row of a
    read for them): against float64, full and partial head groups, the
    vector and the scalar loads; an index out of range gives NaN in its row
    only."""
    E, N = (1 << 19) + 3, 5000
    g = torch.Generator(device="cuda").manual_seed(H * F)
    idx = torch.randint(0, N, (E,), device="cuda", generator=g)
    X = torch.randn(N, H, F, device="cuda", generator=g)
    a = torch.randn(E, F, device="cuda", generator=g)
    want = torch.einsum("ehf,ef->eh", X.double()[idx], a.double())
    got = torch.ops.gt_fused3s.edge_dot(X, a, idx)
    _close(got.double(), want, "edge_dot", torch.float32)
    idx[E - 2] = N
    got = torch.ops.gt_fused3s.edge_dot(X, a, idx)
    assert got[E - 2].isnan().all() and not got[: E - 2].isnan().any() and not got[E - 1].isnan().any()


def test_index_out_of_range_gives_nan():
    idx, X, a, w = (t.cuda() for t in _operands(50, 20, 2, 8, seed=1))
    idx[7] = 20
    out = torch.ops.gt_fused3s.edge_dot(X.float(), a.float(), idx)
    assert out[7].isnan().all() and not out[:7].isnan().any()
    rows = torch.ops.gt_fused3s.edge_rows(w.float(), X.float(), idx)
    assert rows[7].isnan().all() and not rows[8:].isnan().any()


@pytest.mark.parametrize("F", [16, 5])
def test_edge_rows_two_terms(F):
    """edge_rows with a second (w2, x2): both sums in one pass, against
    float64; the vector and the scalar loads."""
    idx, X, a, w = _operands(3000, 211, 3, F, seed=F)
    X2, w2 = X.flip(0) * 0.5, w.flip(1) - 1
    want = (w.unsqueeze(-1) * X[idx]).sum(1) + (w2.unsqueeze(-1) * X2[idx]).sum(1)
    got = torch.ops.gt_fused3s.edge_rows(*(t.float().cuda() for t in (w, X)), idx.cuda(),
                                         *(t.float().contiguous().cuda() for t in (w2, X2)))
    _close(got.double().cpu(), want, "edge_rows two terms", torch.float32)


@pytest.mark.parametrize("H", [1, 4, 7])
def test_edge_probs(H):
    """edge_probs: exp(scale s + bias - lse[idx]) per edge and head, with and
    without a bias, against float64; an index out of range gives NaN there
    only."""
    g = torch.Generator().manual_seed(H)
    E, N = 5000, 300
    s, b = (torch.randn(E, H, generator=g) for _ in range(2))
    lse = torch.randn(N, H, generator=g) + 3
    idx = torch.randint(0, N, (E,), generator=g)
    for bias in (b, None):
        want = torch.exp(s.double() * 0.7 + (0 if bias is None else bias.double()) - lse.double()[idx])
        got = torch.ops.gt_fused3s.edge_probs(s.cuda(), None if bias is None else bias.cuda(), lse.cuda(),
                                              idx.cuda(), 0.7)
        _close(got.double().cpu(), want, "edge_probs", torch.float32)
    bad = idx.clone().cuda()
    bad[11] = N
    out = torch.ops.gt_fused3s.edge_probs(s.cuda(), b.cuda(), lse.cuda(), bad, 0.7)
    assert out[11].isnan().all() and not out[:11].isnan().any()


@pytest.mark.parametrize("F", [16, 5])
@pytest.mark.parametrize("N", [400, 2000])          # 12.5 and 2.5 edges a node (eight lanes a node, two)
def test_edge_scatter_bad_edge_id_gives_nan_rows(F, N):
    """An edge id outside [0, E) in the grouping gives NaN in its node's
    rows only, for a hub (a block per node) and for a plain node."""
    idx, X, a, w = (t.cuda() for t in _operands(5000, N, 3, F, seed=2))
    rowptr, order = node_csr(idx, N)
    order = order.clone()
    for node in (N // 2, 5):                          # 3000 edges (a hub); 256 (not one)
        assert rowptr[node + 1] > rowptr[node]
        order[rowptr[node + 1] - 1] = 5000
    out = torch.ops.gt_fused3s.edge_scatter(w.float(), a.float(), rowptr, order)
    nan = out.isnan().flatten(1)
    assert nan[N // 2].all() and nan[5].all() and nan.any(1).sum() == 2


@pytest.mark.parametrize("case", ["duplicates", "random_1003", "empty_rows"])
@pytest.mark.parametrize("H,C", [(1, 16), (4, 32)])
def test_edge_feature_attention(case, H, C):
    """fp16 kernels against TransformerConv's form in float64: out, weights and the
    gradients of q, k, v, the edge features and W_e."""
    edge_index, n = GRAPH_CASES[case]()
    E, F = edge_index.size(1), 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, H, C, generator=g, dtype=torch.float64) for _ in range(3))
    a = torch.randn(E, F, generator=g, dtype=torch.float64)
    w_e = torch.randn(H, C, F, generator=g, dtype=torch.float64) * 0.2
    scale = C ** -0.5

    def materialised(q, k, v, a, w_e):
        return torch.cat([t.flatten() for t in edge_feature_reference(q, k, v, edge_index, a, w_e, scale)])

    plan = GraphPlan.from_edge_index(edge_index.cuda(), n)

    def fused(q, k, v, a, w_e):
        out, alpha = edge_feature_attention(q, k, v, plan, a, w_e, scale)
        return torch.cat([out.float().flatten(), alpha.flatten()])

    rounded = [t.half().double() for t in (q, k, v)] + [a.float().double(), w_e.float().double()]
    want, want_grads = _grads(materialised, *rounded)
    got, got_grads = _grads(fused, *(t.half().cuda() for t in rounded[:3]),
                            *(t.float().cuda() for t in rounded[3:]))
    for what, x, y in [("out/alpha", got, want)] + [
            (f"grad {i}", gx, gy) for i, (gx, gy) in enumerate(zip(got_grads, want_grads))]:
        err = (x - y).abs().max().item()
        assert err <= 1e-2 * max(y.abs().max().item(), 1.0), f"{what}: max abs error {err:.3g}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("with_csr", [False, True])
def test_compiled_products_give_eager_gradients(backend, with_csr):
    """torch.compile of each product: eager's output and gradients (dynamo's
    trace of the eager autograd.Functions once fed their backward zeros for
    the incoming gradient on CUDA: every gradient was zero)."""
    idx, X, a, w = (t.cuda() for t in _operands(1000, 97, 4, 16, seed=5))
    X, a, w = X.float(), a.float(), w.float()
    csr = node_csr(idx, 97) if with_csr else None
    for name, fn, leaves in (("edge_dot", lambda X, a: edge_dot(X, a, idx, csr), (X, a)),
                             ("edge_scatter", lambda w, a: edge_scatter(w, a, idx, 97, csr), (w, a))):
        torch._dynamo.reset()
        want_out, want = _grads(fn, *leaves)
        got_out, got = _grads(torch.compile(fn, backend=backend, fullgraph=True), *leaves)
        _close(got_out, want_out, f"{name} output", torch.float32)
        for i, (g, e) in enumerate(zip(got, want)):
            assert e.abs().max() > 0
            _close(g, e, f"{name} gradient {i}", torch.float32)


def test_compiled_edge_feature_layer_gives_eager_gradients():
    """Fused3SConv(edge_dim) under torch.compile, with the edge_index and with
    a plan: the gradients of x, the edge features and every weight equal
    eager's (fp16 kernels both ways; the sums' order may differ)."""
    from gt_fused3s.nn.pyg import Fused3SConv
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(11)
    N, E = 300, 1500
    ei = torch.randint(0, N, (2, E), generator=g).cuda()
    x, attr = torch.randn(N, 32, generator=g).cuda(), torch.randn(E, 8, generator=g).cuda()
    grad = torch.randn(N, 32, generator=g).cuda()
    torch.manual_seed(0)
    conv = Fused3SConv(32, 8, heads=4, edge_dim=8, cached=True).cuda()
    plan = GraphPlan.from_edge_index(ei, N).prepare(4, 8, edge_features=True)
    compiled = torch.compile(conv, fullgraph=True)

    def grads(fn, graph):
        leaves = [x.clone().requires_grad_(), attr.clone().requires_grad_()]
        out = fn(leaves[0], graph, leaves[1])
        return [out.detach()] + list(torch.autograd.grad(out, leaves + list(conv.parameters()), grad))

    want = grads(conv, ei)
    names = ["out", "x", "edge_attr"] + [n for n, _ in conv.named_parameters()]
    for graph in (ei, plan):
        got = grads(compiled, graph)
        for name, a, b in zip(names, got, want):
            if name == "lin_key.bias":      # zero but for rounding: a softmax ignores a row's shift
                continue
            err = (a - b).abs().max().item() / b.abs().max().item()
            assert err < 1e-3, f"{name}: relative error {err:.3g}"
