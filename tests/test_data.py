"""Dataset loaders: synthetic generators, npz structure files, and the online
loaders (never downloading: offline failures are simulated)."""
import urllib.error

import numpy as np
import pytest
import torch
from torch_geometric.data import Data

from gt_fused3s.data import (DatasetUnavailableError, check_entry, data_dirs, load_dataset,
                             load_lrgb, load_npz, load_ogb, load_pyg, molecule_batch,
                             molecules_dataset, power_law_graph, random_graph_batch,
                             resolve_path)


def _shared_file(name):
    for d in data_dirs():
        if (d / name).is_file():
            return d / name
    pytest.skip(f"{name} not found in $GT_FUSED3S_DATA, ../shared/data or .data")


def _check_simple_symmetric(ei, n, self_loops=False):
    assert ei.dtype == torch.int64 and ei.shape[0] == 2
    assert int(ei.min()) >= 0 and int(ei.max()) < n
    key = torch.sort(ei[1] * n + ei[0]).values
    assert torch.equal(key, torch.unique(key))                    # deduplicated
    assert torch.equal(torch.sort(ei[0] * n + ei[1]).values, key)  # symmetric
    if not self_loops:
        assert not bool((ei[0] == ei[1]).any())


# -------------------------------------------------------------- synthetic
def test_molecule_batch_structure():
    ei, ptr = molecule_batch(200, min_nodes=10, max_nodes=40, isolated_prob=0.3, seed=3)
    n = int(ptr[-1])
    _check_simple_symmetric(ei, n)
    key = ei[1] * n + ei[0]
    assert bool((key[1:] > key[:-1]).all())                         # sorted by (dst, src)
    sizes = ptr[1:] - ptr[:-1]
    assert ptr[0] == 0 and int(sizes.min()) >= 10 and int(sizes.max()) <= 40
    graph = torch.repeat_interleave(torch.arange(200), sizes)
    assert torch.equal(graph[ei[0]], graph[ei[1]])                 # no edge between graphs
    deg = torch.bincount(ei[1], minlength=n)
    assert 1 <= int(deg.max()) <= 8
    isolated = graph[deg == 0].unique()
    assert 0 < isolated.numel() < 200                               # some, not all, graphs
    assert 1.8 < ei.size(1) / n < 2.6                               # about 2 bonds per atom


def test_molecule_batch_is_seeded():
    a, pa = molecule_batch(50, seed=1)
    b, pb = molecule_batch(50, seed=1)
    c, _ = molecule_batch(50, seed=2)
    assert torch.equal(a, b) and torch.equal(pa, pb)
    assert a.shape != c.shape or not torch.equal(a, c)
    with pytest.raises(ValueError):
        molecule_batch(4, min_nodes=10, max_nodes=5)


def test_power_law_graph():
    n, max_deg = 5000, 200
    ei = power_law_graph(n, avg_degree=8, alpha=2.2, max_degree=max_deg, seed=0)
    _check_simple_symmetric(ei, n)
    deg = torch.bincount(ei[1], minlength=n)
    assert int(deg.min()) >= 1                                      # no isolated node
    assert int(deg.max()) <= 2 * max_deg                            # the clip plus noise
    assert 6 < ei.size(1) / n < 10                                  # mean degree ~ 8
    assert int(deg.max()) > 10 * float(deg.float().median())        # skewed
    assert torch.equal(ei, power_law_graph(n, avg_degree=8, alpha=2.2, max_degree=max_deg, seed=0))
    assert not torch.equal(ei[:, :100], power_law_graph(n, avg_degree=8, seed=1)[:, :100])


def test_power_law_graph_options():
    ei = power_law_graph(400, seed=0)                               # the law's own mean
    _check_simple_symmetric(ei, 400)
    loops = power_law_graph(50, avg_degree=20, max_degree=49, self_loops=True, seed=0)
    _check_simple_symmetric(loops, 50, self_loops=True)
    assert bool((loops[0] == loops[1]).any())
    for bad in (dict(num_nodes=1), dict(num_nodes=10, alpha=1.0), dict(num_nodes=10, max_degree=0)):
        with pytest.raises(ValueError):
            power_law_graph(**bad)


def test_molecules_dataset_batches():
    ds = molecules_dataset(num_graphs=10, batch_size=4, num_features=7, seed=5)
    assert len(ds) == 3 and ds.level == "graph" and ds.num_features == 7
    batches = list(ds)
    assert [b.ptr.numel() - 1 for b in batches] == [4, 4, 2]
    for b in batches:
        assert b.x.shape == (b.num_nodes, 7) and b.x.dtype == torch.float32
        assert torch.equal(torch.bincount(b.batch), b.ptr[1:] - b.ptr[:-1])
        _check_simple_symmetric(b.edge_index, b.num_nodes)
    again = ds[2]                                                   # made on demand, same
    assert torch.equal(again.x, batches[2].x)
    assert torch.equal(again.edge_index, batches[2].edge_index)
    with pytest.raises(IndexError):
        ds[3]


# -------------------------------------------------------------------- npz
def test_npz_single_graph(tmp_path):
    # 0 - 1 - 2, node 3 isolated; row i lists the sources of edges j -> i
    np.savez_compressed(tmp_path / "tiny.npz", indptr=np.array([0, 1, 3, 4, 4], np.int32),
                        indices=np.array([1, 0, 2, 1], np.int32), num_nodes=np.int32(4))
    ds = load_npz(tmp_path / "tiny.npz", num_features=3, seed=1)
    assert ds.name == "tiny" and ds.level == "node" and len(ds) == 1
    d = ds[0]
    assert d.num_nodes == 4 and d.x.shape == (4, 3)
    assert d.edge_index.tolist() == [[1, 0, 2, 1], [0, 1, 1, 2]]
    assert torch.equal(load_npz(tmp_path / "tiny.npz", num_features=3, seed=1)[0].x, d.x)


def test_npz_collection(tmp_path):
    # graph 0: nodes 0-1 bonded; graph 1: nodes 2-4 path; graph 2: node 5 alone
    np.savez_compressed(tmp_path / "coll.npz", graph_ptr=np.array([0, 2, 5, 6]),
                        edge_ptr=np.array([0, 2, 6, 6]),
                        src=np.array([0, 1, 2, 3, 3, 4], np.int32),
                        dst=np.array([1, 0, 3, 2, 4, 3], np.int32))
    ds = load_npz(tmp_path / "coll.npz", batch_size=2, num_features=4)
    assert ds.level == "graph" and len(ds) == 2
    b0, b1 = ds[0], ds[1]
    assert b0.num_nodes == 5 and b0.ptr.tolist() == [0, 2, 5]
    assert b0.batch.tolist() == [0, 0, 1, 1, 1]
    assert b0.edge_index.tolist() == [[0, 1, 2, 3, 3, 4], [1, 0, 3, 2, 4, 3]]
    assert b1.num_nodes == 1 and b1.edge_index.shape == (2, 0) and b1.ptr.tolist() == [0, 1]
    sub = load_npz(tmp_path / "coll.npz", start=1, max_graphs=1)
    assert len(sub) == 1 and sub[0].edge_index.tolist() == [[0, 1, 1, 2], [1, 0, 2, 1]]
    np.savez(tmp_path / "bad.npz", foo=np.zeros(3))
    with pytest.raises(ValueError, match="missing"):
        load_npz(tmp_path / "bad.npz")


def test_npz_real_single_graph():
    ds = load_npz(_shared_file("cora.npz"), num_features=8)
    d = ds[0]
    assert (d.num_nodes, d.edge_index.size(1)) == (2708, 10556)
    _check_simple_symmetric(torch.stack([d.edge_index[0], d.edge_index[1]]), 2708)


def test_npz_real_collection_slices():
    path = _shared_file("zinc.npz")
    with np.load(path) as z:
        gp, ep = z["graph_ptr"][:11], z["edge_ptr"][:11]
    ds = load_npz(path, batch_size=4, max_graphs=10)
    assert len(ds) == 3 and ds.info["num_graphs"] == 10
    b = ds[1]                                                       # graphs 4..7
    assert b.num_nodes == gp[8] - gp[4] and b.edge_index.size(1) == ep[8] - ep[4]
    assert b.ptr.tolist() == (gp[4:9] - gp[4]).tolist()
    _check_simple_symmetric(b.edge_index, b.num_nodes)
    assert torch.equal(b.batch[b.edge_index[0]], b.batch[b.edge_index[1]])


def test_resolve_path(tmp_path, monkeypatch):
    np.savez(tmp_path / "mine.npz", indptr=np.array([0, 0], np.int32),
             indices=np.array([], np.int32), num_nodes=np.int32(1))
    monkeypatch.setenv("GT_FUSED3S_DATA", str(tmp_path))
    assert resolve_path("somewhere/else/mine.npz") == (tmp_path / "mine.npz").resolve()
    assert resolve_path("$GT_FUSED3S_DATA/mine.npz") == (tmp_path / "mine.npz").resolve()
    with pytest.raises(FileNotFoundError, match="GT_FUSED3S_DATA"):
        resolve_path("nothing_here.npz")


def test_load_dataset_dispatch(tmp_path):
    spec = {"name": "m", "kind": "molecules", "params": {"num_graphs": 40, "batch_size": 16},
            "quick": {"num_graphs": 3}}
    assert len(load_dataset(spec)) == 3
    quick = load_dataset(spec, quick=True)
    assert len(quick) == 1 and quick[0].ptr.numel() == 4
    p = load_dataset({"name": "p", "kind": "powerlaw", "params": {"num_nodes": 100}})
    assert p.level == "node" and p[0].num_nodes == 100
    with pytest.raises(ValueError, match="kind"):
        load_dataset({"name": "x", "kind": "nope"})


# ------------------------------------------------- online loaders, offline
def _offline(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")


def _assert_clear(err, name, root):
    msg = str(err.value)
    assert f"dataset {name} is not in {root}" in msg and "could not be downloaded (offline?)" in msg
    assert "npz" in msg


def test_ogb_offline_fails_clearly(tmp_path, monkeypatch):
    pytest.importorskip("ogb")     # the test extra installs it; the GPU machine lacks it
    import ogb.graphproppred.dataset_pyg as graph_mod
    import ogb.nodeproppred.dataset_pyg as node_mod
    monkeypatch.setattr(graph_mod, "decide_download", _offline)
    monkeypatch.setattr(node_mod, "decide_download", _offline)
    with pytest.raises(DatasetUnavailableError) as err:
        load_ogb("ogbg-molhiv", root=tmp_path)
    _assert_clear(err, "ogbg-molhiv", tmp_path)
    with pytest.raises(DatasetUnavailableError) as err:
        load_dataset({"name": "arxiv", "kind": "ogb",
                      "params": {"dataset": "ogbn-arxiv", "root": str(tmp_path)}})
    _assert_clear(err, "ogbn-arxiv", tmp_path)
    with pytest.raises(ValueError, match="ogbn-"):
        load_ogb("molhiv", root=tmp_path)


def test_ogb_second_offline_run_never_waits_on_stdin(tmp_path, monkeypatch, capsys):
    """A folder left by a failed download makes ogb ask on stdin whether to
    update it; the loader answers (and says so) instead of waiting."""
    pytest.importorskip("ogb")
    import io

    import ogb.graphproppred.dataset_pyg as graph_mod
    monkeypatch.setattr(graph_mod, "decide_download", _offline)
    (tmp_path / "ogbg_molhiv").mkdir()                 # the remnant: no RELEASE_v*.txt in it

    class NoStdin(io.StringIO):
        def readline(self, *args):
            raise AssertionError("read stdin")
    monkeypatch.setattr("sys.stdin", NoStdin())
    with pytest.raises(DatasetUnavailableError) as err:
        load_ogb("ogbg-molhiv", root=tmp_path)
    _assert_clear(err, "ogbg-molhiv", tmp_path)
    assert "answered 'y' to: Will you update the dataset now? (y/N)" in capsys.readouterr().err


def test_lrgb_and_pyg_offline_fail_clearly(tmp_path, monkeypatch):
    import torch_geometric.datasets.lrgb as lrgb_mod
    import torch_geometric.datasets.planetoid as planetoid_mod
    monkeypatch.setattr(lrgb_mod, "download_url", _offline)
    monkeypatch.setattr(planetoid_mod.fs, "cp", _offline)          # Planetoid copies with fsspec
    with pytest.raises(DatasetUnavailableError) as err:
        load_lrgb("Peptides-func", root=tmp_path)
    _assert_clear(err, "Peptides-func", tmp_path)
    with pytest.raises(DatasetUnavailableError) as err:
        load_pyg("Planetoid", name="Cora", root=tmp_path)
    _assert_clear(err, "Planetoid-Cora", tmp_path)
    with pytest.raises(ValueError, match="no dataset class"):
        load_pyg("NoSuchDataset")


# ------------------------------------------- online loaders, local data
def _graphs(count, seed=0, int_features=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = int(torch.randint(3, 9, (1,), generator=g))
        src = torch.arange(n - 1)
        ei = torch.stack([torch.cat([src, src + 1]), torch.cat([src + 1, src])])
        x = torch.randint(0, 5, (n, 9), generator=g) if int_features else None
        out.append(Data(x=x, edge_index=ei, num_nodes=n, y=torch.tensor([[i % 2]])))
    return out


class _FakeOgbGraphs:
    """What load_ogb uses of PygGraphPropPredDataset."""

    def __init__(self, name, root):
        self.graphs, self.num_tasks = _graphs(10), 1

    def __len__(self):
        return len(self.graphs)

    def __getitem__(self, idx):
        if isinstance(idx, torch.Tensor):
            sub = _FakeOgbGraphs.__new__(_FakeOgbGraphs)
            sub.graphs, sub.num_tasks = [self.graphs[i] for i in idx.tolist()], 1
            return sub
        return self.graphs[idx]

    def get_idx_split(self):
        return {"train": torch.arange(0, 6), "valid": torch.arange(6, 8),
                "test": torch.arange(8, 10)}


def test_ogb_graph_loader_on_local_data(monkeypatch):
    pytest.importorskip("ogb")
    import ogb.graphproppred
    monkeypatch.setattr(ogb.graphproppred, "PygGraphPropPredDataset", _FakeOgbGraphs)
    ds = load_ogb("ogbg-fake", batch_size=4)
    assert ds.level == "graph" and len(ds) == 3 and ds.num_features == 9 and ds.num_classes == 1
    b = ds[0]
    assert b.x.dtype == torch.float32 and b.ptr.numel() == 5 and b.y.shape == (4, 1)
    assert torch.equal(b.batch[b.edge_index[0]], b.batch[b.edge_index[1]])
    test = load_ogb("ogbg-fake", split="test", batch_size=4)
    assert len(test) == 1 and test[0].ptr.numel() == 3


def test_lrgb_loader_on_local_data(monkeypatch):
    import torch_geometric.datasets

    class FakeLRGB(list):
        num_classes = 2

        def __init__(self, root, name, split="train"):
            super().__init__(_graphs(5, int_features=False))

    monkeypatch.setattr(torch_geometric.datasets, "LRGBDataset", FakeLRGB)
    ds = load_lrgb("Peptides-func", batch_size=2, num_features=6, max_graphs=4)
    assert len(ds) == 2 and ds.num_features == 6                   # no x: random features
    b = ds[1]
    assert b.x.shape == (b.num_nodes, 6) and b.ptr.numel() == 3


def test_pyg_loader_single_graph():
    ds = load_pyg("FakeDataset", label="fake", num_graphs=1, avg_num_nodes=40, num_channels=5)
    assert ds.name == "fake" and ds.level == "node" and ds.num_features == 5
    d = ds[0]
    assert d.x.shape == (d.num_nodes, 5) and d.edge_index.size(0) == 2


# --------------------------------------------- random graphs, devices, fallbacks
def test_random_graph_batch():
    ei, ptr = random_graph_batch(300, min_nodes=20, max_nodes=60, avg_degree=5.5, seed=4)
    n = int(ptr[-1])
    _check_simple_symmetric(ei, n)
    sizes = ptr[1:] - ptr[:-1]
    assert int(sizes.min()) >= 20 and int(sizes.max()) <= 60
    graph = torch.repeat_interleave(torch.arange(300), sizes)
    assert torch.equal(graph[ei[0]], graph[ei[1]])                 # no edge between graphs
    assert 4.5 < ei.size(1) / n < 5.6                               # mean degree ~ 5.5, a bit less
    again, _ = random_graph_batch(300, min_nodes=20, max_nodes=60, avg_degree=5.5, seed=4)
    assert torch.equal(ei, again)
    with pytest.raises(ValueError):
        random_graph_batch(3, min_nodes=1)


def test_dataset_makes_batches_where_asked():
    ds = load_dataset({"name": "r", "kind": "random_graphs",
                       "params": {"num_graphs": 5, "batch_size": 2, "min_nodes": 4,
                                  "max_nodes": 8}})
    assert ds.device == torch.device("cpu") and len(ds) == 3 and ds.info["synthetic"]
    assert torch.equal(ds.get(1, "cpu").x, ds[1].x)
    assert ds.get(2).ptr.numel() == 2


def test_fallback_when_unavailable_or_offline(monkeypatch):
    from gt_fused3s import data

    fallback = {"kind": "powerlaw", "params": {"num_nodes": 50}, "quick": {"num_nodes": 20}}
    spec = {"name": "big", "kind": "npz", "params": {"structure": "no/such/big.npz"},
            "fallback": fallback}
    ds = load_dataset(spec)
    assert ds.name == "big" and ds[0].num_nodes == 50 and ds.info["synthetic"]
    assert "FileNotFoundError" in ds.info["fallback_reason"] and "big.npz" in ds.info["fallback_reason"]
    assert load_dataset(spec, quick=True)[0].num_nodes == 20       # the fallback's quick

    def must_not_load(name, params):
        raise AssertionError("offline runs must not try the download")
    monkeypatch.setitem(data.LOADERS, "ogb", must_not_load)
    offline = load_dataset({"name": "ogbn-x", "kind": "ogb", "fallback": fallback}, offline=True)
    assert offline.info["fallback_reason"] == "offline run"

    def unavailable(name, params):
        raise DatasetUnavailableError("dataset ogbn-x is not in /nowhere")
    monkeypatch.setitem(data.LOADERS, "ogb", unavailable)
    assert "not in /nowhere" in load_dataset({"name": "ogbn-x", "kind": "ogb",
                                              "fallback": fallback}).info["fallback_reason"]
    with pytest.raises(DatasetUnavailableError):                    # no fallback: the error
        load_dataset({"name": "ogbn-x", "kind": "ogb"})
    with pytest.raises(DatasetUnavailableError):                    # offline, no fallback
        load_dataset({"name": "ogbn-x", "kind": "ogb"}, offline=True)


@pytest.mark.parametrize("spec, match", [
    ({"kind": "nope"}, "kind 'nope' is unknown"),
    ({"kind": "npz", "parms": {}}, "unknown keys"),
    ({"kind": "npz", "fallback": {"kind": "npz", "name": "x"}}, "fallback must be"),
    ({"kind": "npz", "fallback": {"kind": "nope"}}, "kind 'nope' is unknown"),
    ({"name": "x"}, "needs at least 'kind'"),
])
def test_check_entry(spec, match):
    with pytest.raises(ValueError, match=match):
        check_entry(spec)
    check_entry({"kind": "npz", "max_batches": 3}, {"max_batches"})


def test_edge_features_from_the_data_or_generated():
    """Integer edge_attr (bond types) comes along as int64 [E, C] with its
    vocabulary (max + 1 per column); without edge_attr, generated bond types
    (one type per unordered pair) stand in; every loader carries them."""
    from gt_fused3s.data.online import from_pyg
    graphs = _graphs(6)
    g = torch.Generator().manual_seed(3)
    for d in graphs:
        d.edge_attr = torch.stack([torch.randint(0, 5, (d.edge_index.size(1),), generator=g),
                                   torch.randint(0, 3, (d.edge_index.size(1),), generator=g)], 1)
    ds = from_pyg(graphs, "bonds", batch_size=4)
    top = torch.cat([d.edge_attr for d in graphs]).max(0).values
    assert ds.edge_vocab == tuple(int(t) + 1 for t in top)
    b = ds[0]
    assert torch.equal(b.edge_attr, torch.cat([d.edge_attr for d in graphs[:4]]))
    plain = from_pyg(_graphs(6), "plain", batch_size=4)
    assert plain.edge_vocab == (4,)
    e = plain[0]
    assert e.edge_attr.shape == (e.edge_index.size(1), 1) and e.edge_attr.max() < 4
    flipped = {(int(s), int(t)): int(a) for (s, t), a in zip(e.edge_index.t(), e.edge_attr[:, 0])}
    assert all(flipped[(t, s)] == a for (s, t), a in flipped.items())      # symmetric
    mols = molecules_dataset(num_graphs=4, batch_size=4)
    assert mols.edge_vocab == (4,) and mols[0].edge_attr.size(0) == mols[0].edge_index.size(1)
