"""The Graph Transformer: one set of weights, the same outputs under every
backend; readouts, norms, and one BSB per forward."""
import pytest
import torch

from gt_fused3s.backends import AttentionGraph
from gt_fused3s.data import molecule_batch, power_law_graph
from gt_fused3s.models import GraphTransformer

CPU_BACKENDS = ["fused3s", "pyg", "reference", "dense"]


def _molecules(num_graphs=6, features=12, seed=0):
    edge_index, ptr = molecule_batch(num_graphs, isolated_prob=0.5, seed=seed)
    n = int(ptr[-1])
    batch = torch.repeat_interleave(torch.arange(num_graphs), ptr[1:] - ptr[:-1])
    x = torch.randn(n, features, generator=torch.Generator().manual_seed(seed))
    return x, edge_index, batch


def _model(**kw):
    torch.manual_seed(0)
    args = dict(in_channels=12, hidden_channels=32, out_channels=5, heads=2)
    args.update(kw)
    return GraphTransformer(**args).eval()


@pytest.mark.parametrize("norm", ["layer", "batch"])
@pytest.mark.parametrize("readout", ["node", "graph"])
def test_same_outputs_across_backends(norm, readout):
    x, ei, batch = _molecules()
    model = _model(norm=norm, readout=readout)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    outs = {}
    with torch.no_grad():
        for backend in CPU_BACKENDS:
            model.backend = backend
            outs[backend] = model(x, ei, batch)
    for k, v in model.state_dict().items():      # switching backends leaves weights alone
        assert torch.equal(v, state[k])
    for backend, out in outs.items():
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, outs["reference"], atol=2e-5, rtol=1e-5,
                                   msg=f"{backend} differs from reference")


def test_power_law_graph_agrees_and_depends_on_the_graph():
    n = 300
    ei = power_law_graph(n, avg_degree=6, max_degree=60, seed=1)
    x = torch.randn(n, 12, generator=torch.Generator().manual_seed(1))
    model = _model(heads=4, hidden_channels=64)
    with torch.no_grad():
        ref = model(x, ei)
        for backend in ("fused3s", "pyg", "dense"):
            model.backend = backend
            torch.testing.assert_close(model(x, ei), ref, atol=2e-5, rtol=1e-5)
        other = model(x, power_law_graph(n, avg_degree=6, max_degree=60, seed=2))
    assert (other - ref).abs().max() > 1e-3       # the attention is not a no-op


def test_readout_shapes():
    x, ei, batch = _molecules(num_graphs=5)
    assert _model(readout="node")(x, ei).shape == (x.size(0), 5)
    model = _model(readout="graph", num_layers=2)
    assert model(x, ei, batch).shape == (5, 5)
    assert model(x, ei).shape == (1, 5)           # no batch: one graph


def test_constructor_options():
    model = _model(num_layers=3, heads=4, hidden_channels=30)   # 30 // 4 = 7 per head
    assert len(model.blocks) == 3 and model.blocks[0].qkv.out_features == 3 * 28
    assert isinstance(_model(norm="batch").blocks[0].norm1, torch.nn.BatchNorm1d)
    assert len(_model().blocks) == 10
    x, ei, _ = _molecules()
    assert model(x, ei).shape == (x.size(0), 5)
    with pytest.raises(ValueError, match="norm"):
        _model(norm="group")
    with pytest.raises(ValueError, match="readout"):
        _model(readout="edge")
    with pytest.raises(ValueError, match="unknown attention backend"):
        _model(backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.backend = "nope"
    assert model.backend == "fused3s"


def test_bad_sizes_numpy_sizes_and_torchscript():
    """Sizes: one-line ValueErrors (heads=0 was a ZeroDivisionError), numpy
    integers accepted; TorchScript fails at once pointing to torch.compile
    and torch.export (tests/test_compile.py exports the model)."""
    import numpy as np
    for kwargs, match in (({"heads": 0}, "heads must be an int >= 1"),
                          ({"hidden_channels": 0}, "hidden_channels must be an int >= 1"),
                          ({"num_layers": 0}, "num_layers must be an int >= 1"),
                          ({"heads": 2.0}, "heads must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            _model(**kwargs)
    model = GraphTransformer(np.int64(4), np.int64(16), np.int32(5), num_layers=np.int64(2), heads=np.int64(2))
    x, ei, _ = _molecules()
    assert model(x[:, :4], ei).shape == (x.size(0), 5)
    with pytest.raises(RuntimeError, match="cannot be compiled by TorchScript.*torch.compile.*torch.export"):
        torch.jit.script(model)


def test_plan_built_once_per_forward(stand_in_kernels):
    calls = stand_in_kernels.calls             # the kernel path, with CPU stand-ins
    builds = lambda: calls.count("bsb_build")  # noqa: E731
    x, ei, _ = _molecules()
    model = _model()                               # 10 blocks, backend fused3s
    with torch.no_grad():
        model(x, ei)
        assert builds() == 1 and calls.count("fwd") == 10
        model(x, ei)                               # a forward is a new graph
        assert builds() == 2
        graph = model.make_graph(ei, x.size(0))
        model(x, None, graph=graph)
        model(x, None, graph=graph)                # prebuilt: reused
        assert builds() == 3
        model(x, None, graph=graph.plan)           # a GraphPlan is accepted too
        model(x, None, graph=graph.plan.bsb)       # and a BSBGraph
        assert builds() == 3
    model.train()
    out = model(x, None, graph=graph)              # training: the transposed format, once
    out.sum().backward()
    assert builds() == 4 and calls.count("bwd") == 10


def test_prebuilt_graph_checks():
    x, ei, _ = _molecules()
    model = _model()
    with pytest.raises(ValueError, match="nodes"):
        model(x[:-1], None, graph=AttentionGraph(ei, x.size(0)))
    with pytest.raises(ValueError, match="edge_index or graph"):
        model(x, None)


def test_attention_timer_and_profiler_ranges():
    x, ei, _ = _molecules()
    model = _model(num_layers=4)
    with torch.no_grad():
        with model.attention_timer() as timer:
            model(x, ei)
            model(x, ei)
        assert timer.count("attention") == 8 and timer.count("format") == 2
        assert timer.ms("attention") > 0 and timer.ms("format") > 0
        model(x, ei)                               # the timer is off again
        assert timer.count("attention") == 8
        with torch.profiler.profile() as prof:
            model(x, ei)
    names = [e.name for e in prof.events()]
    assert names.count("gt_fused3s::attention") == 4
    assert names.count("gt_fused3s::format") == 1


def test_self_loops_and_training_step():
    x, ei, batch = _molecules()
    model = _model(self_loops=True, dropout=0.1, readout="graph").train()
    g = model.make_graph(ei, x.size(0))
    loops = g.edge_index[0] == g.edge_index[1]
    assert int(loops.sum()) == x.size(0)
    model(x, ei, batch).square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_edge_features_bias_every_backend_alike():
    """GraphTransformer(edge_vocab=...): the blocks' attention bias from
    edge_attr gives one function under fused3s (CPU path), pyg and reference;
    another edge typing changes the output; dense refuses clearly."""
    from gt_fused3s.models import GraphTransformer
    from graph_cases import molecule_batches
    data = molecule_batches(1, 8, 6)[0]
    assert data.edge_attr.shape == (data.edge_index.size(1), 1)
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 2, num_layers=3, heads=2, readout="graph", edge_vocab=(4,)).eval()
    outs = {}
    for backend in ("fused3s", "pyg", "reference"):
        model.backend = backend
        outs[backend] = model(data.x, data.edge_index, data.batch, edge_attr=data.edge_attr)
    torch.testing.assert_close(outs["fused3s"], outs["pyg"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["reference"], outs["pyg"], atol=1e-5, rtol=1e-5)
    other = model(data.x, data.edge_index, data.batch, edge_attr=(data.edge_attr + 1) % 4)
    assert not torch.allclose(other, outs["reference"], atol=1e-4)
    model.backend = "dense"
    with pytest.raises(ValueError, match="dense backend takes no per-edge bias"):
        model(data.x, data.edge_index, data.batch, edge_attr=data.edge_attr)
    with pytest.raises(ValueError, match=r"edge_attr must be an integer \[E, 1\]"):
        model.backend = "pyg"
        model(data.x, data.edge_index, data.batch, edge_attr=data.edge_attr.float())
    with pytest.raises(ValueError, match="self_loops adds edges without edge features"):
        GraphTransformer(6, 16, 2, self_loops=True, edge_vocab=(4,))


def test_edge_encoder_equals_embedding_lookups():
    """EdgeEncoder's multi-hot product equals the sum of one embedding lookup
    per column, forward and gradients (fp32 under bf16 autocast too), and a
    code outside its column's vocabulary raises instead of adding nothing."""
    from gt_fused3s.models.graph_transformer import EdgeEncoder
    torch.manual_seed(0)
    enc = EdgeEncoder((5, 3, 2), heads=4)
    attr = torch.stack([torch.randint(0, v, (300,)) for v in enc.vocab], 1)
    ref = sum(e(attr[:, c]) for c, e in enumerate(enc.embeddings))
    grad = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, list(enc.parameters()), grad)
    with torch.autocast("cpu", torch.bfloat16):
        out = enc(attr)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for g, r in zip(torch.autograd.grad(out, list(enc.parameters()), grad), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    for bad in (5, -1):
        wrong = attr.clone()
        wrong[7, 0] = bad
        with pytest.raises(RuntimeError, match="outside its column's vocabulary"):
            enc(wrong)
