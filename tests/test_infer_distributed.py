"""`gt-fused3s infer` under torch.distributed (Gloo, spawned CPU processes):
a single graph partitioned over the ranks gives, gathered, the whole graph's
output of one process; rows of the ranks merge into one; the entry point
under a 2-rank group (torchrun's environment) exits cleanly with output
from rank 0 only."""
from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from test_distributed import _graph, _rank, _run_ranks

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")


def _settings(world: int, rank: int):
    """infer's settings of an fp32 CPU run on ``world`` ranks (eager, no timing)."""
    from gt_fused3s.drivers import infer
    cfg = infer.validate_config({"device": "cpu", "warmup": 0, "repeats": 1,
                                 "datasets": [{"name": "g", "kind": "powerlaw"}]})
    return infer._Settings(cfg, torch.device("cpu"), infer.autocast(torch.device("cpu"), torch.float32),
                           0, 1, False, True, False, lambda m: None, {}, ["reference"], world, rank)


def _check_partitioned(rank, world, case, dtype):
    """infer's work on a single graph (its partition, this rank's forward with
    the halo exchange, the gathered output of the profiled pass) against
    the model on the whole graph in one process, for three backends."""
    from torch_geometric.data import Data

    from gt_fused3s.drivers import infer
    from gt_fused3s.distributed import partition, single_graph
    from gt_fused3s.models import GraphTransformer
    ei, n, part = _graph(case)
    if part is not None:           # the case's parts (some empty), in place of the partitioner's
        part = part % world
    single_graph.partition_nodes = partition.partition_nodes if part is None else (lambda *a, **k: part)
    g = torch.Generator().manual_seed(3)
    data = Data(x=torch.randn(n, 6, generator=g, dtype=dtype), edge_index=ei,
                edge_attr=torch.randint(0, 3, (ei.size(1), 1), generator=g))
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 3, num_layers=2, heads=2, edge_vocab=(3,)).to(dtype).eval()
    work = infer._work_of([data], False, "node", _settings(world, rank))
    assert work.lg is not None and work.lg.parts == world
    if part is not None:
        assert work.lg.num_local == int((part == rank).sum())      # none on rank 1 (and 3)
    with torch.inference_mode():
        for backend in ("reference", "pyg", "fused3s"):      # fused3s: the reference path on a CPU
            model.backend = backend
            want = model(data.x, ei, edge_attr=data.edge_attr)
            got = work.measure(model, "eager", timed=False)["outputs"]
            assert len(got) == 1 and got[0].shape == (n, 3) and got[0].dtype == dtype
            torch.testing.assert_close(got[0], want, msg=lambda m, b=backend: f"{case} {dtype} {b}: {m}")


def _check_gather(rank, world):
    from gt_fused3s.distributed import local_graph, partition_nodes
    from gt_fused3s.distributed.single_graph import gather_rows
    ei, n, _ = _graph("hub")
    part = partition_nodes(ei, n, world)[torch.randperm(n, generator=torch.Generator().manual_seed(4))]
    part[part == world - 1] = 0                     # interleaved ids, uneven parts, the last one empty
    lg = local_graph(ei, n, part, rank, parts=world)
    rows = torch.arange(n * 2, dtype=torch.float64).view(n, 2)
    torch.testing.assert_close(gather_rows(rows[lg.nodes], lg, n), rows, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows has 1 rows but rank"):
        gather_rows(rows[:1], lg, n)


@_rank
def _partitioned_worker(rank, world, init):
    torch.set_num_threads(1)       # ranks share a few CPU cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for case in ("random", "empty_part"):
        for dtype in (torch.float64, torch.float32):
            _check_partitioned(rank, world, case, dtype)
    _check_gather(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_partitioned_inference_equals_one_process(world):
    """Every rank's gathered output equals the whole graph's in one process
    (same model, same weights, float64 and float32; a random graph with
    duplicate edges, and parts that own no node); gather_rows puts the rows
    of interleaved, uneven parts in place."""
    _run_ranks(_partitioned_worker, world)


def test_merge_ranks(monkeypatch):
    """The rows of the ranks as one: the slowest rank's times, the largest
    peak and difference, summed graphs/s; a failure on any rank fails the
    run and names the rank; idle ranks count for nothing."""
    from gt_fused3s.drivers import infer
    per_rank = [
        [{"backend": "a", "status": "ok", "note": "", "ms_median": 2.0, "ms_std": 0.1, "timing": "eager",
          "peak_mem_mb": 10.0, "max_abs_diff": 1e-7, "graphs_per_s": 100.0},
         {"backend": "b", "status": "ok", "note": "", "ms_median": 1.0}],
        [{"backend": "a", "status": "ok", "note": "", "ms_median": 3.0, "ms_std": 0.5, "timing": "eager",
          "peak_mem_mb": 8.0, "max_abs_diff": 3e-7, "graphs_per_s": 50.0},
         {"backend": "b", "status": "oom", "note": "out of memory", "ms_median": None}],
        [{"backend": "a", "status": "idle", "note": ""}, {"backend": "b", "status": "idle", "note": ""}],
    ]
    monkeypatch.setattr(infer.dist, "all_gather_object", lambda out, rows: out.__setitem__(slice(None), per_rank))
    s = _settings(3, 0)
    a, b = infer._merge_ranks(per_rank[0], s)
    assert a["status"] == "ok" and a["ms_median"] == 3.0 and a["ms_std"] == 0.5
    assert a["peak_mem_mb"] == 10.0 and a["max_abs_diff"] == 3e-7 and a["graphs_per_s"] == 150.0
    assert b["status"] == "oom" and b["note"] == "rank 1: out of memory" and b["ms_median"] is None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_infer_entry_point_under_two_ranks(tmp_path):
    """scripts/infer.py in two processes with torchrun's environment (Gloo):
    both exit 0; rank 0 prints the table once (a collection sharded, a
    single graph partitioned, outputs compared over the whole graph) and
    writes the CSV; rank 1 prints nothing and logs nothing."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "device": "cpu", "warmup": 1, "repeats": 2, "backends": ["fused3s", "pyg", "reference"],
        "model": {"hidden": 16, "layers": 2, "heads": 2, "out_channels": 4},
        "datasets": [
            {"name": "mols", "kind": "molecules",        # 3 batches: rank 0 runs two, rank 1 one
             "params": {"num_graphs": 24, "batch_size": 8, "num_features": 8, "min_nodes": 5, "max_nodes": 12}},
            {"name": "plaw", "kind": "powerlaw",
             "params": {"num_nodes": 300, "avg_degree": 6, "max_degree": 40, "num_features": 8}}]}))
    out = tmp_path / "infer.csv"
    port, world = _free_port(), 2
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(REPO / "scripts/infer.py"), "--config", str(config),
                                       "--no-progress", "--offline", "--csv", str(out)],
                                      env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], results
    (out0, err0), (out1, err1) = results
    assert out1 == "" and "infer" not in err1 and "mols" not in err1, (out1, err1)
    assert out0.count("dataset ") == 1 and out0.splitlines()[0].split()[:3] == ["dataset", "C", "backend"]
    assert "Under torchrun (2 ranks)" in out0
    assert "mols: 3 batches sharded over 2 ranks" in err0 and "plaw: nodes partitioned over 2 ranks" in err0
    rows = list(csv.DictReader(open(out)))
    assert [(r["dataset"], r["backend"]) for r in rows] == [
        (d, b) for d in ("mols", "plaw") for b in ("fused3s", "pyg", "reference")]
    for r in rows:
        assert r["status"] == "ok" and r["ranks"] == "2", r
        assert float(r["ms_median"]) > 0 and float(r["max_abs_diff"]) < 1e-5
    by = {(r["dataset"], r["backend"]): r for r in rows}
    assert by["mols", "pyg"]["batches"] == "3" and by["plaw", "pyg"]["nodes_per_fwd"] == "300"
    assert by["plaw", "pyg"]["timing"] == "eager, partitioned over 2 ranks"
    assert by["mols", "pyg"]["timing"] == "eager" and float(by["mols", "pyg"]["graphs_per_s"]) > 0
