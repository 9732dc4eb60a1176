"""The reference attention against the dense masked softmax, and its own
low-precision mode and gradients."""
import pytest
import torch

from gt_fused3s.graph import BSBGraph
from gt_fused3s.reference import attention_dense, attention_reference


def _graph(n, e, seed):
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    return BSBGraph.from_edge_index(ei, n)


def _qkv(n, h, d, seed, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, h, d, generator=gen) * scale).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("n,e,h,d", [(1, 1, 1, 8), (17, 40, 2, 24), (70, 300, 4, 16), (33, 5, 1, 32)])
def test_reference_equals_dense(n, e, h, d):
    g = _graph(n, e, n)
    q, k, v = _qkv(n, h, d, 1)
    out = attention_reference(q, k, v, g.edge_index, compute_dtype=torch.float64)
    dense = attention_dense(q, k, v, g.to_dense_counts(), compute_dtype=torch.float64)
    torch.testing.assert_close(out, dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("logit_scale", [1e2, 1e4])
def test_large_and_negative_logits(logit_scale):
    # scores up to +-1e4: a naive exp overflows, a 0-initialised max or 0-masking breaks
    n, h, d = 40, 2, 8
    g = _graph(n, 200, 3)
    q, k, v = _qkv(n, h, d, 2)
    q = q / q.norm(dim=-1, keepdim=True) * logit_scale ** 0.5 * d ** 0.25
    k = k / k.norm(dim=-1, keepdim=True) * logit_scale ** 0.5 * d ** 0.25
    mask = g.to_dense_counts()
    for kk in (k, -k):          # all-negative scores: the row max must start at -inf, not 0
        exact = attention_reference(q, kk, v, g.edge_index, compute_dtype=torch.float64)
        dense = attention_dense(q, kk, v, mask, compute_dtype=torch.float64)
        torch.testing.assert_close(exact, dense, atol=1e-6, rtol=1e-6)
        # fp32 rounds a logit of 1e4 by ~1e-3: that, not the method, bounds this error
        out = attention_reference(q, kk, v, g.edge_index)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, dense.float(), atol=logit_scale * 1e-7 + 1e-5, rtol=0)


def test_rows_without_neighbours_are_zero_and_output_dtype():
    ei = torch.tensor([[0, 1], [1, 1]])                  # only row 1 has neighbours
    q, k, v = _qkv(4, 2, 8, 0, dtype=torch.float16)
    out = attention_reference(q, k, v, ei)
    assert out.dtype == torch.float16
    assert torch.count_nonzero(out[[0, 2, 3]]) == 0 and torch.count_nonzero(out[1]) > 0
    assert attention_reference(q, k, v, ei, out_dtype=torch.float32).dtype == torch.float32


def test_single_neighbour_copies_value():
    ei = torch.tensor([[2], [0]])
    q, k, v = _qkv(3, 1, 8, 5)
    torch.testing.assert_close(attention_reference(q, k, v, ei)[0], v[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_mode_is_close_but_not_exact(dtype):
    g = _graph(64, 600, 9)
    q, k, v = _qkv(64, 2, 32, 4, dtype=dtype)
    exact = attention_reference(q, k, v, g.edge_index, out_dtype=torch.float32)
    low = attention_reference(q, k, v, g.edge_index, compute_dtype=dtype, out_dtype=torch.float32)
    err = (low - exact).abs().max().item()
    eps = torch.finfo(dtype).eps
    assert 0 < err < 20 * eps


def test_gradcheck_float64():
    g = _graph(12, 40, 1)
    q, k, v = (t.double().requires_grad_() for t in _qkv(12, 2, 4, 3))
    assert torch.autograd.gradcheck(
        lambda a, b, c: attention_reference(a, b, c, g.edge_index, compute_dtype=torch.float64),
        (q, k, v))


def test_value_dim_may_differ_and_bad_shapes():
    ei = torch.tensor([[0, 1], [1, 0]])
    q, k, _ = _qkv(2, 1, 8, 0)
    assert attention_reference(q, k, torch.randn(2, 1, 5), ei).shape == (2, 1, 5)
    with pytest.raises(ValueError, match=r"q must have shape \[N, H, D\]"):
        attention_reference(q[0], k, k, ei)
    with pytest.raises(ValueError, match="must share"):
        attention_reference(q, k[:, :, :4], k, ei)
    with pytest.raises(ValueError, match="floating-point"):
        attention_reference(q.long(), k, k, ei)
    with pytest.raises(ValueError, match=r"mask must be bool or integer \[N, N\]"):
        attention_dense(q, k, k, torch.ones(3, 3, dtype=torch.bool))


def test_float64_stays_float64_and_gradcheck():
    """The CPU path computes float64 inputs in float64 end to end, so
    gradcheck holds (duplicates included)."""
    from gt_fused3s import fused3s_attention
    n = 9
    ei = torch.tensor([[0, 1, 2, 3, 3, 8, 5, 5], [1, 2, 3, 0, 0, 8, 4, 4]])
    q, k, v = (t.double().requires_grad_() for t in _qkv(n, 2, 4, 3))
    out = fused3s_attention(q, k, v, ei)
    assert out.dtype == torch.float64
    exact = attention_dense(q, k, v, torch.zeros(n, n, dtype=torch.int64).index_put_(
        (ei[1], ei[0]), torch.ones(ei.size(1), dtype=torch.int64), accumulate=True),
        compute_dtype=torch.float64)
    assert (out - exact).abs().max() < 1e-12
    assert torch.autograd.gradcheck(lambda a, b, c: fused3s_attention(a, b, c, ei, 0.7), (q, k, v))
