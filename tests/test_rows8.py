"""Plans of 8-row windows (``GraphPlan.from_edge_index(..., window_rows=8)``,
issue 13): the plan holds the 8-row format and its transpose, and the op
runs the 8-row ops. On the CPU, through the registered ops with their CPU
stand-ins (which decode the graph from the arrays they are given and check
the transposed format against it, so a wrong format or argument gives a
wrong result): outputs and gradients equal the reference and the 16-row
plan's on every graph case, fp32 inputs and padded head dims included,
with a reordering too; what the 8-row kernels do not take is refused with
a clear error. The kernels themselves: tests/test_rows8_cuda.py."""
from __future__ import annotations

import warnings

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.edge_terms import edge_feature_attention
from gt_fused3s.graph8 import BSBGraph8
from gt_fused3s.plan import ROWS8_WARN_BLOCKS
from gt_fused3s.reference import attention_reference
from graph_cases import GRAPH_CASES

H = 2


def _inputs(n, D, dtype=torch.float16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g).to(dtype) for _ in range(4)]


def _grads(graph, q, k, v, do, scale=0.3):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused3s_attention(*leaves, graph, scale)
    out.backward(do)
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("name", list(GRAPH_CASES))
def test_rows8_plan_equals_reference_and_16_row_plan(stand_in_kernels, name):
    ei, n = GRAPH_CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # a hub's long window (heavy_node, split_hubs)
        plan = GraphPlan.from_edge_index(ei, n, window_rows=8).prepare(H, 32)
    assert plan.window_rows == 8 and isinstance(plan.bsb, BSBGraph8)
    assert isinstance(plan.transposed, BSBGraph8)
    assert torch.equal(plan.edge_index, ei)
    q, k, v, do = _inputs(n, 32)
    stand_in_kernels.calls.clear()
    out, grads = _grads(plan, q, k, v, do)
    assert stand_in_kernels.calls == ["fwd8", "bwd8"]
    plain_out, plain_grads = _grads(GraphPlan.from_edge_index(ei, n), q, k, v, do)
    torch.testing.assert_close(out, plain_out)
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, ei, 0.3)
    ref.backward(do.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)   # fp16 rounding
    for g, r in zip(grads, leaves):
        torch.testing.assert_close(g.float(), r.grad, atol=2e-3, rtol=2e-3)
    # no gradient wanted: the forward op alone, on the fast path
    stand_in_kernels.calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(fused3s_attention(q, k, v, plan, 0.3), out)
    assert stand_in_kernels.calls == ["fwd8"]


@pytest.mark.parametrize("D", [24, 64])
def test_rows8_casts_and_pads_like_the_16_row_path(stand_in_kernels, D):
    """fp32 inputs (computed in fp16, fp32 gradients) and a head dim padded
    to the next compiled one take the same wrappers as the 16-row ops."""
    ei, n = GRAPH_CASES["random_1003"]()
    q, k, v, do = _inputs(n, D, torch.float32)
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8)
    out, grads = _grads(plan, q, k, v, do)
    plain_out, plain_grads = _grads(GraphPlan.from_edge_index(ei, n), q, k, v, do)
    assert out.dtype == torch.float32 and out.shape == (n, H, D)
    torch.testing.assert_close(out, plain_out)
    for g, p in zip(grads, plain_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, p)


def test_rows8_plan_with_a_reordering(stand_in_kernels):
    ei, n = GRAPH_CASES["random_1003"]()
    q, k, v, do = _inputs(n, 32)
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8, reorder="cuthill_mckee")
    assert plan.order is not None and plan.window_rows == 8
    out, grads = _grads(plan, q, k, v, do)
    plain_out, plain_grads = _grads(GraphPlan.from_edge_index(ei, n), q, k, v, do)
    torch.testing.assert_close(out, plain_out)
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p)


def test_rows8_refuses_what_its_kernels_do_not_take(stand_in_kernels):
    ei, n = GRAPH_CASES["random_1003"]()
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8)
    q, k, v, _ = _inputs(n, 32)
    E = ei.size(1)
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        fused3s_attention(q, k, v, plan, edge_bias=torch.zeros(E, H))
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        fused3s_attention(q, k, v, plan, return_weights=True)
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        fused3s_attention(q, k, v, plan, dropout_p=0.1)
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        edge_feature_attention(q, k, v, plan, torch.zeros(E, 4), torch.zeros(H, 32, 4), 0.3)
    from gt_fused3s.nn.pyg import Fused3SConv
    conv = Fused3SConv(8, 32, heads=H, dropout=0.1)
    x = torch.randn(n, 8)
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        conv(x, plan)                                      # training: attention dropout
    conv.eval()
    with pytest.raises(ValueError, match="8-row plan .* runs plain attention"):
        conv(x, plan, return_attention_weights=True)
    assert conv(x, plan).shape == (n, H * 32)
    with pytest.raises(ValueError, match="head dims up to 128"):
        fused3s_attention(*_inputs(n, 256)[:3], plan)
    with pytest.raises(ValueError, match="window_rows must be 16, 8 or 'auto'"):
        GraphPlan.from_edge_index(ei, n, window_rows=4)
    with pytest.raises(ValueError, match="static build needs num_nodes"):
        GraphPlan.from_edge_index(ei, window_rows=8, static=True)
    with pytest.raises(ValueError, match="host synchronisations"):
        GraphPlan.from_edge_index(ei, n, window_rows=8, static=True, reorder="cuthill_mckee")
    with pytest.raises(ValueError, match="every node as a destination"):
        GraphPlan.from_edge_index(ei, n, window_rows=8, num_rows=n - 1)


@pytest.mark.parametrize("name", ["random_1003", "duplicates", "no_edges", "heavy_node", "empty_rows"])
def test_static_8_row_build_equals_the_exact_one(stand_in_kernels, name):
    """Static: cols / bitmap at capacity (unused blocks -1 / 0 at the end),
    everything else as the exact build; a plan on it gives the same results
    (the stand-ins decode only the blocks the windows list)."""
    from gt_fused3s.graph8 import block_capacity8
    ei, n = GRAPH_CASES[name]()
    exact = BSBGraph8.from_edge_index(ei, n)
    static = BSBGraph8.from_edge_index(ei, n, static=True)
    T, E = exact.num_tcbs, ei.size(1)
    cap = block_capacity8(E, n)
    assert static.static and static.bitmap.shape == (cap, 2) and cap >= T and static.num_tcbs == T
    for a in ("rw_offset", "window_order", "edge_index"):
        assert torch.equal(getattr(static, a), getattr(exact, a)), a
    assert torch.equal(static.cols[:16 * T], exact.cols) and bool((static.cols[16 * T:] == -1).all())
    assert torch.equal(static.bitmap[:T], exact.bitmap) and bool((static.bitmap[T:] == 0).all())
    assert torch.equal(static.decode_edges(), exact.decode_edges())
    assert static.stats(64) == exact.stats(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plans = [GraphPlan.from_edge_index(ei, n, window_rows=8, static=s).prepare(H, 32) for s in (False, True)]
    assert plans[1].static and plans[1].transposed.static
    q, k, v, do = _inputs(n, 32)
    (o0, g0), (o1, g1) = (_grads(p, q, k, v, do) for p in plans)
    torch.testing.assert_close(o1, o0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b)


def test_block_capacity8_bounds_every_graph_of_its_counts():
    """The capacity against the worst graphs of given counts: every edge in
    its own window, every window's columns just past a block boundary."""
    from gt_fused3s.graph8 import block_capacity8
    g = torch.Generator().manual_seed(0)
    for n, e in ((8, 17), (1000, 999), (1000, 4000), (33, 0), (1, 5)):
        cases = [torch.randint(0, n, (2, e), generator=g)]
        # 17 distinct sources into each window's first row: 2 blocks a window
        per = torch.arange(e) // 17
        cases.append(torch.stack([torch.arange(e) % n, (per * 8) % n]))
        for ei in cases:
            assert BSBGraph8.from_edge_index(ei, n).num_tcbs <= block_capacity8(e, n)


def test_rows8_warns_where_one_warp_walks_a_long_window():
    n = 2000
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])   # node 0 sees every node
    with pytest.warns(RuntimeWarning, match="holds 125 blocks"):
        GraphPlan.from_edge_index(hub, n, window_rows=8)
    assert (n - 1 + 15) // 16 > ROWS8_WARN_BLOCKS
    small = hub[:, :16 * ROWS8_WARN_BLOCKS]              # exactly the threshold: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GraphPlan.from_edge_index(small, n, window_rows=8)


def test_auto_picks_8_rows_where_every_window_is_short():
    ei, n = GRAPH_CASES["random_1003"]()
    assert GraphPlan.from_edge_index(ei, n, window_rows="auto").window_rows == 8
    n = 2000                                             # a hub: 125 blocks in one window
    hub = torch.stack([torch.arange(1, n), torch.zeros(n - 1, dtype=torch.long)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # auto does not warn: it takes 16 rows
        plan = GraphPlan.from_edge_index(hub, n, window_rows="auto", reorder="cuthill_mckee")
    assert plan.window_rows == 16 and plan.order is not None
    assert GraphPlan.from_edge_index(ei, 1003, window_rows="auto", static=True).window_rows == 16
    assert GraphPlan.from_edge_index(ei, 1003, window_rows="auto", num_rows=1003).window_rows == 16
    assert GraphPlan.from_edge_index(ei, 1003).window_rows == 16       # the default


def test_rows8_plan_moves_between_devices_and_reprs():
    ei, n = GRAPH_CASES["random_1003"]()
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8)
    assert plan.to("cpu") is plan
    assert "BSBGraph8" in repr(plan)
    assert plan.bsb.to("cpu") is plan.bsb


def test_rows8_ops_pass_opcheck(stand_in_kernels):
    ei, n = GRAPH_CASES["duplicates"]()
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8).prepare(H, 32)
    q, k, v, do = _inputs(n, 32)
    fwd, bwd = plan.forward_args(H, 32), plan.backward_args(H, 32)
    out, lse = torch.ops.gt_fused3s.fwd8(q, k, v, *fwd, 0.3, False)
    for op, args in ((torch.ops.gt_fused3s.fwd8.default, (q, k, v, *fwd, 0.3, False)),
                     (torch.ops.gt_fused3s.fwd8.default, (q, k, v, *fwd, 0.3, True)),
                     (torch.ops.gt_fused3s.bwd8.default, (do, q, k, v, out, lse, *fwd, *bwd, 0.3, False))):
        torch.library.opcheck(op, args)


def test_bench_rows8_table_and_cli_refusal(capsys):
    """The benchmark's table from a row (the run itself needs a GPU: its
    numbers are in the README), and the CLI's clear refusal without one."""
    import os
    import subprocess
    import sys
    from gt_fused3s.bench.rows8 import format_rows8_table
    row = {"graph": "zinc", "setting": "d128h1fp16", "blocks": 4480, "blocks_8": 2972, "mma_fwd": 94624,
           "mma_fwd_8": 47552, "fwd_kernel_ms": 0.0163, "fwd_kernel_ms_8": 0.0152, "fwd_speedup": 1.07,
           "bwd_kernel_ms": 0.0437, "bwd_kernel_ms_8": 0.0291, "bwd_speedup": 1.5, "model_rows": 8, "auto_rows": 8}
    table = format_rows8_table([row, {"graph": "cora", "setting": "d64h8bf16"}])
    assert "| zinc | d128h1fp16 | 4480 / 2972 | 0.50 | 16.3 / 15.2 | 1.07 | 43.7 / 29.1 | 1.50 | - / - | - | 8 / 8 |" in table
    assert "| cora | d64h8bf16 | - / - | - | - / - | - |" in table and table.endswith("| - / - |")
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_kernel.py")
    r = subprocess.run([sys.executable, script, "--model-step"], capture_output=True, text=True)
    assert r.returncode == 2 and "--model-step needs --window-rows 8" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, script, "--window-rows", "8"], capture_output=True, text=True)
        assert r.returncode == 2 and "--window-rows needs a CUDA GPU" in r.stderr


def test_rows8_layer_under_torch_compile(stand_in_kernels):
    """Fused3SConv on a prepared 8-row plan, compiled with fullgraph=True
    (the ops' fakes and the compiled op's autograd), equals the layer on
    the edge list eagerly, outputs and input gradients."""
    from gt_fused3s.nn.pyg import Fused3SConv
    ei, n = GRAPH_CASES["duplicates"]()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, 16, generator=g)
    torch.manual_seed(0)
    conv = Fused3SConv(16, 16, heads=2, beta=True)
    plan = GraphPlan.from_edge_index(ei, n, window_rows=8).prepare(2, 16)
    compiled = torch.compile(conv, fullgraph=True)
    xc, xe = (x.clone().requires_grad_() for _ in range(2))
    stand_in_kernels.calls.clear()
    out_c, out_e = compiled(xc, plan), conv(xe, ei)
    assert "fwd8" in stand_in_kernels.calls
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    out_c.square().sum().backward()
    out_e.square().sum().backward()
    assert "bwd8" in stand_in_kernels.calls
    torch.testing.assert_close(xc.grad, xe.grad, atol=1e-4, rtol=1e-4)
