"""The host-free contract on the GPU (run on the GPU machine): given a
prepared plan, forward and backward of the op, the layers and the Graph
Transformer make no host synchronisation (``set_sync_debug_mode("error")``);
a static plan builds without one too; whole steps captured in CUDA graphs
replay on new batches of the same bucket exactly as eager; and
``torch.compile(fullgraph=True)`` of a model using ``Fused3SConv`` equals
eager, forward and backward."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.backends import AttentionGraph
from gt_fused3s.capture import CudaGraphRunner
from gt_fused3s.data.bucket import Buckets
from gt_fused3s.models import GraphTransformer

from cuda_marks import GPU_TESTS
from graph_cases import molecule_batches

pytestmark = GPU_TESTS
DEV = "cuda"


@contextlib.contextmanager
def no_sync():
    """Every synchronising CUDA call inside raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _edges(n, e, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g, device=DEV)
    return torch.cat([ei, ei[:, :e // 20]], 1)                  # with duplicates


# ------------------------------------------------------------- no host sync
@pytest.mark.parametrize("window_rows", [16, 8])
@pytest.mark.parametrize("static", [False, True])
def test_op_forward_backward_make_no_host_sync(static, window_rows):
    n, h, d = 3001, 4, 64
    ei = _edges(n, 12 * n, 1)
    hub = torch.arange(0, n, 2, device=DEV)                      # a split window in each pass
    ei = torch.cat([ei, torch.stack([hub, torch.full_like(hub, 7)]), torch.stack([torch.full_like(hub, 9), hub])], 1)
    q, k, v, do = (torch.randn(n, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if static:                 # the static build itself makes no sync either
        with no_sync():
            plan = GraphPlan.from_edge_index(ei, n, static=True, window_rows=window_rows).prepare(h, d)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)      # 8 rows: the hubs' long windows
            plan = GraphPlan.from_edge_index(ei, n, window_rows=window_rows).prepare(h, d)
    assert plan.window_rows == window_rows
    with no_sync():
        out = fused3s_attention(*leaves, plan)
        grads = torch.autograd.grad(out, leaves, do)
        with torch.no_grad():
            out2 = fused3s_attention(q, k, v, plan)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("edge_dim", [None, 8])
def test_pyg_layer_makes_no_host_sync(edge_dim):
    """Every fused option too: edge features, attention dropout (training),
    the attention weights returned."""
    from gt_fused3s.nn import Fused3SConv
    n = 2000
    ei = _edges(n, 8 * n, 2)
    conv = Fused3SConv(32, 16, heads=4, beta=True, edge_dim=edge_dim, dropout=0.1).to(DEV).train()
    plan = Fused3SConv.to_graph_format(ei, n).prepare(4, 16, edge_features=edge_dim is not None)
    x = torch.randn(n, 32, device=DEV, requires_grad=True)
    attr = torch.randn(ei.size(1), edge_dim, device=DEV, requires_grad=True) if edge_dim else None
    with no_sync():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, (_, alpha) = conv(x, plan, attr, return_attention_weights=True)
        (out.float().square().sum() + alpha.float().sum()).backward()
    torch.cuda.synchronize()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert attr is None or (attr.grad is not None and torch.isfinite(attr.grad).all())


def test_dgl_layer_makes_no_host_sync():
    dgl = pytest.importorskip("dgl")
    from gt_fused3s.nn.dgl import Fused3SConv
    n = 500
    ei = _edges(n, 4 * n, 3).cpu()
    g = dgl.add_self_loop(dgl.graph((ei[0], ei[1]), num_nodes=n))
    conv = Fused3SConv(16, 16, num_heads=2).to(DEV)
    feat = torch.randn(n, 16, device=DEV, requires_grad=True)
    Fused3SConv.to_graph_format(g, DEV).prepare(2, 16)
    conv(g, feat)                                                # first call: graph checks (cached)
    with no_sync():
        conv(g, feat).sum().backward()
    torch.cuda.synchronize()


def test_graph_transformer_inference_and_training_step_make_no_host_sync():
    data = molecule_batches(1, 32, 8)[0].to(DEV)
    G = data.ptr.numel() - 1
    torch.manual_seed(0)
    model = GraphTransformer(8, 64, 1, num_layers=4, heads=2, readout="graph").to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    model.eval()
    graph = model.prepare_graph(model.make_graph(data.edge_index, data.num_nodes), backward=True)
    with no_sync(), torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(data.x, None, data.batch, graph=graph, num_graphs=G)
    model.train()
    for static_graph in (graph, None):          # prebuilt, and built inside (static)
        with no_sync():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                g = static_graph or AttentionGraph(data.edge_index, data.num_nodes, static=True)
                out = model(data.x, None, data.batch, graph=g, num_graphs=G)
            loss = (out.float().squeeze(-1) - data.y.to(DEV)).square().mean()
            loss.backward()
            opt.step()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)


# ------------------------------------------------------------------ capture
@pytest.mark.parametrize("window_rows", [16, 8])
def test_captured_op_replays_on_a_new_graph_of_the_same_shape(window_rows):
    n, h, d, e = 1500, 2, 64, 9000

    def step(q, k, v, do, edge_index):
        plan = GraphPlan.from_edge_index(edge_index, n, static=True, window_rows=window_rows).prepare(h, d)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fused3s_attention(*leaves, plan)
        return (out, *torch.autograd.grad(out, leaves, do))

    runner = CudaGraphRunner(step)
    for seed in range(3):                       # first: eager + capture; then replays
        ei = _edges(n, e, 10 + seed)[:, :e]
        args = [torch.randn(n, h, d, device=DEV, dtype=torch.float16) for _ in range(4)] + [ei]
        got = [t.clone() for t in runner(*args)]
        want = step(*args)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert runner.captures == 1 and runner.replays == 2


def test_captured_edge_feature_layer_step_equals_eager():
    """Fused3SConv with edge_dim on a plan: forward and backward (inputs,
    edge features, every parameter) captured once, replayed on new
    features, equal to eager."""
    from gt_fused3s.nn import Fused3SConv
    n, h, c, f = 1200, 4, 16, 8
    ei = _edges(n, 6 * n, 5)
    torch.manual_seed(0)
    conv = Fused3SConv(32, c, heads=h, edge_dim=f, beta=True).to(DEV)
    plan = Fused3SConv.to_graph_format(ei, n).prepare(h, c, edge_features=True)
    params = list(conv.parameters())

    def step(x, attr, grad):
        leaves = [x.detach().requires_grad_(), attr.detach().requires_grad_()]
        out = conv(leaves[0], plan, leaves[1])
        return (out, *torch.autograd.grad(out, leaves + params, grad))

    runner = CudaGraphRunner(step)
    for seed in range(3):                       # first: eager + capture; then replays
        g = torch.Generator(device=DEV).manual_seed(seed)
        args = (torch.randn(n, 32, device=DEV, generator=g), torch.randn(ei.size(1), f, device=DEV, generator=g),
                torch.randn(n, h * c, device=DEV, generator=g))
        got = [t.clone() for t in runner(*args)]
        want = step(*args)
        for i, (a, b) in enumerate(zip(got, want)):
            # equal but for the order of float atomics (the weights' gradient
            # summed into the backward's per-row term with index_add_), whose
            # last-bit differences can flip an fp16 rounding of an operand
            # (measured: 1.7e-5 of the gradient's largest entry)
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= 1e-4 * max(scale, 1.0), f"seed {seed}, output {i}: error {err:.3g}, scale {scale:.3g}"
    assert runner.captures == 1 and runner.replays == 2


def test_captured_training_step_equals_eager_on_new_batches_of_a_bucket():
    batches = molecule_batches(4, 32, 8)
    buckets = Buckets.fit([(d.num_nodes, d.edge_index.size(1), d.ptr.numel() - 1) for d in batches],
                          max_buckets=1)
    padded = [buckets.pad_batch(d).to(DEV) for d in batches]
    assert len({p.bucket for p in padded}) == 1

    def make():
        torch.manual_seed(0)
        model = GraphTransformer(8, 32, 1, num_layers=3, heads=2, readout="graph").to(DEV).train()
        # SGD: its step is linear in the gradient, so the rounding noise of a
        # float sum (the readout's scatter order) stays noise; Adam would
        # turn near-zero gradients into steps of size lr either way
        return model, torch.optim.SGD(model.parameters(), lr=1e-2)

    def loss_of(out, y, mask):
        known = mask & ~torch.isnan(y)
        return ((out.float().squeeze(-1) - torch.where(known, y, 0)).square() * known).sum() / known.sum()

    model_c, opt_c = make()

    def step(x, edge_index, batch, graph_mask, y):
        opt_c.zero_grad(set_to_none=True)
        graph = AttentionGraph(edge_index, x.size(0), static=True)
        out = model_c(x, None, batch, graph=graph, num_graphs=graph_mask.numel())
        loss = loss_of(out, y, graph_mask)
        loss.backward()
        opt_c.step()
        return loss.detach()

    runner = CudaGraphRunner(step)
    model_e, opt_e = make()
    for p in padded:
        got = runner(p.x, p.edge_index, p.batch, p.graph_mask, p.y).clone()
        opt_e.zero_grad(set_to_none=True)
        out = model_e(p.x, p.edge_index, p.batch, num_graphs=p.graph_mask.numel())
        want = loss_of(out, p.y, p.graph_mask)
        want.backward()
        opt_e.step()
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-4)
    assert runner.captures == 1 and runner.replays == len(padded) - 1
    for a, b in zip(model_c.parameters(), model_e.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ compile
def test_compile_fullgraph_of_a_fused3sconv_model_equals_eager():
    from gt_fused3s.nn import Fused3SConv
    torch._dynamo.reset()
    n = 1200
    ei = _edges(n, 6 * n, 4)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = Fused3SConv(24, 16, heads=4)
            self.c2 = Fused3SConv(64, 32, heads=2, concat=False)

        def forward(self, x, graph):
            return self.c2(self.c1(x, graph).relu(), graph)

    torch.manual_seed(0)
    net = Net().to(DEV)
    compiled = torch.compile(net, fullgraph=True)
    x = torch.randn(n, 24, device=DEV)
    plan = Fused3SConv.to_graph_format(ei, n).prepare(4, 16).prepare(2, 32)
    for graph in (plan, ei):            # a prepared plan; an edge_index built inside (static)
        xc, xe = (x.clone().requires_grad_() for _ in range(2))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_c, out_e = compiled(xc, graph), net(xe, ei)
        torch.testing.assert_close(out_c.float(), out_e.float(), atol=2e-2, rtol=2e-2)
        out_c.float().square().sum().backward()
        out_e.float().square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, atol=5e-2 * xe.grad.abs().max().item(), rtol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("graph_kind", ["unprepared_plan", "cached_edge_index"])
def test_reduce_overhead_layer_steps_equal_eager(graph_kind):
    """Fused3SConv(edge_dim) under torch.compile(mode="reduce-overhead"),
    four steps, on a plan passed in unprepared and on an edge_index with
    cached=True: eager's gradients at every step. (The arrays the first
    traced call built were stored on the plan: CUDA-graph outputs, which
    the next replay overwrote; with cached=True the plan was rebuilt inside
    the graph on every call.)"""
    from gt_fused3s.nn import Fused3SConv
    torch._dynamo.reset()
    n = 700
    ei = _edges(n, 5 * n, 5)
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(n, 32, device=DEV, generator=g)
    attr = torch.randn(ei.size(1), 8, device=DEV, generator=g)
    torch.manual_seed(0)
    conv = Fused3SConv(32, 16, heads=4, edge_dim=8, cached=graph_kind == "cached_edge_index").to(DEV)
    graph = Fused3SConv.to_graph_format(ei, n) if graph_kind == "unprepared_plan" else ei
    compiled = torch.compile(conv, mode="reduce-overhead")
    for step in range(4):
        grad = torch.randn(n, 64, device=DEV, generator=g)
        leaves = [(x.clone().requires_grad_(), attr.clone().requires_grad_()) for _ in range(2)]
        torch.compiler.cudagraph_mark_step_begin()
        out_c = compiled(leaves[0][0], graph, leaves[0][1])
        got = [t.clone() for t in torch.autograd.grad(out_c, leaves[0], grad)]
        out_e = conv(leaves[1][0], Fused3SConv.to_graph_format(ei, n), leaves[1][1])
        want = torch.autograd.grad(out_e, leaves[1], grad)
        for name, a, b in zip(("x", "edge_attr"), got, want):
            torch.testing.assert_close(a, b, atol=1e-3 * b.abs().max().item(), rtol=0,
                                       msg=lambda m: f"step {step} {name}: {m}")
    if graph_kind == "cached_edge_index":
        assert conv._cached_hit is not None and conv._cached_hit[0] is ei
    torch._dynamo.reset()


def test_compile_dynamic_shapes_equals_eager_without_recompiling():
    """torch.compile(dynamic=True, fullgraph=True) of Fused3SConv(edge_dim)
    on edge_index tensors of four sizes (the static format built inside,
    its node count symbolic through bsb_build's SymInt): eager's output and
    input gradient, and no recompilation after the second size."""
    from gt_fused3s.nn import Fused3SConv
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = Fused3SConv(32, 16, heads=4, edge_dim=8).to(DEV)
    compiled = torch.compile(conv, dynamic=True, fullgraph=True)
    graphs = []
    for n in (300, 420, 555, 700):
        ei = _edges(n, 5 * n, n)
        g = torch.Generator(device=DEV).manual_seed(n)
        x = torch.randn(n, 32, device=DEV, generator=g)
        attr = torch.randn(ei.size(1), 8, device=DEV, generator=g)
        xc, xe = (x.clone().requires_grad_() for _ in range(2))
        out_c, out_e = compiled(xc, ei, attr), conv(xe, ei, attr)
        torch.testing.assert_close(out_c, out_e, atol=1e-3 * out_e.abs().max().item(), rtol=0)
        out_c.square().sum().backward()
        out_e.square().sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, atol=1e-3 * xe.grad.abs().max().item(), rtol=0)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs
    torch._dynamo.reset()
