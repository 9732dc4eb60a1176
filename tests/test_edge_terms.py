"""The edge-feature products (gt_fused3s/edge_terms.py) on the CPU: the
grouping of edges by node, and the kernel path (through the CPU stand-ins of
the edge-term ops, which read the grouping as the kernel does) against the
PyTorch path in float64, values and gradients; and which kernel instance
each launcher of csrc/kernels/edge_terms.cu picks (tests/edge_launch_host.cu,
built with nvcc, no GPU)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from gt_fused3s import GraphPlan
from gt_fused3s.edge_terms import edge_dot, edge_feature_attention, edge_scatter
from gt_fused3s.graph import node_csr
from gt_fused3s.ops import dropout_keep
from gt_fused3s.reference import edge_feature_reference

try:
    from graph_cases import GRAPH_CASES
except ImportError:  # tests/ collected as a package
    from tests.graph_cases import GRAPH_CASES


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_node_csr_groups_every_edge_once(case):
    edge_index, n = GRAPH_CASES[case]()
    dst = edge_index[1]
    rowptr, order = node_csr(dst, n)
    assert rowptr.dtype == order.dtype == torch.int64 and rowptr.shape == (n + 1,)
    assert torch.equal(torch.sort(order).values, torch.arange(dst.numel()))
    for node in range(n):
        mine = order[rowptr[node]:rowptr[node + 1]]
        assert torch.equal(mine, (dst == node).nonzero().flatten())   # ascending edge ids


def _operands(E, N, H, F, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    idx = torch.cat([torch.randint(0, N, (E - 3,), generator=g), torch.tensor([0, 0, N - 1])])
    X = torch.randn(N, H, F, generator=g, dtype=dtype)
    a = torch.randn(E, F, generator=g, dtype=dtype)
    w = torch.randn(E, H, generator=g, dtype=dtype)
    return idx, X, a, w


def _grads(fn, *leaves):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("H,F", [(1, 1), (4, 16), (3, 5)])
def test_kernel_path_equals_pytorch_path(stand_in_kernels, H, F):
    """The ops (fp32, grouped by node) against the chunked PyTorch code in
    float64: forward and the gradients of every input, with duplicates, an
    isolated node and a node of many edges."""
    E, N = 300, 41
    idx, X, a, w = _operands(E, N, H, F)
    idx[:60] = 7                                  # a high-degree node
    csr = node_csr(idx, N)
    for csr_arg in (csr, None):                   # from a plan, or built by the backward
        ref_out, ref_grads = _grads(lambda X, a: edge_dot(X, a, idx), X, a)
        out, grads = _grads(lambda X, a: edge_dot(X, a, idx, csr_arg), X.float(), a.float())
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        for gr, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(gr.double(), g_ref, atol=1e-5, rtol=1e-5)

        ref_out, ref_grads = _grads(lambda w, a: edge_scatter(w, a, idx, N), w, a)
        out, grads = _grads(lambda w, a: edge_scatter(w, a, idx, N, csr_arg), w.float(), a.float())
        torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
        for gr, g_ref in zip(grads, ref_grads):
            torch.testing.assert_close(gr.double(), g_ref, atol=1e-5, rtol=1e-5)
    calls = set(stand_in_kernels.calls)
    assert {"edge_dot", "edge_rows", "edge_scatter"} <= calls


def test_wrong_grouping_is_seen(stand_in_kernels):
    """The sum reads the grouping it is given: another graph's grouping
    gives another result (so the tests above would catch a wrong one)."""
    idx, X, a, w = _operands(200, 30, 2, 4, dtype=torch.float32)
    good = edge_scatter(w, a, idx, 30, node_csr(idx, 30))
    bad = edge_scatter(w, a, idx, 30, node_csr(idx.roll(1), 30))
    assert not torch.allclose(good, bad)


def test_half_operands_compute_in_fp32(stand_in_kernels):
    idx, X, a, w = _operands(100, 20, 2, 8, dtype=torch.float32)
    out = edge_dot(X.half(), a, idx)                  # fp16 nodes, fp32 features: fp32 result
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, edge_dot(X.half().float(), a, idx))


def test_opcheck_edge_ops(stand_in_kernels):
    idx, X, a, w = _operands(64, 12, 3, 4, dtype=torch.float32)
    rowptr, order = node_csr(idx, 12)
    lse = torch.randn(12, 3)
    for name, args in (("edge_dot", (X, a, idx)), ("edge_rows", (w, X, idx)),
                       ("edge_rows", (w, X, idx, w * 2, X * 0.5)),
                       ("edge_scatter", (w, a, rowptr, order)), ("edge_probs", (w, w * 0.5, lse, idx, 0.3)),
                       ("edge_probs", (w, None, lse, idx, 0.3))):
        torch.library.opcheck(getattr(torch.ops.gt_fused3s, name).default, args)


@pytest.mark.parametrize("dropout_p", [0.0, 0.4])
@pytest.mark.parametrize("use_weights", [False, True])
def test_edge_feature_terms_node_equals_composition(stand_in_kernels, dropout_p, use_weights):
    """On a plan, eager, the kernel path (fp16 in the stand-in kernels) runs
    the attention with edge features as one autograd node
    (_EdgeFeatureTerms, its own backward), against TransformerConv's form
    (e_ij = W_e a_ij added to keys and values, [E, H, C] materialised) in
    float64: outputs, weights and the gradients of q, k, v, the features
    and W_e, with dropout (same seed: same mask) and with or without a loss
    on the weights (their gradient enters the fused backward beside the
    value sum's)."""
    from gt_fused3s import edge_terms
    edge_index, n = GRAPH_CASES["duplicates"]()
    E, H, C, F = edge_index.size(1), 3, 16, 6
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, H, C, generator=g, dtype=torch.float64) for _ in range(3))
    a = torch.randn(E, F, generator=g, dtype=torch.float64)
    w_e = torch.randn(H, C, F, generator=g, dtype=torch.float64) * 0.3
    plan = GraphPlan.from_edge_index(edge_index, n)

    def cat(out, alpha):
        return torch.cat([out.flatten()] + ([alpha.flatten()] if use_weights else [])).double()

    def fused(q, k, v, a, w_e):
        return cat(*edge_feature_attention(q, k, v, plan, a, w_e, 0.25, dropout_p=dropout_p, dropout_seed=9))

    mask = dropout_keep(9, dropout_p, E, H).double() if dropout_p else None

    def materialised(q, k, v, a, w_e):
        return cat(*edge_feature_reference(q, k, v, edge_index, a, w_e, 0.25, dropout_mask=mask))
    nodes = []
    orig = edge_terms._EdgeFeatureTerms.apply
    edge_terms._EdgeFeatureTerms.apply = lambda *args: nodes.append(1) or orig(*args)
    try:
        out, grads = _grads(fused, *(t.float() for t in (q, k, v, a, w_e)))
    finally:
        edge_terms._EdgeFeatureTerms.apply = orig
    assert nodes == [1] and "edge_rows" in stand_in_kernels.calls
    ref, ref_grads = _grads(materialised, q, k, v, a, w_e)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for gr, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(gr.double(), g_ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("H,A,B", [(1, 4, 6), (3, 5, 2)])
def test_head_project(H, A, B):
    """The block-diagonal GEMM equals a GEMM per head; gradients by gradcheck."""
    from gt_fused3s.edge_terms import head_project
    g = torch.Generator().manual_seed(H)
    x = torch.randn(23, H, A, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(H, A, B, generator=g, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(head_project(x, w, 0.5), 0.5 * torch.einsum("nha,hab->nhb", x, w))
    assert torch.autograd.gradcheck(lambda x, w: head_project(x, w, 0.5), (x, w))


def test_plan_groups_edges_by_destination_row():
    """A plan whose destinations are its first rows (a partitioned graph's
    rank) groups its edges per row: one group per row of q and the output."""
    ei = torch.tensor([[5, 6, 0, 6, 2], [1, 0, 2, 1, 1]])
    rowptr, order = GraphPlan.from_edge_index(ei, 7, num_rows=3).destination_csr()
    assert rowptr.tolist() == [0, 1, 4, 5] and order.tolist() == [1, 0, 3, 4, 2]


@pytest.mark.parametrize("use_weights", [False, True])
def test_edge_feature_terms_op_under_compile(stand_in_kernels, monkeypatch, use_weights):
    """Under torch.compile (fullgraph) the one node runs as the custom op
    ``gt_fused3s::edge_feature_terms`` (its fake, its own backward), not as
    the composed ops: outputs, weights and every gradient equal eager's,
    and the op's forward and backward are what ran; ``opcheck`` of the op."""
    from gt_fused3s import ops
    edge_index, n = GRAPH_CASES["duplicates"]()
    E, H, C, F = edge_index.size(1), 2, 16, 5
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, H, C, generator=g) for _ in range(3))
    a = torch.randn(E, F, generator=g)
    w_e = torch.randn(H, C, F, generator=g) * 0.3
    plan = GraphPlan.from_edge_index(edge_index, n).prepare(H, C, edge_features=True)

    def fused(q, k, v, a, w_e):
        out, alpha = edge_feature_attention(q, k, v, plan, a, w_e, 0.25, return_weights=use_weights)
        return torch.cat([out.flatten()] + ([alpha.flatten()] if use_weights else []))

    want, want_grads = _grads(fused, q, k, v, a, w_e)
    ran = []
    for name in ("edge_terms_forward", "edge_terms_backward"):
        orig = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *args, _o=orig, _n=name: ran.append(_n) or _o(*args))
    torch._dynamo.reset()
    got, got_grads = _grads(torch.compile(fused, backend="aot_eager", fullgraph=True), q, k, v, a, w_e)
    # the op's forward runs; its backward is traced into the compiled backward once
    assert sorted(ran) == ["edge_terms_backward", "edge_terms_forward"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for x, y in zip(got_grads, want_grads):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    Dp = ops.padded_head_dim(C)
    qe = torch.randn(n, H, F, generator=g)
    torch.library.opcheck(torch.ops.gt_fused3s.edge_feature_terms.default, (
        q, k, v, qe, a, list(plan.forward_args(H, Dp)), list(plan.backward_args(H, Dp)), list(plan.bias_args()),
        plan.edge_index[1].long(), *plan.destination_csr(), 0.25, 0.0, 0, None, None, use_weights))


def test_reference_path_draws_one_seed_for_both_terms():
    """On an edge_index (the reference path) dropout without a seed draws
    one for both terms (it passed None to the value term's mask before, a
    TypeError), and equals the call given that seed."""
    ei = torch.tensor([[0, 1, 2, 2, 3], [1, 2, 0, 3, 0]])
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 2, 8, generator=g) for _ in range(3))
    a, w_e = torch.randn(5, 3, generator=g), torch.randn(2, 8, 3, generator=g)
    torch.manual_seed(7)
    out, _ = edge_feature_attention(q, k, v, ei, a, w_e, 0.3, dropout_p=0.4)
    torch.manual_seed(7)
    from gt_fused3s.ops import draw_dropout_seed
    seed = draw_dropout_seed()
    want, _ = edge_feature_attention(q, k, v, ei, a, w_e, 0.3, dropout_p=0.4, dropout_seed=seed)
    torch.testing.assert_close(out, want)


@pytest.fixture(scope="module")
def edge_launches(host_program):
    """tests/edge_launch_host.cu built with nvcc and run (no GPU: the launch
    entry points are wrapped): the tuning constants and a line per launch."""
    wraps = [a for w in ("__cudaGetKernel", "__cudaLaunchKernel", "cudaLaunchKernel")
             for a in ("-Xlinker", f"--wrap={w}")]
    exe = host_program("edge_launch_host.cu", *wraps)
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    words = lines[0].split()
    assert words[0] == "constants", lines[0]
    return {k: int(v) for k, v in zip(words[1::2], words[2::2])}, [ln.split() for ln in lines[1:]]


def expected_launch(c: dict, launcher: str, E: int, N: int, H: int, F: int, aligned: bool) -> tuple:
    """(kernel, index bits, V or K, flag, grid) that edge_terms.cu must pick:
    32-bit flat indices only where the flat count stays below 2^31, 16-byte
    rows only where F % 4 == 0 and the rows are aligned, dot products of
    several heads a thread from dot_group_edges edges on, the scatter's
    sparse split below sparse_degree edges a node; ("none", ...) for no work."""
    def blocks(total):
        return min((total + c["threads"] - 1) // c["threads"], c["max_blocks"])

    def bits(total):
        return 32 if total < 2 ** 31 else 64

    vec = F % 4 == 0 and aligned
    if launcher == "edge_dot":
        grouped = E >= c["dot_group_edges"]
        k = c["dot_heads"] if grouped else 1
        threads = E * (-(-H // k))
        return ("dot", bits(threads), k, int(vec), blocks(threads)) if E * H else ("none", 0, 0, 0, 0)
    if launcher in ("edge_rows", "edge_rows2"):
        total = E * (F // 4 if vec else F)
        return ("rows", bits(total), 4 if vec else 1, 0, blocks(total)) if total else ("none", 0, 0, 0, 0)
    if launcher == "edge_probs":
        total = E * H
        return ("probs", bits(total), 1, 0, blocks(total)) if total else ("none", 0, 0, 0, 0)
    assert launcher == "edge_scatter", launcher
    chunks = F // 4 if vec else F
    sparse = E < c["sparse_degree"] * N
    total = N * -(-H // c["heads_per_thread"]) * chunks * (c["sparse_split"] if sparse else c["split"])
    if not total:
        return ("none", 0, 0, 0, 0)
    hubs = min(-(-N // c["threads"]), c["max_hub_blocks"]) if chunks <= c["threads"] else 0
    return ("scatter", bits(total), 4 if vec else 1, int(sparse), blocks(total) + hubs)


def test_edge_launchers_pick_the_instance_each_shape_needs(edge_launches):
    """Each launcher of edge_terms.cu, for edges up to 3 x 2^30, nodes,
    heads up to 8192, features and aligned or offset rows (3,600 launches),
    launches the instance and grid its contract gives (expected_launch), and
    every one of the 22 instances is reached."""
    constants, launches = edge_launches
    assert len(launches) == 3600
    seen = set()
    for ln in launches:
        launcher, E, N, H, F, aligned = ln[0], *map(int, ln[1:6])
        got = (ln[6], *map(int, ln[7:11]))
        assert got[0] != "unknown", ln
        assert got == expected_launch(constants, launcher, E, N, H, F, bool(aligned)), ln
        seen.add(got[:4])
    assert len(seen - {("none", 0, 0, 0)}) == 22, sorted(seen)
