"""The fused kernels with an edge bias against the fp32 reference (run on
the GPU machine): output, attention weights (return_weights, with their
gradient in the loss) and the gradients of q, k, v and the bias, fp16 and
bf16, H in {1, 4, 8}, D in {16, 32, 64, 128, 256}, on the edge cases of
graph_cases.py, a graph with split windows in both passes and a shared
real graph, exact and static plans.

Tolerance, per tensor (as in test_backward_cuda.py): the max abs error
against the fp32 reference is at most twice the error of the reference
computed in the same low precision (three times in bf16: the kernels also
round dS to bf16 for its mma, which the reference's backward does not; a
bias of std 2 makes rows peaked and dS large), plus 1e-3 times the
tensor's largest magnitude.
"""
from __future__ import annotations

import math

import pytest
import torch

from gt_fused3s import GraphPlan, fused3s_attention
from gt_fused3s.reference import attention_reference

from cuda_marks import GPU_TESTS, LOW
from graph_cases import GRAPH_CASES, split_hubs

pytestmark = GPU_TESTS

DEV = "cuda"


def _shuffled(ei, seed):
    g = torch.Generator().manual_seed(seed)
    return ei[:, torch.randperm(ei.size(1), generator=g)].to(DEV)


def _reference(q, k, v, bias, do, dw, ei, scale, compute_dtype, mask=None):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    out, w = attention_reference(*leaves[:3], ei, scale, edge_bias=leaves[3], compute_dtype=compute_dtype,
                                 out_dtype=torch.float32, return_weights=True, dropout_mask=mask)
    loss = (out * do.float()).sum() + (0 if dw is None else (w * dw).sum())
    return (out.detach(), w.detach(), *torch.autograd.grad(loss, leaves))


def _check(plan, ei, h, d, dtype, seed, label, weights=True, dropout=0.0, seed_tensor=False):
    """Output, weights (with ``weights``: returned, and their gradient
    part of the loss) and the gradients of q, k, v and the bias (with
    ``dropout``: against the reference given the kernels' mask; with
    ``seed_tensor``, the seed given as a device tensor, which the kernels
    read from memory)."""
    from gt_fused3s.ops import dropout_keep
    n = plan.num_nodes
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v, do = (torch.randn(n, h, d, generator=g, device=DEV).to(dtype) for _ in range(4))
    bias = 2 * torch.randn(ei.size(1), h, generator=g, device=DEV)   # large enough to move the softmax
    dw = torch.randn(ei.size(1), h, generator=g, device=DEV) if weights else None
    scale = 1 / math.sqrt(d)
    torch.full((4, n, h, d), float("nan"), dtype=dtype, device=DEV)   # unwritten output shows up as NaN
    torch.full((3 * ei.size(1), h), float("nan"), device=DEV)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    if seed_tensor:
        seed = torch.tensor([seed], dtype=torch.int64, device=DEV)
    drop = dict(dropout_p=dropout, dropout_seed=seed) if dropout else {}
    mask = dropout_keep(seed, dropout, ei.size(1), h, DEV) if dropout else None
    if weights:
        out, w = fused3s_attention(*leaves[:3], plan, scale, edge_bias=leaves[3], return_weights=True, **drop)
        ((out.float() * do.float()).sum() + (w * dw).sum()).backward()
    else:
        out, w = fused3s_attention(*leaves[:3], plan, scale, edge_bias=leaves[3], **drop), None
        out.backward(do)
    got = (out.detach(), w, *(t.grad for t in leaves))
    ref = _reference(q, k, v, bias, do, dw, ei, scale, torch.float32, mask)
    low = _reference(q, k, v, bias, do, dw, ei, scale, dtype, mask)
    for name, x, r, lo in zip(("out", "weights", "dq", "dk", "dv", "dbias"), got, ref, low):
        if name == "weights" and not weights:
            continue
        assert x is not None and x.shape == r.shape, f"{label}: {name}"
        if x.numel() == 0:
            continue
        assert torch.isfinite(x).all(), f"{label}: non-finite {name}"
        err = (x.float() - r).abs().max().item()
        err_low = (lo - r).abs().max().item()
        mag = r.abs().max().item()
        tol = (3 if dtype == torch.bfloat16 else 2) * err_low + 1e-3 * max(1.0, mag)
        assert err <= tol, f"{label}: {name} max err {err:.3e} > tol {tol:.3e} (low ref {err_low:.3e})"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_graph_cases(name, dtype):
    ei, n = GRAPH_CASES[name]()
    ei = _shuffled(ei, seed=1)
    plan = GraphPlan.from_edge_index(ei, n)
    for h, d in ((1, 64), (4, 32), (8, 16), (1, 128)):
        _check(plan, ei, h, d, LOW[dtype], seed=h + d, label=f"{name} H={h} D={d}", weights=h != 4)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("d", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("h", [1, 4, 8])
def test_heads_and_head_dims_with_split_windows(h, d, dtype):
    """A hub with 600 in-neighbours and one with 600 out-neighbours: split
    windows in the forward, the dQ pass and the dK/dV pass."""
    ei, n = split_hubs()
    ei = _shuffled(ei, seed=2)     # with duplicates into the hub
    plan = GraphPlan.from_edge_index(ei, n)
    assert plan.forward_args(h, d)[5].size(0) > 0, "the in-hub window should be split"
    _check(plan, ei, h, d, LOW[dtype], seed=3, label=f"hubs H={h} D={d}", weights=h != 4)


@pytest.mark.parametrize("h", [1, 4])
def test_bias_weights_and_dropout_on_70k_edges(h):
    """A larger random graph (70k edges, many TCB pairs per window): bias,
    weights and dropout, the per-edge arrays read and written through
    slot_edge."""
    n, E = 20000, 70000
    g = torch.Generator().manual_seed(21)
    ei = torch.randint(0, n, (2, E), generator=g).to(DEV)
    plan = GraphPlan.from_edge_index(ei, n)
    _check(plan, ei, h, 32, torch.float16, seed=7, label=f"70k edges H={h}")
    _check(plan, ei, h, 32, torch.bfloat16, seed=8, label=f"70k edges H={h} dropout", weights=False,
           dropout=0.25)


def test_static_plan_and_shared_graphs():
    from gt_fused3s.bench.kernel import available_graphs, load_graph
    names = [x for x in ("cora", "github") if x in available_graphs()]
    if not names:
        pytest.skip("no graph data (../shared/data, .data/ or $GT_FUSED3S_DATA)")
    for name in names:
        ei, n = load_graph(name, "cpu")
        ei = _shuffled(ei, seed=4)
        for static in (False, True):
            plan = GraphPlan.from_edge_index(ei, n, static=static)
            _check(plan, ei, 4, 32, torch.float16, seed=5, label=f"{name} static={static}")


def test_bias_and_weights_are_free_of_host_syncs():
    ei, n = GRAPH_CASES["duplicates"]()
    ei = ei.to(DEV)
    plan = GraphPlan.from_edge_index(ei, n).prepare(2, 32, edge_bias=True)
    q, k, v = (torch.randn(n, 2, 32, device=DEV, dtype=torch.float16, requires_grad=True) for _ in range(3))
    bias = torch.randn(ei.size(1), 2, device=DEV, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, w = fused3s_attention(q, k, v, plan, edge_bias=bias, return_weights=True)
        (out.float().sum() + w.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bias.grad is not None and q.grad is not None


def test_bad_edge_inputs_through_the_ops(ops):
    ei, n = GRAPH_CASES["duplicates"]()
    ei = ei.to(DEV)
    plan = GraphPlan.from_edge_index(ei, n).prepare(2, 32, edge_bias=True)
    q, k, v = (torch.randn(n, 2, 32, device=DEV, dtype=torch.float16) for _ in range(3))
    fwd = plan.forward_args(2, 32)
    nnz_offset, slot_edge, slot_pos = plan.bias_args()[:3]
    bias = torch.randn(ei.size(1), 2, device=DEV)

    def call(fn, match):
        with pytest.raises((RuntimeError, ValueError), match=match):
            fn()
        torch.cuda.synchronize()

    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, None, None), "an edge_bias or dropout needs the graph's")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, None, None, None, None, 0.2, 1), "an edge_bias or dropout needs")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, None, nnz_offset, slot_edge, slot_pos, 1.0, 1),
         r"dropout_p must be in \[0, 1\)")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias[:-1], nnz_offset, slot_edge, slot_pos),
         r"edge_bias must have shape \[E, H\]")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias.half(), nnz_offset, slot_edge, slot_pos),
         "edge_bias must be float32")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, nnz_offset.long(), slot_edge, slot_pos),
         "nnz_offset must be int32")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, nnz_offset[:-1], slot_edge, slot_pos),
         r"nnz_offset must have T \+ 1")
    call(lambda: ops.fwd_scores(q, k, v, *fwd, 0.1, False, bias, nnz_offset, slot_edge.long(), slot_pos),
         "slot_edge must be int32")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, nnz_offset, slot_edge, None),
         "nnz_offset, slot_edge and slot_pos come together")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, nnz_offset, slot_edge, slot_pos.int()),
         "slot_pos must be uint8")
    call(lambda: ops.fwd(q, k, v, *fwd, 0.1, False, bias, nnz_offset, slot_edge, slot_pos[:-1]),
         "slot_pos must have one entry per non-zero")
    out, lse, scores = ops.fwd_scores(q, k, v, *fwd, 0.1, False, bias, nnz_offset, slot_edge, slot_pos)
    dst = ei[1].long()
    call(lambda: ops.edge_probs(scores, bias[:-1], lse, dst, 0.1), "bias must have the shape of scores")
    call(lambda: ops.edge_probs(scores, bias, lse, dst.int(), 0.1), "idx")
    call(lambda: ops.edge_probs(scores, bias, lse[:, :1].contiguous(), dst, 0.1), r"lse must have shape \[N, H\]")
    probs = ops.edge_probs(scores, bias, lse, dst, 0.1)
    torch.cuda.synchronize()
    assert probs.shape == bias.shape and torch.isfinite(probs).all()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("h,d", [(1, 64), (4, 32), (8, 16), (2, 128), (1, 256)])
def test_dropout_matches_the_reference_with_the_kernels_mask(h, d, dtype):
    """Attention dropout in the kernels (forward, both backward passes, with
    a bias and returned weights) against the reference given dropout_keep's
    mask: the hash agrees between CUDA and PyTorch, and the dK/dV pass
    regenerates the forward's mask."""
    ei, n = GRAPH_CASES["heavy_node"]()
    ei = _shuffled(torch.cat([ei, ei[:, :40]], 1), seed=6)
    plan = GraphPlan.from_edge_index(ei, n)
    _check(plan, ei, h, d, LOW[dtype], seed=1000 + h * d, label=f"dropout H={h} D={d}", dropout=0.3)


@pytest.mark.parametrize("h,d", [(1, 64), (4, 16)])
def test_dropout_seed_tensor_against_the_reference(h, d):
    """The seed as an int64 tensor on the GPU (read by the kernels from
    device memory: how a captured graph or a compiled region passes it),
    above 2^32 so that both of its words count."""
    ei, n = GRAPH_CASES["heavy_node"]()
    ei = _shuffled(ei, seed=7)
    plan = GraphPlan.from_edge_index(ei, n)
    _check(plan, ei, h, d, torch.float16, seed=(5 << 33) + h * d, label=f"seed tensor H={h} D={d}",
           dropout=0.3, seed_tensor=True)


def _graph_step(plan, q, k, v, do, bias, seed):
    out = fused3s_attention(q, k, v, plan, 0.3, edge_bias=bias, dropout_p=0.4, dropout_seed=seed)
    return (out, *torch.autograd.grad(out, (q, k, v, bias), do))


def test_dropout_in_a_captured_graph():
    """Attention dropout inside a captured CUDA graph: with a seed tensor
    that the caller refills between replays, each replay equals the
    reference with that seed's mask; with no seed, the graph draws one on
    the device and each replay drops other edges (an int seed would have
    replayed one mask, so dropout raised inside a capture before)."""
    from gt_fused3s.ops import dropout_keep
    ei, n = GRAPH_CASES["heavy_node"]()
    ei = _shuffled(ei, seed=8)
    h, d = 2, 32
    plan = GraphPlan.from_edge_index(ei, n).prepare(h, d, edge_bias=True)
    g = torch.Generator(device=DEV).manual_seed(9)
    q, k, v, do = (torch.randn(n, h, d, generator=g, device=DEV).half() for _ in range(4))
    bias = torch.randn(ei.size(1), h, generator=g, device=DEV)
    q, k, v, bias = (t.requires_grad_() for t in (q, k, v, bias))
    seed_t = torch.zeros(1, dtype=torch.int64, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):       # warm-up, eagerly
        _graph_step(plan, q, k, v, do, bias, seed_t)
        _graph_step(plan, q, k, v, do, bias, None)
    torch.cuda.current_stream().wait_stream(side)
    given, drawn = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(given):
        res_given = _graph_step(plan, q, k, v, do, bias, seed_t)
    with torch.cuda.graph(drawn):
        res_drawn = _graph_step(plan, q, k, v, do, bias, None)
    for seed in (3, (7 << 40) + 1):
        seed_t.fill_(seed)
        given.replay()
        torch.cuda.synchronize()
        mask = dropout_keep(seed, 0.4, ei.size(1), h, DEV)
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
        ref = attention_reference(*leaves[:3], ei, 0.3, edge_bias=leaves[3], dropout_mask=mask)
        ref_grads = torch.autograd.grad(ref, leaves, do.float())
        for name, x, r in zip(("out", "dq", "dk", "dv", "dbias"), res_given, (ref, *ref_grads)):
            err = (x.float() - r).abs().max().item()
            assert err <= 2e-2 * max(1.0, r.abs().max().item()), f"seed {seed}: {name} err {err:.3e}"
    outs = []
    for _ in range(2):
        drawn.replay()
        torch.cuda.synchronize()
        outs.append([t.clone() for t in res_drawn])
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and not torch.equal(a, b)   # a new mask each replay


def test_layer_dropout_under_reduce_overhead():
    """Fused3SConv training with dropout under torch.compile's
    reduce-overhead mode (CUDA graphs): it runs, each call drops other
    edges, and the gradients are finite."""
    from gt_fused3s.nn import Fused3SConv
    ei, n = GRAPH_CASES["random_1003"]()
    ei = ei.to(DEV)
    torch.manual_seed(0)
    conv = Fused3SConv(32, 16, heads=4, dropout=0.3, edge_dim=8).to(DEV).train()
    x = torch.randn(n, 32, device=DEV)
    ea = torch.randn(ei.size(1), 8, device=DEV)
    torch._dynamo.reset()
    step = torch.compile(conv, mode="reduce-overhead")
    outs = []
    for _ in range(4):
        # a training loop's step: its gradients zeroed (set to None: the last
        # step's live in the CUDA graphs' memory), a new step of the graph trees
        conv.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        xi = x.clone().requires_grad_()
        out = step(xi, ei, ea)
        out.square().sum().backward()
        outs.append((out.detach().clone(), xi.grad.clone()))   # (replays reuse the graphs' memory)
    for out, grad in outs:
        assert torch.isfinite(out).all() and torch.isfinite(grad).all()
    assert not torch.equal(outs[-1][0], outs[-2][0])


def test_compiled_bias_reads_the_plans_grouping_on_the_gpu():
    """torch.compile of the op with a bias and returned weights, on a plan
    whose edges the plan groups (conftest groups every plan not grouped
    already): the kernels' results equal eager's (tests/test_edge_bias.py)."""
    from test_edge_bias import _compiled_bias_matches_eager
    ei, n = GRAPH_CASES["random_1003"]()
    torch._dynamo.reset()
    plan = _compiled_bias_matches_eager(_shuffled(ei, 3), n, device=DEV, dtype=torch.float16, tol=2e-3)
    assert plan.edge_grouping() is not None and True in plan.traced_groupings
