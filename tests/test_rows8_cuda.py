"""The 8-row kernels (``GraphPlan.from_edge_index(..., window_rows=8)``,
csrc/kernels/rows8_params.h) against the fp32 reference, forward and
backward, on the GPU machine: every graph case, fp16 and bf16, head dims
16 to 128 (and a padded one), 1 to 8 heads, fp32 inputs and outputs, the
real graphs. Tolerances as in test_backward_cuda.py: at most twice the
error of the reference computed in the same low precision, plus 1e-3 of
the largest magnitude."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.reference import attention_reference

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES
from test_backward_cuda import _check_grads, _qkv

pytestmark = GPU_TESTS

DEV = "cuda"


def _plan8(ei, n, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # a hub's long window: slow, not wrong
        return GraphPlan.from_edge_index(ei.to(DEV), n, window_rows=8, **kw)


def _check_out(q, k, v, plan, scale=None, out_dtype=None, label=""):
    D = q.size(-1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    torch.full((2,) + tuple(q.shape), float("nan"), dtype=q.dtype, device=DEV)   # unwritten rows show up
    out = fused3s_attention(q, k, v, plan, scale, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or q.dtype) and out.shape == q.shape, label
    f32 = dict(compute_dtype=torch.float32, out_dtype=torch.float32)
    ref = attention_reference(q.float(), k.float(), v.float(), plan.edge_index, scale, **f32)
    # the reference in the kernel's operand precision, rounded to the output's dtype
    low = attention_reference(q, k, v, plan.edge_index, scale, compute_dtype=q.dtype if q.dtype != torch.float32
                              else torch.float16, out_dtype=out_dtype or q.dtype).float()
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    tol = 2 * ((low - ref).abs().max().item() if out.numel() else 0.0) + 1e-3
    assert err <= tol, f"{label}: out max err {err:.3e} > tol {tol:.3e}"
    return err


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases(name, dtype):
    ei, n = GRAPH_CASES[name]()
    plan = _plan8(ei, n)
    for h, d in ((1, 64), (4, 32), (1, 128), (8, 16), (2, 24)):
        q, k, v, do = _qkv(n, h, d, LOW[dtype], seed=h + d)
        _check_out(q, k, v, plan, label=f"{name} H={h} D={d}")
        _check_grads(q, k, v, do, plan, label=f"{name} H={h} D={d}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_reordered_and_large_logits(dtype):
    ei, n = GRAPH_CASES["random_1003"]()
    plan = _plan8(ei, n, reorder="cuthill_mckee")
    q, k, v, do = _qkv(n, 4, 64, LOW[dtype], seed=3)
    _check_out(q, k, v, plan, label="reordered")
    _check_grads(q, k, v, do, plan, label="reordered")
    _check_grads(q, k, v, do, plan, scale=30 / 8, label="logits ~30")


def test_fp32_inputs_and_outputs():
    ei, n = GRAPH_CASES["heavy_node"]()
    plan = _plan8(ei, n)
    q, k, v, do = _qkv(n, 4, 40, torch.float32, seed=1)
    _check_out(q, k, v, plan, label="fp32")
    _check_grads(q.half(), k.half(), v.half(), do.half(), plan, label="fp16 in")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fused3s_attention(*leaves, plan)
    out.backward(do)
    assert out.dtype == torch.float32 and all(t.grad.dtype == torch.float32 for t in leaves)
    # fp16 inputs with an fp32 output: O is read in fp32 for delta
    qh, kh, vh = (t.half().requires_grad_() for t in (q, k, v))
    out32 = fused3s_attention(qh, kh, vh, plan, out_dtype=torch.float32)
    out32.backward(do)
    ref = [t.float().requires_grad_() for t in (q.half(), k.half(), v.half())]
    attention_reference(*ref, plan.edge_index, 1 / math.sqrt(40)).backward(do)
    for t, r in zip((qh, kh, vh), ref):
        assert (t.grad.float() - r.grad).abs().max().item() <= 1e-2 * max(1.0, r.grad.abs().max().item())


def test_real_graphs():
    from gt_fused3s.bench.kernel import available_graphs, load_graph
    names = [n for n in available_graphs() if n != "github"]     # github's hub: a 600-block window
    if not names:
        pytest.skip("no graph data (../shared/data, .data/ or $GT_FUSED3S_DATA)")
    for name in names:
        ei, n = load_graph(name, DEV, batch=256)
        plan = _plan8(ei, n)
        for dt, h, d in (("fp16", 1, 128), ("bf16", 8, 64), ("fp16", 4, 16)):
            q, k, v, do = _qkv(n, h, d, LOW[dt], seed=h * d)
            _check_out(q, k, v, plan, label=f"{name} {dt} H={h} D={d}")
            _check_grads(q, k, v, do, plan, label=f"{name} {dt} H={h} D={d}")


def test_same_as_16_row_on_a_hub_graph():
    """A window longer than the warning's threshold is slow, not wrong."""
    n = 3000
    g = torch.Generator(device=DEV).manual_seed(0)
    src = torch.cat([torch.arange(1, n, device=DEV), torch.randint(0, n, (4 * n,), generator=g, device=DEV)])
    dst = torch.cat([torch.zeros(n - 1, dtype=torch.long, device=DEV),
                     torch.randint(0, n, (4 * n,), generator=g, device=DEV)])
    ei = torch.stack([src, dst])
    with pytest.warns(RuntimeWarning, match="blocks"):
        plan = GraphPlan.from_edge_index(ei, n, window_rows=8)
    q, k, v, do = _qkv(n, 2, 64, torch.float16, seed=9)
    _check_out(q, k, v, plan, label="hub")
    _check_grads(q, k, v, do, plan, label="hub")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_strided_views_are_read_in_place(dtype):
    """q, k, v as slices of one projection (a model's qkv split), dO a view:
    the same results as contiguous copies, bit for bit (the kernels read
    row and head strides; no copy is made for them)."""
    ei, n = GRAPH_CASES["random_1003"]()
    plan = _plan8(ei, n)
    g = torch.Generator(device=DEV).manual_seed(5)
    qkv = torch.randn(n, 3, 2, 64, generator=g, device=DEV).to(LOW[dtype])
    do = torch.randn(n, 2, 2, 64, generator=g, device=DEV).to(LOW[dtype])[:, 1]
    views = [t.requires_grad_() for t in (x.detach() for x in qkv.unbind(1))]
    copies = [t.detach().contiguous().requires_grad_() for t in views]
    assert not views[0].is_contiguous()
    outs = []
    for leaves, grad in ((views, do), (copies, do.contiguous())):
        out = fused3s_attention(*leaves, plan)
        out.backward(grad)
        outs.append((out, [t.grad for t in leaves]))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.equal(a, b)
