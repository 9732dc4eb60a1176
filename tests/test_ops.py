"""The public op on the CPU path: same function as the reference, clear errors,
and an import that never builds or touches the GPU."""
import subprocess
import sys

import pytest
import torch

from gt_fused3s import BSBGraph, fused3s_attention
from gt_fused3s.backends import BACKENDS, AttentionGraph, get_backend
from gt_fused3s.reference import attention_reference


def _setup(n=50, e=300, h=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    return ei, q, k, v


def test_cpu_path_equals_reference_with_bsb_or_edge_index():
    ei, q, k, v = _setup()
    g = BSBGraph.from_edge_index(ei, 50)
    ref = attention_reference(q, k, v, g.edge_index)
    torch.testing.assert_close(fused3s_attention(q, k, v, g), ref)
    torch.testing.assert_close(fused3s_attention(q, k, v, ei), ref)      # duplicates count once
    torch.testing.assert_close(fused3s_attention(q, k, v, g, scale=0.3),
                               attention_reference(q, k, v, g.edge_index, 0.3))


def test_cpu_path_is_differentiable():
    ei, q, k, v = _setup(n=20, e=60)
    q.requires_grad_()
    fused3s_attention(q, k, v, ei).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_errors_are_clear():
    ei, q, k, v = _setup()
    g = BSBGraph.from_edge_index(ei, 50)
    with pytest.raises(ValueError, match="q has 49 nodes but the BSB graph was built for num_nodes=50"):
        fused3s_attention(q[:49], k[:49], v[:49], g)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        fused3s_attention(q, k, v[..., :8], g)
    with pytest.raises(ValueError, match="graph must be a GraphPlan, a BSBGraph or an edge_index"):
        fused3s_attention(q, k, v, [[0], [1]])
    with pytest.raises(ValueError, match="compute_dtype must be"):
        fused3s_attention(q, k, v, g, compute_dtype=torch.float64)
    with pytest.raises(ValueError, match="must be on one device"):
        fused3s_attention(q, k.to("meta"), v, g)
    with pytest.raises(ValueError, match="graph is on meta but q, k, v are on cpu"):
        fused3s_attention(q, k, v, g.to("meta"))


@pytest.mark.parametrize("name", ["fused3s", "pyg", "reference", "dense"])
def test_backends_compute_the_same_function(name):
    ei, q, k, v = _setup(n=37, e=150, h=3, d=8, seed=2)
    ei = torch.cat([ei, ei[:, :10]], 1)                   # duplicates count twice everywhere
    graph = AttentionGraph(ei, 37)
    expect = attention_reference(q, k, v, ei, 0.5)
    assert not torch.allclose(expect, attention_reference(q, k, v, ei[:, :-10], 0.5), atol=1e-3)
    torch.testing.assert_close(get_backend(name)(q, k, v, graph, 0.5), expect, atol=1e-5, rtol=1e-5)


def test_backend_registry_errors():
    assert set(BACKENDS) == {"fused3s", "pyg", "reference", "dense", "flex"}
    with pytest.raises(ValueError, match="unknown attention backend 'cusparse'"):
        get_backend("cusparse")
    bad = AttentionGraph(torch.tensor([[0], [9]]), 3)   # checked where the format is built
    with pytest.raises(ValueError, match="index 9 out of range for num_nodes=3"):
        bad.plan


def test_import_never_builds_or_touches_the_gpu():
    code = ("import sys, gt_fused3s, gt_fused3s.nn, gt_fused3s.backends; "
            "assert gt_fused3s._build._OPS is None and gt_fused3s._build._FAILURE is None; "
            "assert 'torch.utils.cpp_extension' not in sys.modules; "
            "import torch; assert not torch.cuda.is_initialized()")
    subprocess.run([sys.executable, "-c", code], check=True)
