"""The fused backward kernels against the fp32 reference's gradients (run on
the GPU machine).

Tolerance, per gradient (as for the forward): the max abs error of dq, dk, dv
against the fp32 reference's gradients is at most twice the error of the
gradients of the reference computed in the same low precision, plus 1e-3
times the gradient's largest magnitude (gradients are sums over up to 20,000
edges, so an absolute floor must scale with them).
"""
from __future__ import annotations

import math

import pytest
import torch

from gt_fused3s import BSBGraph, fused3s_attention
from gt_fused3s.reference import attention_reference

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES

pytestmark = GPU_TESTS

DEV = "cuda"


def _qkv(n, h, d, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v, do = (torch.randn(n, h, d, generator=g, device=DEV) for _ in range(4))
    return q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype)


def _reference_grads(q, k, v, do, edge_index, scale, compute_dtype):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*leaves, edge_index, scale, compute_dtype=compute_dtype, out_dtype=torch.float32)
    return torch.autograd.grad(out, leaves, do.float())


def _check_grads(q, k, v, do, bsb, scale=None, label=""):
    """Kernel gradients vs fp32 reference gradients; returns the errors."""
    N, H, D = q.shape
    scale = 1 / math.sqrt(D) if scale is None else scale
    for dt in {q.dtype, torch.float32}:        # NaN-filled blocks: unwritten output shows up
        torch.full((3, N, H, D), float("nan"), dtype=dt, device=DEV)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fused3s_attention(*leaves, bsb, scale)
    out.backward(do)
    ref = _reference_grads(q, k, v, do, bsb.edge_index, scale, torch.float32)
    low = _reference_grads(q, k, v, do, bsb.edge_index, scale, q.dtype)
    errs = {}
    for name, leaf, r, lo in zip("qkv", leaves, ref, low):
        g = leaf.grad
        assert g is not None and g.dtype == q.dtype and g.shape == q.shape, f"{label}: d{name} {g}"
        assert torch.isfinite(g).all(), f"{label}: non-finite d{name}"
        err = (g.float() - r).abs().max().item() if g.numel() else 0.0
        err_low = (lo - r).abs().max().item() if g.numel() else 0.0
        mag = r.abs().max().item() if g.numel() else 0.0
        tol = 2 * err_low + 1e-3 * max(1.0, mag)
        assert err <= tol, f"{label}: d{name} max err {err:.3e} > tol {tol:.3e} (low ref {err_low:.3e}, |g| {mag:.2e})"
        errs[name] = (err, err_low, mag)
    return errs


def _random_graph(n, e, seed, extra_src=None, extra_dst=None):
    g = torch.Generator(device=DEV).manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=g, device=DEV)
    dst = torch.randint(0, n, (e,), generator=g, device=DEV)
    if extra_src is not None:
        src, dst = torch.cat([src, extra_src]), torch.cat([dst, extra_dst])
    return BSBGraph.from_edge_index(torch.stack([src, dst]), n)


def _two_hub_graph(n, degree, seed, hub_in=17, hub_out=29):
    """Node hub_in has `degree` in-neighbours (split row window in the dQ
    pass), node hub_out `degree` out-neighbours (split in the dK/dV pass)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randperm(n, generator=g, device=DEV)[:degree]
    b = torch.randperm(n, generator=g, device=DEV)[:degree]
    src = torch.cat([a, torch.full_like(b, hub_out)])
    dst = torch.cat([torch.full_like(a, hub_in), b])
    return _random_graph(n, 3 * n, seed, src, dst)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases(name, dtype):
    ei, n = GRAPH_CASES[name]()
    bsb = BSBGraph.from_edge_index(ei.to(DEV), n)
    for h, d in ((1, 64), (4, 32), (1, 128)):
        _check_grads(*_qkv(n, h, d, LOW[dtype], seed=h + d), bsb, label=f"{name} H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 64, 128, 16, 256, 24])
@pytest.mark.parametrize("h", [1, 4])
def test_head_dims_and_heads_with_split_windows(h, d, dtype):
    from gt_fused3s.plan import GraphPlan, padded_head_dim
    plan = GraphPlan(_two_hub_graph(1003, 600, seed=11))
    q = _qkv(plan.num_nodes, h, d, LOW[dtype], seed=d + h)
    assert plan.forward_args(h, padded_head_dim(d))[5].size(0) > 0, "the in-hub window should be split"
    assert plan.backward_args(h, padded_head_dim(d))[3].size(0) > 0, "the out-hub window should be split"
    _check_grads(*q, plan, label=f"H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_nodes_with_20000_neighbours(dtype):
    bsb = _two_hub_graph(25_000, 20_000, seed=7)
    for h, d in ((1, 128), (4, 64)):
        _check_grads(*_qkv(bsb.num_nodes, h, d, LOW[dtype], seed=h), bsb, label=f"hubs H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_n_16k_plus_1_and_empty_rows(dtype):
    n = 16 * 1000 + 1
    g = torch.Generator(device=DEV).manual_seed(3)
    src = torch.randint(0, n, (8 * n,), generator=g, device=DEV)
    dst = torch.randint(0, n, (8 * n,), generator=g, device=DEV)
    keep = dst % 3 != 0                         # a third of the rows receive nothing
    bsb = BSBGraph.from_edge_index(torch.stack([src[keep], dst[keep]]), n)
    _check_grads(*_qkv(n, 4, 32, LOW[dtype], seed=5), bsb, label="N=16k+1")
    # the last node alone in its window, as destination and as source
    last = torch.tensor([[0, n - 1, 5, n - 1], [n - 1, n - 1, n - 1, 3]], device=DEV)
    _check_grads(*_qkv(n, 1, 128, LOW[dtype], seed=6), BSBGraph.from_edge_index(last, n), label="last row")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_large_logits(dtype):
    n, h, d = 2000, 2, 64
    hub = torch.arange(0, n, 3, device=DEV)
    bsb = _random_graph(n, 6 * n, seed=4, extra_src=hub, extra_dst=torch.full_like(hub, 100))
    q, k, v, do = _qkv(n, h, d, LOW[dtype], seed=2)
    # scale * <q, k> ~ N(0, 30^2): softmax rows are nearly one-hot
    _check_grads(q, k, v, do, bsb, scale=30 / math.sqrt(d), label="logits ~30")
    # all logits near -300 (exp underflows unless lse is used)
    qa, ka = q.float().abs(), -k.float().abs()
    _check_grads(qa.to(q.dtype), ka.to(q.dtype), v, do, bsb, scale=300 / (0.64 * d), label="logits ~ -300")


def test_real_graphs():
    from gt_fused3s.bench.kernel import available_graphs, load_graph
    names = available_graphs()
    if not names:
        pytest.skip("no graph data (../shared/data, .data/ or $GT_FUSED3S_DATA)")
    cases = {"github": [("fp16", 1, 128), ("bf16", 8, 64)], "cora": [("bf16", 1, 128), ("fp16", 4, 32)]}
    seen = []
    for name in names:
        ei, n = load_graph(name, DEV, batch=256)
        bsb = BSBGraph.from_edge_index(ei, n)
        for dt, h, d in cases.get(name, [("fp16", 1, 64), ("bf16", 4, 32)]):
            errs = _check_grads(*_qkv(n, h, d, LOW[dt], seed=h * d), bsb, label=f"{name} {dt} H={h} D={d}")
            seen.append((name, dt, h, d, *(x for e in errs.values() for x in e[:2])))
    for row in seen:
        print("real graph %-9s %s H=%d D=%3d  dq %.2e (low %.2e)  dk %.2e (low %.2e)  dv %.2e (low %.2e)" % row)
    assert seen


def test_fp32_inputs_and_out_dtype():
    ei, n = GRAPH_CASES["heavy_node"]()
    bsb = BSBGraph.from_edge_index(ei.to(DEV), n)
    g = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(n, 3, 4, 40, generator=g, device=DEV, requires_grad=True)   # strided views, D=40
    do = torch.randn(n, 4, 40, generator=g, device=DEV)
    out = fused3s_attention(*qkv.unbind(1), bsb)
    assert out.dtype == torch.float32
    (grad,) = torch.autograd.grad(out, qkv, do)
    assert grad.dtype == torch.float32
    ref = _reference_grads(*qkv.detach().unbind(1), do, bsb.edge_index, 1 / math.sqrt(40), torch.float32)
    low = _reference_grads(*qkv.detach().unbind(1), do, bsb.edge_index, 1 / math.sqrt(40), torch.float16)
    for i in range(3):
        err = (grad[:, i] - ref[i]).abs().max().item()
        assert err <= 2 * (low[i] - ref[i]).abs().max().item() + 1e-3 * ref[i].abs().max().item()
    # fp16 inputs with an fp32 output: O is read in fp32 for delta
    qh, kh, vh = (t.detach().half().requires_grad_() for t in qkv.unbind(1))
    out32 = fused3s_attention(qh, kh, vh, bsb, out_dtype=torch.float32)
    assert out32.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out32, (qh, kh, vh), do)
    assert dq.dtype == torch.float16
    for gk, r in zip((dq, dk, dv), ref):
        assert (gk.float() - r).abs().max().item() <= 2e-2 * r.abs().max().item()


def test_only_some_inputs_require_grad_and_determinism():
    bsb = _two_hub_graph(3000, 2500, seed=1)
    q, k, v, do = _qkv(bsb.num_nodes, 2, 64, torch.float16, seed=9)
    kg = k.clone().requires_grad_()
    (dk1,) = torch.autograd.grad(fused3s_attention(q, kg, v, bsb), kg, do)
    (dk2,) = torch.autograd.grad(fused3s_attention(q, kg, v, bsb), kg, do)
    assert torch.equal(dk1, dk2)          # split windows merge in a fixed order
    ref = _reference_grads(q, k, v, do, bsb.edge_index, 1 / 8, torch.float32)[1]
    assert (dk1.float() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()


def test_double_backward_raises():
    bsb = _random_graph(100, 400, seed=0)
    q, k, v, do = (t.requires_grad_() for t in _qkv(100, 1, 32, torch.float16))
    out = fused3s_attention(q, k, v, bsb)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out, q, do, create_graph=True)


def test_backward_memory_is_not_edge_sized():
    # E = 64 N and D = 16: one fp32 [E, H] array is 8x the size of q; the
    # backward's own allocations are dq, dk, dv (3x q) and delta (q / 8).
    n, h, d = 50_000, 4, 16
    bsb = _random_graph(n, 64 * n, seed=2)
    q, k, v, do = (t.requires_grad_(i < 3) for i, t in enumerate(_qkv(n, h, d, torch.float16)))
    out = fused3s_attention(q, k, v, bsb)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    q_bytes = n * h * d * 2
    assert bsb.num_edges * h * 4 >= 7 * q_bytes
    assert extra <= 4 * q_bytes, (extra, q_bytes)


def test_bad_inputs_through_the_bwd_op(ops):
    from gt_fused3s.plan import GraphPlan
    plan = GraphPlan(_random_graph(40, 160, seed=0))
    q, k, v, do = _qkv(40, 2, 32, torch.float16)
    fwd = plan.forward_args(2, 32)
    out, lse = ops.fwd(q, k, v, *fwd, 0.1, False)
    _, cols, bitmap, _, items, slots = fwd
    args = [do, q, k, v, out, lse, cols, bitmap, items, slots, *plan.backward_args(2, 32), 0.1, False]

    def call(i, value, match):
        a = list(args)
        a[i] = value
        with pytest.raises((RuntimeError, ValueError), match=match):
            ops.bwd(*a)
        torch.cuda.synchronize()

    call(0, do.bfloat16(), "grad_out must have the dtype of q")
    call(4, out[:, :1].contiguous(), "out must have the shape of q")
    call(5, lse.double(), "lse must be a contiguous float32")
    call(5, lse[:20], "lse must be a contiguous float32")
    call(12, args[12][:2].contiguous(), "transposed graph items has 2 rows")
    call(14, float("inf"), "scale must be finite")
    dq, dk, dv, grad_bias = ops.bwd(*args)
    torch.cuda.synchronize()
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv)) and grad_bias.numel() == 0   # no bias


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 1000, 1003])
def test_destinations_as_the_first_rows_equal_the_square_graph(bias, rows):
    """A plan with num_rows (q, out, dq: the first rows; k, v, dk, dv: all
    nodes, as on one rank of a partitioned graph) computes exactly what the
    square graph computes on those rows: forward, weights and backward (one
    heavy row that splits, a window that straddles num_rows). Up to rounding:
    split windows add their partial results in arrival order."""
    from gt_fused3s import GraphPlan
    g = torch.Generator().manual_seed(7)
    n, E = 2500, 30000
    dst = torch.randint(0, rows, (E,), generator=g)
    dst[:4000] = 0                                             # a heavy row: split windows
    ei = torch.stack([torch.randint(0, n, (E,), generator=g), dst]).to(DEV)
    q, k, v, do = _qkv(n, 4, 32, torch.bfloat16)
    b = torch.randn(E, 4, device=DEV) if bias else None
    res = []
    for plan, nq in ((GraphPlan.from_edge_index(ei, n, num_rows=rows), rows), (GraphPlan.from_edge_index(ei, n), n)):
        leaves = [t.clone().requires_grad_() for t in (q[:nq], k, v)]
        eb = b.clone().requires_grad_() if bias else None
        out, w = fused3s_attention(*leaves, plan, edge_bias=eb, return_weights=True)
        (out.float() * do[:nq].float()).sum().add((w * 0.5).sum()).backward()
        res.append([out[:rows], w, *(t.grad for t in leaves), *([eb.grad] if bias else [])])
    torch.cuda.synchronize()
    for a, s in zip(*res):
        s = s[:a.size(0)].float()
        torch.testing.assert_close(a.float(), s, atol=1e-3 * float(s.abs().max()), rtol=1e-2)
