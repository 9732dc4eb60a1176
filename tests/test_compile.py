"""torch.compile on the CPU: the PyG layer and the Graph Transformer trace
with ``fullgraph=True`` (no graph break), forward and backward equal eager,
on the reference path and on the kernel path (the registered ops with CPU
stand-ins: the static plan build and the fused op inside the compiled
region); ``torch.library.opcheck`` passes on every registered op. Plans
that outlive a compiled call (a layer's cached plan, a plan passed in
unprepared) are built outside the graph, and dynamic shapes neither break
the graph nor recompile per node count."""
import pytest
import torch

import gt_fused3s.schedule as schedule
from gt_fused3s import GraphPlan
from gt_fused3s.bench.common import expand_runs, parse_run
from gt_fused3s.graph import node_csr
from gt_fused3s.models import GraphTransformer
from gt_fused3s.nn import Fused3SConv

N = 50


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph(seed=0):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, N, (2, 200), generator=g)
    return torch.cat([ei, ei[:, :7]], 1), torch.randn(N, 16, generator=g)   # with duplicates


def _check_layer():
    ei, x = _graph()
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, beta=True)
    compiled = torch.compile(conv, fullgraph=True)
    for graph in (ei, GraphPlan.from_edge_index(ei, N).prepare(2, 16)):
        xc, xe = (x.clone().requires_grad_() for _ in range(2))
        out_c, out_e = compiled(xc, graph), conv(xe, ei)
        torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
        out_c.square().sum().backward()
        out_e.square().sum().backward()
        # summation orders differ (compiled kernel path vs eager reference,
        # and between torch versions): 2e-5 seen on torch 2.11; a wrong term is O(0.1)
        torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)


def _check_layer_edge_features():
    """edge_dim (the bias and value terms' products), the weights returned."""
    ei, x = _graph(3)
    attr = torch.randn(ei.size(1), 4, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, edge_dim=4, beta=True)
    compiled = torch.compile(conv, fullgraph=True)
    for graph in (ei, GraphPlan.from_edge_index(ei, N).prepare(2, 16, edge_features=True)):
        leaves = [(x.clone().requires_grad_(), attr.clone().requires_grad_()) for _ in range(2)]
        (out_c, (_, w_c)), (out_e, (_, w_e)) = (
            fn(xx, g, aa, return_attention_weights=True) for fn, g, (xx, aa) in
            ((compiled, graph, leaves[0]), (conv, ei, leaves[1])))
        torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(w_c, w_e, atol=1e-6, rtol=1e-5)
        for out, w in ((out_c, w_c), (out_e, w_e)):
            (out.square().sum() + w.sum()).backward()
        for (a_c, a_e) in zip(*leaves):
            torch.testing.assert_close(a_c.grad, a_e.grad, atol=1e-4, rtol=1e-4)


def _check_graph_transformer():
    ei, x = _graph(1)
    batch = torch.arange(N) // 25
    torch.manual_seed(0)
    model = GraphTransformer(16, 32, 3, num_layers=2, heads=2, readout="graph")
    compiled = torch.compile(model, fullgraph=True)
    out_c = compiled(x, ei, batch, num_graphs=2)
    out_e = model(x, ei, batch, num_graphs=2)
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    grads = []
    for out in (out_c, out_e):
        model.zero_grad()
        out.square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_layer_fullgraph_reference_path():
    _check_layer()


def test_layer_edge_features_fullgraph_reference_path():
    _check_layer_edge_features()


def test_layer_edge_features_fullgraph_kernel_path(stand_in_kernels):
    _check_layer_edge_features()
    assert {"fwd_scores", "bwd", "edge_dot", "edge_scatter", "edge_rows"} <= set(stand_in_kernels.calls)


def test_graph_transformer_fullgraph_reference_path():
    _check_graph_transformer()


def test_layer_fullgraph_kernel_path(stand_in_kernels):
    _check_layer()
    assert {"bsb_build", "fwd", "bwd"} <= set(stand_in_kernels.calls)


def test_graph_transformer_fullgraph_kernel_path(stand_in_kernels):
    _check_graph_transformer()
    assert stand_in_kernels.calls.count("bwd") >= 2


def test_layer_dynamic_shapes_fullgraph_kernel_path(stand_in_kernels):
    """torch.compile(dynamic=True, fullgraph=True): graphs of four sizes, as
    edge_index tensors (the plan built inside), equal eager, with no graph
    break (a node count traced as a symbolic size once broke the graph in
    the plan's checks) and no recompilation per node count (the format
    builder's op took the node count as an int, which specialised it)."""
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, edge_dim=4)
    compiled = torch.compile(conv, dynamic=True, fullgraph=True, backend="aot_eager")
    graphs = []
    for n, e in ((50, 200), (70, 300), (90, 410), (110, 520)):
        g = torch.Generator().manual_seed(n)
        ei = torch.randint(0, n, (2, e), generator=g)
        x, attr = torch.randn(n, 16, generator=g), torch.randn(e, 4, generator=g)
        torch.testing.assert_close(compiled(x, ei, attr), conv(x, ei, attr), atol=1e-5, rtol=1e-5)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[1], graphs
    plan = GraphPlan.from_edge_index(ei, n).prepare(2, 16, edge_features=True)
    torch.testing.assert_close(compiled(x, plan, attr), conv(x, ei, attr), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("edge_dim", [None, 4])
def test_layer_cached_plan_under_compile(stand_in_kernels, edge_dim):
    """Fused3SConv(cached=True) under torch.compile builds the plan of an
    edge_index once (outside the graph) and reuses it, where it was built
    inside the graph in every call; outputs and gradients equal eager."""
    ei, x = _graph(5)
    attr = torch.randn(ei.size(1), 4, generator=torch.Generator().manual_seed(6)) if edge_dim else None
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, edge_dim=edge_dim, beta=True, cached=True)
    compiled = torch.compile(conv, backend="aot_eager")
    builds = []
    for _ in range(3):
        xc = x.clone().requires_grad_()
        out_c = compiled(xc, ei, attr)
        out_c.square().sum().backward()
        builds.append(stand_in_kernels.calls.count("bsb_build"))
    assert builds[0] > 0 and builds[2] == builds[1] == builds[0], builds
    xe = x.clone().requires_grad_()
    out_e = conv(xe, ei, attr)          # eager, the same cached plan
    assert stand_in_kernels.calls.count("bsb_build") == builds[0]
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    out_e.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)
    # a plan cached by an earlier call is read without a graph break
    torch.testing.assert_close(torch.compile(conv, backend="aot_eager", fullgraph=True)(x, ei, attr),
                               out_e.detach(), atol=1e-5, rtol=1e-5)
    assert stand_in_kernels.calls.count("bsb_build") == builds[0]
    # on a tensor no call cached, fullgraph=True refuses the lookup's break (docstring)
    fresh = Fused3SConv(16, 16, heads=2, edge_dim=edge_dim, cached=True)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(fresh, backend="aot_eager", fullgraph=True)(x, ei.clone(), attr)


def test_unprepared_plan_is_prepared_outside_the_graph(stand_in_kernels, schedule_builds):
    """A plan passed in unprepared: its schedules, transposed format and
    per-edge arrays are built eagerly (stored on the plan, they outlive the
    compiled call: built by the graph, CUDA graphs would overwrite them at
    the next replay), once; a plan built inside the region builds there."""
    traced = schedule_builds
    ei, x = _graph(7)
    attr = torch.randn(ei.size(1), 4, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, edge_dim=4)
    compiled = torch.compile(conv, backend="aot_eager")
    plan = GraphPlan.from_edge_index(ei, N)
    for _ in range(3):
        xc = x.clone().requires_grad_()
        out_c = compiled(xc, plan, attr)
        out_c.square().sum().backward()
    assert traced == [False, False], traced          # forward and backward schedules, eagerly, once
    assert plan._bias_args is not None and plan._csr is not None
    xe = x.clone().requires_grad_()
    out_e = conv(xe, ei, attr)
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    out_e.square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)
    traced.clear()
    torch.compile(conv, backend="aot_eager", fullgraph=True)(x, ei, attr)   # the plan of the region
    assert traced and all(traced), traced


def test_opcheck_on_registered_ops(stand_in_kernels):
    ei, _ = _graph(2)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(N, 2, 32, generator=g).half() for _ in range(4))
    plan = GraphPlan.from_edge_index(ei, N, static=True).prepare(2, 32, edge_bias=True)
    fwd, bwd = list(plan.forward_args(2, 32)), list(plan.backward_args(2, 32))
    slots = list(plan.bias_args())
    bias = torch.randn(ei.size(1), 2, generator=g)
    out, lse = torch.ops.gt_fused3s.fwd(q, k, v, *fwd, 0.3, False)
    out_b, lse_b = torch.ops.gt_fused3s.fwd(q, k, v, *fwd, 0.3, False, bias, *slots[:3])
    bwd_graph = (fwd[1], fwd[2], fwd[4], fwd[5], *bwd)
    dst, feats = ei[1], torch.randn(ei.size(1), 4, generator=g)
    cases = [
        (torch.ops.gt_fused3s.fwd.default, (q, k, v, *fwd, 0.3, False)),
        (torch.ops.gt_fused3s.fwd.default, (q, k, v, *fwd, 0.3, False, bias, *slots[:3])),
        (torch.ops.gt_fused3s.bwd.default, (do, q, k, v, out, lse, *bwd_graph, 0.3, False)),
        (torch.ops.gt_fused3s.bwd.default, (do, q, k, v, out_b, lse_b, *bwd_graph, 0.3, False, bias, *slots)),
        (torch.ops.gt_fused3s.bsb_build.default, (ei, N)),
        (torch.ops.gt_fused3s.edge_slots.default, (ei, plan.bsb.rw_offset, plan.bsb.cols, plan.bsb.bitmap, N)),
        (torch.ops.gt_fused3s.work_schedule.default, (plan.bsb.rw_offset, plan.bsb.window_order,
                                                      *schedule.chunk_bounds(plan.bsb.tcb_capacity, 2, 32, 132),
                                                      plan.forward_args(2, 32)[4].size(0),
                                                      plan.forward_args(2, 32)[5].size(0))),
        (torch.ops.gt_fused3s.fwd_scores.default, (q, k, v, *fwd, 0.3, False, bias, *slots[:3])),
        (torch.ops.gt_fused3s.edge_probs.default, (bias, None, lse_b, ei[1].long(), 0.3)),
        (torch.ops.gt_fused3s.attention.default,       # the differentiable one
         (q.clone().requires_grad_(), k.clone().requires_grad_(), v, fwd, bwd, 0.3, torch.float16, None, None,
          [], None, 0.0, 0, None)),
        (torch.ops.gt_fused3s.attention.default,       # with a bias, returning the weights
         (q.clone().requires_grad_(), k, v, fwd, bwd, 0.3, torch.float16, None, bias.clone().requires_grad_(),
          slots, ei[1], 0.0, 0, None)),
        (torch.ops.gt_fused3s.attention.default,       # with attention dropout
         (q.clone().requires_grad_(), k, v, fwd, bwd, 0.3, torch.float16, None, None, slots, None, 0.25, 1234,
          None)),
        (torch.ops.gt_fused3s.attention.default,       # with a seed in device memory
         (q.clone().requires_grad_(), k, v, fwd, bwd, 0.3, torch.float16, None, None, slots, None, 0.25, 0,
          torch.tensor([1234]))),
        (torch.ops.gt_fused3s.fwd.default, (q, k, v, *fwd, 0.3, False, None, *slots[:3], 0.25, 1234)),
        (torch.ops.gt_fused3s.fwd.default, (q, k, v, *fwd, 0.3, False, None, *slots[:3], 0.25, 0,
                                            torch.tensor([1234]))),
        (torch.ops.gt_fused3s.edge_dot_term.default,      # the edge terms' differentiable ops
         (torch.randn(N, 2, 4, generator=g).requires_grad_(), feats.requires_grad_(), dst, *node_csr(dst, N))),
        (torch.ops.gt_fused3s.edge_scatter_term.default,
         (bias.clone().requires_grad_(), feats, dst, N, None, None)),
    ]
    for op, args in cases:
        # fwd, bwd and bsb_build have no autograd of their own (attention
        # carries it); the backward is not differentiable twice: no
        # aot_dispatch check, which would try that
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                    "test_autograd_registration"))


def test_runs_expand_per_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert parse_run("pyg@compile") == ("pyg", "compile") and parse_run("dense") == ("dense", "eager")
    assert expand_runs(["fused3s", "pyg"], cpu, eager=False, compiled_runs=True) == ["fused3s", "pyg"]
    assert expand_runs(["fused3s", "pyg"], gpu, eager=False, compiled_runs=True) == [
        "fused3s@graph", "fused3s@compile-graph", "fused3s", "pyg", "pyg@compile", "pyg@reduce-overhead"]
    assert expand_runs(["fused3s", "pyg"], gpu, eager=True, compiled_runs=False) == ["fused3s", "pyg"]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        expand_runs(["pyg@compile"], cpu, eager=False, compiled_runs=False)
    # train compiles on the CPU too; CUDA graphs (reduce-overhead's included) need a GPU
    from gt_fused3s.drivers.train import CPU_MODES
    assert expand_runs(["fused3s@compile", "pyg"], cpu, eager=False, compiled_runs=True,
                       cpu_modes=CPU_MODES) == ["fused3s@compile", "pyg"]
    for mode in ("graph", "reduce-overhead", "compile-graph"):
        with pytest.raises(ValueError, match=f"mode {mode} needs a CUDA device"):
            expand_runs([f"pyg@{mode}"], cpu, eager=False, compiled_runs=False, cpu_modes=CPU_MODES)


@pytest.mark.parametrize("kernel_path", [False, True])
def test_graph_transformer_exports(kernel_path, request):
    """torch.export of the Graph Transformer (for serving): the exported
    program, run on another graph of the same shape, equals eager; on the
    kernel path (CPU stand-ins of the ops) it holds the plan build and the
    fused op."""
    if kernel_path:
        stand_ins = request.getfixturevalue("stand_in_kernels")
    ei, x = _graph(1)
    batch = torch.arange(N) // 25
    torch.manual_seed(0)
    model = GraphTransformer(16, 32, 3, num_layers=2, heads=2, readout="graph").eval()
    program = torch.export.export(model, (x, ei, batch), kwargs={"num_graphs": 2})
    ei2, x2 = _graph(5)
    torch.testing.assert_close(program.module()(x2, ei2, batch, num_graphs=2),
                               model(x2, ei2, batch, num_graphs=2), atol=1e-5, rtol=1e-5)
    if kernel_path:
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert {"gt_fused3s.bsb_build.default", "gt_fused3s.attention.default"} <= ops, ops
        assert "fwd" in stand_ins.calls


def test_kernel_check_before_the_extension_loads_does_not_break_the_graph(monkeypatch):
    """The first compiled call on a GPU may trace the kernel check before
    the extension is loaded, whose build and load dynamo cannot trace (here
    an explicit graph break stands for them): the check runs at trace time
    and its result is a constant of the graph, so a fullgraph compile
    succeeds (it broke the graph there, for good, before)."""
    from gt_fused3s import _build, ops
    loads = []

    def load():
        torch._dynamo.graph_break()
        loads.append(1)
        return True
    monkeypatch.setattr(_build, "extension_available", load)
    monkeypatch.delenv("GT_FUSED3S_DISABLE_KERNEL", raising=False)

    def f(x):
        return x + 1 if ops.kernel_available(torch.device("cuda")) else x - 1
    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(2)), torch.ones(2))
    assert loads
