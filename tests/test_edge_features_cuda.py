"""The attention with edge features on the kernels (edge_terms._EdgeFeatureTerms:
the bias pass, the forward that writes each edge's score (``fwd_scores``),
the node sums, and its own backward) on the GPU machine, against
TransformerConv's materialised form in float64 (``edge_feature_reference``:
[E, H, C] edge embeddings added to keys and values): output, weights and
the gradients of q, k, v, the edge features and W_e; fp16 and bf16, H in
{1, 2, 4, 8}, head dims 16 to 256 (and a padded 24), edge_dim 5, 16, 20,
32; every graph of graph_cases.py (duplicates, a pair of more than 64
non-zeros, no edges, ...), windows split over several chunks, dropout
(against the reference given the kernels' mask), fp32 inputs.

Tolerance: max abs error at most 1e-2 (fp16) / 4e-2 (bf16) times the
tensor's largest magnitude (at least 1): q, k, v and P are rounded to the
low precision in the tensor-core products, the edge terms are fp32."""
from __future__ import annotations

import math

import pytest
import torch

from gt_fused3s import GraphPlan
from gt_fused3s.edge_terms import edge_feature_attention
from gt_fused3s.ops import dropout_keep
from gt_fused3s.plan import padded_head_dim
from gt_fused3s.reference import edge_feature_reference

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES, split_hubs

pytestmark = GPU_TESTS

DEV = "cuda"


def _grads(fn, leaves, seed):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    # the same upstream gradient for both sides: drawn on the CPU
    g = torch.Generator().manual_seed(seed)
    out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64).to(out))
    return out.detach().double().cpu(), [t.grad.double().cpu() for t in leaves]


def _check(ei, n, h, c, f, dtype, seed, *, weights=True, dropout=0.0, in_dtype=None, label=""):
    """The fused edge-feature attention on a plan against the float64
    materialised reference, on the same rounded inputs."""
    E = ei.size(1)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, c, generator=g, dtype=torch.float64).to(dtype).double() for _ in range(3))
    a = torch.randn(E, f, generator=g, dtype=torch.float64).float().double()
    w_e = (torch.randn(h, c, f, generator=g, dtype=torch.float64) * 0.3).float().double()
    scale = 1 / math.sqrt(c)
    mask = dropout_keep(seed, dropout, E, h).double() if dropout else None
    plan = GraphPlan.from_edge_index(ei.to(DEV), n)

    def cat(out, alpha):
        return torch.cat([out.flatten()] + ([alpha.flatten()] if weights else []))

    def materialised(q, k, v, a, w_e):
        return cat(*edge_feature_reference(q, k, v, ei, a, w_e, scale, dropout_mask=mask))

    def fused(q, k, v, a, w_e):
        out, alpha = edge_feature_attention(q, k, v, plan, a, w_e, scale, dropout_p=dropout, dropout_seed=seed,
                                            return_weights=weights)
        assert (alpha is not None) == weights
        return cat(out.float(), alpha) if weights else cat(out.float(), None)

    want, want_grads = _grads(materialised, (q, k, v, a, w_e), seed)
    qkv = (t.to(in_dtype or dtype).to(DEV) for t in (q, k, v))
    got, got_grads = _grads(fused, (*qkv, a.float().to(DEV), w_e.float().to(DEV)), seed)
    tol = 1e-2 if dtype == torch.float16 else 4e-2
    for what, x, y in [("out/alpha", got, want)] + [
            (f"grad {name}", gx, gy) for name, gx, gy in zip(("q", "k", "v", "a", "W_e"), got_grads, want_grads)]:
        assert torch.isfinite(x).all(), f"{label}: non-finite {what}"
        err = (x - y).abs().max().item() if x.numel() else 0.0
        assert err <= tol * max(y.abs().max().item() if y.numel() else 0.0, 1.0), \
            f"{label}: {what} max abs error {err:.3g}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases(name, dtype):
    ei, n = GRAPH_CASES[name]()
    for h, c, f in ((1, 64, 16), (4, 16, 16), (8, 32, 32), (2, 16, 5)):
        _check(ei, n, h, c, f, LOW[dtype], seed=h + c + f, weights=h != 4, label=f"{name} H={h} C={c} F={f}")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("c", [16, 24, 32, 64, 128, 256])
@pytest.mark.parametrize("h,f", [(1, 16), (4, 32), (8, 20)])
def test_heads_head_dims_and_widths_with_split_windows(h, c, f, dtype):
    ei, n = split_hubs()
    plan = GraphPlan.from_edge_index(ei.to(DEV), n)
    assert plan.forward_args(h, padded_head_dim(c))[5].size(0) > 0, "the in-hub window should be split"
    _check(ei, n, h, c, f, LOW[dtype], seed=c + f, weights=h == 1, label=f"hubs H={h} C={c} F={f}")


@pytest.mark.parametrize("h", [1, 4])
def test_dropout_weights_and_fp32_inputs(h):
    """Dropout (one mask for both terms and the backward), the weights'
    gradient in the loss, fp32 inputs (cast once, fp32 outputs)."""
    ei, n = GRAPH_CASES["random_1003"]()
    _check(ei, n, h, 32, 16, torch.float16, seed=7, dropout=0.3, label=f"dropout H={h}")
    _check(ei, n, h, 32, 16, torch.float16, seed=8, in_dtype=torch.float32, label=f"fp32 inputs H={h}")
    ei, n = split_hubs()
    _check(ei, n, h, 16, 32, torch.bfloat16, seed=9, dropout=0.5, weights=False, label=f"hubs dropout H={h}")


def test_fwd_scores_op():
    """fwd_scores: out and lse as fwd's, and each edge's raw q_i.k_j in the
    caller's edge order (every edge written once: NaN-filled memory shows
    up), with and without a bias and dropout, on split windows."""
    ei, n = split_hubs()
    ei = ei[:, torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(1))].to(DEV)
    h, d = 4, 32
    plan = GraphPlan.from_edge_index(ei, n)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, h, d, generator=g).half().to(DEV) for _ in range(3))
    bias = torch.randn(ei.size(1), h, generator=g).to(DEV)
    src, dst = ei
    want = (q.double()[dst] * k.double()[src]).sum(-1)
    for b, p in ((None, 0.0), (bias, 0.0), (bias, 0.3)):
        torch.full((3 * ei.size(1), h), float("nan"), device=DEV)     # a reused block shows as NaN
        args = (q, k, v, *plan.forward_args(h, d), 0.2, False, b, *plan.bias_args()[:3], p, 5)
        out, lse, scores = torch.ops.gt_fused3s.fwd_scores(*args)
        out2, lse2 = torch.ops.gt_fused3s.fwd(*args)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        assert scores.shape == (ei.size(1), h) and torch.isfinite(scores).all()
        assert (scores.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype,case", [(d, c) for d in ("fp16", "bf16", "fp32")
                                        for c in ("all", "weights-loss", "qkv", "w-a", "none", "autocast", "sorted")
                                        if (d, c) != ("fp32", "autocast")])
def test_cpp_op_equals_the_python_composition(dtype, case, monkeypatch):
    """Eagerly, without dropout, on the kernels' own operands the
    edge-feature attention is one C++ op and autograd node
    (``ops.edge_feature_eager``: csrc/bindings.cpp, EdgeFeatureFn: the
    projections by W_e, the kernels, the value term and their backward); it
    equals the Python composition it replaces (the projections' GEMMs around
    the autograd.Function ``_EdgeFeatureTerms``, same kernels; the op's
    projections are head_project kernels in fp32, the GEMMs round to
    autocast's dtype: within the tolerance of the low precision): output,
    weights and the gradients of q, k, v, W_e and the features, for a loss
    on the output (and on the weights), whichever inputs require gradients,
    under autocast (W_e and the features fp32), for fp32 q, k, v (the op
    casts them to fp16 once, as the Python path), on edges the plan
    groups by destination (scattered: conftest groups every plan's) and on
    edges grouped already; dropout and a padded head dim still take the
    Python path; opcheck passes."""
    from gt_fused3s import ops
    ei, n = split_hubs()
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(2))
    if case == "sorted":
        perm = torch.argsort(ei[1], stable=True)
    ei = ei[:, perm].to(DEV)
    h, c, f, scale = 4, 32, 16, 0.2
    plan = GraphPlan.from_edge_index(ei, n)
    assert (plan.edge_grouping() is None) == (case == "sorted")
    g = torch.Generator().manual_seed(4)
    # fp32: q, k, v cast to fp16 once inside either path, out and their gradients fp32
    low = torch.float32 if case == "autocast" or dtype == "fp32" else LOW[dtype]
    q, k, v = (torch.randn(n, h, c, generator=g).to(low).to(DEV) for _ in range(3))
    w_e = (torch.randn(h, c, f, generator=g) * 0.3).to(DEV)
    a = torch.randn(ei.size(1), f, generator=g).to(DEV)
    wants = {"qkv": (1, 1, 1, 0, 0), "w-a": (0, 0, 0, 1, 1), "none": (0,) * 5}.get(case, (1,) * 5)
    if case != "autocast":
        assert ops.edge_feature_eager_fits(q, k, v, w_e, a, (0.0, 0, None))
        assert not ops.edge_feature_eager_fits(q, k, v, w_e, a, (0.1, 3, None))
        assert not ops.edge_feature_eager_fits(q[..., :24], k[..., :24], v[..., :24], w_e, a, (0.0, 0, None))

    def run(cpp):
        leaves = [t.clone().requires_grad_(bool(w)) for t, w in zip((q, k, v, w_e, a), wants)]
        with monkeypatch.context() as m:
            if not cpp:
                m.setattr(ops, "edge_feature_eager_fits", lambda *args: False)
            with torch.autocast("cuda", dtype=LOW.get(dtype, torch.float16), enabled=case == "autocast"):
                if case == "autocast":   # as a layer gives them: q, k, v from autocast's linear layers
                    qkv = [t.to(LOW[dtype]) for t in leaves[:3]]
                else:
                    qkv = leaves[:3]
                out, alpha = edge_feature_attention(*qkv, plan, leaves[4], leaves[3], scale)
        if case == "none":
            assert out.grad_fn is None
            return [out, alpha]
        assert cpp == ("EdgeFeatureFn" in out.grad_fn.name()), out.grad_fn.name()
        gen = torch.Generator(device=DEV).manual_seed(5)
        used = (out, alpha) if case == "weights-loss" else (out,)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen, device=DEV)).sum() for o in used)
        grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
        return [out, alpha] + list(grads)

    got, want = run(True), run(False)
    assert len(got) == len(want)
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        # the same kernels and products (the backward adds with atomics);
        # under autocast the Python path's projections round to its dtype
        # (the op's are fp32): bf16's tolerance of the reference tests there
        tol = (1e-3 if x.dtype == torch.float32 and case != "autocast" else
               4e-2 if case == "autocast" and dtype == "bf16" else 1e-2) * max(y.abs().max().item(), 1.0)
        assert (x.float() - y.float()).abs().max().item() <= tol, (case, i)
    if case == "all":
        dst, csr, slots = ei[1].long(), plan.destination_csr(), plan.bias_args()
        torch.library.opcheck(torch.ops.gt_fused3s.edge_feature_eager.default,
                              (q.clone().requires_grad_(), k, v, w_e, a, list(plan.forward_args(h, c)),
                               list(plan.backward_args(h, c)), list(slots), dst, *csr, scale),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
