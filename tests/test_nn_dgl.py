"""gt_fused3s.nn.dgl.Fused3SConv against DGL's own unfused computation
(u_dot_v -> edge_softmax -> u_mul_e / sum) with the same projections."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("DGLBACKEND", "pytorch")
dgl = pytest.importorskip("dgl")

import dgl.function as fn  # noqa: E402
from dgl.base import DGLError  # noqa: E402
from dgl.nn.functional import edge_softmax  # noqa: E402

import gt_fused3s.nn.dgl as dgl_mod  # noqa: E402
from gt_fused3s import BSBGraph  # noqa: E402
from gt_fused3s.nn.dgl import Fused3SConv  # noqa: E402

try:
    from graph_cases import GRAPH_CASES
except ImportError:  # tests/ collected as a package
    from tests.graph_cases import GRAPH_CASES

ATOL, RTOL = 1e-5, 1e-5
F_IN, D = 19, 24


@pytest.fixture
def fused_calls(count_calls):
    return count_calls(dgl_mod, "fused3s_attention")


@pytest.fixture
def bsb_builds(count_calls):
    return count_calls(BSBGraph, "_build")


def dgl_unfused(conv, g, feat, edge_bias=None):
    """DGL's own computation with conv's projections (the ground truth);
    ``edge_bias`` [E, H] added to the scaled scores before the softmax."""
    feat_src, feat_dst = feat if isinstance(feat, tuple) else (feat, feat)
    H, Dh = conv._num_heads, conv._out_feats
    with g.local_scope():
        g.srcdata["k"] = conv.k_proj(feat_src).view(-1, H, Dh)
        g.srcdata["v"] = conv.v_proj(feat_src).view(-1, H, Dh)
        g.dstdata["q"] = conv.q_proj(feat_dst).view(-1, H, Dh)
        g.apply_edges(fn.u_dot_v("k", "q", "e"))
        score = g.edata["e"] / Dh ** 0.5
        if edge_bias is not None:
            score = score + edge_bias.unsqueeze(-1)
        g.edata["a"] = edge_softmax(g, score)
        g.update_all(fn.u_mul_e("v", "a", "m"), fn.sum("m", "h"))
        return g.dstdata["h"], g.edata["a"]


def to_dgl(case):
    edge_index, n = GRAPH_CASES[case]()
    return dgl.graph((edge_index[0], edge_index[1]), num_nodes=n)


def with_self_loops(g):
    """Every node gets exactly one self loop (no duplicates)."""
    return dgl.add_self_loop(dgl.remove_self_loop(g))


def random_feat(n, f=F_IN, seed=1):
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed))


def make_conv(in_feats=F_IN, out_feats=D, num_heads=3, seed=0, **kwargs):
    torch.manual_seed(seed)
    return Fused3SConv(in_feats, out_feats, num_heads, **kwargs)


def assert_close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("num_heads", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_dgl_with_self_loops(num_heads, bias, fused_calls):
    g = with_self_loops(to_dgl("random_1003"))
    conv = make_conv(num_heads=num_heads, bias=bias)
    feat = random_feat(g.num_nodes())
    out = conv(g, feat)
    assert out.shape == (g.num_nodes(), num_heads, D)
    assert_close(out, dgl_unfused(conv, g, feat)[0])
    assert len(fused_calls) == 1


@pytest.mark.parametrize("case", ["random_1003", "empty_rows", "isolated_nodes", "heavy_node",
                                  "single_node", "no_edges"])
def test_matches_dgl_with_zero_in_degree_allowed(case, fused_calls):
    g = to_dgl(case)
    conv = make_conv(allow_zero_in_degree=True)
    feat = random_feat(g.num_nodes())
    out = conv(g, feat)
    assert_close(out, dgl_unfused(conv, g, feat)[0])
    zero = g.in_degrees() == 0
    assert torch.all(out[zero] == 0)
    assert len(fused_calls) == 1


def test_matches_dgl_on_batched_graphs(fused_calls):
    gen = torch.Generator().manual_seed(7)
    graphs = []
    for n in [5, 17, 1, 33, 12, 40, 9]:
        e = int(torch.randint(0, 3 * n + 1, (1,), generator=gen))
        src, dst = torch.randint(0, n, (2, e), generator=gen)
        graphs.append(dgl.to_simple(dgl.add_self_loop(dgl.graph((src, dst), num_nodes=n))))
    bg = dgl.batch(graphs)
    conv = make_conv(num_heads=3)
    feat = random_feat(bg.num_nodes())
    assert_close(conv(bg, feat), dgl_unfused(conv, bg, feat)[0])
    assert len(fused_calls) == 1


def test_zero_in_degree_raises_dgl_error():
    g = to_dgl("isolated_nodes")
    conv = make_conv()
    with pytest.raises(DGLError, match=r"There are 0-in-degree nodes in the graph.*"
                                       r"allow_zero_in_degree"):
        conv(g, random_feat(g.num_nodes()))
    conv.set_allow_zero_in_degree(True)
    conv(g, random_feat(g.num_nodes()))


def test_gradients_match():
    g = with_self_loops(to_dgl("empty_rows"))
    conv = make_conv(num_heads=3)
    grads = []
    for run in (lambda f: conv(g, f), lambda f: dgl_unfused(conv, g, f)[0]):
        conv.zero_grad()
        feat = random_feat(g.num_nodes()).requires_grad_()
        out = run(feat)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({"feat": feat.grad.clone(),
                      **{k: p.grad.clone() for k, p in conv.named_parameters()}})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


def test_pair_features_on_homogeneous_graph(fused_calls):
    g = with_self_loops(to_dgl("empty_rows"))
    conv = make_conv(in_feats=(F_IN, 7))
    feat = (random_feat(g.num_nodes(), F_IN), random_feat(g.num_nodes(), 7, seed=2))
    assert_close(conv(g, feat), dgl_unfused(conv, g, feat)[0])
    assert len(fused_calls) == 1


@pytest.mark.parametrize("n_src,n_dst", [(30, 21), (21, 30)])
def test_bipartite_and_get_attention_fused(n_src, n_dst, fused_calls):
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, n_src, (80,), generator=gen)
    dst = torch.randint(0, n_dst, (80,), generator=gen)
    src, dst = torch.cat([src, src[:6]]), torch.cat([dst, dst[:6]])       # duplicates
    g = dgl.heterograph({("u", "e", "v"): (src, dst)}, num_nodes_dict={"u": n_src, "v": n_dst})
    conv = make_conv(in_feats=(F_IN, 7), allow_zero_in_degree=True)
    feat = (random_feat(n_src, F_IN), random_feat(n_dst, 7, seed=2))
    ref, ref_attn = dgl_unfused(conv, g, feat)
    assert_close(conv(g, feat), ref)
    out, attn = conv(g, feat, get_attention=True)
    assert_close(out, ref)
    assert attn.shape == ref_attn.shape
    assert_close(attn, ref_attn)
    assert len(fused_calls) == 2


@pytest.mark.parametrize("bipartite", [False, True])
def test_edge_bias_fused_with_gradients(bipartite, fused_calls):
    """An attention bias per edge and head (graph edge order, duplicates
    included): output, attention and the gradients of the features and of
    the bias equal DGL's computation with the bias added to the scores."""
    gen = torch.Generator().manual_seed(4)
    if bipartite:
        src, dst = torch.randint(0, 25, (90,), generator=gen), torch.randint(0, 17, (90,), generator=gen)
        src, dst = torch.cat([src, src[:5]]), torch.cat([dst, dst[:5]])
        g = dgl.heterograph({("u", "e", "v"): (src, dst)}, num_nodes_dict={"u": 25, "v": 17})
        conv = make_conv(in_feats=(F_IN, 7), allow_zero_in_degree=True)
        feat = (random_feat(25, F_IN), random_feat(17, 7, seed=2))
    else:
        g = with_self_loops(to_dgl("duplicates"))
        conv = make_conv()
        feat = random_feat(g.num_nodes())
    bias = torch.randn(g.num_edges(), 3, generator=gen)
    results = []
    for run in ("fused", "dgl"):
        conv.zero_grad()
        leaves = [t.clone().requires_grad_() for t in (feat if bipartite else (feat,))]
        b = bias.clone().requires_grad_()
        f = tuple(leaves) if bipartite else leaves[0]
        out, attn = (conv(g, f, get_attention=True, edge_bias=b) if run == "fused"
                     else dgl_unfused(conv, g, f, edge_bias=b))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, attn, b.grad, *(t.grad for t in leaves)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len(fused_calls) == 1
    with pytest.raises(DGLError, match=r"edge_bias has shape \(5, 3\)"):
        conv(g, feat, edge_bias=bias[:5])


def test_neighbour_sampling_block_fused_with_gradients(fused_calls):
    """A block of dgl.to_block (destination nodes first among the sources):
    outputs and gradients of the features and parameters as DGL's."""
    g = with_self_loops(to_dgl("random_1003"))
    seeds = torch.arange(0, 1003, 7)
    block = dgl.to_block(dgl.sampling.sample_neighbors(g, seeds, 5), seeds)
    conv = make_conv()
    grads = []
    for run in (lambda f: conv(block, f), lambda f: dgl_unfused(conv, block, (f, f[:block.num_dst_nodes()]))[0]):
        feat = random_feat(block.num_src_nodes()).requires_grad_()
        conv.zero_grad()
        out = run(feat)
        assert out.shape == (block.num_dst_nodes(), 3, D)
        out.square().sum().backward()
        grads.append((out.detach(), feat.grad, *(p.grad.clone() for p in conv.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert len(fused_calls) == 1


def test_bsb_built_once_per_graph(bsb_builds, fused_calls):
    g = to_dgl("self_loops")
    conv1 = make_conv(num_heads=2, seed=0)
    conv2 = make_conv(in_feats=D, num_heads=2, seed=1)
    feat = random_feat(g.num_nodes())
    for _ in range(2):
        conv2(g, conv1(g, feat).mean(1))
    assert len(bsb_builds) == 1 and len(fused_calls) == 4
    bsb = Fused3SConv.to_graph_format(g)
    assert bsb is Fused3SConv.to_graph_format(g, "cpu") and len(bsb_builds) == 1
    # a graph changed in place is rebuilt, and the result still matches DGL
    g.add_edges(torch.tensor([0, 1]), torch.tensor([5, 9]))
    assert_close(conv1(g, feat), dgl_unfused(conv1, g, feat)[0])
    assert len(bsb_builds) == 2
    # an edit that keeps the node and edge counts is seen too (DGL makes a
    # new structure index on every edit)
    E = g.num_edges()
    g.remove_edges(torch.tensor([E - 2, E - 1]))            # the two edges added above
    g.add_edges(torch.tensor([3, 4]), torch.tensor([5, 9]))  # other sources, same rows
    assert_close(conv1(g, feat), dgl_unfused(conv1, g, feat)[0])
    assert len(bsb_builds) == 3


def test_duplicate_edges_count_as_in_dgl():
    g = dgl.add_self_loop(to_dgl("duplicates"))
    conv = make_conv()
    feat = random_feat(g.num_nodes())
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no warning: nothing differs
        out = conv(g, feat)
    assert_close(out, dgl_unfused(conv, g, feat)[0])


def test_bad_features_raise_dgl_error():
    g = to_dgl("self_loops")
    conv = make_conv()
    with pytest.raises(DGLError, match=r"feat_src has shape \(32, 19\) but the graph has 33"):
        conv(g, random_feat(32))
    with pytest.raises(DGLError, match=r"feat_src must be a floating-point tensor"):
        conv(g, random_feat(33).long())
    with pytest.raises(DGLError, match=r"expects 19 features"):
        conv(g, random_feat(33, 5))


def test_bad_sizes_numpy_sizes_and_torchscript():
    import numpy as np
    for kwargs, match in (({"out_feats": 0}, "out_feats must be an int >= 1 .got 0."),
                          ({"num_heads": 0}, "num_heads must be an int >= 1 .got 0."),
                          ({"num_heads": 1.5}, "num_heads must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            Fused3SConv(**{"in_feats": F_IN, "out_feats": D, "num_heads": 2, **kwargs})
    g = to_dgl("self_loops")
    conv = Fused3SConv(np.int64(F_IN), np.int64(D), np.int32(2))
    assert conv(g, random_feat(g.num_nodes())).shape == (g.num_nodes(), 2, D)
    with pytest.raises(RuntimeError, match="cannot be compiled by TorchScript.*torch.compile.*torch.export"):
        torch.jit.script(conv)


def test_compiled_layer_builds_its_plan_eagerly(stand_in_kernels, schedule_builds):
    """Under torch.compile the graph's cached plan and its kernel arrays are
    built eagerly (kept on the DGLGraph's cache entry: built by the compiled
    graph, they would be CUDA-graph outputs under reduce-overhead), once;
    outputs and gradients equal eager."""
    traced = schedule_builds
    torch._dynamo.reset()
    g = to_dgl("self_loops")
    conv = make_conv(num_heads=2)
    compiled = torch.compile(conv, backend="aot_eager")
    feat = random_feat(g.num_nodes())
    for _ in range(3):
        fc = feat.clone().requires_grad_()
        out_c = compiled(g, fc)
        out_c.square().sum().backward()
    assert traced == [False, False], traced      # forward and backward schedules, eagerly, once
    fe = feat.clone().requires_grad_()
    out_e = conv(g, fe)
    torch.testing.assert_close(out_c, out_e, atol=1e-5, rtol=1e-5)
    out_e.square().sum().backward()
    torch.testing.assert_close(fc.grad, fe.grad, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def test_heterograph_with_another_node_type_raises_like_dotgatconv():
    """One edge type but an extra node type: DotGatConv refuses it, and so
    does the layer (the edges' ids are per node type); one relation works."""
    g = dgl.heterograph({("user", "follows", "user"): (torch.tensor([0, 1, 2]), torch.tensor([1, 2, 0]))},
                        num_nodes_dict={"user": 3, "item": 5})
    conv = dgl_mod.Fused3SConv(4, 2, 2)
    with pytest.raises(DGLError, match=r"one edge type and one node type on each side.*g\[etype\]"):
        conv(g, torch.randn(8, 4))
    from dgl.nn import DotGatConv
    with pytest.raises((AssertionError, DGLError)):      # DGL's own layer refuses it too
        DotGatConv(4, 2, 2)(g, torch.randn(8, 4))
    assert conv(g["follows"], torch.randn(3, 4)).shape == (3, 2, 2)


def test_reset_parameters_and_state_dict():
    conv = make_conv(num_heads=3)
    assert sorted(conv.state_dict()) == sorted(
        f"{p}_proj.{w}" for p in "qkv" for w in ("weight", "bias"))
    other = make_conv(num_heads=3, seed=5)
    other.load_state_dict(conv.state_dict(), strict=True)
    g = to_dgl("self_loops")
    feat = random_feat(g.num_nodes())
    assert_close(other(g, feat), conv(g, feat))
    conv.reset_parameters()
    assert torch.all(conv.q_proj.bias == 0)
