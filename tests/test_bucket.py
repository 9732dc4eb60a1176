"""Static shapes for batches (gt_fused3s.data.bucket): a padded batch gives
the real nodes and graphs exactly their unpadded outputs and the same loss,
and a stream of batches needs only a few shapes."""
import pytest
import torch

from gt_fused3s.drivers.train import compute_loss
from gt_fused3s.data.bucket import Bucket, Buckets, pad_arrays
from gt_fused3s.models import GraphTransformer

from graph_cases import molecule_batches


@pytest.fixture(scope="module")
def batches():
    return molecule_batches(5, 8, 6, seed=3)


def _sizes(batches):
    return [(d.num_nodes, d.edge_index.size(1), d.ptr.numel() - 1) for d in batches]


def test_fit_covers_every_batch_with_few_shapes(batches):
    buckets = Buckets.fit(_sizes(batches), max_buckets=2)
    assert 1 <= len(buckets.buckets) <= 2
    for n, e, g in _sizes(batches):
        b = buckets.bucket_of(n, e, g)
        assert b in buckets.buckets and b.num_nodes > n and b.num_edges >= e and b.num_graphs > g
        assert b.num_nodes % 16 == 0 and b.num_edges % 64 == 0
    # past the largest bucket: the growth ladder, still few shapes
    big = {buckets.bucket_of(n, 10 * n, 0) for n in range(2000, 4000, 7)}
    assert len(big) <= 8 and all(b.num_nodes > 2000 for b in big)   # node and edge steps of the ladder


@pytest.mark.parametrize("norm", ["layer", "batch"])
def test_padded_batch_gives_the_real_outputs_and_loss(batches, norm):
    buckets = Buckets.fit(_sizes(batches), max_buckets=2)
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 1, num_layers=3, heads=2, readout="graph", norm=norm).eval()
    for d in batches:
        p = buckets.pad_batch(d)
        G = d.ptr.numel() - 1
        assert p.num_nodes == p.bucket.num_nodes and p.edge_index.size(1) == p.bucket.num_edges
        assert int(p.node_mask.sum()) == d.num_nodes and int(p.graph_mask.sum()) == G
        assert p.ptr.numel() == p.bucket.num_graphs + 1 and int(p.ptr[-1]) == p.bucket.num_nodes
        # padding edges stay among padding nodes
        pad_e = p.edge_index[:, d.edge_index.size(1):]
        assert (pad_e >= d.num_nodes).all()
        with torch.no_grad():
            want = model(d.x, d.edge_index, d.batch, num_graphs=G)
            got = model(p.x, p.edge_index, p.batch, num_graphs=p.bucket.num_graphs)
        torch.testing.assert_close(got[:G], want, atol=1e-5, rtol=1e-5)
        assert torch.isnan(p.y[G:]).all()
        for kind in ("mse", "bce"):
            y = d.y if kind == "mse" else (d.y > 0).float()
            py = p.y if kind == "mse" else torch.where(p.graph_mask, (p.y > 0).float(), 0.0)
            torch.testing.assert_close(compute_loss(kind, got, py, p.graph_mask),
                                       compute_loss(kind, want, y))
        labels = (d.y > 0).long()
        plabels = torch.cat([labels, labels.new_zeros(p.bucket.num_graphs - G)])
        two = torch.cat([got, -got], 1)
        torch.testing.assert_close(compute_loss("ce", two, plabels, p.graph_mask),
                                   compute_loss("ce", torch.cat([want, -want], 1), labels))


def test_node_level_padding_and_errors():
    x = torch.randn(30, 4)
    ei = torch.randint(0, 30, (2, 90), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (30,))
    b = Bucket(48, 128, 0)
    xp, ep, batch, yp, node_mask, graph_mask = pad_arrays(x, ei, b, y=y)
    assert xp.shape == (48, 4) and ep.shape == (2, 128) and batch is None and graph_mask is None
    assert torch.equal(yp[:30], y) and (yp[30:] == 0).all() and int(node_mask.sum()) == 30
    torch.manual_seed(0)
    model = GraphTransformer(4, 16, 3, num_layers=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(xp, ep)[:30], model(x, ei), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        pad_arrays(x, ei, Bucket(30, 128, 0))                 # no room for a padding node
    with pytest.raises(ValueError, match="out of range"):
        pad_arrays(x, torch.tensor([[0], [30]]), b)
    with pytest.raises(ValueError, match="max_buckets"):
        Buckets.fit([(1, 1, 1)], max_buckets=0)


def test_pad_dgl():
    dgl = pytest.importorskip("dgl")
    g = dgl.graph((torch.tensor([0, 1, 2, 2]), torch.tensor([1, 2, 0, 0])), num_nodes=5)
    feat = torch.randn(5, 3)
    pg, pf, mask = Buckets([Bucket(16, 64, 0)]).pad_dgl(g, feat)
    assert pg.num_nodes() == 16 and pg.num_edges() == 64 and pf.shape == (16, 3)
    src, dst = pg.edges()
    assert torch.equal(src[:4], torch.tensor([0, 1, 2, 2])) and (src[4:] >= 5).all() and (dst[4:] >= 5).all()
    assert int(mask.sum()) == 5


def test_padding_keeps_edge_features():
    """Bond types of a padded batch: the real edges' in place, type 0 on the
    padding edges; the padded batch's outputs on real graphs are unchanged."""
    from gt_fused3s.models import GraphTransformer
    from graph_cases import molecule_batches
    data = molecule_batches(1, 8, 6)[0]
    E = data.edge_index.size(1)
    buckets = Buckets.fit([(data.num_nodes, E, 8)])
    padded = buckets.pad_batch(data)
    assert torch.equal(padded.edge_attr[:E], data.edge_attr)
    assert padded.edge_attr.size(0) == padded.edge_index.size(1) and not padded.edge_attr[E:].any()
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 2, num_layers=2, heads=2, readout="graph", edge_vocab=(4,),
                             backend="reference").eval()
    out = model(data.x, data.edge_index, data.batch, edge_attr=data.edge_attr)
    out_p = model(padded.x, padded.edge_index, padded.batch, edge_attr=padded.edge_attr,
                  num_graphs=padded.graph_mask.numel())
    torch.testing.assert_close(out_p[padded.graph_mask], out, atol=1e-5, rtol=1e-5)
