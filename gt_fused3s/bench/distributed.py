"""Past one GPU, measured: the checks and scaling runs of the distributed
code (``gt_fused3s.distributed``), each run under ``torchrun``. The work
behind ``scripts/bench_distributed.py``::

    torchrun --nproc_per_node=2 scripts/bench_distributed.py check --csv check.csv
    torchrun --nproc_per_node=P scripts/bench_distributed.py scaling \\
        --config configs/train-scale-powerlaw.yaml --nodes 1000000 2000000 --csv scale_P.csv
    torchrun --nproc_per_node=2 scripts/bench_distributed.py ddp-losses --config configs/train-ddp-zinc1024.yaml
    python scripts/bench_distributed.py report scale_1.csv scale_2.csv

* ``check``: on each graph (default the 200k-node power-law graph of
  ``configs/train-200k.yaml`` and github), the partitioned attention
  (contiguous parts, one per rank) against the fused attention on the whole
  graph on one GPU, forward and backward, with and without an edge bias,
  both against the fp32 reference; then a 10-block Graph Transformer
  (hidden 128, 4 heads, bf16 autocast): the partitioned forward, loss and
  parameter gradients (summed over the ranks) against one GPU's on the whole
  graph, and both against the fp32 ``pyg`` backend. One row per graph and
  case, the largest rank's errors.
* ``scaling``: ``gt-fused3s train`` of the config's single graph at each
  node count of ``--nodes`` (edges: the config's mean degree times N),
  partitioned over the ranks; one row per size: ms/step and peak memory
  (the largest rank's), the halo exchange's time and share. Sizes after the
  first that runs out of memory are skipped.
* ``ddp-losses``: ``gt-fused3s train`` of a batched config, data parallel,
  against one process training on the same global batches (the mean of
  the ranks' batch losses per step): the largest relative loss difference
  per run.
* ``report``: the scaling CSVs of several world sizes side by side, with
  the throughput ratio against the smallest world at each size.
"""
from __future__ import annotations

import argparse
import csv
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist

from . import common

#: the graphs ``check`` runs on: dataset entries (``gt_fused3s.data.load_dataset``)
CHECK_GRAPHS = {
    "powerlaw-200k": {"kind": "powerlaw", "params": {"num_nodes": 200000, "alpha": 2.1, "max_degree": 5000,
                                                     "avg_degree": 42.5, "num_features": 32}},
    "github": {"kind": "npz", "params": {"structure": "../shared/data/github.npz", "num_features": 32}},
    # a small one, for a smoke run on CPUs
    "powerlaw-3k": {"kind": "powerlaw", "params": {"num_nodes": 3000, "alpha": 2.1, "max_degree": 300,
                                                   "avg_degree": 12, "num_features": 8}},
}
#: the graphs ``check`` runs on by default
DEFAULT_CHECK = ["powerlaw-200k", "github"]
CHECK_COLUMNS = ["graph", "N", "E", "ranks", "case", "what", "err_partitioned", "err_one_gpu",
                 "err_partitioned_vs_one_gpu", "device_name", "torch", "git_sha"]
SCALING_COLUMNS = ["ranks", "N", "E", "head_chunks", "status", "ms_step", "steps_per_s", "peak_mem_mb", "exchange_ms",
                   "exchange_share", "halo_rows", "loss_first", "note", "dtype", "device_name", "torch",
                   "git_sha"]


def _max_over_ranks(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: an error on the scale of the values."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


# ------------------------------------------------------------------- check
def check_attention(edge_index, n: int, lg, device, *, bias: bool, heads: int = 4, dim: int = 32,
                    seed: int = 0) -> list[dict]:
    """Partitioned attention (this rank's share ``lg``) against the fused
    attention on the whole graph (one GPU) and the fp32 reference: relative
    errors of the output and of the gradients of q, k, v (and the bias)."""
    from ..ops import fused3s_attention
    from ..plan import GraphPlan
    from ..distributed import partitioned_attention
    from ..reference import attention_reference
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(n, heads, dim, generator=g, device=device).to(torch.bfloat16)
                   for _ in range(4))
    b = torch.randn(edge_index.size(1), heads, generator=g, device=device) if bias else None
    scale = dim ** -0.5

    def run(fn, grad_out, *inputs):
        """fn's output and the gradients of its inputs for ``grad_out``."""
        leaves = [t.detach().clone().requires_grad_() for t in inputs if t is not None]
        out = fn(*leaves[:3], leaves[3] if bias else None)
        return out, torch.autograd.grad(out, leaves, grad_out.to(out.dtype))

    mine = lg.nodes
    plan = GraphPlan.from_edge_index(edge_index, n)
    one = run(lambda q, k, v, b: fused3s_attention(q, k, v, plan, scale, edge_bias=b), do, q, k, v, b)
    ref = run(lambda q, k, v, b: attention_reference(q, k, v, edge_index, scale, edge_bias=b), do,
              q.float(), k.float(), v.float(), b)
    part = run(lambda q, k, v, b: partitioned_attention(q, k, v, lg, scale, edge_bias=b), do[mine],
               q[mine], k[mine], v[mine], b[lg.edge_ids] if bias else None)
    names = ["out", "dq", "dk", "dv"] + (["dbias"] if bias else [])
    rows = []
    for i, what in enumerate(names):
        rows_of = lg.edge_ids if what == "dbias" else mine
        got = part[0] if i == 0 else part[1][i - 1]
        one_t = (one[0] if i == 0 else one[1][i - 1])[rows_of]
        ref_t = (ref[0] if i == 0 else ref[1][i - 1])[rows_of]
        rows.append({"what": what, "err_partitioned": _rel(got, ref_t), "err_one_gpu": _rel(one_t, ref_t),
                     "err_partitioned_vs_one_gpu": _rel(got, one_t)})
    return rows


def check_model(data, lg, device, *, layers: int = 10, hidden: int = 128, heads: int = 4,
                seed: int = 0) -> list[dict]:
    """A Graph Transformer partitioned (bf16 autocast, fused backend) against
    the same on the whole graph on one GPU, both against the whole graph in
    fp32 with the ``pyg`` backend: relative errors of the output rows, the
    loss and the parameter gradients (all parameters as one vector)."""
    from ..models import GraphTransformer
    torch.manual_seed(seed)
    model = GraphTransformer(data.x.size(1), hidden, 1, num_layers=layers, heads=heads).to(device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    y = torch.randn(data.num_nodes, 1, generator=g, device=device)
    mine = lg.nodes

    def loss_grads(run, rows, share, backend, amp):
        model.backend = backend
        model.zero_grad(set_to_none=True)
        with common.autocast(device, torch.bfloat16) if amp else torch.autocast(device.type, enabled=False):
            out = run()
        loss = torch.nn.functional.mse_loss(out.float(), y[rows]) * share
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        return out.detach().float(), loss.detach(), grads

    whole = lambda: model(data.x, data.edge_index)   # noqa: E731
    ref = loss_grads(whole, slice(None), 1.0, "pyg", False)
    one = loss_grads(whole, slice(None), 1.0, "fused3s", True)
    part = loss_grads(lambda: model(data.x[mine], None, graph=lg), mine, mine.numel() / data.num_nodes,
                      "fused3s", True)
    for t in (part[1], *part[2].values()):           # the whole graph's loss and gradients
        dist.all_reduce(t)

    def flat(grads):    # all parameters at once: one scale (some gradients are ~0, a K bias's)
        return torch.cat([g.reshape(-1).float() for _, g in sorted(grads.items())])

    def errs(a, b, rows_a=slice(None), rows_b=slice(None)):
        return {"out": _rel(a[0][rows_a], b[0][rows_b]), "loss": _rel(a[1], b[1]),
                "grads": _rel(flat(a[2]), flat(b[2]))}
    e_part, e_one, e_pv1 = errs(part, ref, rows_b=mine), errs(one, ref), errs(part, one, rows_b=mine)
    return [{"what": w, "err_partitioned": e_part[w], "err_one_gpu": e_one[w],
             "err_partitioned_vs_one_gpu": e_pv1[w]} for w in ("out", "loss", "grads")]


def run_check(graphs: list[str], device, log, layers: int = 10) -> list[dict]:
    from ..data import load_dataset
    from ..distributed import local_graph, partition_nodes
    world, rank = dist.get_world_size(), dist.get_rank()
    info = common.run_info(device, torch.bfloat16)
    rows = []
    for name in graphs:
        data = load_dataset({"name": name, **CHECK_GRAPHS[name]}, device=device).get(0, device)
        n, ei = data.num_nodes, data.edge_index
        lg = local_graph(ei, n, partition_nodes(ei, n, world), rank, parts=world)
        log(f"{name}: N={n}, E={ei.size(1)}; rank 0 owns {lg.num_local} rows, halo {lg.halo.numel()}")
        cases = [("attention", lambda: check_attention(ei, n, lg, device, bias=False)),
                 ("attention+bias", lambda: check_attention(ei, n, lg, device, bias=True)),
                 ("graph transformer", lambda: check_model(data, lg, device, layers=layers))]
        for case, fn in cases:
            for r in fn():
                r = {k: (_max_over_ranks(v, device) if k.startswith("err") else v) for k, v in r.items()}
                rows.append({"graph": name, "N": n, "E": ei.size(1), "ranks": world, "case": case, **r,
                             **info})
        cases = data = ei = lg = None            # free this graph before the next
        common.free_cuda_memory(device)
    return rows


# ----------------------------------------------------------------- scaling
def run_scaling(cfg: dict, nodes: list[int], log, on_row=None) -> list[dict]:
    """``gt-fused3s train`` of ``cfg``'s single graph at each node count
    (partitioned over the ranks under torchrun), one row per size;
    ``on_row(rows)`` after each size (to save what ran so far)."""
    from ..drivers import train
    world = dist.get_world_size() if dist.is_initialized() else 1
    params = cfg["dataset"]["params"]
    degree = params.get("avg_degree")
    rows = []
    for i, n in enumerate(nodes):
        if rows and rows[-1]["status"] == "oom":
            rows.append({"ranks": world, "N": n, "status": "skipped", "note": "a smaller size ran out of memory"})
            continue
        c = common.revalidate({**cfg, "dataset": {**cfg["dataset"], "params": {**params, "num_nodes": n}}},
                              train.validate_config)
        log(f"--- {n} nodes (mean degree {degree}), {world} rank(s)")
        try:
            got, _, task = train.run(c, progress=False, log=log, eager=True)
        except torch.OutOfMemoryError as err:          # the graph or its format did not fit
            rows.append({"ranks": world, "N": n, "status": "oom", "note": common.short_error(err)})
            _free()
            continue
        r = got[0]
        b = task.batches[0]        # partitioned: this rank's rows, which know the graph's edge count
        E = getattr(b, "graph_edges", b.edge_index.size(1))
        row = {"ranks": world, "N": n, "E": E, "head_chunks": c["distributed"]["head_chunks"],
               "status": r["status"], "ms_step": r.get("ms_median"),
               "peak_mem_mb": r.get("peak_mem_mb"), "exchange_ms": r.get("exchange_ms"),
               "exchange_share": r.get("exchange_share"), "halo_rows": r.get("halo_rows"), "loss_first": r.get("loss_first"),
               "note": r.get("note", ""), **{k: r[k] for k in ("dtype", "device_name", "torch", "git_sha")}}
        if row["ms_step"]:
            row["steps_per_s"] = 1e3 / row["ms_step"]
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        del task, got
        _free()
    return rows


def _free() -> None:
    if torch.cuda.is_available():
        common.free_cuda_memory(torch.device("cuda", torch.cuda.current_device()))


def scaling_report(paths: list[str]) -> str:
    """The rows of scaling CSVs of several world sizes, side by side per
    size: step throughput relative to the smallest world size that ran it."""
    rows = []
    for p in paths:
        with open(p) as f:
            rows += list(csv.DictReader(f))
    by_size: dict[int, list[dict]] = {}
    for r in rows:
        by_size.setdefault(int(float(r["N"])), []).append(r)
    out = [f"{'N':>10} {'E':>12} {'ranks':>5} {'chunks':>6} {'status':>8} {'ms/step':>9} "
           f"{'peak GB/GPU':>11} {'exchange':>9} {'speedup':>8}"]
    for n in sorted(by_size):
        base = None
        for r in sorted(by_size[n], key=lambda r: int(r["ranks"])):
            ms = float(r["ms_step"]) if r.get("ms_step") else None
            if base is None and ms:
                base = (int(r["ranks"]), ms)
            speed = f"{base[1] / ms:.2f}x" if ms and base else "-"
            peak = f"{float(r['peak_mem_mb']) / 1024:.1f}" if r.get("peak_mem_mb") else "-"
            ex = f"{float(r['exchange_share']):.1%}" if r.get("exchange_share") else "-"
            chunks = r.get("head_chunks") or "-" if int(r["ranks"]) > 1 else "-"
            out.append(f"{n:>10} {r.get('E') or '-':>12} {r['ranks']:>5} {chunks:>6} {r['status']:>8} "
                       f"{(f'{ms:.1f}' if ms else '-'):>9} {peak:>11} {ex:>9} {speed:>8}")
    return "\n".join(out + ["speedup: step throughput over the fewest ranks that ran the size; "
                            "peak: the largest rank's; exchange: the share of a step spent waiting "
                            "for the halo exchange (chunks: head chunks it is pipelined in)"])


# -------------------------------------------------------------- ddp losses
def global_batch_losses(cfg: dict, world: int, device, dtype=None) -> list[float]:
    """What data-parallel training over ``world`` ranks computes, in one
    process: each step is the mean loss of ``world`` batches (rank r's batch
    of step s: ``order[s * world + r]``), one Adam step on it."""
    from ..drivers import train
    from ..drivers.stream import num_graphs
    task = train.load_task(cfg, device)
    model = train.build_model(task, cfg, device)
    model.backend = common.parse_run(cfg["backends"][0])[0]
    model.train()
    torch.manual_seed(cfg["seed"])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    order = train.step_order(len(task.batches), cfg["steps"] * world, cfg["seed"])
    amp = common.autocast(device, dtype) if dtype is not None else torch.autocast(device.type, enabled=False)
    losses = []
    for s in range(cfg["steps"]):
        opt.zero_grad()
        per = []
        for r in range(world):
            d = task.batches[order[s * world + r]]
            with amp:
                out = model(d.x, d.edge_index, d.batch, num_graphs=num_graphs(d),
                            edge_attr=train.edge_attr_of(model, d))
            per.append(task.loss_of(out, d.y))
        loss = torch.stack(per).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def run_ddp_losses(cfg: dict, device, log) -> list[dict]:
    """Each run of ``cfg`` under the process group against
    :func:`global_batch_losses` (computed on rank 0)."""
    from ..drivers import train
    world = dist.get_world_size()
    rows, curve, _ = train.run(cfg, progress=False, log=log)
    dtype = common.resolve_dtype(cfg["dtype"], device, cuda_default=torch.bfloat16)
    out = []
    if dist.get_rank() == 0:
        want = global_batch_losses(cfg, world, device, dtype if device.type == "cuda" else None)
        for r in rows:
            got = [p["loss"] for p in curve if p["backend"] == r["backend"]]
            diff = max((abs(a - b) / abs(b) for a, b in zip(got, want)), default=float("nan"))
            out.append({"backend": r["backend"], "status": r["status"], "steps": len(got),
                        "max_rel_loss_diff": diff, "ms_step": r.get("ms_median"),
                        "graphs_per_step": world * cfg["dataset"]["params"].get("batch_size", 0),
                        "first_losses": " ".join(f"{x:.5f}" for x in got[:4]),
                        "one_process_first_losses": " ".join(f"{x:.5f}" for x in want[:4])})
    dist.barrier()
    return out


# --------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("check", "scaling", "ddp-losses", "report"))
    p.add_argument("files", nargs="*", help="report: the scaling CSVs")
    p.add_argument("--config", help="scaling, ddp-losses: a gt-fused3s train config")
    p.add_argument("--nodes", type=float, nargs="+", help="scaling: node counts")
    p.add_argument("--graphs", nargs="+", default=DEFAULT_CHECK, choices=list(CHECK_GRAPHS),
                   help="check: the graphs")
    p.add_argument("--layers", type=int, default=10, help="check: Graph Transformer blocks")
    p.add_argument("--head-chunks", type=int, help="scaling: distributed.head_chunks (1: the "
                   "exchange not overlapped)")
    p.add_argument("--quick", action="store_true", help="scaling, ddp-losses: the config's quick "
                   "overrides (a small model; the data as given)")
    p.add_argument("--csv", help="write the rows here (rank 0)")
    args = p.parse_args(argv)
    if args.what == "report":
        print(scaling_report(args.files))
        return 0
    from ..drivers import train
    from ..distributed import data_parallel
    cfg = train.load_config(args.config) if args.config else None
    if cfg is not None and args.quick:
        cfg = train.quick_config(cfg)
    if cfg is not None and args.head_chunks is not None:
        cfg["distributed"]["head_chunks"] = args.head_chunks
    device = common.resolve_device(cfg["device"] if cfg else "auto")
    world, rank, device = data_parallel.init(device)
    if not dist.is_initialized():            # one process: a group of one, so every mode runs
        _single_group(device)
    log = common.log_stderr if rank == 0 else (lambda m: None)
    if args.what == "check":
        rows, columns = run_check(args.graphs, device, log, args.layers), CHECK_COLUMNS
    elif args.what == "scaling":
        if not args.nodes or cfg is None:
            p.error("scaling needs --config and --nodes")
        def save(rows):       # a long run keeps what it measured
            log(f"{rows[-1]['N']} nodes: {rows[-1]['status']}, {rows[-1].get('ms_step')} ms/step, "
                f"peak {rows[-1].get('peak_mem_mb')} MB")
            if args.csv and rank == 0:
                common.write_csv(rows, SCALING_COLUMNS, args.csv)
        rows = run_scaling(cfg, [int(n) for n in args.nodes], log, save)
        columns = SCALING_COLUMNS
    else:
        if cfg is None:
            p.error("ddp-losses needs --config")
        rows = run_ddp_losses(cfg, device, log)
        columns = list(rows[0]) if rows else []
    if rank == 0:
        shown = [{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]
        print(common.text_table(shown, [(c, c, "{}") for c in columns], set(columns)))
        if args.csv:
            common.write_csv(rows, columns, args.csv)
    gc.collect()           # captured graphs (with NCCL work in them) go before the group does
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _single_group(device) -> None:
    """A process group of one (outside torchrun), on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


if __name__ == "__main__":
    sys.exit(main())
