"""Benchmark of the per-edge terms (the work behind ``scripts/bench_edge.py``),
side by side in one process on one GPU.

Two tables:

* ``attention``: ``fused3s_attention`` on a prepared plan, fp16, without and
  with an ``edge_bias`` [E, H], with ``return_weights``, and with edge
  features (``edge_feature_attention``, ``EDGE_DIM`` raw features per edge,
  TransformerConv's ``edge_dim``); forward and
  forward + backward (the leaves' gradients set to None before each call),
  GPU time of the call (CUDA events, L2 flushed, median) and the ratio to
  the plain attention; the profiler's device time
  of the fused kernels alone and of every kernel of the call (the
  permutations to and from the format's edge order included).
* ``layer``: ``Fused3SConv`` against ``TransformerConv`` with the same
  weights (``heads``, ``out_channels``, ``edge_dim``), fp32 features,
  forward + backward of the layer, each side eager (``fused3s``: the plan
  cached, as for one graph; ``fused3s_new_graph``: PyG's default
  ``cached=False``, the plan built in every call, as for a new batch every
  step, added after git 008275c) and without launch overhead:
  ``fused3s_graph`` is the fused step captured once in a CUDA graph and
  replayed (:class:`~gt_fused3s.capture.CudaGraphRunner`, on the graph's
  plan), ``pyg_compiled`` TransformerConv under ``torch.compile``
  (inductor, static shapes), ``pyg_reduce_overhead`` the same in
  ``mode="reduce-overhead"`` (inductor's kernels replayed as CUDA graphs),
  and ``fused3s_compiled`` / ``fused3s_reduce_overhead`` the fused layer
  in the same two modes, called as a PyG user calls it: with the
  ``edge_index`` tensor, its plan cached by the layer (``cached=True``; CSVs
  before git 227ad86 passed the plan instead, which the layer then rebuilt
  inside the compiled graph when given the tensor).
  Per peer: what a user waits (``wall_ms``, synchronised), the GPU time of
  the step (``gpu_ms``, CUDA events), the device time of all its kernels
  (``kernel_ms``, profiler: no launch gaps; added after git 8b329bd), the
  largest gradient error against eager TransformerConv (``grad_diff``:
  inputs and parameters, each relative to the gradient's largest entry),
  and for
  the eager peers the peak memory the step allocates above what it starts
  with (fresh gradients each step);
  ratios (peer / ours, > 1 a gain) in :data:`RATIOS`. A peer that fails
  (out of memory, a compile or capture error) leaves a ``<peer>_error``
  note and the others run.

Both take the graphs' edges in an order of choice (``edge_order``,
:func:`order_edges`): the real graphs' files and the generated power-law
graph list them grouped by destination, PyG's molecule batches by source,
and the edge-feature kernels read node rows in the edges' order (README:
`edge_dot` 0.29 ms grouped, 0.37 in a random order, on the 200k graph).
"""
from __future__ import annotations

import csv
import math
import platform
import warnings

import torch

from .common import free_cuda_memory, git_sha, short_error
from .kernel import load_graph
from .timing import kernel_time, time_cuda, time_wall

GRAPHS = ("zinc", "github", "powerlaw200k")
EDGE_ORDERS = ("as-loaded", "source", "random")
ATTENTION_SETTINGS = ((4, 16), (1, 64), (8, 32))     # (heads, head dim)
EDGE_DIM = 16
PEERS = ("fused3s", "fused3s_new_graph", "fused3s_graph", "fused3s_compiled", "fused3s_reduce_overhead", "pyg",
         "pyg_compiled", "pyg_reduce_overhead")
CAPTURED = ("fused3s_graph", "fused3s_reduce_overhead", "pyg_reduce_overhead")   # replayed as CUDA graphs


def _env() -> dict:
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "git": git_sha(),
            "host": platform.node()}


def order_edges(edge_index: torch.Tensor, num_nodes: int, how: str = "as-loaded", seed: int = 0) -> torch.Tensor:
    """The same edges (duplicates included) in another order: ``"as-loaded"``
    as given; ``"source"`` sorted by (source, destination), PyG's coalesced
    order; ``"random"`` a permutation seeded by ``seed``."""
    if how == "as-loaded":
        return edge_index
    if how == "source":
        key = edge_index[0].long() * max(num_nodes, 1) + edge_index[1].long()
        perm = torch.sort(key, stable=True).indices
    elif how == "random":
        g = torch.Generator(device="cpu").manual_seed(seed)
        perm = torch.randperm(edge_index.size(1), generator=g).to(edge_index.device)
    else:
        raise ValueError(f"edge order must be one of {EDGE_ORDERS} (got {how!r})")
    return edge_index[:, perm]


def attention_rows(graphs=GRAPHS, settings=ATTENTION_SETTINGS, seed: int = 0,
                   edge_order: str = "as-loaded") -> list[dict]:
    from ..edge_terms import edge_feature_attention
    from ..ops import fused3s_attention
    from ..plan import GraphPlan
    rows = []
    for name in graphs:
        ei, n = load_graph(name, "cuda")
        ei = order_edges(ei, n, edge_order, seed)
        E = ei.size(1)
        for H, D in settings:
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v, do = (torch.randn(n, H, D, device="cuda", generator=g, dtype=torch.float16)
                           for _ in range(4))
            bias = torch.randn(E, H, device="cuda", generator=g)
            attr = torch.randn(E, EDGE_DIM, device="cuda", generator=g)
            w_e = (torch.randn(H, D, EDGE_DIM, device="cuda", generator=g) / math.sqrt(EDGE_DIM)).half()
            plan = GraphPlan.from_edge_index(ei, n).prepare(H, D, edge_features=True)
            leaves = [t.clone().requires_grad_() for t in (q, k, v, bias, attr, w_e)]
            dw = torch.randn(E, H, device="cuda", generator=g)

            def fwd(b=None, w=False):
                with torch.no_grad():
                    return fused3s_attention(q, k, v, plan, edge_bias=b, return_weights=w)

            def fresh_grads():   # as after zero_grad(set_to_none=True): no accumulation in the time
                for t in leaves:
                    t.grad = None

            def fb(b=None, w=False):
                fresh_grads()
                out = fused3s_attention(*leaves[:3], plan, edge_bias=b, return_weights=w)
                if w:
                    out, wt = out
                    torch.autograd.backward([out, wt], [do, dw])
                else:
                    out.backward(do)

            def fwd_edges():
                with torch.no_grad():
                    return edge_feature_attention(q, k, v, plan, attr, w_e, 1 / math.sqrt(D), return_weights=False)

            def fb_edges():
                fresh_grads()
                out, _ = edge_feature_attention(*leaves[:3], plan, *leaves[4:], 1 / math.sqrt(D),
                                                return_weights=False)
                out.backward(do)

            row = {"graph": name, "N": n, "E": E, "H": H, "D": D, "edge_dim": EDGE_DIM, "edge_order": edge_order,
                   **_env()}
            cases = {"fwd": lambda: fwd(), "fwd_bias": lambda: fwd(bias),
                     "fwd_weights": lambda: fwd(bias, True), "fwd_edges": fwd_edges,
                     "fb": lambda: fb(), "fb_bias": lambda: fb(leaves[3]),
                     "fb_weights": lambda: fb(leaves[3], True), "fb_edges": fb_edges}
            for key, fn in cases.items():
                row[f"{key}_ms"] = time_cuda(fn)["median"]
                # the fused kernels alone, and every kernel of the call (permutations included)
                row[f"{key}_fused_kernels_ms"] = kernel_time(fn, "fused3s_", reps=10)
                row[f"{key}_all_kernels_ms"] = kernel_time(fn, "", reps=10, flush=False)
            for key in ("fwd_bias", "fwd_weights", "fwd_edges"):
                row[f"{key}_x"] = row[f"{key}_ms"] / row["fwd_ms"]
            for key in ("fb_bias", "fb_weights", "fb_edges"):
                row[f"{key}_x"] = row[f"{key}_ms"] / row["fb_ms"]
            rows.append(row)
            print(format_attention_row(row), flush=True)
            free_cuda_memory()
    return rows


def format_attention_row(r: dict) -> str:
    kern = " ".join(f"{k} {r[f'{k}_fused_kernels_ms'] or float('nan'):.4f}/{r[f'{k}_all_kernels_ms'] or float('nan'):.4f}"
                    for k in ("fwd", "fwd_bias", "fwd_weights", "fwd_edges", "fb", "fb_bias", "fb_weights",
                              "fb_edges"))
    return (f"  kernels (fused/all) {kern}\n" + f"{r['graph']:>13} ({r.get('edge_order', 'as-loaded')}) "
            f"H={r['H']} D={r['D']:>3} | fwd {r['fwd_ms']:.4f} bias {r['fwd_bias_ms']:.4f} "
            f"({r['fwd_bias_x']:.2f}x) +weights {r['fwd_weights_ms']:.4f} ({r['fwd_weights_x']:.2f}x) "
            f"edge_dim {r['fwd_edges_ms']:.4f} ({r['fwd_edges_x']:.2f}x) | "
            f"fwd+bwd {r['fb_ms']:.4f} bias {r['fb_bias_ms']:.4f} ({r['fb_bias_x']:.2f}x) "
            f"+weights {r['fb_weights_ms']:.4f} ({r['fb_weights_x']:.2f}x) "
            f"edge_dim {r['fb_edges_ms']:.4f} ({r['fb_edges_x']:.2f}x)")


#: The layer table's ratios: (suffix, our peer, their peer).
RATIOS = (("", "fused3s", "pyg"),                                   # eager vs eager
          ("_new_graph", "fused3s_new_graph", "pyg"),               # eager, a new graph every call
          ("_compiled", "fused3s", "pyg_compiled"),
          ("_graph", "fused3s_graph", "pyg_reduce_overhead"),     # both without launch overhead
          ("_graph_vs_eager", "fused3s_graph", "pyg"),
          ("_both_compiled", "fused3s_compiled", "pyg_compiled"),
          ("_both_reduce_overhead", "fused3s_reduce_overhead", "pyg_reduce_overhead"))


def _layer_step(conv, x, ei, edge_attr, grad, mark_step: bool = False):
    params = [p for p in conv.parameters() if p.requires_grad]

    def step():
        # fresh gradients each step, as after zero_grad(set_to_none=True):
        # no accumulation kernels ([E, edge_dim] for the features) in the time
        if mark_step:      # reduce-overhead: a new step of its CUDA-graph trees
            torch.compiler.cudagraph_mark_step_begin()
        leaves = [x] + ([edge_attr] if edge_attr is not None else [])
        out = conv(x, ei, edge_attr)
        return torch.autograd.grad(out, leaves + params, grad)
    return step


def _peer_steps(fused, fused_uncached, ref, plan, x, ei, edge_attr, grad, compiled: bool):
    """(label, step) of every peer of the layer table."""
    from ..capture import CudaGraphRunner
    steps = [("fused3s", _layer_step(fused, x, ei, edge_attr, grad)),
             # PyG's default (cached=False), as on a new batch every step: the
             # plan built in every call (the warning that the edge_index is the
             # last call's is silenced in layer_rows: here it is on purpose)
             ("fused3s_new_graph", _layer_step(fused_uncached, x, ei, edge_attr, grad))]
    # the captured step reads the plan (the format built outside it, once per
    # graph) and the inputs where they are: a replay copies nothing in
    steps.append(("fused3s_graph", CudaGraphRunner(_layer_step(fused, x, plan, edge_attr, grad))))
    steps.append(("pyg", _layer_step(ref, x, ei, edge_attr, grad)))
    if compiled:       # the same modules (weights shared), compiled on their first step
        for label, conv, graph in (("fused3s", fused, ei), ("pyg", ref, ei)):
            steps.append((f"{label}_compiled", _layer_step(torch.compile(conv, dynamic=False), x, graph,
                                                           edge_attr, grad)))
            steps.append((f"{label}_reduce_overhead", _layer_step(
                torch.compile(conv, dynamic=False, mode="reduce-overhead"), x, graph, edge_attr, grad,
                mark_step=True)))
    return steps


def _time_peer(label: str, step, row: dict, grads: dict) -> None:
    """Run ``step`` (its first call compiles or captures), keep its gradients
    in ``grads`` and its peak memory and times in ``row``; a compiled or
    captured peer's failure becomes its ``<label>_error`` note."""
    try:
        grads[label] = [t.clone() for t in step()]      # a compile or a capture happens here
        torch.cuda.synchronize()
        free_cuda_memory()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        if label not in CAPTURED:   # a replay allocates nothing: its memory is the capture's pool
            row[f"{label}_peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row[f"{label}_gpu_ms"] = time_cuda(step, flush=False, max_reps=50)["median"]
        row[f"{label}_wall_ms"] = time_wall(step, reps=30)["wall"]
        # every kernel of the step (profiler; inside a replay too), without launch gaps
        row[f"{label}_kernel_ms"] = kernel_time(step, "", reps=10, flush=False)
    except torch.cuda.OutOfMemoryError as e:
        row[f"{label}_error"] = short_error(e)
    except Exception as e:  # noqa: BLE001 - a compile / capture error becomes the peer's note
        if label in ("fused3s", "pyg"):
            raise
        torch.compiler.reset()      # a failed compile leaves nothing behind for the next peer
        row[f"{label}_error"] = short_error(e)
    free_cuda_memory()


def layer_rows(graphs=GRAPHS, in_channels: int = 64, out_channels: int = 16, heads: int = 4,
               edge_dim: int | None = 16, seed: int = 0, compiled: bool = True,
               edge_order: str = "as-loaded") -> list[dict]:
    from torch_geometric.nn import TransformerConv

    from ..nn.pyg import Fused3SConv, PlanRebuildWarning
    rows = []
    for name in graphs:
        ei, n = load_graph(name, "cuda")
        ei = order_edges(ei, n, edge_order, seed)
        E = ei.size(1)
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(n, in_channels, device="cuda", generator=g).requires_grad_()
        edge_attr = (torch.randn(E, edge_dim, device="cuda", generator=g).requires_grad_()
                     if edge_dim else None)
        torch.manual_seed(seed)      # the same weights in every run (errors compare across runs)
        ref = TransformerConv(in_channels, out_channels, heads=heads, edge_dim=edge_dim).cuda()
        fused = Fused3SConv(in_channels, out_channels, heads=heads, edge_dim=edge_dim, cached=True).cuda()
        fused.load_state_dict(ref.state_dict(), strict=True)
        fused_uncached = Fused3SConv(in_channels, out_channels, heads=heads, edge_dim=edge_dim).cuda()
        fused_uncached.load_state_dict(ref.state_dict(), strict=True)
        plan = Fused3SConv.to_graph_format(ei, n).prepare(heads, out_channels, edge_features=bool(edge_dim))
        grad = torch.randn(n, heads * out_channels, device="cuda", generator=g)
        row = {"graph": name, "N": n, "E": E, "heads": heads, "out_channels": out_channels,
               "edge_dim": edge_dim, "edge_order": edge_order, **_env()}
        # the plan is built once per graph and cached, as in training
        with torch.no_grad():
            err = (fused(x, ei, edge_attr) - ref(x, ei, edge_attr)).abs().max().item()
        row["max_abs_diff"] = err
        grads = {}
        with warnings.catch_warnings():   # fused3s_new_graph rebuilds the plan of one edge_index on purpose
            warnings.simplefilter("ignore", PlanRebuildWarning)
            for label, step in _peer_steps(fused, fused_uncached, ref, plan, x, ei, edge_attr, grad, compiled):
                _time_peer(label, step, row, grads)
        # every peer computes the same gradients (inputs and parameters): the
        # largest error of a gradient relative to its largest entry, floored
        # at 1e-3 of the largest entry of all (the key bias's gradient is zero
        # but for rounding: a softmax ignores a shift of a row's scores)
        want = grads["pyg"]
        floor = 1e-3 * max(b.abs().max().item() for b in want)
        for label, got in grads.items():
            row[f"{label}_grad_diff"] = max((a - b).abs().max().item() / max(b.abs().max().item(), floor)
                                            for a, b in zip(got, want))
        for suffix, ours, peer in RATIOS:
            for key, ratio in (("gpu_ms", "gpu_x"), ("wall_ms", "wall_x"), ("peak_mb", "memory_x")):
                if f"{peer}_{key}" in row and f"{ours}_{key}" in row:
                    row[ratio + suffix] = row[f"{peer}_{key}"] / row[f"{ours}_{key}"]
        rows.append(row)
        print(format_layer_row(row), flush=True)
        del fused, fused_uncached, ref, plan, grads
        free_cuda_memory()
    return rows


def format_layer_row(r: dict) -> str:
    def cell(label):
        if f"{label}_error" in r:
            return f"{label}: {r[f'{label}_error']}"
        peak = f"peak {r[f'{label}_peak_mb']:.0f} MB " if f"{label}_peak_mb" in r else ""
        kern = r.get(f"{label}_kernel_ms")
        kern = f"kernels {kern:.3f} " if kern is not None else ""
        return (f"{label} wall {r[f'{label}_wall_ms']:.3f} gpu {r[f'{label}_gpu_ms']:.3f} ms {kern}"
                f"{peak}grad diff {r[f'{label}_grad_diff']:.1e}")
    ratios = " ".join(f"{k}{s} {r[k + s]:.2f}x" for s, _, _ in RATIOS for k in ("wall_x", "gpu_x", "memory_x")
                      if k + s in r)
    peers = "\n    ".join(cell(p) for p in PEERS if f"{p}_error" in r or f"{p}_wall_ms" in r)
    return (f"{r['graph']:>13} ({r.get('edge_order', 'as-loaded')}) E={r['E']} diff {r['max_abs_diff']:.2e}\n"
            f"    {peers}\n    {ratios}")


def geometric_mean(values) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def write_csv(rows: list[dict], path: str) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
