"""CUDA inputs take the fused kernel through every public entry point: the
PyG layer and the Graph Transformer's fused3s backend (run on the GPU machine).
DGL has no CUDA build on PyPI; its layer shares ops.fused3s_attention."""
import pytest
import torch

import gt_fused3s.ops as ops_mod

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Launches of the forward kernel (``torch.ops.gt_fused3s.fwd``, or
    ``fwd_scores`` where the weights are returned, or the C++ op
    ``edge_feature_eager``, which launches fwd_scores itself), by whichever
    path of the op (eager fast path, autograd, general)."""
    from gt_fused3s._build import load_extension
    load_extension()
    calls = []
    lookup = ops_mod._op

    def counting(name):
        op = lookup(name)
        if name not in ("fwd", "fwd_scores", "edge_feature_eager"):
            return op

        def run(*args):
            calls.append(1)
            return op(*args)
        return run
    monkeypatch.setattr(ops_mod, "_op", counting)
    return calls


def _graph(n, e, seed):
    g = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=g)
    return torch.cat([ei, ei[:, :e // 10]], 1).cuda()   # duplicates count, as in TransformerConv


@pytest.mark.parametrize("heads,concat,beta", [(1, True, False), (4, True, True), (4, False, False)])
def test_pyg_layer_on_cuda_takes_the_kernel_and_matches_transformerconv(kernel_calls, heads, concat, beta):
    from torch_geometric.nn import TransformerConv
    from gt_fused3s.nn import Fused3SConv
    torch.manual_seed(0)
    n = 1003
    ei = _graph(n, 6 * n, 1)
    x = torch.randn(n, 48, device="cuda")
    ref = TransformerConv(48, 32, heads=heads, concat=concat, beta=beta).cuda()
    fused = Fused3SConv(48, 32, heads=heads, concat=concat, beta=beta).cuda()
    fused.load_state_dict(ref.state_dict())
    with torch.no_grad():
        expect = ref(x, ei)
        out = fused(x, ei)                       # fp32 features, fp16 tensor-core operands
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_bf16 = fused(x, ei)
    assert len(kernel_calls) == 2
    scale = expect.abs().max().item()
    assert (out - expect).abs().max().item() < 5e-3 * scale
    assert (out_bf16.float() - expect).abs().max().item() < 5e-2 * scale

    # gradients flow (kernel forward, reference backward) and agree
    xg = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    fused(xg, ei).square().sum().backward()
    ref(xr, ei).square().sum().backward()
    assert len(kernel_calls) == 3
    torch.testing.assert_close(xg.grad, xr.grad, atol=5e-3 * xr.grad.abs().max().item(), rtol=0)


def test_graph_transformer_fused3s_backend_on_cuda(kernel_calls):
    from gt_fused3s.models import GraphTransformer
    torch.manual_seed(0)
    n = 2000
    ei = _graph(n, 8 * n, 2)
    x = torch.randn(n, 16, device="cuda")
    model = GraphTransformer(16, 64, 8, num_layers=10, heads=2, backend="reference").cuda().eval()
    with torch.inference_mode():
        exact = model(x, ei)                                     # fp32 everywhere
        with torch.autocast("cuda", dtype=torch.float16):
            ref_fp16 = model(x, ei).float()                      # fp16 linears, fp32 attention
            model.backend = "fused3s"
            fused = model(x, ei).float()
    assert len(kernel_calls) == 10                               # every block took the kernel
    err_ref = (ref_fp16 - exact).abs().max().item()
    err_fused = (fused - exact).abs().max().item()
    assert torch.isfinite(fused).all()
    assert err_fused <= 2 * err_ref + 1e-2, (err_fused, err_ref)


@pytest.mark.parametrize("heads,out_channels,edge_dim", [(4, 16, 16), (1, 64, 8)])
def test_pyg_layer_edge_features_and_weights_on_cuda(kernel_calls, heads, out_channels, edge_dim):
    """edge_dim and return_attention_weights on the kernel path (edge bias,
    probabilities pass, their gradients) against TransformerConv in fp32:
    outputs, weights and the gradients of x, edge_attr and every parameter."""
    from torch_geometric.nn import TransformerConv
    from gt_fused3s.nn import Fused3SConv
    torch.manual_seed(0)
    n = 1003
    ei = _graph(n, 6 * n, 3)
    x = torch.randn(n, 48, device="cuda")
    ea = torch.randn(ei.size(1), edge_dim, device="cuda")
    ref = TransformerConv(48, out_channels, heads=heads, edge_dim=edge_dim, beta=True).cuda()
    fused = Fused3SConv(48, out_channels, heads=heads, edge_dim=edge_dim, beta=True).cuda()
    fused.load_state_dict(ref.state_dict())
    results = []
    for conv in (ref, fused):
        xg, eag = x.clone().requires_grad_(), ea.clone().requires_grad_()
        out, (_, alpha) = conv(xg, ei, eag, return_attention_weights=True)
        (out.square().sum() + (alpha * torch.linspace(0, 1, alpha.numel(), device="cuda").view_as(alpha)).sum()
         ).backward()
        results.append({"out": out.detach(), "alpha": alpha.detach(), "x": xg.grad, "edge_attr": eag.grad,
                        **{k: p.grad for k, p in conv.named_parameters()}})
    assert len(kernel_calls) == 1
    grad_scale = max(results[0][k].abs().max().item() for k in results[0] if k not in ("out", "alpha"))
    for name, expect in results[0].items():
        got = results[1][name]
        # fp16 tensor-core operands: q and k rounded, so scores (and the
        # weights, which the edge terms multiply) move by ~1e-3 of their
        # size; gradients that are 0 in exact arithmetic (lin_key.bias: a
        # shift of every key changes no softmax) get a floor from the others
        floor = 1e-3 * grad_scale if name not in ("out", "alpha") else 0.0
        tol = 1e-2 * max(expect.abs().max().item(), 1e-3) + floor
        err = (got.float() - expect).abs().max().item()
        assert err <= tol, f"{name}: max err {err:.3e} > tol {tol:.3e}"
