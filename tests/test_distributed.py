"""Partitioned full-graph attention with torch.distributed (Gloo, spawned
CPU processes, world sizes 2 and 4): every rank's rows and gradients equal
the single-process attention's; partitions, halos and send lists agree
between ranks; partition statistics."""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gt_fused3s.bench.distributed import global_batch_losses
from gt_fused3s.distributed import (exchange_halo, exchange_timer, local_graph, partition_nodes,
                                    partition_stats, partitioned_attention)
from gt_fused3s.reference import attention_reference

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with Gloo")


def _graph(case: str):
    """(edge_index, N, part) of a named case."""
    g = torch.Generator().manual_seed(1)
    if case == "random":
        n = 300
        ei = torch.randint(0, n, (2, 1500), generator=g)
        return torch.cat([ei, ei[:, :30]], 1), n, None              # duplicates too
    if case == "hub":          # node 7 has in-neighbours on every rank, node 200 sends to all
        n = 240
        ei = torch.randint(0, n, (2, 600), generator=g)
        everyone = torch.arange(n)
        hub = torch.stack([torch.cat([everyone, torch.full((n,), 200)]),
                           torch.cat([torch.full((n,), 7), everyone])])
        return torch.cat([ei, hub], 1), n, None
    if case == "empty_part":   # parts 1 and 3 own nothing
        n = 50
        ei = torch.randint(0, n, (2, 160), generator=g)
        part = torch.where(torch.arange(n) < 20, 0, 2)
        return ei, n, part
    raise ValueError(case)


def _rank(body):
    """A spawned rank's ``body(rank, world, init, *args)``: its error goes to
    the parent (the last argument of the call, a queue), and the process
    group is destroyed however it ends, after a barrier when it succeeded
    (one rank in about 30 runs of test_scaling_runs_and_report aborted,
    exit code -6, without one)."""
    @functools.wraps(body)
    def run(rank, world, init, *args):
        *args, errors = args
        try:
            body(rank, world, init, *args)
            if dist.is_initialized():   # no rank tears its group down while another still talks
                dist.barrier()
        except Exception as e:          # reported by the parent
            errors.put(f"rank {rank}: {type(e).__name__}: {e}")
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # Succeeded and torn down: leave without the interpreter's teardown
        # (a rank of test_scaling_runs_and_report still aborted, exit code
        # -6, in CI after the barrier was added; not diagnosed: this skips
        # only what runs after the group is gone).
        os._exit(0)
    return run


@_rank
def _worker(rank: int, world: int, init: str, case: str):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ei, n, part = _graph(case)
    if part is None:
        part = partition_nodes(ei, n, world)
    lg = local_graph(ei, n, part, rank, parts=world)
    g = torch.Generator().manual_seed(2)
    H, D = 2, 8
    q, k, v, do = (torch.randn(n, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    bias = torch.randn(ei.size(1), H, generator=g, dtype=torch.float64)
    # the whole graph in one process: the ground truth
    full = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    ref = attention_reference(*full[:3], ei, 0.4, edge_bias=full[3], compute_dtype=torch.float64)
    (ref * do).sum().backward()
    # this rank's share
    mine = [t[lg.nodes].clone().requires_grad_() for t in (q, k, v)]
    b = bias[lg.edge_ids].clone().requires_grad_()
    out = partitioned_attention(*mine, lg, 0.4, edge_bias=b)
    (out * do[lg.nodes]).sum().backward()
    torch.testing.assert_close(out, ref[lg.nodes].detach())
    for got, want in zip(mine, full[:3]):          # dK, dV include the halo's gradients
        torch.testing.assert_close(got.grad, want.grad[lg.nodes])
    torch.testing.assert_close(b.grad, full[3].grad[lg.edge_ids])
    # the halo received is the owners' rows, in order; the timer sees one exchange
    with exchange_timer() as timer:
        torch.testing.assert_close(exchange_halo(k[lg.nodes], lg), k[lg.halo])
    assert timer.count == 1 and timer.ms() >= 0
    assert timer.bytes == lg.send_index.numel() * H * D * 8
    dist.barrier()


def _run_ranks(target, world: int, *args) -> None:
    """``target(rank, world, init, *args, errors)`` in ``world`` spawned
    processes sharing a file rendezvous; fails with every rank's error."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=target, args=(r, world, init, *args, errors)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs, "\n".join(msgs)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


@pytest.mark.parametrize("world,case", [(2, "random"), (4, "random"), (4, "hub"), (4, "empty_part")])
def test_partitioned_attention_equals_single_process(world, case):
    _run_ranks(_worker, world, case)


@_rank
def _pipelined_worker(rank, world, init, full_send, chunks):
    """The fused path (CPU stand-ins of the kernels): the K/V exchange
    pipelined in head chunks, full and partial halo blocks."""
    import stand_in_kernels
    patch = pytest.MonkeyPatch()
    stand_in_kernels.install(patch)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ei, n, _ = _graph("hub")
    lg = local_graph(ei, n, partition_nodes(ei, n, world), rank, parts=world, full_send=full_send)
    lg.head_chunks = chunks
    g = torch.Generator().manual_seed(2)
    H, D = 4, 16
    q, k, v, do = (torch.randn(n, H, D, generator=g).half() for _ in range(4))
    bias = torch.randn(ei.size(1), H, generator=g)
    full = [t.double().requires_grad_() for t in (q, k, v, bias)]
    ref = attention_reference(*full[:3], ei, 0.3, edge_bias=full[3], compute_dtype=torch.float64)
    (ref * do.double()).sum().backward()
    mine = [t[lg.nodes].clone().requires_grad_() for t in (q, k, v)]
    b = bias[lg.edge_ids].clone().requires_grad_()
    with exchange_timer() as timer:
        out = partitioned_attention(*mine, lg, 0.3, edge_bias=b)
        out.backward(do[lg.nodes])
    assert out.dtype == torch.float16 and timer.count == 2 * min(chunks, H)   # K|V out, dK|dV back
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), ref[lg.nodes].detach(), **tol)
    for got, want in zip(mine, full[:3]):
        torch.testing.assert_close(got.grad.double(), want.grad[lg.nodes], **tol)
    torch.testing.assert_close(b.grad.double(), full[3].grad[lg.edge_ids], **tol)
    assert any(lg.halo_full) or any(lg.send_full)    # node 7 reads every rank's rows


@pytest.mark.parametrize("world,full_send,chunks", [(2, 0.5, 4), (3, 1.0, 2), (3, 0.5, 1), (4, 0.5, 3)])
def test_pipelined_fused_partitioned_attention(world, full_send, chunks):
    """The path the GPU takes (kernels stood in on the CPU): chunked
    exchanges, gradients of q, k, v (the halo's added back) and the bias."""
    _run_ranks(_pipelined_worker, world, full_send, chunks)


def test_local_graphs_cover_the_graph_and_send_lists_match_halos():
    ei, n, _ = _graph("hub")
    P = 4
    part = partition_nodes(ei, n, P)
    shares = [local_graph(ei, n, part, r) for r in range(P)]
    assert torch.equal(torch.sort(torch.cat([s.nodes for s in shares])).values, torch.arange(n))
    assert torch.equal(torch.sort(torch.cat([s.edge_ids for s in shares])).values, torch.arange(ei.size(1)))
    for s in shares:
        cols = torch.cat([s.nodes, s.halo])
        assert torch.equal(cols[s.edge_index[0]], ei[0, s.edge_ids])        # local columns -> sources
        assert torch.equal(s.nodes[s.edge_index[1]], ei[1, s.edge_ids])     # local rows -> destinations
        assert s.halo_counts[s.rank] == 0 and s.send_counts[s.rank] == 0
    for r in range(P):           # what r receives from o is what o sends to r, in order
        for o in range(P):
            hr = shares[r]
            got = hr.halo[sum(hr.halo_counts[:o]):sum(hr.halo_counts[:o + 1])]
            so = shares[o]
            sent = so.nodes[so.send_index[sum(so.send_counts[:r]):sum(so.send_counts[:r + 1])]]
            assert torch.equal(got, sent)


def test_single_rank_needs_no_process_group():
    ei, n, _ = _graph("random")
    lg = local_graph(ei, n, partition_nodes(ei, n, 1), 0)
    assert lg.halo.numel() == 0 and lg.num_local == n
    q = torch.randn(n, 1, 8)
    torch.testing.assert_close(partitioned_attention(q, q, q, lg), attention_reference(q, q, q, ei))


def test_partition_stats_and_errors():
    ei, n, _ = _graph("random")
    part = partition_nodes(ei, n, 4)
    st = partition_stats(ei, n, part, 4, row_bytes=64)
    cut = int((part[ei[0]] != part[ei[1]]).sum())
    assert st["edge_cut"] == cut and st["node_balance"] == pytest.approx(1.0, abs=0.02)
    assert st["halo_rows_total"] == sum(local_graph(ei, n, part, r, full_send=1.0).halo.numel()
                                        for r in range(4))
    assert st["exchange_bytes_per_layer"] == 64 * st["halo_rows_total"]
    with pytest.raises(ValueError, match="method must be one of"):
        partition_nodes(ei, n, 2, "spectral")
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        partition_nodes(ei, n, 0)
    with pytest.raises(ValueError, match="edge_index has index 300 out of range"):
        local_graph(torch.tensor([[0], [300]]), n, part, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, parts=4\)"):
        local_graph(ei, n, part, 4)
    with pytest.raises(ValueError, match=r"part must hold ranks in \[0, parts=2\)"):
        local_graph(ei, n, part, 0, parts=2)


@pytest.mark.filterwarnings("error::DeprecationWarning")   # pymetis's API as the installed version wants it
def test_metis_partition_balances_in_edges_and_cuts_less():
    pytest.importorskip("pymetis")
    ei, n, _ = _graph("random")
    ring = torch.arange(n)        # a ring plus random edges: METIS keeps the ring's arcs together
    ei = torch.cat([ei, torch.stack([ring, (ring + 1) % n]), torch.stack([(ring + 1) % n, ring])], 1)
    part = partition_nodes(ei, n, 4, "metis")
    assert part.shape == (n,) and set(part.unique().tolist()) == {0, 1, 2, 3}
    st = partition_stats(ei, n, part, 4)
    contiguous = partition_stats(ei, n, partition_nodes(ei, n, 4, "contiguous"), 4)
    assert st["edge_balance"] < 1.2
    assert st["edge_cut"] <= contiguous["edge_cut"] * 1.05


# --------------------------------------------------------------- data parallel
def _train_cfg(tmp, **extra):
    from gt_fused3s.drivers import train
    cfg = {"device": "cpu", "steps": 5, "warmup": 1, "lr": 0.003, "seed": 0, "backends": ["fused3s", "pyg"],
           "model": {"hidden": 16, "layers": 2, "edge_features": True},
           "dataset": {"name": "mols", "kind": "molecules",
                       "params": {"num_graphs": 32, "batch_size": 8, "num_features": 8}}, **extra}
    return train.validate_config(cfg)


def _train_rank(rank, world, port, cfg, results):
    """``gt-fused3s train``'s run on one rank of a process group described by
    torchrun's environment; puts (rank, row statuses, (backend, loss) per
    step, row notes)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        from gt_fused3s.drivers import train
        rows, curve, _ = train.run(cfg, progress=False, log=lambda m: None)
        results.put((rank, [r["status"] for r in rows], [(p["backend"], p["loss"]) for p in curve],
                     [r.get("note", "") for r in rows]))
    except Exception as e:
        results.put((rank, f"{type(e).__name__}: {e}", [], []))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_under_torchrun(cfg, world: int, statuses=("ok", "ok"), timeout: float = 180) -> dict:
    """{rank: (statuses, curve, notes)} of ``cfg`` trained by ``world``
    spawned ranks (each given ``timeout`` seconds); fails unless every rank
    finished with its runs' statuses as ``statuses``."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_train_rank, args=(r, world, port, cfg, results)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    got = {}
    while not results.empty():
        rank, status, curve, notes = results.get()
        got[rank] = (status, curve, notes)
    assert set(got) == set(range(world)) and all(p.exitcode == 0 for p in procs), got
    assert all(status == list(statuses) for status, *_ in got.values()), got
    return got


def test_data_parallel_training_equals_one_process_on_the_same_global_batches():
    """`gt-fused3s train` under a 2-rank process group (torchrun's
    environment, Gloo): DistributedDataParallel steps give the losses of one
    process training on the union of the ranks' batches; rank 0 saves a
    checkpoint that reloads to the trained weights."""
    from gt_fused3s.distributed.data_parallel import load_checkpoint
    from gt_fused3s.models import GraphTransformer
    with tempfile.TemporaryDirectory() as tmp:
        got = _train_under_torchrun(_train_cfg(tmp, checkpoint=tmp), 2)
        expect = global_batch_losses(_train_cfg(tmp), 2, torch.device("cpu"))
        for backend in ("fused3s", "pyg"):
            losses = [loss for b, loss in got[0][1] if b == backend]
            assert losses == pytest.approx(expect, rel=1e-4), (backend, losses, expect)
            assert [loss for b, loss in got[1][1] if b == backend] == pytest.approx(losses)   # every rank agrees
        ck = os.path.join(tmp, "mols_fused3s.pt")
        model = GraphTransformer(8, 16, 1, num_layers=2, readout="graph", edge_vocab=(4,))
        info = load_checkpoint(ck, model)
        assert info["run"] == "fused3s" and info["steps"] == 5 and info["optimizer"] is not None


def test_compiled_data_parallel_training_equals_one_process_on_the_same_global_batches():
    """`gt-fused3s train` with fused3s@compile under a 2-rank process group
    (Gloo): the model compiled alone, its gradients averaged by one
    all-reduce after the compiled backward; the losses are those of one
    process on the union of the ranks' batches (compiled on padded batches
    against eager on the batches as they are), and every rank agrees."""
    with tempfile.TemporaryDirectory() as tmp:
        # one bucket: each rank compiles one shape (CPU compiles are slow)
        cfg = _train_cfg(tmp, backends=["fused3s@compile"], max_buckets=1, steps=4)
        got = _train_under_torchrun(cfg, 2, statuses=["ok"])
    expect = global_batch_losses(cfg, 2, torch.device("cpu"))
    for rank in (0, 1):
        losses = [loss for b, loss in got[rank][1] if b == "fused3s@compile"]
        assert losses == pytest.approx(expect, rel=1e-4), (rank, losses, expect)


# ------------------------------------------------ the Graph Transformer, partitioned
@_rank
def _gt_worker(rank, world, init):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from gt_fused3s.models import GraphTransformer
    ei, n, _ = _graph("hub")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    ea = torch.randint(0, 3, (ei.size(1), 1), generator=g)
    w = torch.randn(n, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = GraphTransformer(6, 16, 2, num_layers=3, heads=2, edge_vocab=(3,)).double()
    # one process, the whole graph
    full = model(x, ei, edge_attr=ea)
    (full * w).sum().backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    # this rank's share; the parameters' gradients are summed over the ranks
    lg = local_graph(ei, n, partition_nodes(ei, n, world), rank, parts=world)
    out = model(x[lg.nodes], None, graph=lg, edge_attr=ea[lg.edge_ids])
    (out * w[lg.nodes]).sum().backward()
    torch.testing.assert_close(out, full[lg.nodes].detach())
    for k, p in model.named_parameters():
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, want[k], msg=lambda m, k=k: f"{k}: {m}")


def test_graph_transformer_on_a_partitioned_graph_equals_one_process():
    """GraphTransformer(graph=LocalGraph): every block's attention exchanges
    the halo; each rank's rows and the parameters' gradients (summed over
    the ranks) equal the whole graph's in one process (float64, edge
    features, a node with neighbours on every rank)."""
    _run_ranks(_gt_worker, 3)


def _single_graph_cfg(**extra):
    from gt_fused3s.drivers import train
    cfg = {"device": "cpu", "steps": 4, "warmup": 1, "lr": 0.003, "seed": 0, "backends": ["fused3s", "pyg"],
           "model": {"hidden": 16, "layers": 2, "edge_features": True},
           "dataset": {"name": "plaw", "kind": "powerlaw",
                       "params": {"num_nodes": 300, "avg_degree": 6, "max_degree": 60, "num_features": 8}},
           **extra}
    return train.validate_config(cfg)


def test_training_a_partitioned_graph_equals_one_process():
    """`gt-fused3s train` on a single graph under a 2-rank process group:
    the nodes are partitioned, each rank trains its rows with the halo
    exchange, gradients are summed; the losses of fused3s and pyg equal the
    whole graph's in one process."""
    from gt_fused3s.drivers import train
    got = _train_under_torchrun(_single_graph_cfg(), 2)
    _, one, _ = train.run(_single_graph_cfg(), progress=False, log=lambda m: None)
    for backend in ("fused3s", "pyg"):
        want = [p["loss"] for p in one if p["backend"] == backend]
        losses = [loss for b, loss in got[0][1] if b == backend]
        assert losses == pytest.approx(want, rel=1e-4), (backend, losses, want)


def test_partitioned_graph_skips_compiled_runs_with_the_reason():
    """Under torchrun a partitioned graph trains eagerly: a compiled run
    named in the config gets a skipped row on every rank, its note saying
    why, and trains no step; the eager run beside it trains."""
    got = _train_under_torchrun(_single_graph_cfg(backends=["fused3s", "fused3s@compile"], steps=2), 2,
                                statuses=["ok", "skipped"])
    for statuses, curve, notes in got.values():
        assert notes[1].startswith("skipped: a partitioned graph trains eagerly under torchrun")
        assert "halo exchange" in notes[1] and "torch.compile" in notes[1]
        assert {b for b, _ in curve} == {"fused3s"}


def test_scaling_runs_and_report(tmp_path):
    """`bench_distributed.py scaling` under 2 ranks (Gloo): a row per size with
    the exchange's share; the report puts world sizes side by side."""
    from gt_fused3s.bench import distributed as bench
    csv = tmp_path / "scale_2.csv"
    _run_ranks(_scaling_rank, 2, str(csv))
    import csv as csvlib
    rows = list(csvlib.DictReader(open(csv)))
    assert [int(r["N"]) for r in rows] == [600, 1200] and all(r["status"] == "ok" for r in rows)
    assert all(0 < float(r["exchange_share"]) < 1 and int(r["halo_rows"]) > 0 for r in rows)
    one = tmp_path / "scale_1.csv"
    one.write_text(csv.read_text().replace("\n2,", "\n1,"))     # as if one rank had run it
    report = bench.scaling_report([str(one), str(csv)])
    assert "1.00x" in report and "exchange" in report


@_rank
def _scaling_rank(rank, world, init, path):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))     # train.run reads torchrun's env
    from gt_fused3s.bench import distributed as bench
    from gt_fused3s.drivers import train
    cfg = train.validate_config({
        "device": "cpu", "steps": 3, "warmup": 1, "backends": ["fused3s"],
        "model": {"hidden": 16, "layers": 2, "heads": 2}, "target": "structure",
        "dataset": {"name": "plaw", "kind": "powerlaw",
                    "params": {"num_nodes": 600, "avg_degree": 6, "max_degree": 60, "num_features": 8}}})
    rows = bench.run_scaling(cfg, [600, 1200], lambda m: None)
    if rank == 0:
        from gt_fused3s.bench import common
        common.write_csv(rows, bench.SCALING_COLUMNS, path)
