"""The fused CUDA kernel against the fp32 reference (run on the GPU machine).

Tolerance (FlashAttention's rule): the kernel's max abs error against the fp32
reference is at most twice the error of the reference computed in the same low
precision (``attention_reference(..., compute_dtype=fp16/bf16)``) plus 1e-3.

Every test needs a CUDA GPU and the compiled extension; without a GPU the
module is skipped; with a GPU, a failed build is an error (never a silent
fallback to the reference path).
"""
from __future__ import annotations

import math
import re

import pytest
import torch

from gt_fused3s import BSBGraph, GraphPlan, fused3s_attention
from gt_fused3s.reference import attention_reference

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES

pytestmark = GPU_TESTS

DEV = "cuda"


# ----------------------------------------------------------------- helpers
def _qkv(n, h, d, dtype, seed=0, scale_q=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=g, device=DEV) for _ in range(3))
    return (q * scale_q).to(dtype), k.to(dtype), v.to(dtype)


def _poison_allocator(n, h, d, dtype):
    """Leave a NaN-filled block of the output's size in the caching allocator,
    so that an output element the kernel forgets to write shows up as NaN."""
    for dt in {dtype, torch.float32}:
        torch.full((n, h, d), float("nan"), dtype=dt, device=DEV)
    torch.full((n, h), float("nan"), dtype=torch.float32, device=DEV)


def _check(q, k, v, bsb, scale=None, out_dtype=None, label=""):
    """Kernel output vs fp32 reference, tolerance from the low-precision reference."""
    N, H, D = q.shape
    low = q.dtype
    _poison_allocator(N, H, D, out_dtype or low)
    out = fused3s_attention(q, k, v, bsb, scale, out_dtype=out_dtype)
    ref = attention_reference(q, k, v, bsb.edge_index, scale, out_dtype=torch.float32)
    ref_low = attention_reference(q, k, v, bsb.edge_index, scale, compute_dtype=low,
                                  out_dtype=out_dtype or low).float()
    assert out.shape == (N, H, D)
    assert out.dtype == (out_dtype or low)
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    err_low = (ref_low - ref).abs().max().item() if out.numel() else 0.0
    tol = 2 * err_low + 1e-3
    assert err <= tol, f"{label}: max err {err:.3e} > tol {tol:.3e} (low-precision ref err {err_low:.3e})"
    return out, err, err_low


def _graph(name):
    ei, n = GRAPH_CASES[name]()
    return BSBGraph.from_edge_index(ei.to(DEV), n)


def _random_graph(n, e, seed, extra_src=None, extra_dst=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=g, device=DEV)
    dst = torch.randint(0, n, (e,), generator=g, device=DEV)
    if extra_src is not None:
        src, dst = torch.cat([src, extra_src]), torch.cat([dst, extra_dst])
    return BSBGraph.from_edge_index(torch.stack([src, dst]), n)


def _hub_graph(n=25_000, hub=12_345, degree=20_000, seed=7):
    """A node with `degree` distinct in-neighbours (heavy row window, split)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    nbrs = torch.randperm(n, generator=g, device=DEV)[:degree]
    return _random_graph(n, 3 * n, seed, nbrs, torch.full_like(nbrs, hub))


# ------------------------------------------------------------ graph cases
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases(name, dtype):
    bsb = _graph(name)
    for h, d in ((1, 64), (4, 32)):
        _check(*_qkv(bsb.num_nodes, h, d, LOW[dtype], seed=h), bsb, label=f"{name} H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256, 24, 40, 8])
@pytest.mark.parametrize("h", [1, 4])
def test_head_dims_and_heads(h, d, dtype):
    # N = 1003 with a node of in-degree ~600 (its window is split) and empty rows.
    n = 1003
    hub_src = torch.arange(0, n, device=DEV)[::2][:600]
    bsb = _random_graph(n, 3 * n, seed=11, extra_src=hub_src, extra_dst=torch.full_like(hub_src, 17))
    _check(*_qkv(n, h, d, LOW[dtype], seed=d + h), bsb, label=f"H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_node_with_20000_neighbours(dtype):
    bsb = _hub_graph()
    for h, d in ((1, 128), (4, 64), (2, 256)):
        _check(*_qkv(bsb.num_nodes, h, d, LOW[dtype], seed=h), bsb, label=f"hub H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_n_16k_plus_1(dtype):
    n = 16 * 1000 + 1
    bsb = _random_graph(n, 8 * n, seed=3)
    _check(*_qkv(n, 4, 32, LOW[dtype], seed=5), bsb, label="N=16k+1")
    # The last row alone in its window.
    src = torch.tensor([0, n - 1, 5], device=DEV)
    dst = torch.tensor([n - 1, n - 1, n - 1], device=DEV)
    bsb1 = BSBGraph.from_edge_index(torch.stack([src, dst]), n)
    _check(*_qkv(n, 1, 128, LOW[dtype], seed=6), bsb1, label="N=16k+1 last row only")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_duplicates_and_self_loops(dtype):
    n = 500
    g = torch.Generator(device=DEV).manual_seed(9)
    src = torch.randint(0, n, (4 * n,), generator=g, device=DEV)
    dst = torch.randint(0, n, (4 * n,), generator=g, device=DEV)
    i = torch.arange(n, device=DEV)
    src = torch.cat([src, src, src[:100], i])       # duplicates x2, x3, self loops
    dst = torch.cat([dst, dst, dst[:100], i])
    bsb = BSBGraph.from_edge_index(torch.stack([src, dst]), n)
    assert bsb.num_duplicates >= 4 * n
    _check(*_qkv(n, 4, 64, LOW[dtype], seed=1), bsb, label="dups+loops")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_huge_logits_both_signs(dtype):
    n, h, d = 2000, 2, 64
    hub = torch.arange(0, n, 3, device=DEV)
    bsb = _random_graph(n, 6 * n, seed=4, extra_src=hub, extra_dst=torch.full_like(hub, 100))
    q, k, v = _qkv(n, h, d, LOW[dtype], seed=2)
    # scale * <q, k> ~ N(0, 1e3^2): logits of magnitude 1e3, both signs.
    _check(q, k, v, bsb, scale=1e3 / math.sqrt(d), label="logits +-1e3")
    # All logits near -1e3 (a max started at 0 would underflow every exp).
    qa, ka = q.float().abs(), -k.float().abs()
    _check(qa.to(q.dtype), ka.to(q.dtype), v, bsb, scale=1e3 / (0.64 * d), label="logits ~ -1e3")
    # All logits near +1e3.
    _check(qa.to(q.dtype), (-ka).to(q.dtype), v, bsb, scale=1e3 / (0.64 * d), label="logits ~ +1e3")


def test_single_node_and_empty_graphs():
    for n, ei in ((1, [[0], [0]]), (1, [[], []]), (17, [[], []]), (16, [[3], [15]])):
        bsb = BSBGraph.from_edge_index(torch.tensor(ei, dtype=torch.long, device=DEV).view(2, -1), n)
        out, _, _ = _check(*_qkv(n, 2, 32, torch.float16), bsb, label=f"n={n} e={len(ei[0])}")
        if not ei[0]:
            assert (out == 0).all()


def test_fp32_inputs_out_dtype_and_strides(ops):
    bsb = _graph("random_1003")
    n, h, d = bsb.num_nodes, 4, 64
    qkv = torch.randn(n, 3, h, d, device=DEV)          # fused projection: strided q, k, v
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous()
    ref = attention_reference(q, k, v, bsb.edge_index)
    for cdt in (torch.float16, torch.bfloat16):
        out = fused3s_attention(q, k, v, bsb, compute_dtype=cdt)
        assert out.dtype == torch.float32
        low = attention_reference(q, k, v, bsb.edge_index, compute_dtype=cdt, out_dtype=torch.float32)
        assert (out - ref).abs().max() <= 2 * (low - ref).abs().max() + 1e-3
    # Strided fp16 views give bit-identical results to contiguous copies.
    qh, kh, vh = qkv.half().unbind(1)
    a = fused3s_attention(qh, kh, vh, bsb)
    b = fused3s_attention(qh.contiguous(), kh.contiguous(), vh.contiguous(), bsb)
    assert torch.equal(a, b)
    # out_dtype fp32 from fp16 inputs: fp32 output straight from the kernel.
    out32, _, _ = _check(qh.contiguous(), kh.contiguous(), vh.contiguous(), bsb, out_dtype=torch.float32)
    assert (out32.half() - a).abs().max() <= 1e-3


def test_lse_and_determinism(ops):
    bsb = _hub_graph(n=5000, hub=77, degree=3000)      # includes a split window
    n, h, d = bsb.num_nodes, 2, 64
    q, k, v = _qkv(n, h, d, torch.float16, seed=3)
    scale = 1 / math.sqrt(d)
    fwd_args = GraphPlan(bsb).forward_args(h, d)
    assert fwd_args[5].size(0) > 0, "the hub window should be split"
    args = (q, k, v, *fwd_args, scale, False)
    out1, lse1 = ops.fwd(*args)
    out2, lse2 = ops.fwd(*args)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)   # no race, no order dependence
    src, dst = bsb.edge_index
    s = (q.float()[dst] * k.float()[src]).sum(-1) * scale          # [E, H]
    mx = torch.full((n, h), float("-inf"), device=DEV).scatter_reduce(
        0, dst[:, None].expand_as(s), s, "amax")
    se = torch.zeros(n, h, device=DEV).index_add(0, dst, torch.exp(s - mx[dst]))
    lse_ref = mx + torch.log(se)                                   # -inf for empty rows
    empty = torch.isinf(lse_ref)
    assert empty.any() and torch.equal(torch.isinf(lse1), empty)
    assert (lse1[empty] < 0).all()
    assert (lse1[~empty] - lse_ref[~empty]).abs().max() < 1e-3


def test_real_graphs():
    from gt_fused3s.bench.kernel import load_graph, available_graphs
    names = available_graphs()
    if not names:
        pytest.skip("no graph data (../shared/data, .data/ or $GT_FUSED3S_DATA)")
    cases = {"cora": [("fp16", 1, 128), ("bf16", 4, 32)], "citeseer": [("bf16", 1, 128), ("fp16", 4, 16)],
             "pubmed": [("fp16", 1, 128), ("bf16", 4, 64)], "github": [("fp16", 1, 128), ("bf16", 4, 32)],
             "molhiv": [("fp16", 1, 128), ("bf16", 8, 32)], "zinc": [("bf16", 1, 128), ("fp16", 4, 64)],
             "peptides": [("fp16", 1, 64), ("bf16", 4, 32)]}
    seen = []
    for name in names:
        ei, n = load_graph(name, DEV, batch=256)
        bsb = BSBGraph.from_edge_index(ei, n)
        for dt, h, d in cases.get(name, [("fp16", 1, 64)]):
            _, err, err_low = _check(*_qkv(n, h, d, LOW[dt], seed=h * d), bsb, label=f"{name} {dt} H={h} D={d}")
            seen.append((name, dt, h, d, err, err_low))
    for row in seen:
        print("real graph %-9s %s H=%d D=%3d  err %.2e  (low-precision ref err %.2e)" % row)
    assert {"cora", "github"} <= set(names) or len(seen) > 0


def test_gpu_bsb_build_equals_cpu_build():
    from gt_fused3s.bench.kernel import load_graph, available_graphs
    graphs = [GRAPH_CASES[nm]() for nm in sorted(GRAPH_CASES)]
    hub = _hub_graph(n=3000, hub=5, degree=2500)
    graphs.append((hub.edge_index.cpu(), hub.num_nodes))
    for name in [nm for nm in ("cora", "zinc") if nm in available_graphs()]:
        ei, n = load_graph(name, "cpu", batch=1024)
        graphs.append((ei, n))
    for ei, n in graphs:
        a = BSBGraph.from_edge_index(ei.cpu(), n)
        b = BSBGraph.from_edge_index(ei.to(DEV), n)
        assert b.rw_offset.is_cuda
        for field in ("rw_offset", "cols", "bitmap", "window_order", "edge_index", "counters"):
            x, y = getattr(a, field), getattr(b, field).cpu()
            assert x.dtype == y.dtype and torch.equal(x, y), f"{field} differs (N={n})"
        assert a.num_duplicates == b.num_duplicates
        # static mode: the same arrays at capacity, padding after the first T TCBs
        c = BSBGraph.from_edge_index(ei.to(DEV), n, static=True)
        T = a.num_tcbs
        assert c.static and c.counters.is_cuda and c.tcb_capacity == ei.size(1) // 8 + (n + 15) // 16 + 1
        assert torch.equal(c.cols[:T * 8].cpu(), a.cols) and torch.equal(c.bitmap[:T].cpu(), a.bitmap)
        assert (c.cols[T * 8:] == -1).all() and (c.bitmap[T:] == 0).all()
        for field in ("rw_offset", "window_order", "edge_index", "counters"):
            assert torch.equal(getattr(c, field).cpu(), getattr(a, field)), f"static {field} differs (N={n})"


# ------------------------------------------------------------- bad inputs
def _op_args(n=40, h=2, d=32, dtype=torch.float16):
    bsb = _random_graph(n, 4 * n, seed=0)
    q, k, v = _qkv(n, h, d, dtype)
    return [q, k, v, *GraphPlan(bsb).forward_args(h, d), 0.1, False]


def test_bad_inputs_through_the_op(ops):
    args = _op_args()
    q = args[0]

    def call(i, value, match):
        a = list(args)
        for j, x in (value.items() if isinstance(value, dict) else [(i, value)]):
            a[j] = x
        with pytest.raises((RuntimeError, ValueError), match=match):
            ops.fwd(*a)
        torch.cuda.synchronize()    # and nothing asynchronous went wrong

    call(0, {0: q.double(), 1: args[1].double(), 2: args[2].double()},
         r"q must be fp16 or bf16 \(got float64\)")
    call(1, args[1].bfloat16(), "k must have the dtype of q")
    call(2, args[2].cpu(), "v must be on the device of q")
    call(3, args[3].cpu(), "rw_offset must be on the device of q")
    call(1, args[1][:, :, :16], r"k must have shape \[40, 2, 32\] \(got \[40, 2, 16\]\)")
    call(0, {0: torch.cat([q, q])}, "q has 80 rows, more than the 40 nodes of k and v")
    # a strided last dim is copied by the binding, not refused
    qt = torch.randn(q.size(0), q.size(1), 2 * q.size(2), device=DEV).half()[..., ::2]
    assert torch.equal(ops.fwd(qt, *args[1:])[0], ops.fwd(qt.contiguous(), *args[1:])[0])
    call(0, {j: args[j][..., :24].contiguous() for j in range(3)}, "head dim D must be 16, 32, 64, 128 or 256")
    call(3, args[3].long(), r"rw_offset must be int32 \(got int64\)")
    call(5, args[5].int(), r"bitmap must be int64 \(got int32\)")
    other = _random_graph(100, 400, seed=1)
    call(3, other.rw_offset, "the BSB was built for another graph")
    call(6, other.window_order, "the BSB was built for another graph")
    call(4, args[4][:-8], "cols must have 8 \\* T")
    call(7, args[7][:, :3].contiguous(), "items must have shape")
    call(8, args[8][:, :3].contiguous(), "slots must have shape")
    call(7, args[7][:2].contiguous(), "the schedule was built for another graph")
    call(9, float("nan"), "scale must be finite")
    # Still fine after all that.
    out, lse = ops.fwd(*args)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def test_bad_inputs_through_the_api():
    bsb = _random_graph(40, 160, seed=0)
    q, k, v = _qkv(40, 2, 32, torch.float16)
    with pytest.raises((RuntimeError, ValueError), match="fp16, bf16 or fp32"):
        fused3s_attention(q.double(), k.double(), v.double(), bsb)
    with pytest.raises((RuntimeError, ValueError), match="device"):
        fused3s_attention(q, k.cpu(), v, bsb)
    with pytest.raises(ValueError, match="multiple of 8"):
        fused3s_attention(q[..., :20], k[..., :20], v[..., :20], bsb)
    with pytest.raises(ValueError, match="built for num_nodes=40"):
        fused3s_attention(q[:39], k[:39], v[:39], bsb)
    # A non-contiguous last dim is copied by the API, not refused.
    qt = torch.randn(40, 2, 64, device=DEV).half()[..., ::2]
    out = fused3s_attention(qt, k, v, bsb)
    torch.testing.assert_close(out, fused3s_attention(qt.contiguous(), k, v, bsb), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_static_plan_equals_exact_plan(dtype):
    """A plan built at capacity (schedule with unused items, split windows
    included) gives the exact plan's outputs, forward and backward."""
    bsb = _hub_graph(n=5000, hub=77, degree=3000)
    ei, n = bsb.edge_index, bsb.num_nodes
    ei = torch.cat([ei, ei[:, :300]], 1)                          # + duplicates
    exact = GraphPlan.from_edge_index(ei, n)
    static = GraphPlan.from_edge_index(ei, n, static=True)
    h, d = 2, 64
    items = static.forward_args(h, d)[4]
    assert static.static and (items[:, 0] < 0).any(), "a static schedule has unused items"
    q, k, v = _qkv(n, h, d, LOW[dtype], seed=4)
    do = torch.randn_like(q)
    outs = []
    for plan in (exact, static):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fused3s_attention(*leaves, plan)
        outs.append([out, *torch.autograd.grad(out, leaves, do)])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    _check(q, k, v, static, label="static plan")


# ------------------------------------------------------------- head groups
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("h, d", [(2, 16), (4, 16), (8, 16), (6, 16), (2, 32), (4, 32), (6, 32), (3, 16)])
def test_head_groups_equal_a_head_a_warp(h, d, dtype, monkeypatch):
    """A warp running 2 or 4 heads (head dims 16, 32) computes each head as a
    warp of its own does: out, lse and the gradients of q, k, v bit for bit,
    with a split window, with heads adjacent in memory and not (every other
    head of a wider tensor: the kernels then run a head a warp), with an
    fp32 output; and the forward equals the reference."""
    bsb = _hub_graph(n=5000, hub=77, degree=3000)      # includes a split window
    n = bsb.num_nodes
    plan = GraphPlan(bsb)
    g = torch.Generator(device=DEV).manual_seed(h * d)
    wide = [torch.randn(n, 2 * h, d, generator=g, device=DEV).to(LOW[dtype]) for _ in range(4)]
    for layout in ("adjacent", "strided"):
        q, k, v, do = ([x[:, :h].contiguous() for x in wide] if layout == "adjacent" else [x[:, ::2] for x in wide])
        _check(q, k, v, bsb, label=f"groups H={h} D={d} {layout}")
        for out_dtype in (None, torch.float32):
            res = {}
            for env in (None, "1"):
                if env is None:
                    monkeypatch.delenv("GT_FUSED3S_HEAD_GROUP", raising=False)
                else:
                    monkeypatch.setenv("GT_FUSED3S_HEAD_GROUP", env)
                qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
                out = fused3s_attention(qq, kk, vv, plan, out_dtype=out_dtype)
                out.backward(do.to(out.dtype))
                lse = torch.ops.gt_fused3s.fwd(q, k, v, *plan.forward_args(h, d), 1 / math.sqrt(d), False)[1]
                res[env] = (out, lse, qq.grad, kk.grad, vv.grad)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res[None], res["1"]):
                assert torch.equal(a, b), f"H={h} D={d} {layout} out_dtype={out_dtype}: {name}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("h, d", [(4, 16), (8, 16), (2, 16), (4, 32), (2, 32)])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_head_groups_with_edge_terms(h, d, dropout, dtype, monkeypatch):
    """The edge terms in head groups (each non-zero's kG values in one access,
    placed once for the group): output, returned weights and the gradients
    of q, k, v and the bias bit for bit equal to a head a warp, with dropout
    (its mask keyed by each head), a split window and duplicate edges; with
    a gradient of the weights too, equal up to the rounding of its share of
    delta (``ops.weights_delta``: an index_add, whose atomic order varies
    from run to run); and a bias not aligned for a vector access (a view one
    float into its storage) runs a head a warp, equally."""
    bsb = _hub_graph(n=5000, hub=77, degree=3000)
    ei = torch.cat([bsb.edge_index, bsb.edge_index[:, :500]], 1)      # 500 duplicated edges
    n, E = bsb.num_nodes, ei.size(1)
    plan = GraphPlan.from_edge_index(ei, n)
    g = torch.Generator(device=DEV).manual_seed(h * d + 1)
    q, k, v, do = (torch.randn(n, h, d, generator=g, device=DEV).to(LOW[dtype]) for _ in range(4))
    store = torch.randn(E * h + 1, generator=g, device=DEV)
    dw = torch.randn(E, h, generator=g, device=DEV)
    for bias in (store[:-1].view(E, h), store[1:].view(E, h)):        # aligned, then one float off
        for weights_grad in (False, True):
            res = {}
            for env in ("4", "1"):
                monkeypatch.setenv("GT_FUSED3S_HEAD_GROUP", env)
                leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
                drop = dict(dropout_p=dropout, dropout_seed=1234) if dropout else {}
                out, w = fused3s_attention(*leaves[:3], plan, edge_bias=leaves[3], return_weights=True, **drop)
                torch.autograd.backward([out, w] if weights_grad else [out], [do, dw] if weights_grad else [do])
                res[env] = (out, w, *(t.grad for t in leaves))
            for name, a, b in zip(("out", "weights", "dq", "dk", "dv", "dbias"), res["4"], res["1"]):
                label = f"H={h} D={d} dropout={dropout} weights_grad={weights_grad}: {name}"
                if weights_grad and name in ("dq", "dk", "dbias"):
                    tol = 1e-5 if name == "dbias" else 2e-2
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=label)
                else:
                    assert torch.equal(a, b), label


def test_head_groups_are_chosen_where_they_pay():
    """The launch rule (bindings.cpp: head_group, on a GPU of 100-160 SMs):
    groups of 4 for a batch of small molecule-like graphs at 4 heads of 16
    (of 2 with an edge bias), of 2 at 8 heads of 32; for a 30k-node random
    graph groups at 8 heads (two groups an item), not at 4; a head a warp for
    a small citation-like graph and at head dim 64 (the profiler's kernel
    names carry the group as the last template argument)."""
    from torch.profiler import ProfilerActivity, profile

    def groups(ei, n, h, d, bias=False):
        """The head group (last template argument) of each fused kernel of a forward + backward."""
        plan = GraphPlan.from_edge_index(ei, n)
        q, k, v = _qkv(n, h, d, torch.float16)
        q.requires_grad_(True)
        b = torch.randn(ei.size(1), h, device=DEV) if bias else None
        fused3s_attention(q, k, v, plan, edge_bias=b).sum().backward()   # warm up (the build, the schedules)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fused3s_attention(q, k, v, plan, edge_bias=b).sum().backward()
            torch.cuda.synchronize()
        found = [re.search(r"fused3s_(?:fwd|bwd)_kernel<(.*?)>", e.name) for e in prof.events()]
        found = [int(m.group(1).split(",")[-1]) for m in found if m]
        assert len(found) >= 3, "the forward and both backward passes"
        return set(found)

    # 2000 rings of 12 nodes: 2 in-edges a node, a few TCBs a window
    ring = torch.arange(12, device=DEV)
    src = torch.cat([ring, (ring + 1) % 12])
    dst = torch.cat([(ring + 1) % 12, ring])
    off = 12 * torch.arange(2000, device=DEV).repeat_interleave(src.numel())
    mol = (torch.stack([src.repeat(2000), dst.repeat(2000)]) + off, 24000)
    citation = (_random_graph(3000, 12000, seed=5).edge_index, 3000)   # ~8 TCBs a window, 190 windows
    bigger = (_random_graph(30000, 120000, seed=6).edge_index, 30000)  # ~15k TCBs
    assert groups(*mol, 4, 16) == {4}
    assert groups(*mol, 4, 16, bias=True) == {2}
    assert groups(*mol, 8, 32) == {2}
    assert groups(*citation, 4, 16) == {1}
    assert groups(*citation, 8, 32) == {1}
    assert groups(*bigger, 8, 16) == {4}
    assert groups(*bigger, 4, 16) == {1}
    assert groups(*mol, 4, 64) == {1}
